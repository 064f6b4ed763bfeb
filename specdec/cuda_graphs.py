"""A runner's passes as CUDA graphs: static shapes, persistent buffers, one replay a pass.

Why: on a GPU an eager forward is the host issuing one kernel at a time, and the host, not
the device, sets the pace. Measured on an H100 (bench.gpu, eager, bf16): every pass of the
Llama-3.1-8B shape took 22-27 ms whatever its batch and width against a memory-bound floor
of about 5 ms, the 1B draft's step 11 ms against 0.85 ms. A CUDA graph records a pass's
kernels once and replays them with one launch, so the device runs them back to back.

What a graph needs, and how a pass gets it here:

- **Static shapes.** A graph is recorded for one :class:`GraphShape`: rows padded up to a
  batch bucket (1, 2, 4, 8, ... up to the slot count), the pass's query length as it is
  (1 for decode and draft steps, k + 1 for a verification; longer passes, prefill chunks,
  run eager), and keys padded up to a multiple of ``kv_block``. Every query attends
  through a mask built from its row's positions (:class:`specdec.row_attention.RowSpans`
  with ``keys_padded``), so the padded keys past a row's end are never read; padded rows
  write their keys to the cache's scratch column, which no mask lets anyone read.
- **Persistent buffers.** Each shape owns its inputs (ids, positions, write positions,
  slots; the key range is constant) and the pass copies its values into them; the graph
  reads those addresses, the KV cache's and the weights' (weights load in place).
- **No host syncs inside.** The pass reads no device value into Python (the compiled path
  already needed that; ``tests/specdec/test_cuda_graphs.py`` counts them).

Recording runs the pass eagerly twice on a side stream first (lazy initialisations,
allocations), then records it. Both eager runs write the same keys and values the pass
will (the same tokens at the same positions: an idempotent write), so recording a shape at
its first real pass is exact. Graphs share one memory pool per runner (they never run
concurrently) and, per batch and query count, one logits buffer that each pass copies out
of before the next replays; a runner keeps at most ``max_graphs`` graphs, dropping the
least recently replayed (recorded again, in a fraction of a second, when next needed).

A shape whose recording fails runs eager from then on (logged). Off CUDA nothing is
recorded: the same padded passes run eagerly on the buffers, which is how the tests check
the padding's exactness on a CPU.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("specserve.execution")

KV_BLOCK = 256  # keys are padded up to a multiple of this [tokens]
# Graphs a runner keeps (least recently replayed dropped first): a server meets a shape
# per batch bucket, query length and key block (6 x 3 x 32 for 32 rows, k = 4 and 8192
# tokens), each holding its kernels' launch state on the device.
MAX_GRAPHS = 256
MAX_FAILURES = 3  # failed recordings after which a runner stops trying
# Queries a graphed pass may have: decode and draft steps (1), verifications of up to 8
# drafts (the default max_speculative_tokens). Longer passes (short prompts, a long
# prompt's last chunk) run eager: each length would be graphs of its own, and their
# logits buffers [rows, queries, vocab] grow with it.
MAX_GRAPH_QUERY_LEN = 9
# What a runner's KV budget leaves its graphs beyond their estimated needs [bytes]: the
# caching allocator hands a pool whole segments (2 MiB for small blocks, 20 MiB or more
# for large ones), so a pool holds more than its blocks' sum.
GRAPH_POOL_SLACK = 64 << 20


@dataclass(frozen=True, slots=True, order=True)
class GraphShape:
    """The sizes one graph is recorded for."""

    batch: int  # rows, the batch padded up to a bucket
    queries: int  # tokens each row appends (padded per row to the longest)
    kv_len: int  # keys attended, padded up to a multiple of kv_block [tokens]

    def __str__(self) -> str:
        return f"{self.batch} rows x {self.queries} queries x {self.kv_len} keys"


@dataclass(slots=True)
class StaticInputs:
    """One shape's persistent inputs on the model's device (a graph reads these addresses)."""

    input_ids: torch.Tensor  # [batch, queries] int64
    position_ids: torch.Tensor  # [batch, queries] int64 each query's position
    write_positions: torch.Tensor  # [batch, queries] int64 where its keys go in the cache
    slots: torch.Tensor  # [batch] int64 each row's KV slot
    kv_range: torch.Tensor  # [kv_len] int64 arange (constant)


def batch_buckets(max_rows: int) -> list[int]:
    """Row counts graphs are recorded for: powers of two below ``max_rows``, then it."""
    buckets, b = [], 1
    while b < max_rows:
        buckets.append(b)
        b *= 2
    return [*buckets, max_rows]


def padded_keys(kv_len: int, kv_block: int, max_kv_len: int) -> int:
    """Keys a graph attends for a pass reading ``kv_len``: up to a multiple of
    ``kv_block``, at most ``max_kv_len`` (a pass never reads past it)."""
    return min(-(-kv_len // kv_block) * kv_block, max_kv_len)


class GraphRecorder:
    """One CUDA graph per key, each over that key's persistent inputs: recorded at the
    key's first replay, replayed after; off CUDA the function runs eagerly on the inputs.

    ``run(inputs)`` returns a tensor or a tuple of tensors and must read nothing from the
    device into Python. Its outputs are returned as fresh tensors (the graph's own are
    overwritten by the next replay), each cut to its first ``rows`` rows. With ``share``,
    a single-tensor output is copied into one buffer per share key (graphs of one size
    and several key counts then hold one output between them).

    ``share_pool_with``: another recorder of the same device whose memory pool and
    recording stream these graphs use too, so that their transients reuse what its
    largest pass left in the pool rather than a pool of their own that no budget counts.
    The two recorders' graphs must then never replay at once (one thread runs both: a
    runner's passes and its draft rounds)."""

    def __init__(
        self,
        run: Callable,
        *,
        device: torch.device,
        name: str,
        max_graphs: int,
        share_pool_with: GraphRecorder | None = None,
    ):
        self.name = name
        self._run = run
        self.device = device
        self.record = device.type == "cuda"
        self.max_graphs = max_graphs
        self.inputs: dict = {}  # key -> its persistent inputs
        # Recorded graphs and their outputs, least recently replayed first.
        self.graphs: OrderedDict = OrderedDict()
        self._shared: dict = {}  # share key -> output buffer
        self.failed: set = set()  # keys that run eager (recording failed)
        self.record_seconds: dict = {}
        self.evicted = 0  # graphs dropped past max_graphs (recorded again when next needed)
        # After this many failed recordings nothing more is tried (a model whose forward
        # reads the device, DeepSeek-V3's experts in float32: each try costs two passes).
        self.max_failures = MAX_FAILURES
        self.disabled = False
        # One recording stream for every capture: the allocator reuses a freed block only
        # on the stream it was allocated on, so a new stream per capture would leave every
        # earlier graph's transients unusable and grow the pool by a pass's peak per graph.
        if share_pool_with is not None:
            if share_pool_with.device != device:
                raise ValueError(f"{name}: a pool is shared on one device only")
            self._pool, self._stream = share_pool_with._pool, share_pool_with._stream
        elif self.record:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        else:
            self._pool = self._stream = None

    def memory_bytes(self) -> int:
        """What the recorded graphs hold now [bytes]: their pool's segments and the shared
        output buffers (0 off CUDA, where nothing is recorded). A recorder that shares
        another's pool counts that whole pool too: add one of the two, not both."""
        shared = sum(b.numel() * b.element_size() for b in self._shared.values())
        return self.pool_bytes() + shared

    def pool_bytes(self) -> int:
        """The segments of the graphs' shared memory pool [bytes]: the transients of the
        largest pass recorded, whatever the number of graphs (0 off CUDA)."""
        if not self.record:
            return 0
        pool = tuple(self._pool)
        segments = torch.cuda.memory_snapshot()
        return sum(s["total_size"] for s in segments if tuple(s["segment_pool_id"]) == pool)

    def replay(self, key, rows: int, share=None):
        """The outputs of ``key``'s graph over its inputs (which the caller has filled),
        cut to ``rows`` rows; None where ``key`` runs eager (the caller runs it)."""
        if key in self.failed or self.disabled:
            return None
        static = self.inputs[key]
        if not self.record:
            return _cut(self._run(static), rows)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(key, static, share)
            if entry is None:
                return None
        self.graphs.move_to_end(key)
        entry[0].replay()
        return _cut(entry[1], rows)

    def _capture(self, key, static, share):
        """Record ``key``'s graph over its inputs (which hold a real call: the eager runs
        before recording write what the call writes); None if that failed (then eager)."""
        start = time.perf_counter()
        try:
            side = self._stream
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    result = self._run(static)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if share is not None and share not in self._shared:
                self._shared[share] = torch.empty_like(result)
            graph = torch.cuda.CUDAGraph()
            # On this runner's own stream and device (torch's default recording stream is
            # one per process, made on whichever device was current: a runner on another
            # device would record nothing). thread_local: another thread's CUDA calls do
            # not break this recording, nor does it break theirs.
            with (
                torch.cuda.device(self.device),
                torch.cuda.graph(
                    graph, pool=self._pool, stream=side, capture_error_mode="thread_local"
                ),
            ):
                result = self._run(static)
                if share is not None:
                    result = self._shared[share].copy_(result)
        except Exception as exc:  # whatever the recording raised: this key runs eager
            self._failed(key, exc)
            return None
        self.graphs[key] = (graph, result)
        if len(self.graphs) > self.max_graphs:
            old, _ = self.graphs.popitem(last=False)
            del self.inputs[old]
            self.evicted += 1
        seconds = time.perf_counter() - start
        self.record_seconds[key] = seconds
        logger.info("%s: recorded %s in %.2f s", self.name, key, seconds)
        return self.graphs[key]

    def _failed(self, key, exc: Exception) -> None:
        """``key`` runs eager from now on (logged); past ``max_failures`` every key."""
        self.failed.add(key)
        self.inputs.pop(key, None)
        logger.warning("%s: %s runs eager, recording its graph failed: %r", self.name, key, exc)
        if len(self.failed) >= self.max_failures and not self.disabled:
            self.disabled = True
            logger.warning(
                "%s: %d recordings failed; every pass runs eager from now on",
                self.name,
                len(self.failed),
            )


