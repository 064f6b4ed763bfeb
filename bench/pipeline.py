"""Benchmark of the distributed pipeline on the demo pair (real Ray actors).

    python -m bench.pipeline        # writes bench/results/pipeline.json and pipeline.png
    python -m bench.pipeline --shipped   # bench/results/pipeline_shipped.json

For 1, 4 and 16 concurrent greedy requests it runs, side by side in one run:
target-only (speculation off per request), sequential mode and overlap mode over direct
actor calls, and overlap mode over a Ray Compiled Graph (``transport: compiled_graph``).
It reports tokens/s, the per-round split measured in the engine core's loop (verify,
waiting for drafts on misses; overhead = everything else on the critical path) and the
speculation-cache hit rate.

``--shipped``: the two shipped shapes as they are, the engine sections of
``cluster/serve/demo.yaml`` (draft on an actor of its own, overlap) and
``demo-colocated.yaml`` (one process, sequential), both up at once and served prompt by
prompt in turns (the first of each pair rotating) at batch 1, on prompts the recipe never
saw (:mod:`bench.heldout`). Per shape: tokens/s (total tokens over total time), tokens a
round, the per-round split, the hit rate and the acceptance; and actor / colocated. It
says where the actor shape's rounds go, which ``bench.peers`` (over HTTP) does not.

The compiled-graph engine is started only for its own runs: its channels poll while idle
and would slow the other engines' runs on a small machine.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import ray
import yaml
from transformers import AutoTokenizer

from bench.common import write_result
from bench.heldout import mixed
from deployments.config import EngineConfig
from deployments.frontend.engine_client import EngineClient
from specdec.demo.corpus import read_jsonl
from specdec.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
SHIPPED = {"actor": "demo.yaml", "colocated": "demo-colocated.yaml"}
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


PHASES = ("wall_s", "total_s", "draft_wait_s", "verify_s", "overhead_s")  # RoundTimings' fields, s


async def drive(
    engine: EngineClient, prompts, concurrency: int, requests: int, params, speculation: bool
) -> dict:
    """Serve ``requests`` prompts, ``concurrency`` at a time; the requests' own totals
    (tokens, drafted, accepted, rounds, hits) and the wall time ``wall_s``."""
    queue = list(range(requests))
    total = dict.fromkeys(("tokens", "drafted", "accepted", "rounds", "hits"), 0)

    async def worker():
        while queue:
            i = queue.pop()
            last = None
            async for out in engine.generate(
                prompts[i % len(prompts)], params, speculation=speculation
            ):
                last = out
            total["tokens"] += last.num_output_tokens
            total["drafted"] += last.stats.drafted
            total["accepted"] += last.stats.accepted
            total["rounds"] += last.stats.rounds
            total["hits"] += last.stats.cache_hits

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    total["wall_s"] = time.perf_counter() - t0
    return total


def per_round_ms(t: dict) -> dict[str, float]:
    """The core's phase times (``RoundTimings``) as ms per round."""
    n = max(1, t["rounds"])
    return {key.replace("_s", "_ms"): round(t[key] / n * 1e3, 3) for key in PHASES}


