"""The one-process path on a GPU: what a round costs against the memory-bound floor.

    python -m bench.gpu                      # on a GPU machine: Llama-3.1-8B / 3.2-1B shapes
    python -m bench.gpu --device cpu --smoke # tiny configs, here, in under a minute

Why this exists: speculative decoding pays only when a draft token costs a small fraction
of a target pass, and whether SpecServe's runner gets there on the hardware users run is a
question for a GPU, which the serving stack (Ray) does not reach in this project's device
sessions. So this needs nothing but ``torch``, ``transformers`` and the source tree on
``PYTHONPATH``: no Ray, no network, no weights. It builds a target and a draft with random
weights from the configs in ``bench/configs/`` (the real ones; ``--smoke`` shrinks widths,
depths and vocabulary), in bf16 on the device, and measures with :mod:`specdec`'s runner:

* the bandwidth the device really has (a device-to-device copy), and from it the floor of
  each pass: the bytes it must read (weights, less an untied input embedding, which is a
  gather; plus the KV cache it attends to) over that bandwidth (a copy also writes; reads
  alone may go faster, so a fraction of the floor slightly above 1 is possible);
* ms per verification pass at (batch, k + 1 positions) and per draft step, each against
  its floor;
* tokens/s of plain decoding and of speculative decoding at batch 1, 8 and 32, with the
  acceptance fixed by an oracle at ``--alphas`` (random weights agree with nothing, so a
  row's accepted count is drawn as the geometric law of α, capped at k; everything else is
  the real round: k draft steps, one verification pass, argmax, commit, rollbacks);
* transformers at batch 1 on the same models: plain eager ``generate``, static cache +
  ``torch.compile`` (CUDA graphs on a GPU), and assisted generation with the draft (whose
  random weights accept little, so it is the cost of the machinery, not a speedup).

Results are written after every section to ``gpu.json`` (``gpu_smoke.json`` with
``--smoke``) in ``--out`` (default ``bench/results``), so a run cut short keeps what it
measured.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.common import commit, median
from specdec.cuda_graphs import KV_BLOCK
from specdec.draft_steps import GraphedDraftSteps
from specdec.execution import EXECUTION_MODES, default_execution_mode
from specdec.kv_cache import check_transformers_version
from specdec.runner import ATTENTION_BACKENDS, ModelRunner

CONFIGS = Path(__file__).resolve().parent / "configs"
TARGET, DRAFT = "llama-3.1-8b", "llama-3.2-1b"
# --smoke: the same families, tiny (GQA ratio and tying kept).
SMOKE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SMOKE_LAYERS = {TARGET: 2, DRAFT: 1}


def build_model(name: str, device: str, dtype: torch.dtype, smoke: bool):
    """A random-weight model of config ``name``, built on ``device`` in ``dtype``."""
    config = AutoConfig.from_pretrained(CONFIGS / name)
    if smoke:
        for key, value in {**SMOKE, "num_hidden_layers": SMOKE_LAYERS[name]}.items():
            setattr(config, key, value)
    config.dtype = dtype
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a timing must not end before its kernels do)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int) -> float:
    """Median wall seconds of ``fn()`` (after one warm-up), the device drained each time."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return median(times)


def bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second a device-to-device copy moves (each byte read and written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, reps=10)
    return 2 * nbytes / seconds


