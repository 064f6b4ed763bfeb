"""Can adaptation win the drift back? The drift draft distilled on retained prose, offline.

    python -m bench.distill            # writes bench/results/distill.json and distill.png

The question behind the adaptation loop, without the serving stack: the Python-only demo
draft (``models/demo-draft-python``) accepts little on prose. Serve prose "traffic" with the
demo target (greedy, its committed outputs are what retention keeps), distill the drift
draft on it with :func:`adaptation.distill.distill` (Python traffic replayed beside it),
and measure on prompts from *other documents* than the traffic's:

* agreement with the target's committed tokens (:func:`adaptation.validation.agreement`,
  the score validation uses), and
* greedy acceptance α̂ at k = 4 through the real speculative loop
  (:func:`specdec.generate.generate_speculative`),

before and after each training length, with the general demo draft as the reference.
Prompts come from ``models/prompts/``: each domain's source documents are split, the first
70 % (sorted by name) for traffic and replay, the rest for probes.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from adaptation.distill import DistillSettings, distill, training_rows
from adaptation.retention import RetainedRequest
from adaptation.validation import agreement
from bench.common import write_result
from specdec.generate import generate_autoregressive, generate_speculative
from specdec.proposers import DraftModelProposer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.speedup import estimate_alpha

MODELS = Path(__file__).resolve().parents[1] / "models"
PROBES = ("prose", "python")


def split_prompts(tokenizer, domain: str) -> tuple[list[list[int]], list[list[int]]]:
    """``(traffic, probes)`` token ids: prompts of the first 70 % of the domain's source
    documents, and of the rest (no document in both)."""
    rows = [json.loads(line) for line in (MODELS / "prompts" / f"{domain}.jsonl").open()]
    sources = sorted({r["source"] for r in rows})
    traffic_docs = set(sources[: int(len(sources) * 0.7)])

    def ids(r):
        return tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]

    return (
        [ids(r) for r in rows if r["source"] in traffic_docs],
        [ids(r) for r in rows if r["source"] not in traffic_docs],
    )


def served(target: ModelRunner, domain: str, prompts, params) -> list[RetainedRequest]:
    """What retention would keep of these requests: the target's greedy outputs."""
    return [
        RetainedRequest(
            domain, tuple(p), tuple(generate_autoregressive(target, p, params).token_ids), 0.0
        )
        for p in prompts
    ]


def acceptance(target: ModelRunner, model, records, params, k: int) -> float:
    """Greedy α̂ of ``model`` drafting k tokens for the records' prompts."""
    proposer = DraftModelProposer(ModelRunner(copy.deepcopy(model)))
    accepted, drafted = [], []
    for r in records:
        result = generate_speculative(target, proposer, list(r.prompt_token_ids), params, k)
        accepted += [x.num_accepted for x in result.rounds]
        drafted += [x.num_draft_tokens for x in result.rounds]
    return estimate_alpha(accepted, drafted)


def run(args) -> dict:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "demo-target")
    target = ModelRunner(str(MODELS / "demo-target"))
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    prose, python = split_prompts(tokenizer, "prose"), split_prompts(tokenizer, "python")
    t0 = time.perf_counter()
    data = {
        "traffic": served(target, "prose", prose[0][: args.traffic], params),
        "replay": served(target, "python", python[0][: args.replay], params),
        "prose": served(target, "prose", prose[1][: args.probes], params),
        "python": served(target, "python", python[1][: args.probes], params),
    }
    rows = {name: training_rows(recs, 256) for name, recs in data.items()}
    out: dict = {"serving_s": round(time.perf_counter() - t0, 1), "drafts": {}}

    def score(model) -> dict:
        return {
            d: {
                "agreement": round(agreement(model, rows[d]), 4),
                "alpha_k": round(acceptance(target, model, data[d], params, args.k), 4),
            }
            for d in PROBES
        }

    drift = AutoModelForCausalLM.from_pretrained(MODELS / "demo-draft-python", dtype=torch.float32)
    general = AutoModelForCausalLM.from_pretrained(MODELS / "demo-draft", dtype=torch.float32)
    out["drafts"]["drift (before)"] = score(drift.eval())
    out["drafts"]["general (reference)"] = score(general.eval())
    print(json.dumps(out["drafts"]), flush=True)
    teacher = None
    if args.token_level:
        teacher = AutoModelForCausalLM.from_pretrained(MODELS / "demo-target", dtype=torch.float32)
        teacher.eval()
    # Interleaved by training length: sequence-level, then (asked) token-level, same seed.
    for steps in args.steps:
        for level in ("sequence", "token") if teacher is not None else ("sequence",):
            model = copy.deepcopy(drift)
            settings = DistillSettings(
                steps=steps, max_seconds=900, lr=args.lr, teacher_top_k=args.top_k
            )
            report = distill(
                model,
                rows["traffic"],
                rows["replay"],
                settings,
                teacher=teacher if level == "token" else None,
            )
            name = f"drift + {steps} steps" + (
                f" (token-level, top {args.top_k})" if level == "token" else ""
            )
            out["drafts"][name] = {
                **score(model),
                "train_s": report.seconds,
                "loss": report.last_loss,
            }
            print(name, json.dumps(out["drafts"][name]), flush=True)
    return out


def plot(results: dict, path: Path, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["drafts"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.38
    for i, domain in enumerate(PROBES):
        values = [results["drafts"][n][domain]["alpha_k"] for n in names]
        ax.bar([x + i * width for x in range(len(names))], values, width, label=domain)
    ax.set_xticks([x + width / 2 for x in range(len(names))], names, fontsize=8)
    ax.set_ylabel(f"greedy acceptance α̂ at k = {k} (probe documents)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traffic", type=int, default=80, help="prose requests served")
    ap.add_argument("--replay", type=int, default=40, help="python requests replayed")
    ap.add_argument("--probes", type=int, default=20, help="probe requests per domain")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, nargs="+", default=[50, 150])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--token-level",
        action="store_true",
        help="also distil on the target's top-k distributions (a target pass per row)",
    )
    ap.add_argument("--top-k", type=int, default=16, help="--token-level: tokens kept")
    args = ap.parse_args()
    torch.set_num_threads(2)
    results = run(args)
    path = write_result(
        "distill_token_level" if args.token_level else "distill", vars(args), results
    )
    plot(results, path.with_suffix(".png"), args.k)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
