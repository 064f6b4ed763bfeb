"""Attention by row positions: the runner's attention function for transformers models.

Why not hand the model 4-D masks (the reference path, :func:`specdec.attention.build_masks`):
transformers turns grouped-query SDPA off whenever a mask is given, so every layer of a
verification or prefill pass copies keys and values out to every query head (``repeat_kv``:
4x the KV traffic for Llama 3's 32 query / 8 KV heads), and SDPA's flash kernels refuse any
mask. Here the runner passes, per forward, where each row's queries sit (:class:`RowSpans`),
and this function, registered with transformers' ``AttentionInterface`` as
:data:`ROW_ATTENTION`, decides per layer type:

- where the runner asks for them (a GPU with Triton), a pass of up to
  :data:`MAX_SLOT_QUERIES` queries a row on :mod:`specdec.slot_attention`'s kernels: no
  mask, each query bounded by its own position, grouped heads reading their KV head;
- no mask where each query reads exactly its own prefix: one query per row at a common end
  (decode), or a pass from position 0 with no padding (prefill), SDPA's own causal flag;
- else a boolean mask built from the row positions, once per layer type per pass, on the
  model's device, never through the model's mask code;
- grouped-query attention with keys and values read in place: SDPA's ``enable_gqa``, or
  on CUDA for a masked pass (no fused kernel there takes groups and a mask) each group's
  query heads folded into one KV head's queries (:func:`grouped_masked_attention`).

A model whose attention SDPA cannot compute (soft-capped scores, attention sinks), that
does not pass the runner's arguments down to its attention, or that changes the mask it is
given raises :class:`RowAttentionUnavailable`; the runner then keeps the reference path
for it. Run without :class:`RowSpans`, the function is transformers' SDPA.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec import slot_attention
from specdec.attention import SLIDING, AttentionLayout, build_masks

ROW_ATTENTION = "specserve_rows"  # the name models are switched to

# SDPA's CUDA kernels a runner's passes may use, in PyTorch's order of preference. cuDNN's
# is left out: it builds an execution plan for every new shape (then caches it), and a
# runner's keys grow by one or more every pass. Measured on an H100 (torch 2.11, bench.gpu,
# eager): a decode step of the Llama-3.2-1B-shaped draft took 50 ms against 11.7 ms for
# the same pass repeated at one length, the 8B target's 57 against 22 ms; the profile
# showed SDPA running cuDNN's kernel. Flash and memory-efficient attention take any length.
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels a forward on ``device`` runs with (enter it around the pass): on
    CUDA every kernel but cuDNN's, elsewhere whatever PyTorch picks."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(_CUDA_SDPA_BACKENDS)


ROW_SPANS_KWARG = "specserve_row_spans"  # the forward keyword that carries RowSpans

# Queries per row up to which a pass attends by :mod:`specdec.slot_attention` where its
# kernels run (a GPU with Triton): a round's passes (decode, a verification of up to 9
# positions, a draft's steps) and short prefill chunks. Longer passes are prefill, which
# SDPA's causal flash kernel runs unmasked from position 0.
MAX_SLOT_QUERIES = 16


class RowAttentionUnavailable(RuntimeError):
    """This model cannot run attention by row positions; the message says why."""


@dataclass
class RowSpans:
    """Where one forward pass's queries sit, shared by every layer of the pass.

    ``query_positions`` is what the runner gives the model as ``position_ids`` (a row's
    padded queries repeat its last real position, so they read what it reads); the
    masks built from it are kept per layer type for the pass's other layers.
    """

    layout: AttentionLayout
    query_positions: torch.Tensor  # [batch | 1, n] int64 absolute positions, model's device
    # [kv_len] int64 arange: keys every row's attention is given, cache positions
    # [0, kv_len) (a tensor, so a compiled graph reads kv_len as a dynamic size)
    kv_range: torch.Tensor
    same_start: bool  # every row's first query sits at the same position
    # A compiled pass (specdec.execution): a mask per row unless the pass is one query of
    # one row, so which rows start where never changes which graph runs.
    per_row_masks: bool = False
    # Keys padded past the longest row (a CUDA graph's static key count, specdec.cuda_graphs):
    # every pass masks, even one query of one row.
    keys_padded: bool = False
    # The pass attends by specdec.slot_attention's kernels (the runner's choice: up to
    # MAX_SLOT_QUERIES queries a row where the kernels run compiled, a GPU with Triton).
    slot_kernel: bool = False
    # The cache the pass reads (a SlotKVCache). Where its layout reads in place, every
    # layer is given the whole cache tensors and the layout's slots say which of their
    # rows each query row reads; ``foreign_kv`` records a layer given other tensors than
    # the cache's own (the runner's probe looks).
    kv_cache: object | None = None
    foreign_kv: bool = field(default=False, init=False)
    # What the runner passes as the model's attention_mask: an empty 4-D tensor, which
    # transformers hands to every layer untouched (it builds no mask of its own then).
    no_mask: torch.Tensor | dict[str, torch.Tensor] = field(init=False, repr=False)
    calls: int = field(default=0, init=False)  # layers that attended by these spans
    _masks: dict[str, torch.Tensor | None] = field(default_factory=dict, repr=False)

    @property
    def kv_len(self) -> int:
        return self.kv_range.shape[0]

    def __post_init__(self) -> None:
        empty = torch.empty(1, 1, 0, 0, dtype=torch.bool, device=self.query_positions.device)
        self.no_mask = empty

    def model_mask(self) -> torch.Tensor | dict[str, torch.Tensor]:
        """The model's ``attention_mask`` argument: :attr:`no_mask` for every layer type."""
        if self.layout.keyed:
            return {t: self.no_mask for t in set(self.layout.layer_types)}
        return self.no_mask

    def mask(self, layer_type: str) -> tuple[torch.Tensor | None, bool]:
        """``(mask, is_causal)`` for SDPA in a layer of ``layer_type``: mask
        ``[batch | 1, 1, n, kv_len]`` bool (True = may attend), or None with
        ``is_causal`` telling SDPA to mask the upper triangle itself."""
        n = self.query_positions.shape[-1]
        if self.per_row_masks:
            # A compiled pass decides from its graph's static sizes alone: no comparison
            # of kv_len (a dynamic size: each would be a guard, and a recompile once a
            # context outgrows a sliding window).
            one_query = n == 1 and self.query_positions.shape[0] == 1
            if layer_type != SLIDING and one_query and not self.keys_padded:
                return None, False
        elif self.same_start and (
            layer_type != SLIDING or self.kv_len <= self.layout.sliding_window
        ):
            if n == 1:  # one query per row at the common end: every key is its prefix
                return None, False
            if n == self.kv_len:  # from position 0: plain causal (a padded query reads
                # past its row's end, but its logits are never used)
                return None, True
        if layer_type not in self._masks:
            one = not self.per_row_masks and self.same_start  # (compiled: never read)
            rows = self.query_positions[:1] if one else self.query_positions
            masks = build_masks(self.layout, rows, self.kv_len)
            self._masks[layer_type] = masks[layer_type] if isinstance(masks, dict) else masks
        return self._masks[layer_type], False