def weight_bytes(model) -> int:
    """Bytes a forward pass reads of the weights: all but an untied input embedding."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    if embed is not model.get_output_embeddings().weight:
        total -= embed.numel() * embed.element_size()
    return total


def start_rows(runner: ModelRunner, batch: int, context: int, gen: random.Random) -> list[str]:
    """``batch`` sequences with a random ``context``-token prompt each, prefilled."""
    ids = [f"row-{i}" for i in range(batch)]
    vocab = runner.input_vocab_size
    for sid in ids:
        runner.add(sid)
    runner.forward_padded(
        ids, [[gen.randrange(vocab) for _ in range(context)] for _ in ids], last_only=True
    )
    return ids


def pass_ms(runner: ModelRunner, ids: list[str], n: int, reps: int) -> float:
    """ms of one pass appending ``n`` tokens to every row (rolled back after each)."""
    lengths = [runner.length(sid) for sid in ids]

    def one():
        runner.forward_padded(ids, [[1] * n for _ in ids], last_only=n == 1)
        for sid, length in zip(ids, lengths, strict=True):
            runner.rollback(sid, length)

    return 1e3 * timed(one, runner.device, reps)


def free_rows(*runners: ModelRunner) -> None:
    """Free every sequence of the runners (the next measurement starts from empty caches)."""
    for runner in runners:
        for sid in list(runner.seq_ids):
            runner.free(sid)


def tokens_of(logits: torch.Tensor) -> list:
    """Greedy choices as Python ints (the one device-to-host read of a step)."""
    return logits.argmax(dim=-1).tolist()


def plain_decode(target: ModelRunner, batch: int, context: int, new_tokens: int, gen) -> float:
    """Tokens/s of target-only greedy decoding at ``batch`` (prefill not timed)."""
    ids = start_rows(target, batch, context, gen)
    last = [[1] for _ in ids]
    sync(target.device)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        last = [[t] for t in tokens_of(target.forward_padded(ids, last, last_only=True))]
    sync(target.device)
    seconds = time.perf_counter() - t0
    free_rows(target)
    return batch * new_tokens / seconds


class OracleRound:
    """Speculative rounds over ``batch`` rows with the acceptance drawn by an oracle.

    Both caches hold every committed token but the newest (fed next), as the engine keeps
    them; the draft also lags by the tokens it has not seen (the k-th draft of a round
    whose drafts were all accepted)."""

    def __init__(
        self,
        target: ModelRunner,
        draft: ModelRunner,
        ids: list[str],
        k: int,
        fused: GraphedDraftSteps | None = None,
    ):
        self.target, self.draft, self.ids, self.k = target, draft, ids, k
        self.fused = fused  # a round's draft steps as one graph (else step by step)
        self.committed = {sid: [1] * (target.length(sid) + 1) for sid in ids}

    def run(self, alpha: float, rng: random.Random) -> int:
        """One round; returns the tokens it committed over all rows."""
        drafts = self._draft()
        cached = [self.target.length(sid) for sid in self.ids]
        feeds = [[self.committed[sid][-1], *d] for sid, d in zip(self.ids, drafts, strict=True)]
        best = tokens_of(self.target.forward_padded(self.ids, feeds))  # [batch, k + 1]
        committed = 0
        for sid, d, b, c in zip(self.ids, drafts, best, cached, strict=True):
            a = 0
            while a < self.k and rng.random() < alpha:
                a += 1
            before = len(self.committed[sid])
            self.committed[sid] += [*d[:a], b[a]]
            self.target.rollback(sid, c + 1 + a)
            self.draft.rollback(sid, before + min(a, self.k - 1))
            committed += a + 1
        return committed

    def _draft(self) -> list[list[int]]:
        """k draft steps: the unseen committed tokens, then each draft."""
        feeds = [self.committed[sid][self.draft.length(sid) :] for sid in self.ids]
        if self.fused is not None:
            return self._draft_fused(feeds)
        drafts: list[list[int]] = [[] for _ in self.ids]
        for _ in range(self.k):
            step = tokens_of(self.draft.forward_padded(self.ids, feeds, last_only=True))
            for row, tok in zip(drafts, step, strict=True):
                row.append(tok)
            feeds = [[tok] for tok in step]
        return drafts

    def _draft_fused(self, feeds: list[list[int]]) -> list[list[int]]:
        """The k steps as one graph of k (every row feeding one token: the usual round),
        or one ordinary pass and a graph of k - 1 (a row feeding two: all accepted)."""
        dev, k = self.draft.device, self.k
        done = []
        if all(len(f) == 1 for f in feeds):
            tokens = torch.tensor([f[0] for f in feeds], device=dev)  # [batch]
        else:
            tokens = self.draft.forward_padded(self.ids, feeds, last_only=True).argmax(-1)
            done.append(tokens[:, None])
        steps = k - len(done)
        if steps:
            counts = torch.full((len(self.ids),), k, dtype=torch.long, device=dev)
            out = self.fused.run(
                self.ids,
                tokens,
                steps=steps,
                first_step=k - steps,
                num_draft_tokens=counts,
                k=k,
                vocab_limit=self.draft.vocab_size,
                min_confidence=0.0,
                top_m=0,
            )
            done.append(out.draft_token_ids)  # [batch, steps]
        return torch.cat(done, dim=1).tolist()  # [batch, k]


def speculative_decode(
    target, draft, batch, context, new_tokens, k, alpha, gen, fused=None
) -> dict:
    """Tokens/s of greedy speculative decoding with the oracle's acceptance ``alpha``."""
    ids = start_rows(target, batch, context, gen)
    for sid in ids:
        draft.add(sid)
    draft.forward_padded(ids, [[1] * context for _ in ids], last_only=True)
    rounds = math.ceil(new_tokens / ((1 - alpha ** (k + 1)) / (1 - alpha)))
    spec = OracleRound(target, draft, ids, k, fused)
    sync(target.device)
    t0 = time.perf_counter()
    tokens = sum(spec.run(alpha, gen) for _ in range(rounds))
    sync(target.device)
    seconds = time.perf_counter() - t0
    free_rows(target, draft)
    return {
        "tokens_per_s": tokens / seconds,
        "tokens_per_round_per_row": tokens / (rounds * batch),
        "ms_per_round": 1e3 * seconds / rounds,
    }


