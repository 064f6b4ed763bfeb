"""A round's one-token draft steps as compiled graphs of several steps each.

Why: a small draft's step is mostly the cost of calling it. On the demo draft (one layer,
one thread, this repository's CPU machines) a compiled call costs about 0.75 ms before its
first kernel (guards on thousands of module attributes, the graph's wrappers; once warm
only the input tensors' guards run, :meth:`specdec.execution.CompiledForward._guard_stance`)
and each step inside it about 0.25 ms; the runner's Python around a pass (rows, positions, layout,
the logits' commit) and the proposer's after it (top-m, confidence) add 0.3-0.5 ms more.
So :meth:`specdec.proposers.DraftModelProposer.propose` runs a round's steps, each
feeding one token per row (the step before's draft, or at the first step the one
committed token the draft has not seen: the usual round), as graphs of 1, 2 or 4 steps:
the model, the argmax or top-m, the draft's own probabilities and the confidence stop,
never returning to Python between steps. A first step that feeds several committed
tokens (a new row's prompt; a round that accepted every draft) stays an ordinary pass.
Greedy rows only: a sampled row draws from its request's generator, which a graph cannot
hold, and a row with penalties or ``min_tokens`` needs its drafts on the host each step
(such batches run step by step, as before).

Graphs are kept per :class:`StepsShape` (one row or several; steps; top-m) and built by
:meth:`FusedDraftSteps.warm_up` at startup; the sizes that vary (rows, keys) are dynamic,
and everything else a round changes (positions, slots, how many tokens each row may
draft, the ids the draft may propose, the confidence threshold) is a tensor, so no round
recompiles (``tests/specdec/test_draft_steps.py``). A graph that runs eagerly (it failed to
compile, or missed its guards once warm) is drafted step by step instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from specdec.cuda_graphs import KV_BLOCK, MAX_GRAPHS, GraphRecorder, batch_buckets, padded_keys
from specdec.execution import CompiledForward
from specdec.row_attention import sdpa_backends
from specdec.runner import ModelRunner

logger = logging.getLogger("specserve.execution")

# Steps one graph runs. Each size is a graph per row shape; a graph of n steps takes about
# n times as long to compile as one step (6-16 s each here, cold), so sizes stay few.
CHUNK_SIZES = (1, 2, 4)
# The largest graph for several rows: rows share each call's cost, so a graph of 4 (the
# costliest to build: 32-40 s for the demo draft on a slow day here) saves them little.
MAX_ROWS_STEPS = 2


@dataclass(frozen=True, slots=True)
class StepsShape:
    """Which fused graph runs: the sizes and settings it is specialised on."""

    single_row: bool  # batch == 1
    steps: int  # one-token passes in the graph
    top_m: int  # likeliest tokens recorded per step (0: argmax only)

    def __str__(self) -> str:
        rows = "1 row" if self.single_row else "rows"
        return f"{rows} x {self.steps} draft steps (top {self.top_m})"


@dataclass(frozen=True, slots=True)
class FusedSteps:
    """What a graph of ``steps`` draft steps returns, on the draft's device."""

    draft_token_ids: torch.Tensor  # [batch, steps] int64
    top_token_ids: torch.Tensor | None  # [batch, steps, top_m] int64 (None: top_m 0)
    top_probs: torch.Tensor | None  # [batch, steps, top_m] float32 raw probabilities
    num_draft_tokens: torch.Tensor  # [batch] int64 each row's count after these steps