def row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA over ``query [b, heads, n, d]``, ``key [b, kv_heads, kv_len, d]`` and
    ``value [b, kv_heads, kv_len, dv]``; returns ``[b, n, heads, dv]`` as transformers'
    attention functions do (no attention weights).

    Called without :class:`RowSpans` (a caller running the model itself, as the tests'
    references do), it is transformers' SDPA with the masks transformers built."""
    spans = kwargs.pop(ROW_SPANS_KWARG, None)
    if spans is None:
        if attention_mask is not None and attention_mask.numel() == 0:
            raise RowAttentionUnavailable(
                f"{type(module).__name__} does not pass the forward's keyword arguments to "
                "its attention function"
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise RowAttentionUnavailable(f"{type(module).__name__} attends with {name}")
    if attention_mask is not spans.no_mask:
        raise RowAttentionUnavailable(f"{type(module).__name__} changes the attention mask")
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int) or not 0 <= layer_idx < spans.layout.num_layers:
        raise RowAttentionUnavailable(f"{type(module).__name__} has no usable layer_idx")
    spans.calls += 1
    if spans.slot_kernel:
        return _slot_attention(spans, layer_idx, query, key, value, scaling), None
    mask, is_causal = spans.mask(spans.layout.layer_types[layer_idx])
    groups = query.shape[1] // key.shape[1]
    # On CUDA no fused kernel takes grouped heads and a mask together (flash takes no
    # mask, memory-efficient no groups): SDPA would fall to its math kernel, which
    # materialises every score. There a masked pass folds each group's query heads into
    # one head's queries instead (grouped_masked_attention); the CPU kernels take both.
    if groups > 1 and mask is not None and query.device.type != "cpu":
        return grouped_masked_attention(query, key, value, mask, dropout, scaling), None
    in_place = groups > 1
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=is_causal,
        scale=scaling,
        enable_gqa=in_place,
    )  # [b, heads, n, dv]
    return out.transpose(1, 2).contiguous(), None


