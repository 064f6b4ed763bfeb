"""What a token costs in SpecServe's workers against the bare model, in one process.

    python -m bench.costs        # writes bench/results/costs.json and costs.png

Two ratios, measured side by side and interleaved (rep by rep) on the demo pair, each the
median over reps of the ratio within a rep (a shared machine drifts between reps):

* target-only decoding: one step of the engine core's path (``ModelRunner.forward_padded``
  on the slot KV cache, :func:`specdec.verify.verify_rows`, rollback) against a bare
  transformers step ``model(token, past_key_values=DynamicCache)`` + argmax;
* drafting: :meth:`DraftModelProposer.propose` per draft token (greedy, with the top-4
  candidates the speculation cache uses, KV resynchronisation included; compiled: the
  steps after the first in fused graphs, :mod:`specdec.draft_steps`) against a bare step
  of the draft model.

Each is measured for both execution modes (``eager``, ``torch_compile``: the runner's
graphs, warmed up before the reps) and against two bare steps: eager, and gpt-fast's
recipe (a static cache, the forward compiled whole with ``torch.compile``). The ratios that
decide ``specdec.execution``'s default are ``*_compiled_vs_worker`` (below 1: compiled is
faster), and the one a draft token must keep is ``draft_compiled_vs_bare_compiled``.

One torch thread, as the demo config runs the workers; the dtype the demo config serves.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

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


def bare_compiled_steps(path: Path, prompt: list[int], steps: int, dtype) -> float:
    """Median seconds of one bare decode step as gpt-fast runs it: a static cache and the
    model's forward compiled whole (its first steps, which compile, are left out)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    cache = StaticCache(config=model.config, max_cache_len=len(prompt) + steps + 1)
    positions = torch.arange(len(prompt))
    out = model(torch.tensor([prompt]), past_key_values=cache, cache_position=positions)
    token = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
    forward = torch.compile(model.forward, fullgraph=True)
    times = []
    # Room for this model's graph beside the others of the class's forward (every rep's
    # model and the runners' graphs share its code object: torch allows 8 by default).
    with torch._dynamo.config.patch(recompile_limit=1024):
        for i in range(steps):
            t0 = time.perf_counter()
            position = torch.tensor([len(prompt) + i])  # [1]
            out = forward(input_ids=token, past_key_values=cache, cache_position=position)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
    return median(times[2:])


def runner_for(path: Path, dtype: str, mode: str) -> ModelRunner:
    """A worker's runner; compiled ones warmed up (graphs built before any timing)."""
    runner = ModelRunner(str(path), dtype=dtype, max_num_seqs=4, execution_mode=mode)
    runner.warm_up()
    return runner


def target_steps(runner: ModelRunner, prompt: list[int], steps: int) -> float:
    """Median seconds of one target-only step of the engine core's path."""
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
    runner.free("seq")
    return median(times[2:])


def draft_steps(proposer: DraftModelProposer, prompt: list[int], rounds: int, k: int) -> float:
    """Median seconds per draft token of ``propose`` (k tokens, one accepted per round)."""
    seq = SequenceState("seq", list(prompt), GREEDY)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        prop = proposer.propose([seq], k, 4)
        times.append((time.perf_counter() - t0) / k)
        seq.output_token_ids.append(int(prop.draft_token_ids[0, 0]))
    proposer.free("seq")
    return median(times[2:])


def run(args) -> dict:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    prompt = list(range(5, 5 + args.prompt_len))
    paths = {"target": MODELS / "demo-target", "draft": MODELS / "demo-draft"}
    started = time.perf_counter()
    runners = {
        (model, mode): runner_for(path, args.dtype, mode)
        for model, path in paths.items()
        for mode in ("eager", "torch_compile")
    }
    # The worker's proposers, their fused draft steps (compiled runners) built as a
    # worker builds them, with the top-4 candidates.
    proposers = {
        mode: DraftModelProposer(runners["draft", mode]) for mode in ("eager", "torch_compile")
    }
    for proposer in proposers.values():
        proposer.warm_up(4)
    warm_up_s = round(time.perf_counter() - started, 1)
    samples: dict[str, list[float]] = {
        f"{model}_{kind}": []
        for model in paths
        for kind in ("bare", "bare_compiled", "worker", "compiled")
    }
    for _ in range(args.reps):
        for model, path in paths.items():
            samples[f"{model}_bare"].append(bare_steps(path, prompt, 40, dtype))
            samples[f"{model}_bare_compiled"].append(bare_compiled_steps(path, prompt, 40, dtype))
            for kind, mode in (("worker", "eager"), ("compiled", "torch_compile")):
                runner = runners[model, mode]
                samples[f"{model}_{kind}"].append(
                    target_steps(runner, prompt, 40)
                    if model == "target"
                    else draft_steps(proposers[mode], prompt, 20, args.k)
                )
    ms = {name: round(median(v) * 1e3, 3) for name, v in samples.items()}

    def ratio(a: str, b: str) -> float:  # median over reps of the ratio within a rep
        return round(median([x / y for x, y in zip(samples[a], samples[b], strict=True)]), 3)

    pairs = [("worker", "bare"), ("compiled", "worker"), ("compiled", "bare_compiled")]
    pairs.append(("bare_compiled", "bare"))
    return {
        "ms_per_token": ms,
        "ratios": {
            f"{model}_{a}_vs_{b}": ratio(f"{model}_{a}", f"{model}_{b}")
            for model in paths
            for a, b in pairs
        },
        "warm_up_s": warm_up_s,
        "samples_ms": {n: [round(x * 1e3, 3) for x in v] for n, v in samples.items()},
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms, r = results["ms_per_token"], results["ratios"]
    kinds = ("bare", "bare_compiled", "worker", "compiled")
    labels = ["bare eager", "bare compiled", "SpecServe eager", "SpecServe compiled"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, model in zip(axes, ("target", "draft"), strict=True):
        ax.bar(labels, [ms[f"{model}_{k}"] for k in kinds])
        ax.tick_params(axis="x", labelsize=8)
        ax.set(
            title=f"{model}: compiled / eager = {r[f'{model}_compiled_vs_worker']}x, "
            f"/ bare compiled = {r[f'{model}_compiled_vs_bare_compiled']}x",
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