def _cut(result, rows: int):
    """Fresh copies of the first ``rows`` rows of a tensor or of each tensor of a tuple."""
    if isinstance(result, torch.Tensor):
        return result[:rows].clone()
    return tuple(t[:rows].clone() for t in result)


class GraphedForward(GraphRecorder):
    """A pass function run as one CUDA graph per :class:`GraphShape` (eagerly on the same
    padded buffers off CUDA).

    ``run(inputs)`` is the model's forward over a :class:`StaticInputs` returning logits
    ``[batch, queries, vocab]``; it must read nothing from the device into Python.
    ``scratch_position`` is where padded rows write; ``max_kv_len`` the most keys a pass
    reads (keys are padded up to it, never past)."""

    def __init__(
        self,
        run: Callable[[StaticInputs], torch.Tensor],
        *,
        device: torch.device,
        max_rows: int,
        max_kv_len: int,
        scratch_position: int,
        name: str,
        kv_block: int = KV_BLOCK,
        max_graphs: int = MAX_GRAPHS,
    ):
        super().__init__(run, device=device, name=name, max_graphs=max_graphs)
        self.buckets = batch_buckets(max_rows)
        self.max_kv_len = max_kv_len
        self.kv_block = kv_block
        self.scratch_position = scratch_position

    def shape_for(self, batch: int, queries: int, kv_len: int) -> GraphShape | None:
        """The graph a pass of these sizes runs, or None: it has more rows than any bucket."""
        rows = next((b for b in self.buckets if b >= batch), None)
        if rows is None:
            return None
        return GraphShape(rows, queries, padded_keys(kv_len, self.kv_block, self.max_kv_len))

    def __call__(
        self,
        shape: GraphShape,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        write_positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor | None:
        """Run a pass of ``batch <= shape.batch`` rows (``[batch, queries]`` ids, positions
        and write positions, ``[batch]`` slots, on the model's device); returns its logits
        ``[batch, queries, vocab]`` (a fresh tensor), or None where this shape runs eager
        (the caller runs the model)."""
        if shape in self.failed or self.disabled:
            return None
        static = self.inputs.get(shape) or self._new_inputs(shape)
        batch = input_ids.shape[0]
        static.input_ids[:batch].copy_(input_ids)
        static.position_ids[:batch].copy_(position_ids)
        static.write_positions[:batch].copy_(write_positions)
        static.slots[:batch].copy_(slots)
        if batch < shape.batch:  # padded rows: a harmless pass written to scratch
            static.input_ids[batch:].zero_()
            static.position_ids[batch:].zero_()
            static.write_positions[batch:].fill_(self.scratch_position)
            static.slots[batch:].copy_(slots[:1].expand(shape.batch - batch))
        return self.replay(shape, batch, share=(shape.batch, shape.queries))

    def _new_inputs(self, shape: GraphShape) -> StaticInputs:
        def zeros(*size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.long, device=self.device)

        static = StaticInputs(
            input_ids=zeros(shape.batch, shape.queries),
            position_ids=zeros(shape.batch, shape.queries),
            write_positions=zeros(shape.batch, shape.queries),
            slots=zeros(shape.batch),
            kv_range=torch.arange(shape.kv_len, device=self.device),
        )
        self.inputs[shape] = static
        return static
