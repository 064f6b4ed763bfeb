"""The shipped length policy against the same engine with its speculation settings changed.

    python -m bench.length_policy                       # against policy: fixed
    python -m bench.length_policy --variant '{"policy_gate": false}'
    python -m bench.length_policy --config demo.yaml --variant '{}' \
        --engine-variant '{"target_resources": {"num_cpus": 1, "cpu_affinity": [1]}}'

Two engines of one shipped config (``cluster/serve/demo-colocated.yaml`` by default, its
engine section as shipped) in one Ray cluster: the shipped one and a variant whose
``speculation`` section is updated with ``--variant`` (JSON), and its engine section's
top-level keys replaced by ``--engine-variant`` (JSON; e.g. worker resources). Held-out prompts
(:mod:`bench.heldout`), 128 greedy tokens, batch 1, served prompt by prompt in turns (the
first of each pair alternating). Reports tokens/s (total tokens over total time), tokens a
round, acceptance, the k the shipped policy chose (the core's rounds by planned k), and
variant / shipped. Why: the goodput policy chooses k from what it measures; a fixed k that
beats it on the same prompts says what the policy leaves on the table.

Writes ``bench/results/length_policy.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import ray
from transformers import AutoTokenizer

from bench.common import RESULTS, write_result
from bench.heldout import mixed
from bench.pipeline import MODELS, drive, shipped_config
from deployments.frontend.engine_client import EngineClient
from specdec.sampling import SamplingParams

KEYS = ("tokens", "wall_s", "rounds", "drafted", "accepted")


async def bench(args) -> dict:
    tok = AutoTokenizer.from_pretrained(MODELS / "demo-target")
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in mixed(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    variant = json.loads(args.variant)
    engines = {
        "shipped": EngineClient(shipped_config(args.config)),
        "variant": EngineClient(
            shipped_config(args.config, speculation=variant, engine=json.loads(args.engine_variant))
        ),
    }
    for engine in engines.values():
        await engine.start()
    totals = {name: dict.fromkeys(KEYS, 0) for name in engines}
    try:
        for engine in engines.values():  # warm-up on prompts of their own
            await drive(engine, prompts[-3:], 1, 3, params, True)
            await engine.round_timings(reset=True)
        for i, prompt in enumerate(prompts[:-3]):
            order = list(engines) if i % 2 == 0 else list(engines)[::-1]
            for name in order:
                r = await drive(engines[name], [prompt], 1, 1, params, True)
                for key in KEYS:
                    totals[name][key] += r[key]
        timings = {name: await engine.round_timings() for name, engine in engines.items()}
    finally:
        for engine in engines.values():
            await engine.shutdown()
    results = {
        name: {
            "tokens_per_s": round(t["tokens"] / t["wall_s"], 2),
            "tokens_per_round": round(t["tokens"] / max(1, t["rounds"]), 3),
            "acceptance_rate": round(t["accepted"] / max(1, t["drafted"]), 4),
            "core_rounds": timings[name]["rounds"],
            "drafted_rows": timings[name]["drafted_rows"],
            "rounds_by_planned_k": dict(sorted(timings[name]["by_planned_k"].items())),
            "by_planned_k": by_planned_k(timings[name]),
            **{key: t[key] for key in ("tokens", "rounds")},
            "wall_s": round(t["wall_s"], 2),
        }
        for name, t in totals.items()
    }
    results["variant_vs_shipped"] = round(
        results["variant"]["tokens_per_s"] / results["shipped"]["tokens_per_s"], 3
    )
    return results


def by_planned_k(t: dict) -> dict[int, dict[str, float]]:
    """Per planned k: rounds, tokens a round, ms a round (critical path) and the goodput
    those rounds gave [tokens/s]: what each choice of the policy really paid."""
    out = {}
    for k, rounds in sorted(t["by_planned_k"].items()):
        tokens, seconds = t["tokens_by_planned_k"][k], t["seconds_by_planned_k"][k]
        out[k] = {
            "rounds": rounds,
            "tokens_per_round": round(tokens / rounds, 3),
            "ms_per_round": round(seconds / rounds * 1e3, 3),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
        }
    return out


def plot(results: dict, path: Path, variant: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["shipped", "variant"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    axes[0].bar(names, [results[n]["tokens_per_s"] for n in names], color=["C0", "C1"])
    axes[0].set(title=f"tokens/s (variant: {variant})", ylabel="tokens / s")
    axes[1].bar(names, [results[n]["tokens_per_round"] for n in names], color=["C0", "C1"])
    axes[1].set(title="tokens per drafted round", ylabel="tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.length_policy")
    parser.add_argument("--config", default="demo-colocated.yaml", help="cluster/serve/<name>")
    parser.add_argument("--variant", default='{"policy": "fixed"}', help="speculation JSON")
    parser.add_argument("--engine-variant", default="{}", help="engine keys JSON (replaced)")
    parser.add_argument("--prompts", type=int, default=35, help="held-out prompts (3: warm-up)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-cpus", type=int, default=4, help="the local Ray cluster's")
    args = parser.parse_args()
    ray.init(num_cpus=args.num_cpus, log_to_driver=False)
    results = asyncio.run(bench(args))
    settings = dict(vars(args))
    settings.update(batch=1, greedy=True, interleaved="prompt by prompt, order alternating")
    path = write_result("length_policy", settings, results)
    plot(results, RESULTS / "length_policy.png", args.variant)
    print(json.dumps(results, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
