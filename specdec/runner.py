"""Model runner: a causal LM plus a slot KV cache, batched over ragged sequences.

One runner serves one model (the target or a draft). It knows nothing about
speculation: callers append tokens to sequences (:meth:`ModelRunner.forward`), get the
logits of every appended position back, and roll sequences back to a shorter length
(:meth:`ModelRunner.rollback`) after verification rejects a suffix. Prefill, one-token
decode and multi-token verify are the same operation with different token counts.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, modeling_utils

from specdec import slot_attention
from specdec.attention import (
    attention_layout,
    build_masks,
    decoder_config,
    exact_position_limit,
)
from specdec.cuda_graphs import (
    GRAPH_POOL_SLACK,
    MAX_GRAPH_QUERY_LEN,
    GraphedForward,
    GraphShape,
    StaticInputs,
    batch_buckets,
)
from specdec.execution import (
    CUDA_GRAPH,
    EAGER,
    TORCH_COMPILE,
    CompiledForward,
    PassShape,
    check_execution_mode,
)
from specdec.kv_budget import KVPlan, budget_bytes, device_free_bytes, kv_free_bytes, plan_slots
from specdec.kv_cache import BatchLayout, SlotKVCache, check_transformers_version
from specdec.kv_manager import SlotTable
from specdec.low_rank import LowRankUpdate, merged, unfit_factors
from specdec.peak_memory import PeakMemory
from specdec.row_attention import (
    MAX_SLOT_QUERIES,
    ROW_ATTENTION,
    ROW_SPANS_KWARG,
    RowAttentionUnavailable,
    RowSpans,
    sdpa_backends,
)
from specdec.shard_loading import load_shard
from specdec.tensor_parallel import ModelShard, TensorParallelError, shard_model, shard_plan

# Attention kinds a runner takes (ModelRunner._attention_choice says what each does).
ATTENTION_BACKENDS = ("auto", "slots", "rows", "masks")

logger = logging.getLogger("specserve.runner")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Whether the models take ``logits_to_keep`` as per-row positions ``[batch, 1]`` (transformers
# 5.2x's ``slice_logits_to_keep``); before, only positions shared by every row ``[m]``.
_PER_ROW_LOGITS_TO_KEEP = hasattr(modeling_utils, "slice_logits_to_keep")
# What max_model_len is when unset and the model has more positions (as vLLM caps its
# default by memory, but fixed: the KV budget's arithmetic stays readable).
DEFAULT_MAX_MODEL_LEN = 8192


class ModelRunner:
    """Owns a model, its KV cache, and the sequences whose KV lives in that cache.

    ``model`` is any Hugging Face hub id or local directory loadable with
    ``AutoModelForCausalLM.from_pretrained`` (``trust_remote_code`` stays off unless the
    caller turns it on), or a model already built (``bench.gpu``'s random-weight 8B: saving
    16 GB only to load it again would take minutes); ``dtype`` applies to the former.
    Sliding-window layers get their window in every mask the runner builds
    (:mod:`specdec.attention`); a config with layer types it cannot mask raises
    :class:`specdec.attention.UnsupportedModelError` before any weight is loaded.
    ``attention_backend="auto"`` (the default) runs an SDPA model's attention by row
    positions (:mod:`specdec.row_attention`: no repeat_kv, masks only where needed; on a
    GPU with Triton a round's passes on :mod:`specdec.slot_attention`'s kernels, no mask
    at all; ``"rows"``: never the kernels, ``"slots"``: wherever Triton runs them); the
    probe at load falls back to ``"masks"`` (4-D masks, the reference) where it cannot.

    The KV cache is allocated once, here: ``max_num_seqs`` slots of ``max_model_len``
    tokens, or fewer when the budget (``kv_cache_memory_bytes``, or
    ``kv_cache_memory_fraction`` of the device's free memory after the weights) holds
    fewer; :attr:`max_num_seqs` is then the slot count, and :attr:`kv_plan` says why.
    A draft in the same process shares the budget: built with ``defer_kv``, it gets as
    many slots as the target built with ``kv_shared_with=draft``. With
    ``reserve_activations`` the budget leaves the measured peak of the largest passes
    free (:meth:`_measure_activations`; ``verifies`` False: a draft, whose passes keep
    only the last position's logits).
    """

    def __init__(
        self,
        model: str | PreTrainedModel,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        trust_remote_code: bool = False,
        prefill_chunk_size: int = 2048,
        max_num_batched_tokens: int = 8192,
        kv_cache_memory_bytes: int | None = None,
        kv_cache_memory_fraction: float | None = None,
        defer_kv: bool = False,
        kv_shared_with: ModelRunner | None = None,
        attention_backend: str = "auto",
        execution_mode: str = EAGER,
        max_compiled_query_len: int = 32,
        reserve_activations: bool = False,
        verifies: bool = True,
        shard: ModelShard | None = None,
    ):
        check_transformers_version()
        check_execution_mode(execution_mode)
        # This rank's share of a tensor-parallel model (None: the whole model here).
        self.shard = _checked_shard(shard, execution_mode, defer_kv)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.device = torch.device(device)
        model_name = self._load(model, dtype, trust_remote_code)
        self._set_attention(attention_backend, execution_mode)
        self._compiled: CompiledForward | None = None  # set once the probe has run eagerly
        self._graph_mode = False  # likewise (execution_mode="cuda_graph")
        # Passes of more queries (long prefill chunks: compute-bound, few) run eager.
        self.max_compiled_query_len = max_compiled_query_len
        self.max_model_len = self._served_length(model_name, max_model_len)
        self.prefill_chunk_size = prefill_chunk_size
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        # Tokens one prefill pass may carry, padding included (rows x longest append): a
        # batch of long prompts runs as several passes, so activations stay bounded.
        self.max_num_batched_tokens = max_num_batched_tokens
        # time.monotonic() when the last pass committed: progress, for a watchdog to read
        self.last_pass_at = 0.0
        # Rows of the LM head (logits width) and of the input embedding (ids it can read):
        # either may be padded past the tokenizer's size (Qwen 2.5: 151936 or 152064 rows).
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.input_vocab_size = self.model.get_input_embeddings().weight.shape[0]
        self.kv_bytes_per_token = self._probe_kv()
        # Peak memory of the largest passes (and the graphs') [bytes], kept out of the budget.
        peaks = self._measure_activations if reserve_activations else lambda *_: {}
        self.activation_peaks: dict[str, int] = peaks(max_num_seqs, verifies, execution_mode)
        self.kv_plan: KVPlan | None = None
        self.max_num_seqs = 0
        if not defer_kv:
            self._allocate_planned(
                max_num_seqs, kv_cache_memory_bytes, kv_cache_memory_fraction, kv_shared_with
            )
        self._compiled = self._compiled_forward(execution_mode, model_name)
        self._graph_mode = self._uses_graphs(execution_mode, model_name)
        self._graphed: GraphedForward | None = None
        self._name = model_name

    def _load(self, model: str | PreTrainedModel, dtype: str, trust_remote_code: bool) -> str:
        """The model onto this runner's device, in eval mode, with its config and attention
        layout (checked before any weight is loaded: a layout it cannot mask raises), and
        only this rank's share of it where the runner is one of a tensor-parallel group
        (a model that cannot be split raises, also before loading). Returns the name logs
        give it (its path, or its class's name)."""
        if isinstance(model, str):
            self.config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        else:
            self.config = model.config
        self.attention = attention_layout(self.config)  # refuses what it cannot mask
        split = self.shard is not None and self.shard.world_size > 1
        plan = shard_plan(self.config, self.shard.world_size) if split else None
        model_name = model if isinstance(model, str) else type(model).__name__
        share = None
        if isinstance(model, str) and plan is not None and not trust_remote_code:
            share = load_shard(model, self.config, plan, self.shard, _DTYPES[dtype], self.device)
        if share is not None:  # this rank's parts alone, read from the checkpoint
            model = share
        else:
            if isinstance(model, str):
                model = _load_model(model, _DTYPES[dtype], trust_remote_code)
            if plan is not None:  # the whole model here: cut it
                shard_model(model, plan, self.shard.rank, self.shard.all_reduce)
        self.model = model.to(self.device)
        self.model.eval()
        if plan is not None and self.shard.barrier is not None:
            self.shard.barrier()  # the first pass's sums wait rank_timeout_s, not a load
        return model_name

    def _set_attention(self, attention_backend: str, execution_mode: str) -> None:
        """How the model attends: by row positions (:mod:`specdec.row_attention`) where it
        runs SDPA, on the slot kernels where they run; the probe at load falls back to
        4-D masks where the model cannot."""
        # Eager attention adds the mask to its scores; SDPA takes a boolean one.
        impl = getattr(self.model.config, "_attn_implementation", "sdpa")
        self._mask_dtype = self.model.dtype if impl == "eager" else None
        self._row_attention, self._slot_kernel = self._attention_choice(
            attention_backend, impl, execution_mode
        )
        self._kv_in_place = True  # (the probe may turn it off: _check_spans)
        self._last_spans: RowSpans | None = None  # the last pass's (the probe checks it)
        if self._row_attention:
            self.model.set_attn_implementation(ROW_ATTENTION)

    def _uses_graphs(self, mode: str, name: str) -> bool:
        """Whether passes replay CUDA graphs: of the eager kernels ("cuda_graph") or, on
        CUDA, of Inductor's ("torch_compile", as torch.compile's reduce-overhead, but
        through the runner's static buffers). The graphs are made at each shape's first
        pass, once the slot count is known (a deferred cache is allocated later)."""
        if mode != CUDA_GRAPH:  # (a torch_compile runner without row attention said why)
            return self._compiled is not None and self.device.type == "cuda"
        if self.device.type != "cuda":
            logger.warning(
                "%s: cuda_graph on %s records nothing: its padded passes run eagerly "
                "(a check of the padding, slower than eager)",
                name,
                self.device,
            )
        return self._usable_compiled(name)

    def _usable_compiled(self, name: str) -> bool:
        """Whether a compiled or graphed pass can run: it needs attention by row positions
        (its masks are then built from tensors, not from Python ints it would be
        specialised on); a model without it runs eager, logged."""
        if self._row_attention:
            return True
        logger.warning(
            "%s runs eager: compiled execution needs attention by row positions "
            "(this model attends by 4-D masks)",
            name,
        )
        return False

    def _compiled_forward(self, mode: str, name: str) -> CompiledForward | None:
        """The compiled forward (``execution_mode="torch_compile"``), or None: eager. A
        compiled pass needs attention by rows (its masks are then built inside the graph
        from tensors of dynamic size, not from Python ints it would be specialised on); a
        model without it runs eager, logged."""
        if mode != TORCH_COMPILE or not self._usable_compiled(name):
            return None
        return CompiledForward(self.model.forward, name)

    @property
    def execution_mode(self) -> str:
        if self._compiled is not None:
            return TORCH_COMPILE
        return CUDA_GRAPH if self._graph_mode else EAGER

    @property
    def compile_seconds(self) -> dict[PassShape, float]:
        """Each compiled graph's first call [s] (empty when eager)."""
        return {} if self._compiled is None else dict(self._compiled.compile_seconds)

    @torch.no_grad()
    def warm_up(self) -> dict[PassShape, float]:
        """Compile every graph a pass can need now, at startup, rather than in a request:
        each :class:`PassShape` once, on scratch sequences in free slots (freed after), then
        freeze (a pass that would need another graph runs eager instead of compiling in a
        request). Returns the seconds each graph took; nothing when eager, or when no slot
        is free. With one slot the several-row shapes are never needed, so never built.
        With CUDA graphs of the eager kernels (nothing to compile), records the decode
        graphs of every row bucket at the first key block (on CUDA; a fraction of a second
        each)."""
        if self._compiled is None:  # eager, or CUDA graphs of the eager kernels: record
            # the decode graphs of the first key block (every other shape at its first pass)
            free = self.num_free_slots
            if not (self._graph_mode and self.device.type == "cuda" and free):
                return {}
            first = min(self._graphs().kv_block, self.max_model_len)
            return self.record_graphs(batch_buckets(free), [1], [first])
        if self.num_free_slots == 0 or self.max_model_len < 8:
            return {}
        rows = ["warm-up-0", "warm-up-1"][: min(2, self.num_free_slots)]
        n = max(2, min(3, self.max_compiled_query_len, self.max_model_len // 4))
        for sid in rows:
            self.add(sid)
        try:
            for batch in range(1, len(rows) + 1):
                ids = rows[:batch]
                # a short prefill (ragged when there are rows), then a draft step
                self.forward_padded(ids, [[0] * (n - i) for i in range(batch)], last_only=True)
                self.forward_padded(ids, [[0]] * batch, last_only=True)
        finally:
            for sid in rows:
                self.free(sid)
        self._compiled.freeze()
        return self.compile_seconds

    def _served_length(self, model: str, max_model_len: int | None) -> int:
        """The longest sequence served: ``max_model_len``, capped at what the model has
        positions for (and, under LongRoPE, at its pretraining length); unset, at most
        :data:`DEFAULT_MAX_MODEL_LEN` (a slot holds that many tokens whether a request
        uses them or not: Llama 3.1's 131072 would be 16 GiB per 8B sequence)."""
        limit = _context_limit(decoder_config(self.config))
        rope_limit = exact_position_limit(self.config)
        if rope_limit is not None and rope_limit < limit:
            logger.warning(
                "%s uses LongRoPE: served up to its pretraining length %d (past it, the "
                "frequencies of every cached position change at once)",
                model,
                rope_limit,
            )
            limit = rope_limit
        if max_model_len is None and limit > DEFAULT_MAX_MODEL_LEN:
            logger.info(
                "%s: max_model_len unset, serving %d of its %d positions (set max_model_len "
                "for more)",
                model,
                DEFAULT_MAX_MODEL_LEN,
                limit,
            )
            return DEFAULT_MAX_MODEL_LEN
        return min(max_model_len or limit, limit)

    def _allocate_planned(
        self,
        max_num_seqs: int,
        kv_cache_memory_bytes: int | None,
        kv_cache_memory_fraction: float | None,
        kv_shared_with: ModelRunner | None,
    ) -> None:
        """Plan the slots the budget holds (shared with ``kv_shared_with``, a draft built
        with ``defer_kv``) and allocate them here, and the same number there."""
        free = device_free_bytes(self.device)
        shared = kv_shared_with.kv_bytes_per_slot if kv_shared_with is not None else 0
        # The models take turns: the larger of the two peaks is what a pass may need; each
        # model's graphs hold their memory for good.
        other = kv_shared_with
        reserve = max(
            self.activation_reserve_bytes, other.activation_reserve_bytes if other else 0
        ) + (self.graph_reserve_bytes + (other.graph_reserve_bytes if other else 0))
        plan = plan_slots(
            self.kv_bytes_per_token,
            self.max_model_len,
            max_num_seqs,
            budget_bytes(
                kv_cache_memory_bytes, kv_cache_memory_fraction, kv_free_bytes(free, reserve)
            ),
            free,
            shared_bytes_per_slot=shared,
            reserved_bytes=reserve,
        )
        if self.shard is not None:  # every rank holds as many slots: the least any can
            plan = dataclasses.replace(plan, num_slots=self.shard.min_over_ranks(plan.num_slots))
        self.allocate_kv(plan)
        if kv_shared_with is not None:  # one budget: the same number of slots
            kv_shared_with.allocate_kv(
                plan.sharing(kv_shared_with.kv_bytes_per_token, kv_shared_with.max_model_len)
            )

    @property
    def kv_bytes_per_slot(self) -> int:
        return self.kv_bytes_per_token * self.max_model_len

    @property
    def activation_reserve_bytes(self) -> int:
        """What the KV budget leaves free for the eager passes [bytes]: the largest of
        :attr:`activation_peaks` but the graphs'; 0 when not measured."""
        eager = [v for k, v in self.activation_peaks.items() if k != "graphs"]
        return max(eager, default=0)

    @property
    def graph_reserve_bytes(self) -> int:
        """What the KV budget leaves to this runner's CUDA graphs [bytes] (``graphs`` of
        :attr:`activation_peaks`): held for good, beside the eager passes' transients."""
        return self.activation_peaks.get("graphs", 0)

    def _attention_choice(self, backend: str, impl: str, mode: str) -> tuple[bool, bool]:
        """(attention by row positions, a round's passes on the slot-attention kernels)
        for ``attention_backend``, where the model runs SDPA: ``auto`` (the default) by
        rows, on the kernels where they run compiled (CUDA with Triton) for a 16-bit model
        (in float32 their tiles spill registers); ``slots`` on the kernels wherever Triton
        runs them (a CPU under its interpreter: the tests); ``rows`` by rows through SDPA
        alone; ``masks``: the 4-D masks reference. Never in ``torch_compile`` mode, whose
        graphs Inductor traces, attention included."""
        if backend not in ATTENTION_BACKENDS:
            choices = ", ".join(ATTENTION_BACKENDS)
            raise ValueError(f"attention_backend must be one of {choices}, got {backend!r}")
        if backend == "slots" and mode == TORCH_COMPILE:
            raise ValueError("attention_backend='slots' with execution_mode='torch_compile'")
        if backend == "slots" and not slot_attention.runs_on(self.device):
            raise ValueError(
                "attention_backend='slots' runs Triton kernels: a CUDA device with Triton "
                "installed, or a CPU under TRITON_INTERPRET=1 (set before Triton is imported)"
            )
        rows = backend != "masks" and impl == "sdpa"
        on_gpu = self.device.type == "cuda" and slot_attention.runs_on(self.device)
        half = self.model.dtype in (torch.bfloat16, torch.float16)
        auto = backend == "auto" and on_gpu and half and mode != TORCH_COMPILE
        return rows, rows and (backend == "slots" or auto)

    def _slot_pass(self, n: int) -> bool:
        """Whether a pass of ``n`` queries a row attends on the slot-attention kernels."""
        return self._row_attention and self._slot_kernel and n <= MAX_SLOT_QUERIES

    def _in_place(self, n: int) -> bool:
        """Whether such a pass reads keys and values in the cache itself
        (:class:`BatchLayout` ``in_place``), not copies of its rows."""
        return self._slot_pass(n) and self._kv_in_place

    def _will_record(self, mode: str) -> bool:
        """Whether this runner's passes will replay CUDA graphs (as :meth:`_uses_graphs`
        says later, known here before the cache is planned): ``cuda_graph`` or
        ``torch_compile`` on CUDA, with attention by rows."""
        graphs = mode in (CUDA_GRAPH, TORCH_COMPILE)  # (off CUDA nothing is recorded)
        return graphs and self.device.type == "cuda" and self._row_attention

    def _activation_shapes(
        self, max_num_seqs: int, verifies: bool
    ) -> dict[str, tuple[int, int, bool]]:
        """The largest passes as ``(rows, queries, last_only)``: a prefill of
        ``max_num_batched_tokens`` in chunks of at most ``prefill_chunk_size`` (last
        logits only), and a round of every row at ``max_compiled_query_len`` positions:
        a target's verification keeps every position's logits, a draft's step only the
        last (``verifies`` False)."""
        n = max(1, min(self.prefill_chunk_size, self.max_num_batched_tokens, self.max_model_len))
        rows = max(1, min(max_num_seqs, self.max_num_batched_tokens // n))
        verify_n = max(1, min(self.max_compiled_query_len, self.max_model_len))
        return {"prefill": (rows, n, True), "verify": (max_num_seqs, verify_n, not verifies)}

    def _measure_activations(self, max_num_seqs: int, verifies: bool, mode: str) -> dict[str, int]:
        """Each of the largest passes' peak memory at ``max_model_len`` of context [bytes].

        Attention's transients grow with the keys a pass reads (masks of ``queries x
        keys`` per row, keys and values copied out per query head where attention runs
        by masks), and a pass at the full context would need a cache of the full size.
        So each pass runs twice, eagerly, at two short contexts past its own queries (the
        path later chunks and verifications take: masked, not causal from 0), on a
        scratch cache allocated before the peak is read (the cache is not the pass's),
        and the peak is extrapolated linearly in the context to ``max_model_len``. A
        verification that keeps every position's logits adds one float32 copy of them:
        the sampler's probabilities, made while the logits live.

        Where ``mode`` replays CUDA graphs (:meth:`_will_record`) also ``graphs``: what the
        recorded graphs keep for good, as :meth:`_graph_memory` estimates it."""
        peaks: dict[str, int] = {}
        try:
            for name, (rows, n, last_only) in self._activation_shapes(
                max_num_seqs, verifies
            ).items():
                logits = 0 if last_only else rows * n * self.vocab_size * 4
                peaks[name] = self._extrapolated_peak(rows, n, last_only) + logits
            if self._will_record(mode):
                peaks["graphs"] = self._graph_memory(max_num_seqs)
        finally:
            self.cache.allocate(1, 2)  # the scratch goes; the budget allocates for good
            self.slots = SlotTable(0)
            if self.device.type == "cuda":  # else free memory would miss the probe's blocks
                torch.cuda.empty_cache()
        return peaks

    def _extrapolated_peak(self, rows: int, n: int, last_only: bool) -> int:
        """Peak memory [bytes] of a pass of ``rows`` x ``n`` queries at ``max_model_len``
        of context: measured at two short contexts, carried on linearly."""
        step = max(16, n // 4)
        contexts = [c for c in (n + step, n + 2 * step) if c <= self.max_model_len]
        measured = [self._peak_at(rows, n, c, last_only) for c in contexts]
        if len(measured) < 2:  # no room past the pass in max_model_len: the pass as it comes
            return self._peak_at(rows, n, n, last_only)
        slope = max(0.0, (measured[1] - measured[0]) / step)
        return int(measured[1] + slope * (self.max_model_len - contexts[1]))

    def _graph_memory(self, max_num_seqs: int) -> int:
        """What a runner's recorded graphs hold for good [bytes]: the memory pool they
        share, which the largest graphed pass fills (``max_num_seqs`` rows of
        ``MAX_GRAPH_QUERY_LEN`` queries at ``max_model_len`` keys: its transients, as for
        the eager passes), and the logits buffer each row bucket and query count shares
        (``[rows, queries, vocab]`` in the model's dtype, :class:`GraphRecorder`), plus
        :data:`GRAPH_POOL_SLACK` for the allocator's rounding (whole segments)."""
        n = max(1, min(MAX_GRAPH_QUERY_LEN, self.max_model_len - 1))
        pool = self._extrapolated_peak(max_num_seqs, n, last_only=False)
        queries = sum(range(1, n + 1))
        logits = sum(batch_buckets(max_num_seqs)) * queries * self.vocab_size
        return pool + logits * self.model.dtype.itemsize + GRAPH_POOL_SLACK

    def _peak_at(self, rows: int, n: int, context: int, last_only: bool) -> int:
        """Peak memory [bytes] of one pass of ``rows`` x ``n`` queries ending at
        ``context`` cached positions (the earlier ones zeros of a scratch cache). Every
        other row is one position shorter: rows of a real round are ragged, so attention
        masks each row apart (rows of one length would share one mask)."""
        self.cache.allocate(rows, context + 1)
        self.slots = SlotTable(rows)
        ids = [f"activation-probe-{i}" for i in range(rows)]
        for i, sid in enumerate(ids):
            self.add(sid)
            self.slots.set_length(sid, max(0, context - n - i % 2))
        with PeakMemory(self.device) as peak:
            self.forward_padded(ids, [[0] * n] * rows, last_only=last_only)
        return peak.bytes

    def _probe_kv(self) -> int:
        """The cache's bytes per token, learnt from one probe token (heads, head_dim and
        dtype per layer, whatever the family calls them); nothing is allocated for good."""
        self.slots = SlotTable(1)
        self.add("kv-probe")
        try:
            while True:
                self.cache = SlotKVCache(self.attention.num_layers, num_slots=1, capacity=2)
                try:
                    self.forward_padded(["kv-probe"], [[0]], last_only=True)
                    self._check_spans()
                    break
                except Exception as exc:  # whatever the model did with the row spans
                    if isinstance(exc, torch.distributed.DistError) or not self._fall_back(exc):
                        raise  # (a failed sum is the group's, not the attention's)
        finally:
            self.free("kv-probe")
        self.slots = SlotTable(0)
        self._check_ranks_agree()
        return self.cache.bytes_per_token()

    def _check_ranks_agree(self) -> None:
        """Every rank of a split model attends the same way after the probe (a fallback on
        one rank alone would pair its sums with other passes' on the others)."""
        if self.shard is None or self.shard.world_size == 1:
            return
        choice = 2 * int(self._slot_kernel) + int(self._row_attention)
        if self.shard.min_over_ranks(choice) != -self.shard.min_over_ranks(-choice):
            raise TensorParallelError("the ranks chose different attention paths at the probe")

    def _check_spans(self) -> None:
        """After the probe pass: every layer attended by row positions (else raise), and
        the slot-attention kernels were given the cache's own tensors where they read it
        in place (else, as DeepSeek-V3's latent attention, which expands what the cache
        returns, they read gathered rows from now on: expanding the whole cache each pass
        would cost every slot's every position)."""
        if not self._row_attention:
            return
        spans = self._last_spans
        if spans.calls != self.attention.num_layers:
            raise RowAttentionUnavailable(
                f"{spans.calls} of {self.attention.num_layers} layers attended by row positions"
            )
        if spans.foreign_kv:
            logger.info(
                "slot attention over gathered rows: the model attends over tensors it "
                "makes from the cache's"
            )
            self._kv_in_place = False

    def _fall_back(self, exc: Exception) -> bool:
        """One step down after a failed probe pass: the slot-attention kernels, attention
        by rows through SDPA, 4-D masks. False where nothing is left to fall back to."""
        if self._slot_kernel:
            logger.warning("slot-attention kernels off, attention by rows (SDPA): %r", exc)
            self._slot_kernel = False
            return True
        if self._row_attention:
            logger.info("attention by 4-D masks (SDPA): %r", exc)
            self.model.set_attn_implementation("sdpa")
            self._row_attention = False
            return True
        return False

    def allocate_kv(self, plan: KVPlan) -> None:
        """Allocate the cache for good (once): ``plan.num_slots`` slots of max_model_len."""
        if self.kv_plan is not None:
            raise RuntimeError("the KV cache is allocated once")
        self.cache.allocate(plan.num_slots, self.max_model_len + 1)  # + the scratch column
        self.slots = SlotTable(plan.num_slots)
        self.kv_plan, self.max_num_seqs = plan, plan.num_slots
        if plan.num_slots < plan.wanted_slots:
            logger.warning(
                "KV cache: the budget holds %d of the %d sequences wanted at max_model_len=%d "
                "(%d bytes per token); the rest wait for a free slot",
                plan.num_slots,
                plan.wanted_slots,
                self.max_model_len,
                plan.bytes_per_token,
            )

    # ----- sequence bookkeeping -------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def seq_ids(self) -> list[Hashable]:
        return self.slots.seq_ids

    def holds(self, seq_id: Hashable) -> bool:
        return seq_id in self.slots

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    def kv_usage(self) -> dict[str, int | float]:
        """Slots and tokens in use against what was allocated (a metric and /health)."""
        tokens = self.slots.cached_tokens
        capacity = self.max_num_seqs * self.max_model_len
        return {
            "num_slots": self.max_num_seqs,
            "used_slots": len(self.slots),
            "used_tokens": tokens,
            "capacity_tokens": capacity,
            "usage": len(self.slots) / self.max_num_seqs,
            "token_usage": tokens / capacity,
            "allocated_bytes": self.kv_plan.total_bytes,
            "bytes_per_token": self.kv_plan.bytes_per_token,
        }

    def add(self, seq_id: Hashable) -> None:
        """Register a new, empty sequence (in a free KV slot)."""
        self.slots.add(seq_id)

    def free(self, seq_id: Hashable) -> None:
        """Forget a sequence; the last slot's live tokens move into its place (slots stay
        dense, so a batch of every sequence reads the cache as a view)."""
        move = self.slots.free(seq_id)
        if move is not None:
            self.cache.copy_slot(*move)

    def fork(self, src: Hashable, dst: Hashable) -> None:
        """Start sequence ``dst`` as a copy of ``src`` (its live keys/values and length)."""
        self.cache.copy_slot(*self.slots.fork(src, dst))

    def rename(self, old: Hashable, new: Hashable) -> None:
        """Give sequence ``old`` the id ``new`` (which must be free); no data moves."""
        self.slots.rename(old, new)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy new weights into the model's parameters, in place.

        Why in place: the parameters' storages stay, so compiled graphs (which read them
        as inputs) and anything else holding them see the new values with no recompile.
        ``weights`` must give every parameter as a finite floating-point tensor of its
        shape; a tied parameter may come under either name, or both if equal. Anything
        else is refused (ValueError) before a single value is copied: every value is
        converted to its parameter's dtype and device first. Every cached key and value
        was computed by the old weights: the caller rebuilds them (rolls its sequences
        back and feeds them again)."""
        staged = self._staged_weights(weights)
        with torch.no_grad():
            for param, value in staged:
                param.copy_(value)

    def add_low_rank(self, update: LowRankUpdate) -> None:
        """Merge ``update``'s factors into their weights, in place (as :meth:`load_weights`:
        the storages stay). Every factor pair is checked, and every merged value computed,
        before one is written (ValueError names what does not fit); a finite update that
        merges to a non-finite value is refused too. The base version is the caller's to
        check: the factors mean something only on the weights they were trained on."""
        params = dict(self.model.state_dict(keep_vars=True))
        if not isinstance(update.scale, (int, float)) or not math.isfinite(update.scale):
            raise ValueError(f"scale {update.scale!r} is not a finite number")
        problems: dict[str, list[str]] = {}
        staged, seen = [], set()
        for name, pair in update.factors.items():
            pair_ok = isinstance(pair, (tuple, list)) and len(pair) == 2
            why = None if pair_ok else "not a pair (A, B)"
            why = why or unfit_factors(*pair, params.get(name))
            if why is None and id(params[name]) in seen:
                why = "named twice (tied names)"
            seen.add(id(params.get(name)))
            if why is None:
                value = merged(params[name], *pair, update.scale)
                why = None if bool(torch.isfinite(value).all()) else "merges to non-finite"
                staged.append((params[name], value))
            if why:
                problems.setdefault(why, []).append(name)
        if problems:
            raise ValueError(
                "low-rank update does not fit the model: "
                + "; ".join(f"{what}: {', '.join(ns[:5])}" for what, ns in problems.items())
            )
        with torch.no_grad():
            for param, value in staged:
                param.copy_(value)

    def _staged_weights(
        self, weights: Mapping[str, torch.Tensor]
    ) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """``(parameter, its new value on its device and dtype)`` for every parameter, or
        ValueError naming what does not fit."""
        params = dict(self.model.named_parameters())  # a tied parameter once
        by_tensor = {id(p): name for name, p in params.items()}
        # every state-dict name -> the parameter it is (tied aliases -> their canonical)
        canonical = {
            name: by_tensor[id(t)]
            for name, t in self.model.state_dict(keep_vars=True).items()
            if id(t) in by_tensor
        }
        problems: dict[str, list[str]] = {}
        given: dict[str, torch.Tensor] = {}
        for name, value in weights.items():
            if name not in canonical:
                problems.setdefault("unknown", []).append(name)
                continue
            target = canonical[name]
            if target in given and not _same(given[target], value):
                problems.setdefault("tied names that differ", []).append(name)
            given.setdefault(target, value)
        staged = []
        for name, param in params.items():
            value = given.get(name)
            why = _unfit(value, param)
            if why:
                problems.setdefault(why, []).append(name)
            elif not problems:
                staged.append((param, value.detach().to(param.device, param.dtype)))
        if problems:
            raise ValueError(
                "weights do not fit the model: "
                + "; ".join(
                    f"{what}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                    for what, names in problems.items()
                )
            )
        return staged

    def length(self, seq_id: Hashable) -> int:
        """Number of tokens whose keys/values are cached for ``seq_id``."""
        return self.slots.length(seq_id)

    def rollback(self, seq_id: Hashable, length: int) -> None:
        """Keep only the first ``length`` cached positions (a pointer move, no copy)."""
        self.slots.rollback(seq_id, length)

    # ----- forward --------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """Append ``token_ids[i]`` to sequence ``seq_ids[i]`` and return their logits.

        Returns one float32 tensor ``[len(token_ids[i]), vocab]`` per sequence: row ``j``
        is the next-token logits after the ``j``-th appended token. All sequences run in
        one padded forward pass; padding is masked out and never becomes part of a
        sequence.
        """
        if not seq_ids:
            if token_ids:
                raise ValueError("seq_ids and token_ids differ in length")
            return []
        logits = self.forward_padded(seq_ids, token_ids)  # [batch, n, vocab]
        return [logits[row, : len(t)] for row, t in enumerate(token_ids)]

    @torch.no_grad()
    def forward_padded(
        self,
        seq_ids: Sequence[Hashable],
        token_ids: Sequence[Sequence[int]] | torch.Tensor,
        *,
        last_only: bool = False,
    ) -> torch.Tensor:
        """:meth:`forward` returning one padded tensor, rows in the order given.

        ``token_ids`` may be a ``[batch, n]`` int64 tensor (every row appends ``n``
        tokens), on the model's device or the host: a draft step feeds the tokens of the
        step before without reading them back.

        Returns ``[batch, n, vocab]`` float32 (``n`` = the longest append; row ``i`` is
        valid up to ``len(token_ids[i])``), or ``[batch, vocab]`` with ``last_only``: the
        logits after each row's last appended token, the only ones prefill and drafting
        need. With ``last_only`` the LM head runs on those positions alone, so a long
        prompt never materialises ``[batch, prompt_len, vocab]``.
        """
        counts = _append_counts(seq_ids, token_ids)
        if (
            last_only
            and not isinstance(token_ids, torch.Tensor)
            and (
                max(counts) > self.prefill_chunk_size
                or len(counts) * max(counts) > self.max_num_batched_tokens
            )
        ):
            return self._chunked_last(seq_ids, token_ids)
        plan = self._plan_rows(seq_ids, counts)
        if self._graph_mode and plan.n <= MAX_GRAPH_QUERY_LEN and plan.kv_len > 1:
            logits = self._graphed_pass(plan, token_ids)
            if logits is not None:
                return self._commit(seq_ids, plan, logits, last_only)
        return self._commit(seq_ids, plan, self._module_pass(plan, token_ids, last_only), last_only)

    def _module_pass(
        self, plan: _RowPlan, token_ids: Sequence[Sequence[int]] | torch.Tensor, last_only: bool
    ) -> torch.Tensor:
        """The pass through the model's module, compiled or eager (not a recorded graph):
        its logits in slot order, ``[batch, n, vocab]``, or on the eager path with
        ``last_only`` only the positions :meth:`_logits_to_keep` names (which
        :meth:`_commit` reads each row's last from)."""
        # Compiled unless a long prefill chunk, or a one-token cache (a size of 1 would
        # be a graph of its own: a 1-token prompt's prefill runs eagerly instead).
        compiled = (
            self._compiled is not None and plan.n <= self.max_compiled_query_len and plan.kv_len > 1
        )
        inputs = self._pass_inputs(plan, token_ids, compiled)
        self.cache.layout = inputs.layout
        try:
            kwargs = dict(
                input_ids=inputs.input_ids,
                position_ids=inputs.position_ids,
                past_key_values=self.cache,
                **self._attention_args(plan, inputs.position_ids, inputs.layout, compiled),
                use_cache=True,
                # Compiled: every position's logits (transformers' per-row selection
                # specialises a graph on its sizes); _commit picks each row's last.
                **({} if compiled else self._logits_to_keep(plan, last_only)),
            )
            with sdpa_backends(self.device):
                if compiled:
                    shape = PassShape(len(plan.slots) == 1, plan.n == 1)
                    out = self._compiled(shape, inputs.dynamic(), **kwargs)
                else:
                    out = self.model(**kwargs)
        finally:
            self.cache.layout = None
        return out.logits

    # ----- CUDA graphs (execution_mode="cuda_graph", specdec.cuda_graphs) -----------------

    def _graphs(self) -> GraphedForward:
        if self._graphed is None:
            self._graphed = GraphedForward(
                self._static_pass,
                device=self.device,
                max_rows=self.max_num_seqs,
                # Keys up to max_model_len: the scratch column past it is never read (and a
                # key count equal to the cache's capacity would miss Inductor's graphs,
                # traced with fewer: measured on an H200, the guard compared the two).
                max_kv_len=self.max_model_len,
                scratch_position=self.cache.scratch_position,
                name=self._name,
            )
        return self._graphed

    @property
    def pass_graphs(self) -> GraphedForward:
        """This runner's pass graphs (made at first use); other graphs of this runner
        (a draft's rounds, :class:`specdec.draft_steps.GraphedDraftSteps`) share their pool.
        Refused before the KV cache is allocated: the graphs take their row buckets and
        scratch column from it for good."""
        if self.kv_plan is None:
            raise RuntimeError(f"{self._name}: allocate the KV cache before its graphs")
        return self._graphs()

    def _graphed_pass(
        self, plan: _RowPlan, token_ids: Sequence[Sequence[int]] | torch.Tensor
    ) -> torch.Tensor | None:
        """The pass as its shape's graph replayed: ``[batch, n, vocab]`` logits in slot
        order, or None where it runs eager (more rows than a bucket, a failed recording)."""
        graphs = self._graphs()
        shape = graphs.shape_for(len(plan.slots), plan.n, plan.kv_len)
        if shape is None:
            return None
        inputs = self._pass_inputs(plan, token_ids, compiled=True)
        lay = inputs.layout
        return graphs(shape, inputs.input_ids, inputs.position_ids, lay.write_positions, lay.slots)

    def _static_pass(self, inputs: StaticInputs) -> torch.Tensor:
        """The model over a graph's persistent inputs (what a CUDA graph records): keys up
        to the shape's padded count, each query masked to its row's own prefix. Returns
        ``[batch, queries, vocab]`` logits in the model's dtype."""
        in_place = self._in_place(inputs.input_ids.shape[1])
        layout = BatchLayout(
            inputs.slots, inputs.write_positions, inputs.kv_range, None, None, in_place
        )
        self.cache.layout = layout
        spans = RowSpans(
            self.attention,
            inputs.position_ids,
            inputs.kv_range,
            False,
            True,
            keys_padded=True,
            slot_kernel=self._slot_pass(inputs.input_ids.shape[1]),
            kv_cache=self.cache,
        )
        kwargs = dict(
            input_ids=inputs.input_ids,
            position_ids=inputs.position_ids,
            past_key_values=self.cache,
            attention_mask=spans.model_mask(),
            use_cache=True,
            **{ROW_SPANS_KWARG: spans},
        )
        try:
            with sdpa_backends(self.device):
                if self._compiled is None:
                    out = self.model(**kwargs)
                else:  # Inductor's kernels recorded (its graph per PassShape, sizes dynamic)
                    batch, n = inputs.input_ids.shape
                    dynamic = _PassInputs(inputs.input_ids, inputs.position_ids, layout).dynamic()
                    # (padded keys under a shape the module pass may have built: every guard)
                    with self._compiled.every_guard():
                        out = self._compiled(PassShape(batch == 1, n == 1), dynamic, **kwargs)
        finally:
            self.cache.layout = None
        return out.logits

    @torch.no_grad()
    def record_graphs(
        self, batches: Sequence[int], queries: Sequence[int], kv_lens: Sequence[int]
    ) -> dict[GraphShape, float]:
        """Record the graphs of these pass sizes now, not in the first request that needs
        them: on scratch sequences in free slots (freed after), each size's rows prefilled
        once and rolled back for each key count. Returns the seconds each recording took
        (nothing off CUDA or in another mode, where nothing is recorded)."""
        if not self._graph_mode or self.device.type != "cuda":
            return {}
        graphs, longest = self._graphs(), max(kv_lens)
        for batch in sorted(set(batches)):
            if batch > self.num_free_slots:
                continue
            rows = [f"graph-warm-up-{i}" for i in range(batch)]
            for sid in rows:
                self.add(sid)
            try:
                self.forward_padded(rows, [[0] * (longest - 1)] * batch, last_only=True)
                for kv_len in sorted(set(kv_lens), reverse=True):
                    for n in queries:
                        if n >= kv_len:
                            continue
                        for sid in rows:
                            self.rollback(sid, kv_len - n)
                        self.forward_padded(rows, [[0] * n] * batch)
            finally:
                for sid in rows:
                    self.free(sid)
        return dict(graphs.record_seconds)

    @property
    def graph_record_seconds(self) -> dict[GraphShape, float]:
        """Each recorded CUDA graph's recording time [s] (empty when none)."""
        return {} if self._graphed is None else dict(self._graphed.record_seconds)

    @property
    def graph_memory_bytes(self) -> int:
        """What this runner's recorded graphs hold now [bytes]: their pool (which a draft's
        recorded rounds share) and the passes' output buffers; :attr:`graph_reserve_bytes`
        is what the KV budget left them."""
        return 0 if self._graphed is None else self._graphed.memory_bytes()

    # ----- one-token passes inside a fused graph (specdec.draft_steps) -------------------

    def step_rows(self, seq_ids: Sequence[Hashable], steps: int) -> StepRows:
        """Where ``steps`` one-token passes of these rows go, in the caller's row order:
        each row's slot and next position, and the keys of the first pass. Refuses steps
        that would carry a row past ``max_model_len`` (as :meth:`forward_padded` does)."""
        slots = [self.slots.slot(sid) for sid in seq_ids]
        starts = [self.slots.length_of_slot(s) for s in slots]
        if max(starts) + steps > self.max_model_len:
            raise ValueError(f"sequence would exceed max_model_len={self.max_model_len}")
        dev, host = self.device, torch.device("cpu")
        return StepRows(
            slots=torch.tensor(slots, dtype=torch.long, device=host).to(dev),
            positions=torch.tensor(starts, dtype=torch.long, device=host).to(dev)[:, None],
            kv_range=torch.arange(max(starts) + 1, device=dev),
        )

    def step_logits(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_range: torch.Tensor,
        write_positions: torch.Tensor | None = None,
        keys_padded: bool = False,
    ) -> torch.Tensor:
        """One token per row through the model, written to the rows' slots: traced inside a
        fused graph, so it reads no Python value that changes between rounds (the cache's
        layout is set here and must be cleared by the caller, outside the graph).

        tokens: [batch] int64; positions: [batch, 1] int64 where each goes; slots:
        [batch] int64; kv_range: [kv_len] int64 arange, keys every row is given (each
        reads only up to its own position). A CUDA graph's step (specdec.cuda_graphs)
        gives ``write_positions`` ([batch, 1]: its padded rows write to the scratch
        column) and ``keys_padded`` (keys past the longest row: every row masked).
        Returns ``[batch, vocab]`` float32 logits."""
        ids = tokens[:, None]  # [batch, 1]
        if self.vocab_size > self.input_vocab_size:  # an id with no embedding row: fed as 0
            ids = torch.where(ids < self.input_vocab_size, ids, torch.zeros_like(ids))
        writes = positions if write_positions is None else write_positions
        in_place = self._in_place(1)
        self.cache.layout = BatchLayout(slots, writes, kv_range, None, None, in_place)
        # (compiled runners attend by rows: a mask per row, built in the graph)
        spans = RowSpans(
            self.attention,
            positions,
            kv_range,
            False,
            True,
            keys_padded=keys_padded,
            slot_kernel=self._slot_pass(1),
            kv_cache=self.cache,
        )
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            past_key_values=self.cache,
            attention_mask=spans.model_mask(),
            use_cache=True,
            **{ROW_SPANS_KWARG: spans},
        )
        return out.logits[:, -1].float()

    def advance(self, seq_ids: Sequence[Hashable], steps: int) -> None:
        """Record ``steps`` more cached positions per row (after :meth:`step_logits` passes).
        Every id is looked up before any length changes: an unknown one changes nothing (a
        split runner relies on it, see specdec.rank_group.DEFERRED)."""
        lengths = [self.slots.length(sid) for sid in seq_ids]
        for sid, length in zip(seq_ids, lengths, strict=True):
            self.slots.set_length(sid, length + steps)

    def end_steps(self) -> None:
        """Clear the layout a fused graph's passes left on the cache."""
        self.cache.layout = None

    def _pass_inputs(
        self, plan: _RowPlan, token_ids: Sequence[Sequence[int]] | torch.Tensor, compiled: bool
    ) -> _PassInputs:
        """The pass's ids, positions and cache layout on the model's device (ids and
        positions assembled on the host from Python lists, one copy each)."""
        dev = self.device
        input_ids = _input_ids(token_ids, plan).to(dev)  # [batch, n] int64
        position_ids, write_positions = self._positions(plan)  # [batch, n] each
        first, batch = plan.slots[0], len(plan.slots)
        contiguous = plan.slots == list(range(first, first + batch))
        if compiled:
            # One layout for every compiled pass: writes scattered by position, keys
            # gathered by slot; fresh row-major tensors, none aliasing another (a graph
            # is guarded on its inputs' strides and aliasing).
            dense = torch.contiguous_format
            input_ids = input_ids.clone(memory_format=dense)
            position_ids = position_ids.clone(memory_format=dense)
            write_positions = write_positions.clone(memory_format=dense)
        layout = BatchLayout(
            slots=torch.tensor(plan.slots, dtype=torch.long, device=dev),
            write_positions=write_positions,
            kv_range=torch.arange(plan.kv_len, device=dev),
            contiguous_from=first if contiguous and not compiled else None,
            write_start=plan.starts[0] if plan.same_start and not compiled else None,
            in_place=self._in_place(plan.n),
        )
        return _PassInputs(input_ids, position_ids, layout)

    def _plan_rows(self, seq_ids: Sequence[Hashable], counts: list[int]) -> _RowPlan:
        """Rows in slot order (a batch of consecutive slots then reads the cache as a
        view), with where each starts and ends; refuses appends past max_model_len."""
        batch = len(seq_ids)
        slot_of = [self.slots.slot(sid) for sid in seq_ids]
        in_order = all(a < b for a, b in itertools.pairwise(slot_of))
        order = list(range(batch)) if in_order else sorted(range(batch), key=slot_of.__getitem__)
        slots = [slot_of[i] for i in order]
        starts = [self.slots.length_of_slot(s) for s in slots]
        ns = [counts[i] for i in order]
        ends = [st + c for st, c in zip(starts, ns, strict=True)]
        if max(ends) > self.max_model_len:
            raise ValueError(f"sequence would exceed max_model_len={self.max_model_len}")
        return _RowPlan(
            order=order,
            in_order=in_order,
            slots=slots,
            starts=starts,
            ns=ns,
            ends=ends,
            n=max(ns),
            kv_len=max(ends),  # no row reads past its own end; padding writes to scratch
            same_start=min(starts) == max(starts),
        )

    def _positions(self, plan: _RowPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """``(position_ids, write_positions)``, ``[batch, n]`` int64 each on the model's
        device: each query's position, and the cache position its keys/values go to."""
        dev, host = self.device, torch.device("cpu")
        batch, n, starts = len(plan.slots), plan.n, plan.starts
        if plan.same_start:  # every row's writes lie in [start, start + n), within max_model_len
            position_ids = torch.arange(starts[0], starts[0] + n, device=dev).expand(batch, n)
            return position_ids, position_ids
        start_t = torch.tensor(starts, dtype=torch.long, device=host).to(dev)
        position_ids = start_t[:, None] + torch.arange(n, device=dev)[None, :]  # [batch, n]
        if min(plan.ns) == n:
            return position_ids, position_ids
        # A row's padded queries would sit past its end (and past max_model_len for a row
        # near the limit): they take the row's last real position, so their masks are that
        # query's and learned position tables have an entry, and their keys go to the
        # scratch column, which no mask lets anyone read.
        end_t = torch.tensor(plan.ends, dtype=torch.long, device=host).to(dev)[:, None]
        padded = position_ids >= end_t  # [batch, n]
        position_ids = torch.minimum(position_ids, end_t - 1)
        return position_ids, position_ids.masked_fill(padded, self.cache.scratch_position)

    def _attention_args(
        self, plan: _RowPlan, position_ids: torch.Tensor, layout: BatchLayout, compiled: bool
    ) -> dict:
        """The model's keyword arguments that say what each query attends to: the rows'
        positions for attention by rows (a mask per row in a compiled pass), else the 4-D
        masks (:meth:`_mask`)."""
        if self._row_attention:
            spans = RowSpans(
                self.attention,
                position_ids,
                layout.kv_range,
                plan.same_start,
                compiled,
                slot_kernel=self._slot_pass(plan.n),
                kv_cache=self.cache,
            )
            self._last_spans = spans
            return {"attention_mask": spans.model_mask(), ROW_SPANS_KWARG: spans}
        return {"attention_mask": self._mask(plan, position_ids)}

    def _mask(self, plan: _RowPlan, position_ids: torch.Tensor) -> torch.Tensor | None:
        """The attention masks of the pass (:func:`specdec.attention.build_masks`), or None
        where one query per row at the common end sees its whole prefix."""
        if plan.same_start and plan.n == 1 and not self.attention.has_sliding:
            return None
        # Query j of row b sees cache positions <= start_b + j (and, in a sliding layer,
        # fewer than the window back): its own prefix, nothing of other rows' padding,
        # nothing of its own padded queries.
        rows_pos = position_ids[:1] if plan.same_start else position_ids
        return build_masks(self.attention, rows_pos, plan.kv_len, self._mask_dtype)

    def _logits_to_keep(self, plan: _RowPlan, last_only: bool) -> dict[str, int | torch.Tensor]:
        """The model's ``logits_to_keep`` argument: with ``last_only``, each row's last
        appended position only (a slice where every row ends at the last position)."""
        if not last_only:
            return {}
        if min(plan.ns) == plan.n:
            return {"logits_to_keep": 1}
        if _PER_ROW_LOGITS_TO_KEEP:
            keep = torch.tensor(plan.ns, dtype=torch.long, device=self.device)[:, None] - 1
            return {"logits_to_keep": keep}  # [batch, 1]
        # [m]: every row's last position, for every row (_commit picks each row's own)
        return {
            "logits_to_keep": torch.tensor(sorted({n - 1 for n in plan.ns}), device=self.device)
        }

    def _commit(
        self,
        seq_ids: Sequence[Hashable],
        plan: _RowPlan,
        logits: torch.Tensor,
        last_only: bool,
    ) -> torch.Tensor:
        """Record the rows' new lengths and return their float32 logits in the caller's
        row order: ``[batch, n, vocab]``, or ``[batch, vocab]`` with ``last_only``."""
        self.last_pass_at = time.monotonic()
        batch = len(plan.slots)
        if last_only and logits.shape[1] != 1:
            # [batch, m, vocab]: every row's last position kept for all rows (transformers
            # before per-row logits_to_keep), or every position (a model that ignores it)
            last = [n - 1 for n in plan.ns]
            if logits.shape[1] != plan.n:
                column = {pos: i for i, pos in enumerate(sorted(set(last)))}
                last = [column[pos] for pos in last]
            last = torch.tensor(last, device=logits.device)
            logits = logits[torch.arange(batch, device=logits.device), last][:, None]
        logits = logits.float()  # [batch, n, vocab] or [batch, 1, vocab], once selected
        for row in range(batch):
            self.slots.set_length(seq_ids[plan.order[row]], plan.ends[row])
        if not plan.in_order:
            inverse = [0] * batch
            for row, i in enumerate(plan.order):
                inverse[i] = row
            logits = logits[torch.tensor(inverse, device=logits.device)]
        return logits[:, 0] if last_only else logits

    def _chunked_last(
        self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Long appends in chunks of ``prefill_chunk_size`` queries (the masks, and eager
        attention's scores, grow with queries x keys: a 128k-token prompt in one pass would
        need gigabytes for its masks alone), each chunk's rows in passes of at most
        ``max_num_batched_tokens`` padded tokens (activations grow with rows x queries).
        Returns ``[batch, vocab]``; on failure every row is rolled back to where it started."""
        chunk = min(self.prefill_chunk_size, self.max_num_batched_tokens)
        starts = [self.length(sid) for sid in seq_ids]
        last: list[torch.Tensor | None] = [None] * len(seq_ids)
        try:
            for c0 in range(0, max(len(t) for t in token_ids), chunk):
                rows = [i for i, t in enumerate(token_ids) if len(t) > c0]
                for group in _token_budget_groups(
                    [min(chunk, len(token_ids[i]) - c0) for i in rows],
                    self.max_num_batched_tokens,
                ):
                    group = [rows[g] for g in group]
                    logits = self.forward_padded(
                        [seq_ids[i] for i in group],
                        [token_ids[i][c0 : c0 + chunk] for i in group],
                        last_only=True,
                    )  # [rows in the group, vocab]
                    for r, i in enumerate(group):
                        if len(token_ids[i]) <= c0 + chunk:
                            last[i] = logits[r]
        except BaseException:
            for sid, start in zip(seq_ids, starts, strict=True):
                self.rollback(sid, start)
            raise
        return torch.stack(last)  # type: ignore[arg-type]

    def prefill(
        self, seq_ids: Sequence[Hashable], prompts: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Add new sequences with their prompts; returns last-position logits ``[batch, vocab]``."""
        for sid in seq_ids:
            self.add(sid)
        return self.forward_padded(seq_ids, prompts, last_only=True)


def _checked_shard(
    shard: ModelShard | None, execution_mode: str, defer_kv: bool
) -> ModelShard | None:
    """``shard``, refused where it splits the model with anything but eager execution, or
    with a cache allocated later (the other ranks would never allocate theirs)."""
    if shard is None or shard.world_size == 1:
        return shard
    if execution_mode != EAGER:
        raise TensorParallelError(
            f"tensor parallelism runs eager (execution_mode: {EAGER}), "
            f"not {execution_mode}: a pass's sums across ranks are not in its graphs"
        )
    if defer_kv:
        raise TensorParallelError("a model split over ranks allocates its KV cache at load")
    return shard


def _token_budget_groups(counts: list[int], budget: int) -> list[list[int]]:
    """Consecutive indices of ``counts`` in groups whose padded size (rows x longest
    count) stays within ``budget``; a count above the budget goes alone."""
    groups: list[list[int]] = []
    longest = 0
    for i, n in enumerate(counts):
        if groups and (len(groups[-1]) + 1) * max(longest, n) <= budget:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return groups


def _load_model(model: str, dtype: torch.dtype, trust_remote_code: bool):
    """The model with SDPA attention, or eager where the family has no SDPA path (Gemma 2:
    SDPA cannot soft-cap attention scores). The runner then switches an SDPA model to
    attention by row positions where it can; eager attention takes its 4-D masks."""
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    try:
        return AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa", **kwargs)
    except ValueError as exc:
        message = str(exc).lower()
        if "sdpa" not in message and "scaled_dot_product_attention" not in message:
            raise
        return AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager", **kwargs)


def _context_limit(config) -> int:
    """The longest sequence the model has positions for (2048 when the config says nothing).

    ``max_position_embeddings`` covers most models (GPT-2's ``n_positions`` is aliased to
    it); the other names are the ones configs without that alias use.
    """
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


@dataclass(frozen=True, slots=True)
class StepRows:
    """Rows of a fused graph's one-token passes (:meth:`ModelRunner.step_rows`), in the
    caller's order, on the model's device."""

    slots: torch.Tensor  # [batch] int64 each row's KV slot
    positions: torch.Tensor  # [batch, 1] int64 where each row's next token goes
    kv_range: torch.Tensor  # [kv_len] int64 arange: the first pass's keys (longest row + 1)


@dataclass(frozen=True, slots=True)
class _RowPlan:
    """One padded pass's rows in slot order (lists indexed by that order's row)."""

    order: list[int]  # the caller's index of each row
    in_order: bool  # the caller's order is slot order already (nothing to permute)
    slots: list[int]  # each row's KV slot
    starts: list[int]  # tokens cached before the pass [tokens]
    ns: list[int]  # tokens appended [tokens]
    ends: list[int]  # starts + ns [tokens]
    n: int  # the longest append: the pass's query length [tokens]
    kv_len: int  # keys/values attention reads: the furthest end [tokens]
    same_start: bool  # every row starts at the same position


@dataclass(frozen=True, slots=True)
class _PassInputs:
    """One pass's model inputs on the model's device."""

    input_ids: torch.Tensor  # [batch, n] int64, 0-padded
    position_ids: torch.Tensor  # [batch, n] int64: each query's position
    layout: BatchLayout  # where the pass writes and reads the cache

    def dynamic(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """The sizes a compiled graph takes as dynamic: rows, queries, keys."""
        lay = self.layout
        return [
            (self.input_ids, (0, 1)),
            (self.position_ids, (0, 1)),
            (lay.write_positions, (0, 1)),
            (lay.slots, (0,)),
            (lay.kv_range, (0,)),
        ]


def _append_counts(
    seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]] | torch.Tensor
) -> list[int]:
    """Tokens each row appends (a ``[batch, n]`` tensor: ``n`` each); refuses a mismatch
    of rows or an empty append."""
    if len(seq_ids) != len(token_ids):
        raise ValueError("seq_ids and token_ids differ in length")
    if isinstance(token_ids, torch.Tensor):  # [batch, n] on any device: n per row
        counts = [token_ids.shape[1]] * token_ids.shape[0]
    else:
        counts = [len(t) for t in token_ids]
    if not counts or min(counts) < 1:
        raise ValueError("every sequence must append at least one token")
    return counts


def _input_ids(token_ids: Sequence[Sequence[int]] | torch.Tensor, plan: _RowPlan) -> torch.Tensor:
    """``[batch, n]`` int64 ids in slot order, 0-padded, assembled on the host when they
    come from Python lists (so they reach the model's device in one copy)."""
    host = torch.device("cpu")
    if isinstance(token_ids, torch.Tensor):  # already a tensor (a draft step's tokens)
        return (
            token_ids
            if plan.in_order
            else token_ids[torch.tensor(plan.order, device=token_ids.device)]
        )
    if min(plan.ns) == plan.n:  # no padding: one tensor straight from the lists
        return torch.tensor([token_ids[i] for i in plan.order], dtype=torch.long, device=host)
    input_ids = torch.zeros(len(plan.order), plan.n, dtype=torch.long, device=host)
    for row, i in enumerate(plan.order):
        input_ids[row, : plan.ns[row]] = torch.tensor(token_ids[i], dtype=torch.long, device=host)
    return input_ids


def _same(a, b) -> bool:
    """Two values of one tied parameter: equal tensors (anything else is not)."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and torch.equal(a.detach().cpu(), b.detach().cpu())
    )


def _unfit(value, param: torch.nn.Parameter) -> str | None:
    """Why ``value`` cannot be ``param``'s new value, or None."""
    if value is None:
        return "missing"
    if not isinstance(value, torch.Tensor) or value.is_meta:
        return "not a tensor with data"
    if value.shape != param.shape:
        return f"wrong shape (the model's: {tuple(param.shape)})"
    if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
        return "not finite floating point"
    return None