def measure_passes(target, draft, args, gen, bw: float, fused=None) -> dict:
    """ms per verification at (batch, k + 1) and per draft step, against their floors; with
    ``fused``, ms per round of k draft steps run as one graph."""
    out: dict = {"verify": {}, "draft_step": {}}
    weights = {"target": weight_bytes(target.model), "draft": weight_bytes(draft.model)}
    for batch in args.batches:
        for name, runner, sizes in (
            ("verify", target, [k + 1 for k in args.ks]),
            ("draft_step", draft, [1]),
        ):
            ids = start_rows(runner, batch, args.context, gen)
            kv = batch * args.context * runner.kv_bytes_per_token
            for n in sizes:
                ms = pass_ms(runner, ids, n, args.reps)
                floor = 1e3 * (weights["target" if runner is target else "draft"] + kv) / bw
                key = f"batch {batch}, {n} positions" if name == "verify" else f"batch {batch}"
                out[name][key] = {
                    "ms": round(ms, 4),
                    "floor_ms": round(floor, 4),
                    "floor_fraction": round(floor / ms, 4),
                }
            free_rows(runner)
        if fused is not None:  # k draft steps as one graph, against k single steps
            k = max(args.ks)
            ids = start_rows(draft, batch, args.context, gen)
            ms = fused_round_ms(draft, fused, ids, k, args.reps)
            single = out["draft_step"][f"batch {batch}"]["ms"]
            out.setdefault("draft_round", {})[f"batch {batch}, {k} steps"] = {
                "ms": round(ms, 4),
                "ms_per_step": round(ms / k, 4),
                "vs_single_steps": round(ms / (k * single), 4),
            }
            free_rows(draft)
    return out


def fused_round_ms(draft: ModelRunner, fused, ids: list[str], k: int, reps: int) -> float:
    """ms of ``k`` draft steps of every row as one graph (rolled back after each)."""
    lengths = [draft.length(sid) for sid in ids]
    tokens = torch.ones(len(ids), dtype=torch.long, device=draft.device)
    counts = torch.full_like(tokens, k)

    def one():
        out = fused.run(
            ids,
            tokens,
            steps=k,
            first_step=0,
            num_draft_tokens=counts,
            k=k,
            vocab_limit=draft.vocab_size,
            min_confidence=0.0,
            top_m=0,
        )
        out.draft_token_ids.tolist()  # the round's one read, as the proposer's
        for sid, length in zip(ids, lengths, strict=True):
            draft.rollback(sid, length)

    return 1e3 * timed(one, draft.device, reps)