def top_candidates(
    logits: torch.Tensor, m: int, lse: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``m`` likeliest tokens of ``[batch, vocab]`` logits (``[batch, m]`` ids, the
    likeliest first) and their probabilities (``lse``: the logits' ``logsumexp`` over the
    vocabulary, ``[batch, 1]``, when the caller has it)."""
    values, index = logits.topk(m, dim=-1)  # [batch, m]
    if lse is None:
        lse = logits.logsumexp(dim=-1, keepdim=True)
    return index, (values - lse).exp()


def confidence_stop(
    counts: torch.Tensor,  # [batch] int64 drafts per row
    live: torch.Tensor,  # [batch] bool rows the stop has not ended
    logits: torch.Tensor,  # [batch, vocab] the step's logits
    lse: torch.Tensor,  # [batch, 1] their logsumexp
    tokens: torch.Tensor,  # [batch] int64 the step's drafts
    min_confidence: float | torch.Tensor,
    count: int | torch.Tensor,  # the count a row stopped at this step gets (step + 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The confidence stop, decided on the device: a live row whose draft the draft itself
    gave less than ``min_confidence`` ends here (that token is still proposed), its count
    set to ``count``. Returns the new counts and live flags. Both drafting paths (step by
    step, fused) decide by this one rule, so they propose the same counts."""
    conf = (logits.gather(-1, tokens[:, None]) - lse)[:, 0].exp()  # [batch] raw probability
    stop = live & (conf < min_confidence)
    return torch.where(stop, count, counts), live & ~stop


def chunk_sizes(remaining: int, ascending: bool, sizes: tuple[int, ...] = CHUNK_SIZES) -> list[int]:
    """The graphs (of ``sizes`` steps: ascending, 1 first) that run ``remaining`` steps,
    in order: the largest that fits each time, or, ``ascending`` (where drafting ends once
    the confidence stop has ended every row, checked between graphs), 1, 2, 4, 4, ... so
    that a round whose rows all stop early runs few steps past the stop."""
    chunks: list[int] = []
    while remaining > 0:
        fits = [s for s in sizes if s <= remaining]
        size = fits[-1]
        if ascending:
            size = min(size, sizes[min(len(chunks), len(sizes) - 1)])
        chunks.append(size)
        remaining -= size
    return chunks


class FusedDraftSteps:
    """A compiled draft runner's one-token steps, several per graph (module docstring)."""

    def __init__(
        self,
        runner: ModelRunner,
        name: str,
        sizes: tuple[int, ...] = CHUNK_SIZES,
        max_rows_steps: int = MAX_ROWS_STEPS,
    ):
        if not sizes or sizes[0] != 1 or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"sizes must ascend from 1 without repeats, got {sizes}")
        self.runner = runner
        self.sizes = sizes  # steps per graph of one row
        self.rows_sizes = tuple(s for s in sizes if s <= max_rows_steps)  # of several rows
        self._graphs = CompiledForward(self._steps, f"{name} draft steps")
        self._vocab = torch.arange(runner.vocab_size, device=runner.device)  # [vocab]
        # 0-d tensors of the scalars a call passes, made once each on the device (a copy
        # from the host per call would wait for the device's queue on an accelerator).
        self._scalars: dict[tuple[str, float], torch.Tensor] = {}

    @property
    def compile_seconds(self) -> dict[StepsShape, float]:
        return dict(self._graphs.compile_seconds)

    @property
    def eager_shapes(self) -> set[StepsShape]:
        return set(self._graphs.eager_shapes)

    def sizes_for(self, batch: int) -> tuple[int, ...]:
        """Steps per graph for a batch of ``batch`` rows."""
        return self.sizes if batch == 1 else self.rows_sizes

    def can_run(self, seq_ids: Sequence[Hashable], steps: int, top_m: int) -> bool:
        """Whether a graph of ``steps`` steps should draft these rows: not where it runs
        eagerly (its compile failed, or it missed its guards once warm: one eager pass per
        step costs more than the runner's compiled one), where a row has fewer than
        ``steps`` positions left before ``max_model_len`` (a step refuses just the one
        past the limit), or where no row has a cached token yet. Callers draft those
        steps one by one instead."""
        shape = StepsShape(len(seq_ids) == 1, steps, top_m)
        return self._fits(seq_ids, steps) and shape not in self._graphs.eager_shapes

    def _fits(self, seq_ids: Sequence[Hashable], steps: int) -> bool:
        """Whether every row has ``steps`` positions left and some row a cached token (a
        first step over no cached keys would attend to 1 key: a size the compiled graphs,
        dynamic in keys from 2, would miss their guards on, and go eager for good)."""
        longest = max(self.runner.length(sid) for sid in seq_ids)
        return longest >= 1 and longest + steps <= self.runner.max_model_len

    @torch.no_grad()  # (its graphs are traced and guarded without autograd)
    def run(
        self,
        seq_ids: Sequence[Hashable],
        tokens: torch.Tensor,
        *,
        steps: int,
        first_step: int,
        num_draft_tokens: torch.Tensor,
        k: int,
        vocab_limit: int,
        min_confidence: float,
        top_m: int,
    ) -> FusedSteps:
        """Draft positions ``first_step .. first_step + steps - 1`` of every row, the
        first fed ``tokens`` (``[batch]``, on the device: the step before's drafts, or at
        ``first_step`` 0 each row's one committed token not yet cached).

        ``num_draft_tokens`` (``[batch]``): each row's count so far, ``k`` for a row the
        confidence stop has not ended; a row whose token at position ``i`` has a raw
        probability under ``min_confidence`` ends at ``i + 1``. Every row runs every step
        (a stopped row's later drafts are never proposed). Only ids below ``vocab_limit``
        are proposed. The rows' cached lengths advance by ``steps``."""
        runner = self.runner
        rows = runner.step_rows(seq_ids, steps)
        kwargs = self._step_kwargs(
            rows, tokens, num_draft_tokens, k, first_step, vocab_limit, min_confidence, steps, top_m
        )
        try:
            with sdpa_backends(runner.device):
                drafts, top_ids, top_p, counts = self._execute(kwargs)
        finally:
            runner.end_steps()
        runner.advance(seq_ids, steps)
        if not top_m:
            top_ids = top_p = None
        return FusedSteps(drafts, top_ids, top_p, counts)

    def _execute(self, kwargs: dict):
        """:meth:`_steps` over a call's arguments, as the graph of its :class:`StepsShape`."""
        shape = StepsShape(kwargs["slots"].shape[0] == 1, kwargs["steps"], kwargs["top_m"])
        # Rows (one: specialised) and keys vary between calls of a graph.
        batch_dims = () if shape.single_row else (0,)
        dynamic = [(kwargs[name], batch_dims) for name in ("tokens", "slots", "counts", "live")]
        dynamic += [(kwargs["positions"], batch_dims), (kwargs["kv_range"], (0,))]
        return self._graphs(shape, dynamic, **kwargs)

    def _step_kwargs(
        self,
        rows,
        tokens,
        num_draft_tokens,
        k,
        first_step,
        vocab_limit,
        min_confidence,
        steps,
        top_m,
    ) -> dict:
        """:meth:`_steps`' arguments for a call (fresh row-major tensors, none aliasing
        another: a graph is guarded on its inputs' strides and aliasing)."""
        dense = torch.contiguous_format
        return dict(
            tokens=tokens.clone(memory_format=dense),
            positions=rows.positions,
            slots=rows.slots,
            kv_range=rows.kv_range,
            counts=num_draft_tokens.clone(memory_format=dense),
            live=num_draft_tokens == k,  # [batch] bool: rows the stop has not ended
            first_step=self._scalar("first_step", first_step, torch.long),
            vocab_limit=self._scalar("vocab_limit", vocab_limit, torch.long),
            min_confidence=self._scalar("min_confidence", min_confidence, torch.float32),
            steps=steps,
            top_m=top_m,
        )

    def _scalar(self, name: str, value: float, dtype: torch.dtype) -> torch.Tensor:
        key = (name, value)
        if key not in self._scalars:
            self._scalars[key] = torch.tensor(value, dtype=dtype, device=self.runner.device)
        return self._scalars[key]

    def _steps(
        self,
        tokens: torch.Tensor,  # [batch] int64: fed at the first step
        positions: torch.Tensor,  # [batch, 1] int64: where the first step's tokens go
        slots: torch.Tensor,  # [batch] int64
        kv_range: torch.Tensor,  # [kv_len] int64: the first step's keys
        counts: torch.Tensor,  # [batch] int64: drafts per row so far
        live: torch.Tensor,  # [batch] bool: rows the confidence stop has not ended
        first_step: torch.Tensor,  # [] int64: position in the round of the first step
        vocab_limit: torch.Tensor,  # [] int64: ids at or past it are never proposed
        min_confidence: torch.Tensor,  # [] float32
        steps: int,
        top_m: int,
        padded: torch.Tensor | None = None,  # [batch] bool: a CUDA graph's padded rows
    ):
        """The traced body: ``steps`` passes, each fed the argmax of the one before. In a
        CUDA graph (``padded`` given) every step reads the same padded ``kv_range``, each
        row masked to its own prefix, and padded rows write to the scratch column."""
        drafts, top_ids, top_p = [], [], []
        for j in range(steps):
            if padded is None:
                keys = torch.arange(kv_range.shape[0] + j, device=kv_range.device)
                logits = self.runner.step_logits(tokens, positions + j, slots, keys)
            else:
                at = positions + j  # [batch, 1]
                writes = at.masked_fill(padded[:, None], self.runner.cache.scratch_position)
                logits = self.runner.step_logits(
                    tokens, at, slots, kv_range, writes, keys_padded=True
                )  # [batch, V]
            logits = logits.masked_fill(self._vocab >= vocab_limit, float("-inf"))
            lse = logits.logsumexp(dim=-1, keepdim=True)  # [batch, 1]
            if top_m:  # the likeliest token heads the top-m, as in the step-by-step path
                index, probs = top_candidates(logits, top_m, lse)  # [batch, m]
                top_ids.append(index)
                top_p.append(probs)
                tokens = index[:, 0]
            else:
                tokens = logits.argmax(dim=-1)
            drafts.append(tokens)
            counts, live = confidence_stop(
                counts, live, logits, lse, tokens, min_confidence, first_step + (j + 1)
            )
        drafts_t = torch.stack(drafts, dim=1)  # [batch, steps]
        if not top_m:
            return drafts_t, drafts_t, drafts_t, counts  # (placeholders: dropped by run)
        return drafts_t, torch.stack(top_ids, dim=1), torch.stack(top_p, dim=1), counts

    @torch.no_grad()
    def warm_up(self, top_m: int) -> dict[StepsShape, float]:
        """Build every graph a round can need (each size for one row and, where two slots
        are free, :attr:`rows_sizes` for several), on scratch sequences freed after; then freeze
        (a call that would need another graph runs eagerly, logged). Returns the seconds
        each graph took."""
        runner = self.runner
        free = runner.num_free_slots
        if free == 0 or runner.max_model_len < 2 * max(self.sizes) + 4:
            self._graphs.freeze()  # (nothing compiles in a request: those graphs go eager)
            return {}
        ids = ["fused-warm-up-0", "fused-warm-up-1"][: min(2, free)]
        started = time.perf_counter()
        for sid in ids:
            runner.add(sid)
        try:
            runner.forward_padded(ids, [[0, 0, 0]] * len(ids), last_only=True)
            for batch in range(1, len(ids) + 1):
                rows = ids[:batch]
                tokens = torch.zeros(batch, dtype=torch.long, device=runner.device)
                counts = torch.full_like(tokens, max(self.sizes) + 1)
                for size in self.sizes_for(batch):
                    length = [runner.length(sid) for sid in rows]
                    self.run(
                        rows,
                        tokens,
                        steps=size,
                        first_step=1,
                        num_draft_tokens=counts,
                        k=max(self.sizes) + 1,
                        vocab_limit=runner.vocab_size,
                        min_confidence=0.0,
                        top_m=top_m,
                    )
                    for sid, n in zip(rows, length, strict=True):
                        runner.rollback(sid, n)
        finally:
            runner.end_steps()
            for sid in ids:
                runner.free(sid)
        self._graphs.freeze()
        logger.info(
            "%s: fused draft steps ready in %.1f s",
            self._graphs.name,
            time.perf_counter() - started,
        )
        return self.compile_seconds


