"""Does the drift scenario drift? Greedy acceptance of the drafts on *fresh* held-out prompts.

    python -m specdec.demo drift --prompts 24 --out data/drift-draft/drift.json

The committed prompt sets (``models/prompts/*.jsonl``) were cut with the recipe's seed;
this cuts new ones from the same held-out files with another seed and drops any prompt
whose text equals a committed one, so the figures are not tuned to the committed set.
For each draft, domain and k it reports α̂ = ΣA / (ΣA + rounds with a rejection), and with
one torch thread the per-token costs, the target's verify cost for k + 1 positions and the
break-even α (``specdec.speedup.break_even_alpha``) below which k drafts lose time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from specdec.demo import corpus
from specdec.generate import generate_speculative
from specdec.proposers import DraftModelProposer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.speedup import break_even_alpha, estimate_alpha

DOMAINS = ("python", "prose")


def fresh_prompts(domain: str, count: int, seed: int, models: Path = Path("models")) -> list[dict]:
    """``count`` prompts cut from held-out files with ``seed``, none equal to a committed one."""
    committed = {r["prompt"] for r in corpus.read_jsonl(models / "prompts" / f"{domain}.jsonl")}
    _, held = corpus.load_documents()
    rows, seen, want = [], set(committed), count
    while len(rows) < count:
        want *= 2  # make_prompts is deterministic in (seed, count): draw more, keep the new
        rows = []
        seen = set(committed)
        for row in corpus.make_prompts(held, domain, want, seed):
            if row["prompt"] not in seen:
                seen.add(row["prompt"])
                rows.append(row)
    return rows[:count]


def token_cost(runner: ModelRunner, n_new: int, reps: int, context: int = 64) -> float:
    """Median seconds of one forward pass appending ``n_new`` tokens after ``context``."""
    runner.add("cost")
    runner.forward(["cost"], [list(range(10, 10 + context))])
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.forward(["cost"], [list(range(20, 20 + n_new))])
        times.append(time.perf_counter() - t0)
        runner.rollback("cost", context)
    runner.free("cost")
    return statistics.median(times)


def measure(
    models: Path,
    drafts: list[str],
    count: int,
    seed: int,
    max_tokens: int,
    ks: list[int],
    reps: int,
) -> dict:
    tok = AutoTokenizer.from_pretrained(models / "demo-target")
    prompts = {d: fresh_prompts(d, count, seed, models) for d in DOMAINS}
    ids = {
        d: [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        for d, rows in prompts.items()
    }
    target = ModelRunner(str(models / "demo-target"))
    runners = {name: ModelRunner(str(models / name)) for name in drafts}
    t_target = token_cost(target, 1, reps)
    verify = {k: token_cost(target, k + 1, reps) for k in ks}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out: dict = {
        "prompts_per_domain": count,
        "prompt_seed": seed,
        "max_tokens": max_tokens,
        "ms_per_token": {"demo-target": round(t_target * 1e3, 3)},
        "verify_over_decode": {str(k + 1): round(verify[k] / t_target, 3) for k in ks},
        "drafts": {},
    }
    for name, runner in runners.items():
        t_draft = token_cost(runner, 1, reps)
        out["ms_per_token"][name] = round(t_draft * 1e3, 3)
        proposer = DraftModelProposer(runner)
        per: dict = {"alpha_hat": {}, "break_even": {}}
        for d in DOMAINS:
            per["alpha_hat"][d] = {}
            for k in ks:
                accepted, drafted = [], []
                for p in ids[d]:
                    res = generate_speculative(target, proposer, p, params, k)
                    accepted += [r.num_accepted for r in res.rounds]
                    drafted += [r.num_draft_tokens for r in res.rounds]
                per["alpha_hat"][d][str(k)] = round(estimate_alpha(accepted, drafted), 4)
                print(f"{name} {d} k={k}: {per['alpha_hat'][d][str(k)]}", flush=True)
        for k in ks:
            per["break_even"][str(k)] = round(
                break_even_alpha(k, t_draft / verify[k], verify[k] / t_target), 4
            )
        a = per["alpha_hat"]
        per["drop_at_k4"] = round(a["python"]["4"] - a["prose"]["4"], 4) if 4 in ks else None
        per["mean_over_k"] = {d: round(statistics.mean(a[d].values()), 4) for d in DOMAINS}
        per["drop_mean_over_k"] = round(
            per["mean_over_k"]["python"] - per["mean_over_k"]["prose"], 4
        )
        per["prose_below_break_even"] = {
            str(k): a["prose"][str(k)] < per["break_even"][str(k)] for k in ks
        }
        out["drafts"][name] = per
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.demo drift")
    add_arguments(parser)
    run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--drafts", nargs="+", default=["demo-draft-python", "demo-draft"])
    parser.add_argument("--prompts", type=int, default=24, help="fresh prompts per domain")
    parser.add_argument("--seed", type=int, default=1, help="prompt seed (the recipe's is 0)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--ks", type=int, nargs="+", default=list(range(2, 9)))
    parser.add_argument("--reps", type=int, default=40, help="timing repetitions")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    result = measure(
        args.models, args.drafts, args.prompts, args.seed, args.max_tokens, args.ks, args.reps
    )
    result["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