def profile_passes(target, draft, args, gen, top: int = 15) -> dict:
    """Where a pass's device time goes (``--profile``): torch's profiler over ``args.reps``
    batch-1 passes each of a verification (k + 1 positions, k the largest of ``--ks``) and
    a draft step, kernels inside CUDA graph replays included. Per pass: wall ms, device ms
    (the kernels' total), kernel launches, and the ``top`` kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if target.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    out: dict = {}
    for name, runner, n in (
        ("verify", target, max(args.ks) + 1),
        ("draft_step", draft, 1),
    ):
        ids = start_rows(runner, 1, args.context, gen)
        pass_ms(runner, ids, n, 1)  # recorded / warm before the profile
        with profile(activities=activities) as prof:
            wall = pass_ms(runner, ids, n, args.reps)
        free_rows(runner)
        device_events = [
            e
            for e in prof.key_averages()
            if getattr(e, "device_type", None) is not None
            and str(e.device_type).endswith("CUDA")
            and e.self_device_time_total > 0
        ]
        kernels = sorted(device_events, key=lambda e: e.self_device_time_total, reverse=True)
        passes = args.reps + 1  # pass_ms runs one more, untimed
        out[name] = {
            "wall_ms": round(wall, 4),
            "device_ms_per_pass": round(
                sum(e.self_device_time_total for e in kernels) / 1e3 / passes, 4
            ),
            "kernels_per_pass": round(sum(e.count for e in kernels) / passes, 1),
            "top_kernels": [
                {
                    "name": e.key[:120],
                    "ms_per_pass": round(e.self_device_time_total / 1e3 / passes, 4),
                    "calls_per_pass": round(e.count / passes, 1),
                }
                for e in kernels[:top]
            ],
        }
    return out


def measure_decoding(target, draft, args, gen, fused=None) -> dict:
    """Plain and oracle-speculative tokens/s per batch (k = the largest of ``--ks``)."""
    k = max(args.ks)
    out: dict = {}
    for batch in args.batches:
        row = {"plain": plain_decode(target, batch, args.context, args.new_tokens, gen)}
        for alpha in args.alphas:
            spec = speculative_decode(
                target, draft, batch, args.context, args.new_tokens, k, alpha, gen, fused
            )
            spec["speedup_vs_plain"] = spec["tokens_per_s"] / row["plain"]
            row[f"alpha {alpha}"] = spec
        out[f"batch {batch}"] = row
    return out


def transformers_batch1(target_model, draft_model, args, gen, out: dict, save) -> None:
    """tokens/s of transformers ``generate`` at batch 1 into ``out``, saved after each: plain
    eager, assisted, then static cache + torch.compile (last: it compiles the forward)."""
    device = target_model.device
    vocab = target_model.get_input_embeddings().weight.shape[0]
    prompt = torch.tensor([[gen.randrange(vocab) for _ in range(args.context)]], device=device)
    n = args.new_tokens
    kwargs = {
        "attention_mask": torch.ones_like(prompt),
        "max_new_tokens": n,
        "min_new_tokens": n,
        "do_sample": False,
        "pad_token_id": 0,
    }

    def rate(**extra) -> float:
        return n / timed(lambda: target_model.generate(prompt, **kwargs, **extra), device, 2)

    out["plain_eager"] = rate()
    save("transformers plain")
    out["assisted"] = rate(assistant_model=draft_model)
    save("transformers assisted")
    if args.no_compile:
        return
    static: dict = {"cache_implementation": "static"}
    if device.type != "cuda":
        # gpt-fast's recipe, by hand: generate compiles static-cache decoding by itself only
        # on accelerators (there with CUDA graphs, which need its step marking, so it is
        # left to compile there).
        target_model.forward = torch.compile(target_model.forward, fullgraph=True)
        static["disable_compile"] = True
    # Room beside the graphs other tests (under pytest) made of the same class's forward:
    # torch allows 8 per code object by default (SpecServe's runners have their own).
    with torch._dynamo.config.patch(recompile_limit=1024):
        t0 = time.perf_counter()
        try:
            target_model.generate(prompt, **kwargs, **static)
        except Exception as exc:  # a peer that fails to compile is a result, not a crash
            out["static_compile_error"] = repr(exc)[:500]
            return
        out["static_compile_warmup_s"] = time.perf_counter() - t0
        out["static_compile"] = rate(**static)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--smoke", action="store_true", help="tiny configs (a CPU check)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3, 5], help="drafts per row")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.6, 0.8])
    ap.add_argument("--context", type=int, default=None, help="prompt tokens per row")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true", help="skip transformers + compile")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers altogether")
    ap.add_argument(
        "--stepwise-draft",
        action="store_true",
        help="cuda_graph: draft step by step (a graph per step), not a round as one graph",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="profile a batch-1 verification and draft step first (device time per kernel)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for the JSON and PNG (default bench/results)",
    )
    ap.add_argument(
        "--attention",
        default="auto",
        choices=list(ATTENTION_BACKENDS),
        help="SpecServe's runners' attention_backend (auto: on a GPU a round's passes on "
        "specdec.slot_attention's Triton kernels; rows: by rows through SDPA alone)",
    )
    ap.add_argument(
        "--execution-mode",
        default=None,
        choices=list(EXECUTION_MODES),
        help="how SpecServe's runners execute (specdec.execution; default: what a server "
        "runs on the device, cuda_graph on CUDA): compiled ones warm up first, and on CUDA "
        "every measured shape's graph is recorded first",
    )
    args = ap.parse_args(argv)
    args.execution_mode = args.execution_mode or default_execution_mode(
        torch.device(args.device).type
    )
    if max(args.ks) < 1 or not all(0 < a < 1 for a in args.alphas):
        ap.error("speculation needs some k >= 1 in --ks and every --alphas in (0, 1)")
    small = args.smoke
    args.context = args.context or (32 if small else 512)
    args.new_tokens = args.new_tokens or (16 if small else 128)
    args.reps = args.reps or (2 if small else 10)
    return args


def served_length(args) -> int:
    """Tokens a row can reach: its context, then at most k + 1 a round for as many rounds
    as the lowest α's expected acceptance plans (and the plain decode's new tokens)."""
    k = max(args.ks)
    rounds = max(math.ceil(args.new_tokens * (1 - a) / (1 - a ** (k + 1))) for a in args.alphas)
    return args.context + max(rounds * (k + 1), args.new_tokens) + k + 2


def record_fused(draft: ModelRunner, fused, args, kv_lens: list[int]) -> dict:
    """Record the graphs of a round's draft steps (k, and k - 1 after a round that
    accepted all) for each batch and key block, on scratch rows freed after."""
    k = max(args.ks)
    for batch in args.batches:
        ids = [f"fused-{i}" for i in range(batch)]
        for sid in ids:
            draft.add(sid)
        draft.forward_padded(ids, [[1] * (max(kv_lens) - 1)] * batch, last_only=True)
        for kv in sorted(kv_lens, reverse=True):
            for steps in (k - 1, k):  # (rollbacks only shrink: the longer row first)
                if steps < 1 or kv - steps < 1:
                    continue
                for sid in ids:
                    draft.rollback(sid, kv - steps)
                fused_round_ms(draft, fused, ids, steps, 1)
        free_rows(draft)
    return fused.compile_seconds


def record_graphs(target: ModelRunner, draft: ModelRunner, args, length: int, fused=None) -> dict:
    """Record the CUDA graphs every measured pass replays (``execution_mode="cuda_graph"``),
    before any timing: each batch, each query length (the target's verifications of k + 1
    and decode; the draft's steps of 1, or 2 tokens after a round that accepted all), and
    each key block from the context to ``length``. Returns seconds per graph and in all."""
    block = KV_BLOCK
    first = -(-(args.context + 1) // block) * block
    kv_lens = [min(b, length) for b in range(first, length + block, block)]
    out: dict = {}
    for name, runner, queries in (
        ("target", target, sorted({1, *(k + 1 for k in args.ks)})),
        ("draft", draft, [1, 2]),
    ):
        t0 = time.perf_counter()
        seconds = runner.record_graphs(args.batches, queries, kv_lens)
        out[name] = {
            "graphs": len(seconds),
            "total_s": round(time.perf_counter() - t0, 2),
            "per_graph_s": {str(shape): round(s, 3) for shape, s in seconds.items()},
            # what the graphs hold, against what a server's KV budget leaves them
            "memory_gb": round(runner.graph_memory_bytes / 1e9, 4),
            "reserve_gb": round(runner.graph_reserve_bytes / 1e9, 4),
        }
        print(f"[bench.gpu] {name}: {len(seconds)} graphs in {out[name]['total_s']} s", flush=True)
    if fused is not None:
        t0 = time.perf_counter()
        seconds = record_fused(draft, fused, args, kv_lens)
        out["draft_rounds"] = {
            "graphs": len(seconds),
            "total_s": round(time.perf_counter() - t0, 2),
            # the draft's graphs with its rounds recorded into their pool, against the reserve
            "memory_gb": round(draft.graph_memory_bytes / 1e9, 4),
            "reserve_gb": round(draft.graph_reserve_bytes / 1e9, 4),
        }
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    # Each graph's compile and recording time as it happens (a run cut short by its time
    # box still says how far it got).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    check_transformers_version()  # before minutes of model building, not after
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gen = random.Random(0)
    name = "gpu_smoke" if args.smoke else "gpu"
    results: dict = {}
    t0 = time.perf_counter()
    models = [build_model(m, args.device, dtype, args.smoke) for m in (TARGET, DRAFT)]
    results["build_s"] = time.perf_counter() - t0
    save = _saver(name, vars(args), results, args.out)
    results["bandwidth_gb_s"] = bandwidth(device, (1 << 24) if args.smoke else (1 << 30)) / 1e9
    save("bandwidth")
    length = served_length(args)
    target, draft = (
        ModelRunner(
            m,
            device=args.device,
            max_num_seqs=max(args.batches),
            max_model_len=length,
            execution_mode=args.execution_mode,
            attention_backend=args.attention,
            # the peaks the KV budget leaves free, graphs' included (record_graphs compares)
            reserve_activations=True,
        )
        for m in models
    )
    results["compile_s"] = {
        name: {str(shape): s for shape, s in runner.warm_up().items()}
        for name, runner in (("target", target), ("draft", draft))
    }
    # A draft on CUDA graphs drafts a round as one graph of k steps, as a server's does
    # (specdec.draft_steps.GraphedDraftSteps); --stepwise-draft: one graph per step.
    fused = None
    if args.execution_mode == "cuda_graph" and not args.stepwise_draft:
        fused = GraphedDraftSteps(draft, "draft")
    if target.device.type == "cuda" and args.execution_mode != "eager":
        results["record_s"] = record_graphs(target, draft, args, length, fused)
    save("warm-up")
    bw = results["bandwidth_gb_s"] * 1e9
    if args.profile:  # first: the likeliest question a lease is for
        results["profile"] = profile_passes(target, draft, args, gen)
        save("profile")
    results["passes"] = measure_passes(target, draft, args, gen, bw, fused)
    save("passes")
    results["decoding"] = measure_decoding(target, draft, args, gen, fused)
    save("decoding")
    if not args.no_peers:
        results["transformers_batch1"] = {}
        transformers_batch1(*models, args, gen, results["transformers_batch1"], save)
    path = save("transformers")
    _plot(results, path.with_suffix(".png"))
    print(f"wrote {path}")


def _saver(name: str, settings: dict, results: dict, out: Path | None):
    """Writes the results so far (JSON, with machine and commit) after each section."""
    import bench.common

    settings = {**settings, "target": TARGET, "draft": DRAFT, "commit": commit()}
    settings["out"] = str(out) if out else None
    directory = out  # None: bench/results

    def save(section: str) -> Path:
        print(f"[bench.gpu] {section} done", flush=True)
        return bench.common.write_result(name, settings, results, directory)

    return save


def _plot(results: dict, path: Path) -> None:
    """Fraction of the floor per pass, and tokens/s per batch (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # a bare GPU machine: the JSON is the result
        print("[bench.gpu] no matplotlib: no PNG")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    passes = {f"verify {k}": v for k, v in results["passes"]["verify"].items()}
    passes |= {f"draft {k}": v for k, v in results["passes"]["draft_step"].items()}
    left.barh(list(passes), [v["floor_fraction"] for v in passes.values()])
    left.set_xlabel("memory-bound floor / measured (1 = at the floor)")
    rows = results["decoding"]
    series = sorted({key for row in rows.values() for key in row})
    width = 0.8 / len(series)
    for i, key in enumerate(series):
        values = [
            (row[key] if key == "plain" else row[key]["tokens_per_s"]) for row in rows.values()
        ]
        right.bar([x + i * width for x in range(len(rows))], values, width, label=key)
    right.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], list(rows))
    right.set_ylabel("tokens/s")
    right.legend()
    fig.suptitle(f"bench.gpu ({commit()})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
