"""A slot-based KV cache for batched speculative decoding with O(1) rollback.

Why not ``DynamicCache``: speculative decoding appends ``k + 1`` positions per round and
then throws away the rejected suffix, per sequence, with sequences of different lengths
in one batch. Like gpt-fast's static cache, each sequence here owns a *slot* (a row of a
preallocated ``[slots, kv_heads, capacity, head_dim]`` tensor per layer for keys, and one
for values, whose head size may differ) and a length; rollback is a length change, and new
positions are written at each row's own offset.
Attention reads only up to each row's length: the runner tells the attention function
where each row's queries sit (:mod:`specdec.row_attention`), or builds 4-D masks.

The tensors are allocated once, when the runner knows its slot count from the memory
budget (:mod:`specdec.kv_budget`), with ``capacity = max_model_len + 1``: the last
position is a scratch column where padded queries of a ragged batch write their keys,
which no mask ever lets a query read. Nothing grows while serving.

Active sequences are kept in slots ``0..n-1`` (freeing moves the last slot into the
hole, copying only its live tokens), so a batch of all active sequences reads the cache
as a view, without copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin

# The transformers minor versions this cache was tested against: it subclasses
# ``Cache``/``CacheLayerMixin``, whose internals change within 5.x, so any other minor is
# refused at load time. TRANSFORMERS_MINOR is pyproject.toml's pin (the serving stack's);
# 5.17 is the lent GPU machine's, where ``specdec``'s tests pass (docs/benchmarks.md).
TRANSFORMERS_MINOR = (5, 23)
TRANSFORMERS_MINORS = ((5, 17), TRANSFORMERS_MINOR)


def check_transformers_version(version: str = transformers.__version__) -> None:
    """Raise unless ``version`` is a transformers minor the slot cache was tested on."""
    parts = version.split(".")
    try:
        minor = (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        minor = None
    if minor not in TRANSFORMERS_MINORS:
        want = ".".join(map(str, TRANSFORMERS_MINOR))
        tested = ", ".join(".".join(map(str, m)) + ".x" for m in TRANSFORMERS_MINORS)
        raise RuntimeError(
            f"transformers {version} is installed, but SpecServe's KV cache "
            f"(specdec/kv_cache.py) subclasses transformers internals, which change between "
            f"minor versions, and was tested on {tested}: install transformers=={want}.* "
            "(pyproject.toml pins it)"
        )


@dataclass
class BatchLayout:
    """Where the current forward pass reads and writes, shared by all layers."""

    slots: torch.Tensor  # [batch] int64 slot of each row
    write_positions: torch.Tensor  # [batch, n] int64 cache positions of the new tokens
    # [kv_len] int64 arange: keys/values returned to attention are positions [0, kv_len).
    # A tensor, not an int, so a compiled graph reads kv_len as a dynamic size.
    kv_range: torch.Tensor
    contiguous_from: int | None  # first slot if slots == range(first, first + batch)
    write_start: int | None = None  # every row writes at [write_start, write_start + n)
    # Attention reads the rows' slots in the cache itself (specdec.slot_attention's
    # kernels): each layer hands it its whole [slots, kv_heads, capacity, dim] tensors.
    in_place: bool = False

    @property
    def kv_len(self) -> int:
        return self.kv_range.shape[0]


class _SlotLayer(CacheLayerMixin):
    """One decoder layer's keys ``[slots, kv_heads, capacity, head_dim]`` and values
    ``[slots, kv_heads, capacity, v_head_dim]``: the two head sizes may differ (multi-head
    latent attention as transformers runs DeepSeek-V3 and Kimi K2: keys of
    ``qk_nope_head_dim + qk_rope_head_dim``, values of ``v_head_dim``)."""

    is_sliding = False

    def __init__(self, owner: SlotKVCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # The first forward (the runner's probe at load) learns heads, head sizes and dtype.
        self.keys = self._zeros_like(key_states)
        self.values = self._zeros_like(value_states)
        self.is_initialized = True

    def _zeros_like(self, states: torch.Tensor) -> torch.Tensor:
        """Zeros ``[slots, heads, capacity, dim]`` with ``states``' heads, dim, dtype and
        device (``states``: ``[batch, heads, n, dim]``, or a cache tensor)."""
        _, heads, _, dim = states.shape
        shape = (self.owner.num_slots, heads, self.owner.capacity, dim)
        return torch.zeros(shape, dtype=states.dtype, device=states.device)

    def bytes_per_token(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.shape[1] * t.shape[3] * t.element_size() for t in (self.keys, self.values))

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states, value_states: [batch, kv_heads, n, head_dim]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        layout = self.owner.layout
        if layout.write_start is not None:
            # Every row writes the same positions: a slice, no scatter.
            span = slice(layout.write_start, layout.write_start + key_states.shape[2])
            if layout.contiguous_from is not None:
                rows = slice(layout.contiguous_from, layout.contiguous_from + key_states.shape[0])
            else:
                rows = layout.slots
            self.keys[rows, :, span] = key_states
            self.values[rows, :, span] = value_states
        else:
            rows = layout.slots[:, None]  # [batch, 1] broadcasts against [batch, n]
            pos = layout.write_positions
            # Advanced indices around a slice put the indexed dims first: [batch, n, heads, dim].
            self.keys[rows, :, pos] = key_states.transpose(1, 2)
            self.values[rows, :, pos] = value_states.transpose(1, 2)
        return self._read(self.keys, layout), self._read(self.values, layout)

    @staticmethod
    def _read(t: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        if layout.in_place:
            return t
        if layout.contiguous_from is not None:
            first = layout.contiguous_from
            return t[first : first + layout.slots.shape[0], :, : layout.kv_len]
        return t[layout.slots, :, : layout.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.layout.kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.layout.kv_len if self.owner.layout is not None else 0

    def get_max_length(self) -> int:
        return self.owner.capacity

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """This layer alone (one left out of the owner's stacks: initialised after them)."""
        if self.is_initialized and length > 0:
            self.keys[dst, :, :length] = self.keys[src, :, :length]
            self.values[dst, :, :length] = self.values[src, :, :length]

    def shape_key(self) -> tuple:
        """Layers with equal keys and values layouts share one stacked tensor."""
        k, v = self.keys, self.values
        return (k.shape[1], k.shape[3], v.shape[1], v.shape[3], k.dtype, v.dtype, k.device)


class SlotKVCache(Cache):
    """The transformers ``Cache`` handed to the model; the runner sets :attr:`layout`."""

    def __init__(self, num_layers: int, num_slots: int, capacity: int):
        self.num_slots = num_slots
        self.capacity = capacity
        self.layout: BatchLayout | None = None
        # (keys [layers, slots, heads, capacity, head_dim], values likewise) per layout: every
        # layer's tensors are views of its stack, so a slot copy is one op per stack.
        self._stacks: list[tuple[torch.Tensor, torch.Tensor]] = []
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])
        self._loose = list(self.layers)  # layers in no stack (copied one by one)

    @property
    def scratch_position(self) -> int:
        """Where padded queries write: past every position a sequence can own."""
        return self.capacity - 1

    def allocate(self, num_slots: int, capacity: int) -> None:
        """Size every layer's tensors for good (done once, after the probe forward), zeroed
        (a masked-out key must never be NaN, which uninitialised memory can be), as views of
        one stacked tensor per layout that the layers share.

        The slot count and capacity are constants of a compiled graph, not sizes it reads.
        Marked dynamic (so that one graph served every ``max_num_seqs`` and
        ``max_model_len``), the layers' views became inputs of symbolic sizes that alias
        one storage, and torch guards every pair of them against overlapping (2 x 190
        storage-offset guards for the demo target's 10 layers): measured on the demo pair,
        a start from the compile cache took 33.1 s for ``demo.yaml`` (39.1 s colocated)
        against 24.1 s (29.5 s) with constant sizes. A runner of other sizes compiles its
        own graphs: a restart with the same settings loads them, unless a budget by memory
        fraction gives it another slot count (free memory differs)."""
        self.num_slots, self.capacity = num_slots, capacity
        groups: dict[tuple, list[_SlotLayer]] = {}
        for layer in self.layers:
            if layer.is_initialized:
                groups.setdefault(layer.shape_key(), []).append(layer)
        self._stacks = []
        for members in groups.values():
            k, v = members[0].keys, members[0].values  # the probe's (replaced below)
            keys = k.new_zeros((len(members), num_slots, k.shape[1], capacity, k.shape[3]))
            values = v.new_zeros((len(members), num_slots, v.shape[1], capacity, v.shape[3]))
            for i, layer in enumerate(members):
                layer.keys, layer.values = keys[i], values[i]
            self._stacks.append((keys, values))
        stacked = {id(layer) for members in groups.values() for layer in members}
        self._loose = [layer for layer in self.layers if id(layer) not in stacked]

    def bytes_per_token(self) -> int:
        """Keys and values of one token over every layer (known after the first forward)."""
        return sum(layer.bytes_per_token() for layer in self.layers)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions (the live tokens) of slot ``src`` to ``dst``:
        one op per stack over all its layers (a fork or a free on a 32-layer model is two
        kernels, not 64)."""
        if length <= 0:
            return
        for keys, values in self._stacks:
            keys[:, dst, :, :length] = keys[:, src, :, :length]
            values[:, dst, :, :length] = values[:, src, :, :length]
        for layer in self._loose:
            layer.copy_slot(src, dst, length)
