"""Which sequence owns which KV slot, and how many tokens it has cached there (pure).

The runner's cache tensors are sized once (:mod:`specdec.kv_budget`); this table decides
where sequences live in them, as vLLM's ``KVCacheManager`` decides block ownership for
its workers. Slots stay dense (sequences in ``0..n-1``), so a batch of every sequence
reads the cache as one view: freeing moves the last slot into the hole, and the table
says which live tokens the runner must copy for that (or for a fork). No torch here.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple


class SlotCopy(NamedTuple):
    """Copy the first ``length`` cached positions of slot ``src`` into slot ``dst``."""

    src: int
    dst: int
    length: int


class SlotTable:
    """Slot ownership and cached lengths for ``num_slots`` slots."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slot: dict[Hashable, int] = {}  # seq_id -> slot
        self._length: list[int] = []  # slot -> cached tokens (dense: one per sequence)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def seq_ids(self) -> list[Hashable]:
        return list(self._slot)

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self._slot)

    @property
    def cached_tokens(self) -> int:
        return sum(self._length)

    def slot(self, seq_id: Hashable) -> int:
        return self._slot[seq_id]

    def length_of_slot(self, slot: int) -> int:
        return self._length[slot]

    def length(self, seq_id: Hashable) -> int:
        return self._length[self._slot[seq_id]]

    def set_length(self, seq_id: Hashable, length: int) -> None:
        self._length[self._slot[seq_id]] = length

    def add(self, seq_id: Hashable) -> int:
        """A new, empty sequence in the next free slot."""
        if seq_id in self._slot:
            raise KeyError(f"sequence {seq_id!r} already exists")
        if len(self._slot) >= self.num_slots:
            raise RuntimeError(f"runner is full: max_num_seqs={self.num_slots} KV slots")
        self._slot[seq_id] = len(self._length)
        self._length.append(0)
        return self._slot[seq_id]

    def free(self, seq_id: Hashable) -> SlotCopy | None:
        """Forget a sequence; returns the copy that moves the last slot into its hole."""
        slot = self._slot.pop(seq_id)
        last = len(self._length) - 1
        move = None
        if slot != last:
            moved = next(s for s, sl in self._slot.items() if sl == last)
            move = SlotCopy(last, slot, self._length[last])
            self._slot[moved] = slot
            self._length[slot] = self._length[last]
        self._length.pop()
        return move

    def fork(self, src: Hashable, dst: Hashable) -> SlotCopy:
        """Start ``dst`` as a copy of ``src``; returns the copy of ``src``'s live tokens."""
        src_slot = self._slot[src]  # (an unknown src raises before dst is added)
        dst_slot = self.add(dst)
        self._length[dst_slot] = self._length[src_slot]
        return SlotCopy(src_slot, dst_slot, self._length[src_slot])

    def rename(self, old: Hashable, new: Hashable) -> None:
        if new in self._slot:
            raise KeyError(f"sequence {new!r} already exists")
        self._slot[new] = self._slot.pop(old)

    def rollback(self, seq_id: Hashable, length: int) -> None:
        """Keep only the first ``length`` cached positions (a pointer move, no copy)."""
        slot = self._slot[seq_id]
        if not 0 <= length <= self._length[slot]:
            raise ValueError(f"cannot roll {seq_id!r} back to {length} (has {self._length[slot]})")
        self._length[slot] = length
