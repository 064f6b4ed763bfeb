"""What a token costs in SpecServe's workers against the bare model, in one process.

    python -m bench.costs        # writes bench/results/costs.json and costs.png

Two ratios, measured side by side and interleaved on the demo pair (the four kinds of a
model take turns in blocks of 10 steps, each first in turn), each the median over reps of
the ratio of the medians within a rep (a shared machine drifts):

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
faster), and the one a draft token must keep is ``draft_compiled_vs_bare_compiled``;
``draft_compiled_vs_compiled_stepwise`` is what the fused draft steps save (the compiled
draft with them against the same draft step by step).

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


class BareStep:
    """A bare transformers decode step of one sequence, timed one at a time: eager with a
    DynamicCache, or as gpt-fast runs it (``compiled``: a static cache and the model's
    forward compiled whole; its compiling steps run at construction, untimed)."""

    def __init__(self, path: Path, prompt: list[int], dtype, compiled: bool, max_steps: int):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.length = len(prompt)
        if compiled:
            self.cache = StaticCache(
                config=self.model.config, max_cache_len=self.length + max_steps + 8
            )
            positions = torch.arange(self.length)
            out = self.model(
                torch.tensor([prompt]), past_key_values=self.cache, cache_position=positions
            )
            self.forward = torch.compile(self.model.forward, fullgraph=True)
        else:
            self.cache = DynamicCache()
            out = self.model(torch.tensor([prompt]), past_key_values=self.cache, use_cache=True)
            self.forward = self.model.forward
        self.compiled = compiled
        self.token = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        for _ in range(3):
            self.step()

    def step(self) -> float:
        """Seconds of one decode step (the forward and its argmax)."""
        t0 = time.perf_counter()
        if self.compiled:
            position = torch.tensor([self.length])  # [1]
            # Room for this graph beside the other bare model's (the class's forward is
            # one code object for every model of the class: torch allows 8 by default).
            with torch._dynamo.config.patch(recompile_limit=1024):
                out = self.forward(
                    input_ids=self.token, past_key_values=self.cache, cache_position=position
                )
        else:
            out = self.forward(input_ids=self.token, past_key_values=self.cache, use_cache=True)
        self.token = out.logits[:, -1].argmax(-1, keepdim=True)
        self.length += 1
        return time.perf_counter() - t0


class TargetStep:
    """One target-only step of the engine core's path: ``ModelRunner.forward_padded`` on
    the slot KV cache, :func:`specdec.verify.verify_rows`, rollback."""

    def __init__(self, runner: ModelRunner, prompt: list[int], seq_id: str):
        self.runner, self.seq_id = runner, seq_id
        runner.add(seq_id)
        self.token = int(runner.forward_padded([seq_id], [prompt], last_only=True)[0].argmax())

    def step(self) -> float:
        t0 = time.perf_counter()
        cached = self.runner.length(self.seq_id)
        logits = self.runner.forward_padded([self.seq_id], [[self.token]])  # [1, 1, vocab]
        ((tokens, accepted),) = verify_rows(logits, [VerifyRow(GREEDY, [], None, None)])
        self.runner.rollback(self.seq_id, cached + 1 + accepted)
        self.token = tokens[-1]
        return time.perf_counter() - t0


class DraftRound:
    """:meth:`DraftModelProposer.propose` of ``k`` tokens with the top-4 candidates, one
    accepted per round (so each round resynchronises the draft's cache)."""

    def __init__(self, proposer: DraftModelProposer, prompt: list[int], k: int, seq_id: str):
        self.proposer, self.k = proposer, k
        self.seq = SequenceState(seq_id, list(prompt), GREEDY)

    def step(self) -> float:
        """Seconds per draft token of one proposal."""
        t0 = time.perf_counter()
        prop = self.proposer.propose([self.seq], self.k, 4)
        seconds = (time.perf_counter() - t0) / self.k
        self.seq.output_token_ids.append(prop.host_draft_token_ids[0][0])
        return seconds


def runner_for(path: Path, dtype: str, mode: str) -> ModelRunner:
    """A worker's runner; compiled ones warmed up (graphs built before any timing)."""
    runner = ModelRunner(str(path), dtype=dtype, max_num_seqs=4, execution_mode=mode)
    runner.warm_up()
    return runner


KINDS = ("bare", "bare_compiled", "worker", "compiled")


def run(args) -> dict:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    prompt = list(range(5, 5 + args.prompt_len))
    paths = {"target": Path(args.target), "draft": Path(args.draft)}
    started = time.perf_counter()
    modes = {"worker": "eager", "compiled": "torch_compile"}
    runners = {
        (m, kind): runner_for(p, args.dtype, modes[kind])
        for m, p in paths.items()
        for kind in modes
    }
    max_steps = args.reps * (args.steps + args.steps // args.block + 1)
    timers = {}
    for model, path in paths.items():
        timers[model, "bare"] = BareStep(path, prompt, dtype, False, max_steps)
        timers[model, "bare_compiled"] = BareStep(path, prompt, dtype, True, max_steps)
    for kind in modes:
        timers["target", kind] = TargetStep(runners["target", kind], prompt, "seq")
        # The worker's proposer, its fused draft steps (compiled) built as a worker
        # builds them, with the top-4 candidates.
        proposer = DraftModelProposer(runners["draft", kind])
        proposer.warm_up(4)
        timers["draft", kind] = DraftRound(proposer, prompt, args.k, "seq")
    # The compiled draft step by step (no fused steps): what the fused graphs save.
    stepwise = DraftModelProposer(runners["draft", "compiled"])
    stepwise.fused = None
    timers["draft", "compiled_stepwise"] = DraftRound(stepwise, prompt, args.k, "seq-stepwise")
    warm_up_s = round(time.perf_counter() - started, 1)
    # [rep] median seconds per token, per (model, kind). Within a rep the four kinds of a
    # model take turns in blocks of steps, so a drifting machine moves them alike; blocks,
    # not single steps, so each kind runs warm, as a worker running one model does.
    kinds = {"target": KINDS, "draft": (*KINDS, "compiled_stepwise")}
    samples = {f"{m}_{kind}": [] for m in paths for kind in kinds[m]}
    for _ in range(args.reps):
        for model in paths:
            times: dict[str, list[float]] = {kind: [] for kind in kinds[model]}
            for b in range(0, args.steps, args.block):
                turn = (b // args.block) % len(kinds[model])
                for kind in kinds[model][turn:] + kinds[model][:turn]:  # each first in turn
                    timer = timers[model, kind]
                    timer.step()  # (the block's first call finds its graph first after it)
                    times[kind] += [timer.step() for _ in range(min(args.block, args.steps - b))]
            for kind in kinds[model]:
                samples[f"{model}_{kind}"].append(median(times[kind]))
    ms = {name: round(median(v) * 1e3, 3) for name, v in samples.items()}

    def ratio(a: str, b: str) -> float:  # median over reps of the ratio within a rep
        return round(median([x / y for x, y in zip(samples[a], samples[b], strict=True)]), 3)

    pairs = [("worker", "bare"), ("compiled", "worker"), ("compiled", "bare_compiled")]
    pairs.append(("bare_compiled", "bare"))
    ratios = {
        f"{model}_{a}_vs_{b}": ratio(f"{model}_{a}", f"{model}_{b}")
        for model in paths
        for a, b in pairs
    }
    ratios["draft_compiled_vs_compiled_stepwise"] = ratio(
        "draft_compiled", "draft_compiled_stepwise"
    )
    return {
        "ms_per_token": ms,
        "ratios": ratios,
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
    parser.add_argument("--steps", type=int, default=60, help="steps of each kind per rep")
    parser.add_argument("--block", type=int, default=10, help="steps of a kind in a row")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--target", default=str(MODELS / "demo-target"), help="model dir")
    parser.add_argument("--draft", default=str(MODELS / "demo-draft"), help="model dir")
    args = parser.parse_args()
    results = run(args)
    path = write_result("costs", vars(args) | {"threads": 1}, results)
    plot(results, path.with_suffix(".png"))
    print(path.read_text())


if __name__ == "__main__":
    main()
