"""What a token costs in SpecServe's workers against the bare model, in one process.

    python -m bench.costs        # writes bench/results/costs.json and costs.png

Two ratios, measured side by side and interleaved (rep by rep) on the demo pair, each the
median over reps of the ratio within a rep (a shared machine drifts between reps):

* target-only decoding: one step of the engine core's path (``ModelRunner.forward_padded``
  on the slot KV cache, :func:`specdec.verify.verify_rows`, rollback) against a bare
  transformers step ``model(token, past_key_values=DynamicCache)`` + argmax;
* drafting: :meth:`DraftModelProposer.propose` per draft token (greedy, with the top-4
  candidates the speculation cache uses, KV resynchronisation included) against a bare
  step of the draft model.

One torch thread, as the demo config runs the workers; the dtype the demo config serves.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from bench.common import median, write_result
from specdec.proposers import DraftModelProposer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState
from specdec.verify import VerifyRow, verify_rows

MODELS = Path(__file__).resolve().parents[1] / "models"
GREEDY = SamplingParams(temperature=0.0, max_tokens=100_000)


def bare_steps(path: Path, prompt: list[int], steps: int, dtype) -> float:
    """Median seconds of one bare transformers decode step with a DynamicCache."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    cache = DynamicCache()
    out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
    return median(times[2:])


def target_steps(path: Path, prompt: list[int], steps: int, dtype: str) -> float:
    """Median seconds of one target-only step of the engine core's path."""
    runner = ModelRunner(str(path), dtype=dtype, max_num_seqs=4)
    runner.add("seq")
    token = int(runner.forward_padded(["seq"], [prompt], last_only=True)[0].argmax())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        cached = runner.length("seq")
        logits = runner.forward_padded(["seq"], [[token]])  # [1, 1, vocab]
        ((tokens, accepted),) = verify_rows(logits, [VerifyRow(GREEDY, [], None, None)])
        runner.rollback("seq", cached + 1 + accepted)
        token = tokens[-1]
        times.append(time.perf_counter() - t0)
    return median(times[2:])


def draft_steps(path: Path, prompt: list[int], rounds: int, k: int, dtype: str) -> float:
    """Median seconds per draft token of ``propose`` (k tokens, one accepted per round)."""
    proposer = DraftModelProposer(ModelRunner(str(path), dtype=dtype, max_num_seqs=4))
    seq = SequenceState("seq", list(prompt), GREEDY)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        prop = proposer.propose([seq], k, 4)
        times.append((time.perf_counter() - t0) / k)
        seq.output_token_ids.append(int(prop.draft_token_ids[0, 0]))
    return median(times[2:])


def run(args) -> dict:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    prompt = list(range(5, 5 + args.prompt_len))
    samples = {"target_bare": [], "target_worker": [], "draft_bare": [], "draft_worker": []}
    for _ in range(args.reps):
        samples["target_bare"].append(bare_steps(MODELS / "demo-target", prompt, 40, dtype))
        samples["target_worker"].append(
            target_steps(MODELS / "demo-target", prompt, 40, args.dtype)
        )
        samples["draft_bare"].append(bare_steps(MODELS / "demo-draft", prompt, 40, dtype))
        samples["draft_worker"].append(
            draft_steps(MODELS / "demo-draft", prompt, 20, args.k, args.dtype)
        )
    ms = {name: round(median(v) * 1e3, 3) for name, v in samples.items()}

    def ratio(model: str) -> float:  # median over reps of the ratio within a rep
        pairs = zip(samples[f"{model}_worker"], samples[f"{model}_bare"], strict=True)
        return round(median([w / b for w, b in pairs]), 3)

    return {
        "ms_per_token": ms,
        "ratios": {
            "target_worker_vs_bare": ratio("target"),
            "draft_worker_vs_bare": ratio("draft"),
        },
        "samples_ms": {n: [round(x * 1e3, 3) for x in v] for n, v in samples.items()},
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms, r = results["ms_per_token"], results["ratios"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, model in zip(axes, ("target", "draft"), strict=True):
        ax.bar(
            ["bare transformers", "SpecServe worker"], [ms[f"{model}_bare"], ms[f"{model}_worker"]]
        )
        ax.set(
            title=f"{model}: worker / bare = {r[f'{model}_worker_vs_bare']}x",
            ylabel="ms per token (median)",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.costs")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--prompt-len", type=int, default=80)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per propose call")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    results = run(args)
    path = write_result("costs", vars(args) | {"threads": 1}, results)
    plot(results, path.with_suffix(".png"))
    print(path.read_text())


if __name__ == "__main__":
    main()