async def run_load(
    engine: EngineClient, prompts, concurrency: int, requests: int, params, speculation: bool
):
    await engine.round_timings(reset=True)
    total = await drive(engine, prompts, concurrency, requests, params, speculation)
    t = await engine.round_timings()
    rounds, drafted = total["rounds"], total["drafted"]
    return {
        "tokens_per_s": round(total["tokens"] / total["wall_s"], 2),
        "requests": requests,
        "tokens": total["tokens"],
        "wall_s": round(total["wall_s"], 3),
        "rounds": t["rounds"],
        "per_round_ms": per_round_ms(t),
        "overhead_fraction": round(t["overhead_s"] / t["total_s"], 4) if t["total_s"] else None,
        "acceptance_rate": round(total["accepted"] / drafted, 4) if drafted else None,
        "cache_hit_rate": round(total["hits"] / rounds, 4) if rounds else None,
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


def shipped_config(
    name: str,
    fixed_width: bool = False,
    speculation: dict | None = None,
    engine: dict | None = None,
) -> EngineConfig:
    """The engine section of ``cluster/serve/<name>`` as shipped (model paths made
    absolute); ``fixed_width``: speculation during verification always on, at the config's
    width (what its branches do, whether or not the width policy would keep them);
    ``speculation``: settings that replace the section's own; ``engine``: top-level keys
    of the section replaced (e.g. a worker's resources)."""
    app = yaml.safe_load((ROOT / "cluster" / "serve" / name).read_text())["applications"][0]
    engine_section = app["args"]["engine"]
    if "speculation" in (engine or {}):
        raise ValueError("engine: speculation settings go in speculation")
    engine_section.update(engine or {})
    for role in ("target", "draft"):
        engine_section[role]["model"] = str(ROOT / engine_section[role]["model"])
    if fixed_width:
        engine_section["speculation"]["adaptive_overlap"] = False
    engine_section["speculation"].update(speculation or {})
    return EngineConfig.model_validate(engine_section)


async def bench_shipped(args) -> dict:
    """Both shipped shapes at batch 1, prompt by prompt in turns; see the module docstring."""
    tok = AutoTokenizer.from_pretrained(MODELS / "demo-target")
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in mixed(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {
        shape: EngineClient(shipped_config(name, args.fixed_width))
        for shape, name in SHIPPED.items()
    }
    for engine in engines.values():
        await engine.start()
    totals = {
        shape: dict.fromkeys(("tokens", "wall_s", "rounds", "hits", "drafted", "accepted"), 0)
        for shape in engines
    }
    try:
        for engine in engines.values():  # warm-up: the first rounds of the width policy
            await run_load(engine, prompts[-2:], 1, 2, params, True)
            await engine.round_timings(reset=True)
        for i, prompt in enumerate(prompts):
            order = list(engines) if i % 2 == 0 else list(engines)[::-1]
            for shape in order:
                r = await drive(engines[shape], [prompt], 1, 1, params, True)
                for key in totals[shape]:
                    totals[shape][key] += r[key]
        timings = {shape: await engine.round_timings() for shape, engine in engines.items()}
        draft = await engines["actor"].draft.stats.remote()
    finally:
        for engine in engines.values():
            await engine.shutdown()
    results = {shape: _shape_result(totals[shape], timings[shape]) for shape in engines}
    # The actor draft's speculation while verifying, since it started (warm-up included):
    # branches prepared, hits, and the width policy's measured goodput with and without.
    results["actor"]["draft"] = {
        key: draft[key] for key in ("speculated", "hits", "misses", "width", "widths", "goodput")
    }
    results["actor_vs_colocated"] = round(
        results["actor"]["tokens_per_s"] / results["colocated"]["tokens_per_s"], 3
    )
    return results


def _shape_result(total: dict, t: dict) -> dict:
    return {
        "tokens_per_s": round(total["tokens"] / total["wall_s"], 2),
        "tokens_per_round": round(total["tokens"] / max(1, total["rounds"]), 3),
        "per_round_ms": per_round_ms(t),
        "cache_hit_rate": round(total["hits"] / max(1, total["rounds"]), 4),
        "acceptance_rate": round(total["accepted"] / max(1, total["drafted"]), 4),
        "draft_timeouts": t["draft_timeouts"],
        **{key: total[key] for key in ("tokens", "rounds")},
        "wall_s": round(total["wall_s"], 2),
        "core_rounds": t["rounds"],  # (with the warm-up's last round, if it ran past reset)
        "core_round_wall_s": round(t["wall_s"], 2),  # idle time excluded
    }


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
    parser.add_argument("--shipped", action="store_true", help="the shipped shapes at batch 1")
    parser.add_argument("--prompts", type=int, default=16, help="--shipped: held-out prompts")
    parser.add_argument(
        "--fixed-width",
        action="store_true",
        help="--shipped: the actor shape speculates at its width every round (no width policy)",
    )
    args = parser.parse_args()
    if args.shipped:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
        results = asyncio.run(bench_shipped(args))
        settings = vars(args) | {"configs": SHIPPED, "batch": 1, "greedy": True}
        name = "pipeline_shipped_fixed_width" if args.fixed_width else "pipeline_shipped"
        print(write_result(name, settings, results).read_text())
        return
    # Logical CPUs: three engines of two workers each (the CPU cores are shared).
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    results = asyncio.run(bench(args))
    path = write_result("pipeline", vars(args) | {"workers_threads": 1}, results)
    plot(results, path.with_suffix(".png"))
    print(path.read_text())


if __name__ == "__main__":
    main()
