"""Where the first token's time goes: idle and under load, with Serve's two ingresses.

    python -m bench.ttft          # writes bench/results/ttft.json and .png

The shipped ``cluster/serve/demo.yaml`` (ports freed) is deployed on a fresh local Ray
instance twice, once per ingress: Serve's Python proxy, and its HAProxy ingress
(``RAY_SERVE_ENABLE_HA_PROXY=1``, what ``make serve`` uses). Each ingress runs in a child
process of its own because Ray reads the setting when it starts. Measured per ingress:

* ``health_ms``: ``GET /health`` round trip: the ingress and the replica's HTTP handling,
  no engine work (the floor of any request);
* ``one_token_ms``: a 1-token greedy completion's round trip (the issue's 30 ms figure);
* ``ttft_stream_ms``: time to the first streamed text of a 32-token request;
* ``prefill_ms``: the target's prefill of the same prompt in this process (one thread,
  as the shipped config runs it): the model's share;
* under load (``--load`` streams of ``--load-tokens`` tokens running): the probe's
  streamed TTFT, and the round time the running streams see (their median gap between
  chunks), so TTFT can be compared with "one round + prefill".

Idle and loaded probes alternate with ``/health`` probes; medians over ``--reps``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from bench.common import write_result

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "cluster" / "serve" / "demo.yaml"
MODEL = "demo-target"
PROMPT = "import os\n\ndef read_config(path):\n"


def prefill_ms(reps: int) -> float:
    import torch

    from specdec.runner import ModelRunner

    torch.set_num_threads(1)
    runner = ModelRunner(str(ROOT / "models" / "demo-target"))
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(ROOT / "models" / "demo-target"))(PROMPT)["input_ids"]
    times = []
    for i in range(reps + 3):
        runner.add(i)
        t0 = time.perf_counter()
        runner.forward_padded([i], [ids], last_only=True)
        times.append(time.perf_counter() - t0)
        runner.free(i)
    return statistics.median(times[3:]) * 1e3


async def stream_times(http: httpx.AsyncClient, max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, gaps between later chunks) of one streamed greedy completion, in ms."""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    first, stamps = None, []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                now = time.perf_counter()
                first = first or now
                stamps.append(now)
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]
    return (first - t0) * 1e3, gaps


async def measure(url: str, args) -> dict:
    one = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        for _ in range(5):  # warm-up
            (await http.post("/v1/completions", json=one)).raise_for_status()
        health, one_token, ttft = [], [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            (await http.get("/health")).raise_for_status()
            health.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            (await http.post("/v1/completions", json=one)).raise_for_status()
            one_token.append((time.perf_counter() - t0) * 1e3)
            ttft.append((await stream_times(http, 32))[0])
        # Under load: `load` streams run; probes start one at a time among them.
        stop = asyncio.Event()
        gaps: list[float] = []

        async def background():
            while not stop.is_set():
                gaps.extend((await stream_times(http, args.load_tokens))[1])

        tasks = [asyncio.create_task(background()) for _ in range(args.load)]
        await asyncio.sleep(2.0)  # let the batch fill (not a measurement)
        loaded = []
        for _ in range(args.reps):
            loaded.append((await stream_times(http, 8))[0])
        stop.set()
        await asyncio.gather(*tasks)
    med = statistics.median
    return {
        "health_ms": round(med(health), 2),
        "one_token_ms": round(med(one_token), 2),
        "ttft_stream_ms": round(med(ttft), 2),
        "loaded_ttft_ms": round(med(loaded), 2),
        "loaded_round_ms": round(med(gaps), 2),
        "loaded_streams": args.load + 1,
    }


def child(args) -> None:
    """One ingress: a fresh Ray instance (the env var is already set), the shipped app."""
    import ray
    from ray import serve

    from deployments.app import build_app
    from tests.conftest import free_port

    (app,) = yaml.safe_load(SHIPPED.read_text())["applications"]
    app_args = app["args"]
    app_args["monitoring"]["prometheus_port"] = free_port()
    app_args["monitoring"]["prometheus_host"] = "127.0.0.1"
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(app_args), name=app["name"], route_prefix="/")
        result = asyncio.run(measure(f"http://127.0.0.1:{port}", args))
    finally:
        serve.delete(app["name"])
        ray.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["health_ms", "one_token_ms", "ttft_stream_ms", "loaded_ttft_ms", "loaded_round_ms"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.38
    for j, ingress in enumerate(("python", "haproxy")):
        xs = [i + (j - 0.5) * width for i in range(len(keys))]
        ax.bar(xs, [results[ingress][k] for k in keys], width, label=f"{ingress} ingress")
    ax.axhline(results["prefill_ms"], color="k", ls="--", lw=0.8, label="prefill (model)")
    ax.set_xticks(range(len(keys)), [k.replace("_ms", "") for k in keys], fontsize=8)
    ax.set_ylabel("ms (median)")
    ax.set_title("first-token latency, shipped demo.yaml")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ttft", description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--load", type=int, default=15, help="streams running under load")
    parser.add_argument("--load-tokens", type=int, default=96)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    results: dict = {"prefill_ms": round(prefill_ms(args.reps), 2)}
    for ingress in ("python", "haproxy"):
        env = {**os.environ, "RAY_SERVE_ENABLE_HA_PROXY": "1" if ingress == "haproxy" else "0"}
        argv = [sys.executable, "-m", "bench.ttft", "--child", "--reps", str(args.reps)]
        argv += ["--load", str(args.load), "--load-tokens", str(args.load_tokens)]
        out = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{ingress} run failed:\n{out.stderr[-3000:]}")
        results[ingress] = json.loads(line[7:])
        print(ingress, results[ingress], flush=True)
    for ingress in ("python", "haproxy"):
        r = results[ingress]
        r["one_token_over_prefill_ms"] = round(r["one_token_ms"] - results["prefill_ms"], 2)
    path = write_result("ttft", {**vars(args), "config": str(SHIPPED.relative_to(ROOT))}, results)
    plot(results, path.with_suffix(".png"))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
