"""Worker memory under sustained load: the shipped demo config at max_num_seqs, over HTTP.

    python -m bench.soak --minutes 6      # writes bench/results/soak.json and soak.png

Starts the demo app (``cluster/serve/demo.yaml``, one replica) on a local Ray, keeps
``max_num_seqs`` requests in flight (mixed greedy and sampled completions of different
lengths, held-out prompts), and samples the resident memory (RSS) of the engine core's
and the draft's processes every few seconds. The KV cache is allocated at startup, so
after warm-up the curves should be flat: the report gives the growth after warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time
from pathlib import Path

import httpx
import yaml

from bench.common import write_result
from bench.peers import ROOT, free_port
from specdec.demo.corpus import read_jsonl

PROMPT_SETS = ("python", "prose")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start(max_num_seqs: int | None) -> tuple[str, dict]:
    from ray import serve

    from deployments.app import build_app

    config = yaml.safe_load((ROOT / "cluster" / "serve" / "demo.yaml").read_text())
    args = config["applications"][0]["args"]
    args.pop("autoscaling_config", None)
    args["num_replicas"] = 1
    args["monitoring"]["prometheus_port"] = free_port()
    if max_num_seqs:
        args["engine"]["scheduler"]["max_num_seqs"] = max_num_seqs
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    handle = serve.run(build_app(args), name="soak", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while httpx.get(f"{url}/health").status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("SpecServe did not become healthy")
        time.sleep(0.5)
    return url, {"handle": handle, "max_num_seqs": args["engine"]["scheduler"]["max_num_seqs"]}


async def drive(url: str, prompts: list[str], clients: int, seconds: float, pids: dict) -> dict:
    stop = time.monotonic() + seconds
    counts = {"requests": 0, "errors": 0, "tokens": 0}
    source = itertools.cycle(prompts)
    rng = random.Random(0)
    samples: list[dict] = []

    async def client(http: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            body = {
                "model": "demo-target",
                "prompt": next(source),
                "max_tokens": rng.choice([16, 64, 128]),
                "temperature": rng.choice([0.0, 0.8]),
                "seed": rng.randrange(1 << 30),
            }
            try:
                r = await http.post("/v1/completions", json=body)
                r.raise_for_status()
                counts["tokens"] += r.json()["usage"]["completion_tokens"]
            except httpx.HTTPError:
                counts["errors"] += 1
            counts["requests"] += 1

    async def sampler() -> None:
        t0 = time.monotonic()
        while time.monotonic() < stop:
            samples.append(
                {"t_s": round(time.monotonic() - t0, 1), **{k: rss_mib(p) for k, p in pids.items()}}
            )
            await asyncio.sleep(5.0)

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await asyncio.gather(sampler(), *[client(http) for _ in range(clients)])
    return {**counts, "rss_mib": samples}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    samples = results["rss_mib"]
    for key in ("core", "draft"):
        ax.plot([s["t_s"] for s in samples], [s[key] for s in samples], label=key)
    ax.axvline(results["warmup_s"], color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("seconds under load")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(f"worker RSS at {results['clients']} concurrent requests (demo config)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=6.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the config's")
    args = parser.parse_args()

    import ray

    prompts = [
        r["prompt"]
        for name in PROMPT_SETS
        for r in read_jsonl(ROOT / "models" / "prompts" / f"{name}.jsonl")
    ]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        url, app = start(args.max_num_seqs)
        info = app["handle"].health_info.remote().result()
        pids = {"core": info["target"]["pid"], "draft": info["draft"]["pid"]}
        clients = app["max_num_seqs"]
        run = asyncio.run(drive(url, prompts, clients, args.minutes * 60, pids))
        health = httpx.get(f"{url}/health").json()
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    samples = run["rss_mib"]
    after = [s for s in samples if s["t_s"] >= args.warmup_s]
    growth = {
        key: round(after[-1][key] - after[0][key], 1) if len(after) > 1 else None
        for key in ("core", "draft")
    }
    results = {
        **run,
        "clients": clients,
        "warmup_s": args.warmup_s,
        "growth_after_warmup_mib": growth,
        "kv_cache": health.get("kv_cache"),
        "kv_plans": {
            "core": info["target"].get("kv_cache"),
            "draft": info["draft"].get("kv_cache"),
        },
    }
    path = write_result("soak", vars(args), results)
    plot(results, path.with_suffix(".png"))
    print({k: v for k, v in results.items() if k != "rss_mib"})


if __name__ == "__main__":
    main()