# Steps one recorded graph runs (GraphedDraftSteps): any round of up to 8 drafts is one
# graph, one replay (recording is cheap: no compile).
GRAPH_STEP_SIZES = tuple(range(1, 9))


@dataclass(frozen=True, slots=True, order=True)
class StepsGraph:
    """Which recorded graph of draft steps runs: sizes and settings it is recorded for."""

    batch: int  # rows, padded up to a bucket
    steps: int  # one-token passes in the graph
    top_m: int  # likeliest tokens recorded per step (0: argmax only)
    kv_len: int  # keys every step attends, padded up to a multiple of KV_BLOCK [tokens]

    def __str__(self) -> str:
        return (
            f"{self.batch} rows x {self.steps} draft steps (top {self.top_m}) x {self.kv_len} keys"
        )


@dataclass(slots=True)
class _StepsInputs:
    """One :class:`StepsGraph`'s persistent inputs on the draft's device."""

    tokens: torch.Tensor  # [batch] int64 fed at the first step
    positions: torch.Tensor  # [batch, 1] int64 where the first step's tokens go
    slots: torch.Tensor  # [batch] int64
    padded: torch.Tensor  # [batch] bool: rows past the call's (written to scratch)
    counts: torch.Tensor  # [batch] int64 drafts per row so far
    live: torch.Tensor  # [batch] bool rows the confidence stop has not ended
    first_step: torch.Tensor  # [] int64
    vocab_limit: torch.Tensor  # [] int64
    min_confidence: torch.Tensor  # [] float32
    kv_range: torch.Tensor  # [kv_len] int64 arange (constant)
    steps: int
    top_m: int


