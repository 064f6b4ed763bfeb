"""How many KV slots a worker gets: the memory arithmetic, decided once at startup.

A slot holds one sequence's keys and values for ``max_model_len`` tokens in every layer
(:mod:`specdec.kv_cache`), so a slot costs ``bytes_per_token * max_model_len`` and the
budget buys ``budget // that`` of them, never more than the worker can use (the target:
``max_num_seqs``; the draft: those plus its speculation branches). Nothing is allocated
later: a worker whose slots are all taken makes new sequences wait (the scheduler admits
on free slots) and makes the draft prepare fewer branches, instead of growing. The
passes need memory of their own beside the cache: the peak their largest shapes took,
measured before the plan (:mod:`specdec.peak_memory`), is kept out of the free memory.

Pure arithmetic, plus :func:`device_free_bytes` to read what the device has left.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

GiB = 1 << 30


class KVBudgetError(ValueError):
    """The configured budget (or the device) cannot hold one sequence, or what was asked."""


@dataclass(frozen=True)
class KVPlan:
    """The slots a worker allocates, and why that many."""

    bytes_per_token: int  # keys + values of one token over all layers
    max_model_len: int  # tokens per slot
    num_slots: int
    wanted_slots: int  # what the worker could use (max_num_seqs, plus branches)
    budget_bytes: int | None  # the configured budget; None: sized to wanted_slots
    # What each slot also costs another model drawing on the same budget (a colocated
    # draft keeps one slot per target slot); not part of this plan's allocation.
    shared_bytes_per_slot: int = 0
    # Kept free of KV for the passes themselves: the measured peak activation memory of
    # the largest passes (specdec.peak_memory), taken out of the free memory first.
    reserved_bytes: int = 0

    @property
    def bytes_per_slot(self) -> int:
        return self.bytes_per_token * self.max_model_len

    def sharing(self, bytes_per_token: int, max_model_len: int) -> KVPlan:
        """The plan of the model that shares this budget: as many slots, its own size."""
        return KVPlan(
            bytes_per_token,
            max_model_len,
            self.num_slots,
            self.num_slots,
            None,
            reserved_bytes=self.reserved_bytes,
        )

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "bytes_per_slot": self.bytes_per_slot,
            "total_bytes": self.total_bytes,
        }


def budget_bytes(
    memory_bytes: int | None, memory_fraction: float | None, free_bytes: int | None
) -> int | None:
    """The budget in bytes from the config: explicit bytes, or a fraction of free memory
    (None when neither is set: the plan then sizes the cache to what the worker uses)."""
    if memory_bytes is not None:
        return memory_bytes
    if memory_fraction is None:
        return None
    if free_bytes is None:
        raise KVBudgetError(
            "kv_cache_memory_fraction needs the device's free memory, which this device "
            "does not report: set kv_cache_memory_bytes instead"
        )
    return int(memory_fraction * free_bytes)


def kv_free_bytes(free_bytes: int | None, reserved_bytes: int) -> int | None:
    """What the KV cache may take of the device's free memory: all of it but the
    activation reserve (None: unknown)."""
    return None if free_bytes is None else max(0, free_bytes - reserved_bytes)


def plan_slots(
    bytes_per_token: int,
    max_model_len: int,
    wanted_slots: int,
    budget: int | None,
    free_bytes: int | None,
    shared_bytes_per_slot: int = 0,
    reserved_bytes: int = 0,
) -> KVPlan:
    """The slot count for a budget; raises :class:`KVBudgetError` with the arithmetic
    when not one sequence of ``max_model_len`` fits, or when the memory is not there.

    ``shared_bytes_per_slot``: what another model's slot costs out of the same budget
    (a draft in the target's process has one slot per target slot). ``free_bytes``: the
    device's free memory, of which ``reserved_bytes`` (the passes' activations) is never
    the cache's."""
    if bytes_per_token <= 0 or max_model_len <= 0 or wanted_slots <= 0:
        raise ValueError("bytes_per_token, max_model_len and wanted_slots must be positive")
    free_bytes = kv_free_bytes(free_bytes, reserved_bytes)
    per_slot = bytes_per_token * max_model_len + shared_bytes_per_slot
    if budget is None:
        num = wanted_slots
        need = num * per_slot
        if free_bytes is not None and need > free_bytes:
            raise KVBudgetError(
                f"the KV cache for {num} sequences of max_model_len={max_model_len} needs "
                f"{_gib(need)} ({_gib(per_slot)} each{_shared(shared_bytes_per_slot)}), but the "
                f"device has {_gib(free_bytes)} free{_reserved(reserved_bytes)}: set "
                "kv_cache_memory_fraction (or kv_cache_memory_bytes) so that fewer run at "
                "once, or lower max_num_seqs or max_model_len"
            )
    else:
        num = min(wanted_slots, budget // per_slot)
        if num < 1:
            raise KVBudgetError(
                f"a KV cache budget of {_gib(budget)} holds no sequence of "
                f"max_model_len={max_model_len}: each needs {_gib(per_slot)} "
                f"({bytes_per_token} bytes per token{_shared(shared_bytes_per_slot)}); raise "
                "the budget or lower max_model_len"
            )
        if free_bytes is not None and num * per_slot > free_bytes:
            raise KVBudgetError(
                f"kv_cache_memory_bytes={budget} asks for {_gib(num * per_slot)} of KV cache, "
                f"but the device has {_gib(free_bytes)} free{_reserved(reserved_bytes)}"
            )
    return KVPlan(
        bytes_per_token,
        max_model_len,
        num,
        wanted_slots,
        budget,
        shared_bytes_per_slot,
        reserved_bytes,
    )


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory of ``device``: CUDA's own count, the host's MemAvailable for the CPU,
    None where neither applies."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def _shared(n: int) -> str:
    return f", {_gib(n)} of it the colocated draft's" if n else ""


def _reserved(n: int) -> str:
    return f" once {_gib(n)} is kept for the passes' activations" if n else ""


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
