"""A split target's rank SIGKILLed under load: what a client sees, with the shipped config.

    python -m bench.rank_kill      # writes bench/results/rank_kill.json and rank_kill.png

Deploys ``cluster/serve/demo-tp.yaml`` as it is (the demo pair, the target split over two
ranks; only its ports changed) on a local Ray, then sends the same mixed workload twice
over HTTP, ``--concurrency`` at a time: held-out prompts (third-party Python and licence
prose), greedy and seeded sampled requests (T = 0.8, top-p 0.95), 32 to 96 tokens. The
first pass is the reference. During the second, once ``--kill-after`` requests have
finished, rank 1's process is SIGKILLed (its pid from ``/health``). Records: requests,
failures, outputs that differ from the reference (greedy and seeded alike: seeded rows
draw each position's randomness from their seed), the seconds from the kill to the next
request finished and to the last, and the target's restarts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import yaml

from bench.common import write_result
from bench.heldout import mixed

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "cluster" / "serve" / "demo-tp.yaml"


def workload(count: int, seed: int) -> list[dict]:
    """``count`` completions: every third sampled with its own seed, lengths 32-96."""
    out = []
    for i, prompt in enumerate(mixed(count, seed=seed)):
        body = {"model": "demo-target", "prompt": prompt[-600:], "max_tokens": 32 + (i * 13) % 65}
        if i % 3 == 2:
            body.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        else:
            body.update(temperature=0.0)
        out.append(body)
    return out


async def run_pass(http, jobs, concurrency: int, on_done=None) -> list[dict]:
    """Each job's text (or its error) and the time it finished, ``concurrency`` at once."""
    gate, results = asyncio.Semaphore(concurrency), [None] * len(jobs)

    async def one(i: int, body: dict) -> None:
        async with gate:
            r = await http.post("/v1/completions", json=body)
            ok = r.status_code == 200
            text = r.json()["choices"][0]["text"] if ok else None
            results[i] = {"ok": ok, "status": r.status_code, "text": text, "at": time.monotonic()}
            if on_done is not None:
                on_done()

    await asyncio.gather(*(one(i, b) for i, b in enumerate(jobs)))
    return results


async def measure(url: str, args) -> dict:
    jobs = workload(args.requests, args.seed)
    async with httpx.AsyncClient(base_url=url, timeout=900) as http:
        reference = await run_pass(http, jobs, args.concurrency)
        pid = (await http.get("/health")).json()["tensor_parallel"]["ranks"][0]["pid"]
        done, killed = [0], {}

        def count() -> None:
            done[0] += 1
            if done[0] == args.kill_after and not killed:
                os.kill(pid, signal.SIGKILL)
                killed["at"] = time.monotonic()

        second = await run_pass(http, jobs, args.concurrency, count)
        health = (await http.get("/health")).json()
    after = sorted(r["at"] - killed["at"] for r in second if r["at"] > killed["at"])
    return {
        "requests": len(jobs),
        "failed": sum(not r["ok"] for r in second),
        "reference_failed": sum(not r["ok"] for r in reference),
        "differ": sum(a["text"] != b["text"] for a, b in zip(reference, second, strict=True)),
        "unfinished_at_kill": len(after),
        "first_finished_after_kill_s": round(after[0], 2) if after else None,
        "all_finished_after_kill_s": round(after[-1], 2) if after else None,
        "target_restarts": health["target_restarts"],
        "new_rank_pid_differs": health["tensor_parallel"]["ranks"][0].get("pid") != pid,
        "finish_times_after_kill_s": [round(a, 2) for a in after],
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.rank_kill", description=__doc__)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--kill-after", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="rank_kill")
    args = parser.parse_args()
    import ray
    from ray import serve

    from deployments.app import build_app
    from tests.conftest import free_port

    (app,) = yaml.safe_load(CONFIG.read_text())["applications"]
    app["args"]["monitoring"]["prometheus_port"] = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(app["args"]), name=app["name"], route_prefix=app["route_prefix"])
        results = asyncio.run(measure(f"http://127.0.0.1:{port}", args))
    finally:
        serve.shutdown()
        ray.shutdown()
    settings = {**vars(args), "config": str(CONFIG.relative_to(ROOT))}
    path = write_result(args.name, settings, results)
    plot(results, path.with_suffix(".png"))
    print({k: v for k, v in results.items() if k != "finish_times_after_kill_s"})


def plot(results: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    times = results["finish_times_after_kill_s"]
    ax.plot(times, range(1, len(times) + 1), drawstyle="steps-post")
    ax.set_xlabel("seconds after rank 1 was killed")
    ax.set_ylabel("requests finished (of those unfinished)")
    ax.set_title(f"{results['failed']} failed, {results['differ']} differ")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
