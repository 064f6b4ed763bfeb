"""Benchmark of the demo pair in one process: costs, acceptance, in-process speedup.

    python -m bench.pair            # writes bench/results/pair.json and pair.png

Measures, with one torch thread at batch 1: per-token cost of the target and each draft,
the target's verify cost for k + 1 = 2..9 positions, greedy and T=1 acceptance per
domain for k = 2..8 (α̂ = ΣA / (ΣA + rounds with a rejection), and accepted/drafted),
and the speedup of generate_speculative over generate_autoregressive (greedy), measured
side by side on the same prompts.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from bench.common import write_result
from specdec.demo.corpus import read_jsonl
from specdec.demo.drift import token_cost
from specdec.generate import generate_autoregressive, generate_speculative
from specdec.proposers import DraftModelProposer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.speedup import estimate_alpha

MODELS = Path(__file__).resolve().parents[1] / "models"
DRAFTS = ("demo-draft", "demo-draft-python")
DOMAINS = ("python", "prose")


def acceptance(target, draft, prompts, k, params) -> dict:
    accepted, drafted = [], []
    for ids in prompts:
        res = generate_speculative(target, draft, ids, params, k)
        accepted += [r.num_accepted for r in res.rounds]
        drafted += [r.num_draft_tokens for r in res.rounds]
    return {
        "alpha_hat": round(estimate_alpha(accepted, drafted), 4),
        "accepted_over_drafted": round(sum(accepted) / max(1, sum(drafted)), 4),
        "tokens_per_round": round((sum(accepted) + len(accepted)) / max(1, len(accepted)), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pair")
    parser.add_argument("--prompts", type=int, default=12, help="held-out prompts per domain")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=40, help="timing repetitions")
    args = parser.parse_args()
    torch.set_num_threads(1)

    tok = AutoTokenizer.from_pretrained(MODELS / "demo-target")
    prompts = {
        d: [
            tok(r["prompt"], add_special_tokens=False)["input_ids"]
            for r in read_jsonl(MODELS / "prompts" / f"{d}.jsonl")[: args.prompts]
        ]
        for d in DOMAINS
    }
    target = ModelRunner(str(MODELS / "demo-target"))
    drafts = {name: ModelRunner(str(MODELS / name)) for name in DRAFTS}

    costs = {"demo-target": token_cost(target, 1, args.reps)}
    for name, runner in drafts.items():
        costs[name] = token_cost(runner, 1, args.reps)
    verify = {n: token_cost(target, n, args.reps) for n in range(1, 10)}

    ks = list(range(2, 9))
    acc: dict = {}
    jobs = [
        (name, d, temp, k) for name in DRAFTS for d in DOMAINS for temp in (0.0, 1.0) for k in ks
    ]
    for name, d, temp, k in tqdm(jobs, desc="acceptance", unit="cfg"):
        params = SamplingParams(
            temperature=temp, max_tokens=args.max_tokens, seed=0, ignore_eos=True
        )
        acc.setdefault(name, {}).setdefault(d, {}).setdefault(f"T={temp:g}", {})[str(k)] = (
            acceptance(target, DraftModelProposer(drafts[name]), prompts[d], k, params)
        )

    # Side-by-side timing: autoregressive vs speculative (greedy) on the same prompts, each k.
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    draft = DraftModelProposer(drafts["demo-draft"])
    all_prompts = prompts["python"][:6] + prompts["prose"][:6]
    speed = {}
    for k in tqdm([0, *ks], desc="speedup", unit="k"):
        t0 = time.perf_counter()
        n = 0
        for ids in all_prompts:
            if k == 0:
                out = generate_autoregressive(target, ids, greedy)
            else:
                out = generate_speculative(target, draft, ids, greedy, k)
            n += len(out.token_ids)
        speed[str(k)] = n / (time.perf_counter() - t0)
    base = speed["0"]
    best_k = max(ks, key=lambda k: speed[str(k)])
    results = {
        "ms_per_token": {m: round(c * 1e3, 3) for m, c in costs.items()},
        "target_over_draft_cost": round(costs["demo-target"] / costs["demo-draft"], 2),
        "verify_ms": {str(n): round(c * 1e3, 3) for n, c in verify.items()},
        "verify_over_decode": {str(n): round(c / verify[1], 3) for n, c in verify.items()},
        "acceptance": acc,
        "tokens_per_s": {k: round(v, 1) for k, v in speed.items()},
        "speedup_vs_target_only": {k: round(v / base, 3) for k, v in speed.items() if k != "0"},
        "best_k": best_k,
        "speedup_at_best_k": round(speed[str(best_k)] / base, 3),
    }
    path = write_result("pair", vars(args) | {"threads": 1, "batch": 1}, results)
    plot(results, path.with_suffix(".png"))
    print(path.read_text())


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for name, per_domain in results["acceptance"].items():
        for d, per_t in per_domain.items():
            curve = per_t["T=0"]
            ax.plot(
                [int(k) for k in curve],
                [v["alpha_hat"] for v in curve.values()],
                marker="o",
                label=f"{name} / {d}",
            )
    ax.set(title="greedy acceptance α̂ by draft length", xlabel="k", ylabel="α̂", ylim=(0, 1))
    ax.legend(fontsize=8)
    ax = axes[1]
    v = results["verify_over_decode"]
    ax.plot([int(n) for n in v], list(v.values()), marker="o")
    ax.set(
        title="target verify cost / one-token decode",
        xlabel="positions verified (k + 1)",
        ylabel="ratio",
    )
    ax = axes[2]
    s = results["speedup_vs_target_only"]
    ax.bar([int(k) for k in s], list(s.values()))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(title="in-process speedup (greedy, batch 1)", xlabel="k", ylabel="× target-only")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
