"""Benchmark of the distributed pipeline on the demo pair (real Ray actors).

    python -m bench.pipeline        # writes bench/results/pipeline.json and pipeline.png

For 1, 4 and 16 concurrent greedy requests it runs, side by side in one run:
target-only (speculation off per request), sequential mode and overlap mode over direct
actor calls, and overlap mode over a Ray Compiled Graph (``transport: compiled_graph``).
It reports tokens/s, the per-round split measured in the engine core's loop (verify,
waiting for drafts on misses; overhead = everything else on the critical path) and the
speculation-cache hit rate.

The compiled-graph engine is started only for its own runs: its channels poll while idle
and would slow the other engines' runs on a small machine.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import ray
from transformers import AutoTokenizer

from bench.common import write_result
from deployments.config import EngineConfig
from deployments.frontend.engine_client import EngineClient
from specdec.demo.corpus import read_jsonl
from specdec.sampling import SamplingParams

MODELS = Path(__file__).resolve().parents[1] / "models"
MODES = ["target_only", "sequential", "overlap", "overlap_compiled_graph"]
SHORT = {"sequential": "seq", "overlap": "ovl", "overlap_compiled_graph": "cg"}


def engine_config(mode: str, k: int, max_num_seqs: int, transport: str = "actor") -> EngineConfig:
    return EngineConfig.model_validate(
        {
            "transport": transport,
            "target": {"model": str(MODELS / "demo-target"), "num_threads": 1},
            "draft": {"model": str(MODELS / "demo-draft"), "num_threads": 1},
            "engine_resources": {"num_cpus": 0},
            "target_resources": {"num_cpus": 1},
            "draft_resources": {"num_cpus": 1},
            "speculation": {"mode": mode, "num_speculative_tokens": k, "policy": "fixed"},
            "scheduler": {"max_num_seqs": max_num_seqs, "max_waiting": 1024},
        }
    )


async def run_load(
    engine: EngineClient, prompts, concurrency: int, requests: int, params, speculation: bool
):
    await engine.round_timings(reset=True)
    queue = list(range(requests))
    tokens = drafted = accepted = rounds = hits = 0

    async def worker():
        nonlocal tokens, drafted, accepted, rounds, hits
        while queue:
            i = queue.pop()
            last = None
            async for out in engine.generate(
                prompts[i % len(prompts)], params, speculation=speculation
            ):
                last = out
            tokens += last.num_output_tokens
            drafted += last.stats.drafted
            accepted += last.stats.accepted
            rounds += last.stats.rounds
            hits += last.stats.cache_hits

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    wall = time.perf_counter() - t0
    t = await engine.round_timings()
    n = max(1, t["rounds"])
    per_round = {
        key.replace("_s", "_ms"): round(t[key] / n * 1e3, 3)
        for key in ("total_s", "draft_wait_s", "verify_s", "overhead_s")
    }
    return {
        "tokens_per_s": round(tokens / wall, 2),
        "requests": requests,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "rounds": t["rounds"],
        "per_round_ms": per_round,
        "overhead_fraction": round(t["overhead_s"] / t["total_s"], 4) if t["total_s"] else None,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "cache_hit_rate": round(hits / rounds, 4) if rounds else None,
        "draft_timeouts": t["draft_timeouts"],
    }


async def bench(args) -> dict:
    tok = AutoTokenizer.from_pretrained(MODELS / "demo-target")
    rows = (
        read_jsonl(MODELS / "prompts" / "python.jsonl")[:8]
        + read_jsonl(MODELS / "prompts" / "prose.jsonl")[:8]
    )
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict = {}
    # Both engines stay up; runs alternate so that each sees the same machine load.
    engines = {
        mode: EngineClient(engine_config(mode, args.k, max(args.concurrency)))
        for mode in ("sequential", "overlap")
    }
    for engine in engines.values():
        await engine.start()
    try:
        await run_load(engines["overlap"], prompts, 1, 4, params, True)  # warm-up
        for c in args.concurrency:
            n = max(args.min_requests, c * 2)
            runs = {
                "target_only": (engines["sequential"], False),
                "sequential": (engines["sequential"], True),
                "overlap": (engines["overlap"], True),
            }
            for name, (engine, speculation) in runs.items():
                results.setdefault(str(c), {})[name] = await run_load(
                    engine, prompts, c, n, params, speculation
                )
                print(c, name, results[str(c)][name]["tokens_per_s"], flush=True)
            if args.compiled_graph:
                graph = EngineClient(
                    engine_config("overlap", args.k, max(args.concurrency), "compiled_graph")
                )
                await graph.start()
                try:
                    await run_load(graph, prompts, 1, 2, params, True)  # compiles the graph
                    results[str(c)]["overlap_compiled_graph"] = await run_load(
                        graph, prompts, c, n, params, True
                    )
                finally:
                    await graph.shutdown()
                print(
                    c,
                    "overlap_compiled_graph",
                    results[str(c)]["overlap_compiled_graph"]["tokens_per_s"],
                    flush=True,
                )
    finally:
        for engine in engines.values():
            await engine.shutdown()
    for r in results.values():
        base = r["target_only"]["tokens_per_s"]
        r["speedup"] = {
            "sequential_vs_target_only": round(r["sequential"]["tokens_per_s"] / base, 3),
            "overlap_vs_target_only": round(r["overlap"]["tokens_per_s"] / base, 3),
            "overlap_vs_sequential": round(
                r["overlap"]["tokens_per_s"] / r["sequential"]["tokens_per_s"], 3
            ),
        }
        if "overlap_compiled_graph" in r:
            r["speedup"]["compiled_graph_vs_actor_overlap"] = round(
                r["overlap_compiled_graph"]["tokens_per_s"] / r["overlap"]["tokens_per_s"], 3
            )
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = list(results)
    modes = [m for m in MODES if m in results[conc[0]]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    ax = axes[0]
    width = 0.8 / len(modes)
    for i, m in enumerate(modes):
        ax.bar(
            [j + (i - (len(modes) - 1) / 2) * width for j in range(len(conc))],
            [results[c][m]["tokens_per_s"] for c in conc],
            width,
            label=m,
        )
    ax.set_xticks(range(len(conc)), [f"{c} concurrent" for c in conc])
    ax.set(title="throughput (greedy, demo pair)", ylabel="tokens / s")
    ax.legend()
    ax = axes[1]
    labels, draft, verify, over = [], [], [], []
    for c in conc:
        for m in modes[1:]:
            pr = results[c][m]["per_round_ms"]
            labels.append(f"{SHORT[m]}\n{c}")
            draft.append(pr["draft_wait_ms"])
            verify.append(pr["verify_ms"])
            over.append(pr["overhead_ms"])
    ax.bar(labels, draft, label="waiting for drafts (misses)")
    ax.bar(labels, verify, bottom=draft, label="verify")
    ax.bar(
        labels, over, bottom=[a + b for a, b in zip(draft, verify, strict=True)], label="overhead"
    )
    ax.set(title="per-round time split", ylabel="ms per round")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument(
        "--no-compiled-graph",
        dest="compiled_graph",
        action="store_false",
        help="skip overlap mode over a Ray Compiled Graph",
    )
    args = parser.parse_args()
    # Logical CPUs: three engines of two workers each (the CPU cores are shared).
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    results = asyncio.run(bench(args))
    path = write_result("pipeline", vars(args) | {"workers_threads": 1}, results)
    plot(results, path.with_suffix(".png"))
    print(path.read_text())


if __name__ == "__main__":
    main()