class GraphedDraftSteps(FusedDraftSteps):
    """A draft on CUDA graphs (``execution_mode="cuda_graph"``): a round's one-token steps
    as one recorded graph of up to 8 steps, replayed with one launch (the model, the
    argmax or top-m, the draft's probabilities and the confidence stop on the device). Rows
    are padded up to a power-of-two bucket and keys up to a 256-token block, as the
    runner's own graphs (:mod:`specdec.cuda_graphs`), and recorded into the runner's
    memory pool (what the KV budget reserves for its graphs); off CUDA the same padded
    steps run eagerly. A graph that cannot be recorded runs its steps eagerly (logged)."""

    def __init__(self, runner: ModelRunner, name: str, sizes: tuple[int, ...] = GRAPH_STEP_SIZES):
        super().__init__(runner, name, sizes, max_rows_steps=max(sizes))
        self.recorder = GraphRecorder(
            self._run_inputs,
            device=runner.device,
            name=f"{name} draft steps",
            max_graphs=MAX_GRAPHS,
            # The runner's pool: a round's steps need less than the largest pass, whose
            # transients the KV budget already reserves (ModelRunner.graph_reserve_bytes).
            share_pool_with=runner.pass_graphs,
        )

    @property
    def compile_seconds(self) -> dict[StepsGraph, float]:
        return dict(self.recorder.record_seconds)

    @property
    def eager_shapes(self) -> set[StepsGraph]:
        return set(self.recorder.failed)

    def can_run(self, seq_ids: Sequence[Hashable], steps: int, top_m: int) -> bool:
        return self._fits(seq_ids, steps) and not self.recorder.disabled

    def _execute(self, kwargs: dict):
        """:meth:`_steps` over a call's arguments through the graph of its padded sizes
        (eagerly, unpadded, where that graph cannot be recorded)."""
        runner, batch, steps = self.runner, kwargs["slots"].shape[0], kwargs["steps"]
        bucket = next(b for b in batch_buckets(runner.max_num_seqs) if b >= batch)
        longest = kwargs["kv_range"].shape[0] - 1 + steps  # keys the last step reads
        kv_len = padded_keys(longest, KV_BLOCK, runner.max_model_len)
        key = StepsGraph(bucket, steps, kwargs["top_m"], kv_len)
        out = None
        if key not in self.recorder.failed and not self.recorder.disabled:
            static = self.recorder.inputs.get(key) or self._new_inputs(key)
            self._fill(static, batch, kwargs)
            out = self.recorder.replay(key, batch)
        return self._steps(**kwargs) if out is None else out

    def _fill(self, static: _StepsInputs, batch: int, kwargs: dict) -> None:
        """The call's rows into the first ``batch`` rows; the rest padded (their token 0 at
        position 0 of the first row's slot, written to scratch, never live)."""
        for name in ("tokens", "positions", "slots", "counts", "live"):
            getattr(static, name)[:batch].copy_(kwargs[name])
        static.padded[:batch].fill_(False)
        for name in ("first_step", "vocab_limit", "min_confidence"):
            getattr(static, name).copy_(kwargs[name])
        if batch < static.tokens.shape[0]:
            static.tokens[batch:].zero_()
            static.positions[batch:].zero_()
            static.slots[batch:].copy_(kwargs["slots"][:1].expand(static.tokens.shape[0] - batch))
            static.padded[batch:].fill_(True)
            static.counts[batch:].zero_()
            static.live[batch:].fill_(False)

    def _new_inputs(self, key: StepsGraph) -> _StepsInputs:
        dev = self.runner.device

        def zeros(*size: int, dtype=torch.long) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, device=dev)

        static = _StepsInputs(
            tokens=zeros(key.batch),
            positions=zeros(key.batch, 1),
            slots=zeros(key.batch),
            padded=zeros(key.batch, dtype=torch.bool),
            counts=zeros(key.batch),
            live=zeros(key.batch, dtype=torch.bool),
            first_step=zeros(),
            vocab_limit=zeros(),
            min_confidence=zeros(dtype=torch.float32),
            kv_range=torch.arange(key.kv_len, device=dev),
            steps=key.steps,
            top_m=key.top_m,
        )
        self.recorder.inputs[key] = static
        return static

    def _run_inputs(self, static: _StepsInputs):
        """The steps over a graph's persistent inputs (what a recording runs)."""
        return self._steps(
            tokens=static.tokens,
            positions=static.positions,
            slots=static.slots,
            kv_range=static.kv_range,
            counts=static.counts,
            live=static.live,
            first_step=static.first_step,
            vocab_limit=static.vocab_limit,
            min_confidence=static.min_confidence,
            steps=static.steps,
            top_m=static.top_m,
            padded=static.padded,
        )
