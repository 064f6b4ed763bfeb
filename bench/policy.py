"""The length policy against always-on and always-off speculation, over HTTP.

    python -m bench.policy                               # demo pair, Python prompts
    python -m bench.policy --draft demo-draft-python --prompts prose --name policy_drift

Starts a local Ray + Serve with the demo app (``speculation.policy: goodput``, k up to
``--k``), then at each concurrency runs, interleaved in blocks and repeated ``--reps``
times: **on** (each request sets ``num_speculative_tokens: k``: a request's own k always
wins, so this is fixed-k speculation), **off** (``speculation.enabled: false``: target
only) and **policy** (no k: the goodput policy chooses per round). Greedy completions of
held-out prompts. The policy's requests carry their own domain (``metadata.domain``), so
its acceptance estimate is learnt from its own traffic only; round costs are per batch
size for the whole engine, so rounds of the on/off blocks are real cost measurements it
may use (as requests with their own k would be in production). Writes JSON + PNG to
``bench/results/<name>.*`` with machine, commit and settings.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import httpx

from bench.common import median, write_result
from specdec.demo.corpus import read_jsonl

MODELS = Path(__file__).resolve().parents[1] / "models"
MODES = ("on", "off", "policy")


def app_config(draft: str, k: int, metrics_port: int) -> dict:
    return {
        "engine": {
            "target": {"model": str(MODELS / "demo-target"), "num_threads": 1},
            "draft": {"model": str(MODELS / draft), "num_threads": 1},
            "engine_resources": {"num_cpus": 0.5},
            "target_resources": {"num_cpus": 1},
            "draft_resources": {"num_cpus": 1},
            "speculation": {"num_speculative_tokens": k, "policy": "goodput"},
            "scheduler": {"max_num_seqs": 32, "max_waiting": 1024},
        },
        "num_replicas": 1,
        "monitoring": {"prometheus_port": metrics_port, "prometheus_host": "127.0.0.1"},
    }


async def run_block(http, prompts, mode, concurrency, requests, k, max_tokens, offset):
    """``requests`` completions by ``concurrency`` clients; returns (tokens, seconds)."""
    body = {"model": "demo-target", "max_tokens": max_tokens, "temperature": 0}
    if mode == "on":
        body |= {"speculation": {"enabled": True, "num_speculative_tokens": k}}
        body |= {"metadata": {"domain": "bench-fixed"}}
    elif mode == "off":
        body |= {"speculation": {"enabled": False}, "metadata": {"domain": "bench-fixed"}}
    else:
        body |= {"metadata": {"domain": "bench-policy"}}
    queue = list(range(requests))
    tokens = 0

    async def client():
        nonlocal tokens
        while queue:
            i = queue.pop()
            prompt = prompts[(offset + i) % len(prompts)]
            r = await http.post("/v1/completions", json={**body, "prompt": prompt})
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return tokens, time.perf_counter() - t0


async def measure(url, prompts, args) -> dict:
    out = {}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await run_block(http, prompts, "on", 2, 4, args.k, 8, 0)  # warm-up
        for c in args.concurrency:
            requests = max(args.min_requests, 2 * c)
            rates = {m: [] for m in MODES}
            # The policy's first block at this batch size includes its exploration.
            for rep in range(args.reps):
                # Each rep starts with a different mode: a machine that drifts in speed
                # during a block sequence favours no mode.
                for mode in MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]:
                    tok, sec = await run_block(
                        http, prompts, mode, c, requests, args.k, args.max_tokens, rep * 97
                    )
                    rates[mode].append(tok / sec)
                    print(f"c={c} rep={rep} {mode}: {tok / sec:.1f} tok/s", flush=True)
            best = max(median(rates["on"]), median(rates["off"]))
            out[str(c)] = {
                "tokens_per_s": {m: round(median(v), 2) for m, v in rates.items()},
                "all_tokens_per_s": {m: [round(x, 2) for x in v] for m, v in rates.items()},
                "policy_over_best_fixed": round(median(rates["policy"]) / best, 3),
                "policy_over_off": round(median(rates["policy"]) / median(rates["off"]), 3),
                "on_over_off": round(median(rates["on"]) / median(rates["off"]), 3),
            }
    return out


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = list(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for i, mode in enumerate(MODES):
        ax.bar(
            [j + (i - 1) * width for j in range(len(cs))],
            [results[c]["tokens_per_s"][mode] for c in cs],
            width,
            label=mode,
        )
    ax.set_xticks(range(len(cs)), [f"{c} concurrent" for c in cs])
    ax.set_ylabel("tokens/s (median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.policy", description=__doc__)
    parser.add_argument("--draft", default="demo-draft")
    parser.add_argument("--prompts", default="python", choices=["python", "prose"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--name", default="policy")
    args = parser.parse_args()

    import ray
    from ray import serve

    from deployments.app import build_specserve_app
    from deployments.config import AppConfig
    from tests.conftest import free_port

    prompts = [r["prompt"] for r in read_jsonl(MODELS / "prompts" / f"{args.prompts}.jsonl")]
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cfg = AppConfig.model_validate(app_config(args.draft, args.k, free_port()))
    serve.run(build_specserve_app(config=cfg, name="Bench"), name="Bench", route_prefix="/")
    try:
        results = asyncio.run(measure(f"http://127.0.0.1:{port}", prompts, args))
    finally:
        serve.shutdown()
        ray.shutdown()
    path = write_result(args.name, vars(args), results)
    plot(results, path.with_suffix(".png"), f"policy vs fixed k={args.k} vs off ({args.prompts})")
    print(path.read_text())


if __name__ == "__main__":
    main()