def _slot_attention(
    spans: RowSpans,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Layer ``layer_idx`` of a pass on :mod:`specdec.slot_attention`'s kernels: keys and
    values ``[slots, kv_heads, capacity, d]`` read in place (the cache's layout says so),
    else the pass's rows ``[b, kv_heads, kv_len, d]``. Notes in ``spans.foreign_kv`` a
    layer given other tensors than the cache's where it should read in place. Returns
    ``[b, n, heads, dv]``."""
    cache = spans.kv_cache
    slots = None
    if cache is not None and cache.layout.in_place:
        slots = cache.layout.slots  # [batch] int64
        layer = cache.layers[layer_idx]
        spans.foreign_kv |= key is not layer.keys or value is not layer.values
    sliding = spans.layout.layer_types[layer_idx] == SLIDING
    window = spans.layout.sliding_window if sliding else None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return slot_attention.slot_attention(
        query, key, value, spans.query_positions, spans.kv_len, scale, window, slots
    )


def grouped_masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    dropout: float = 0.0,
    scaling: float | None = None,
) -> torch.Tensor:
    """Masked grouped-query attention without copying keys and values per query head.

    Query head ``h`` reads KV head ``h // groups`` (transformers' ``repeat_kv`` order), so
    the ``groups`` query heads of one KV head are ``groups x n`` queries of that head:
    ``query [b, heads, n, d]`` is viewed as ``[b, kv_heads, groups * n, d]`` (row
    ``g * n + j`` is query ``j`` of the group's ``g``-th head) and the mask ``[b|1, 1, n,
    kv_len]`` repeated ``groups`` times along its queries. SDPA then runs one KV head per
    head, its memory-efficient kernel taking the mask; nothing of ``[b, heads, kv_len, d]``
    is ever written (``repeat_kv`` writes and reads it in every layer: 4x the KV traffic
    for Llama 3's 32 / 8 heads). Returns ``[b, n, heads, dv]``."""
    b, heads, n, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    folded = query.reshape(b, kv_heads, groups * n, d)
    out = F.scaled_dot_product_attention(
        folded,
        key,
        value,
        attn_mask=mask.repeat(1, 1, groups, 1),  # [b|1, 1, groups * n, kv_len]
        dropout_p=dropout,
        scale=scaling,
    )  # [b, kv_heads, groups * n, dv]
    return out.reshape(b, heads, n, -1).transpose(1, 2).contiguous()


# Without RowSpans the models get transformers' own SDPA masks, so the name behaves as "sdpa".
AttentionInterface.register(ROW_ATTENTION, row_attention)
AttentionMaskInterface.register(ROW_ATTENTION, sdpa_mask)
