"""The peak memory a block of work takes on a device, above what it held when it began.

A worker sizes its KV cache from the memory left once the weights are in; the passes it
runs later need room of their own on top of the cache (hidden states, attention's
scratch, the logits of every verified position), and a cache that took that room fails
the first large batch with an out-of-memory error instead of at startup.
:class:`specdec.runner.ModelRunner` therefore runs its largest passes once before it
plans the cache, inside a :class:`PeakMemory`, and keeps what they took out of the budget.

How the peak is read: on CUDA, the allocator's own peak (reset at entry), which includes
every kernel's scratch. Elsewhere (a CPU) no allocator keeps one, and the process's
resident size misses memory the C allocator hands out again without touching new pages,
so the tensors themselves are counted: a dispatch mode sees every tensor an operation
returns, counts the storages that are new (not one of its inputs') until the last tensor
on them is gone, and keeps the highest total. That leaves out scratch that fused kernels
free before returning (a CPU attention kernel's blocks), which is small beside the
tensors a pass keeps.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakMemory:
    """``with PeakMemory(device) as peak: ...``; then ``peak.bytes``: the most memory
    the block held above its start [bytes]."""

    bytes: int

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.bytes = 0
        self._base = 0
        self._counter: _LiveTensorBytes | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._counter = _LiveTensorBytes()
            self._counter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._counter is not None:
            self._counter.__exit__(*exc)
            self.bytes = self._counter.peak
            return
        torch.cuda.synchronize(self.device)
        self.bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)


class _LiveTensorBytes(TorchDispatchMode):
    """Bytes of the storages operations allocated while active and still alive, and the
    most there ever were (``peak``). A storage is new when no input of the operation
    that returned it had it (views and in-place results share their input's)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}  # storage data_ptr -> live tensors on it
        self._sizes: dict[int, int] = {}  # storage data_ptr -> its bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_ptr(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            ptr = _ptr(t)
            if ptr in self._refs:
                self._refs[ptr] += 1
            elif ptr in inputs or ptr == 0:
                continue  # a view or an in-place result of a tensor from before
            else:
                self._refs[ptr] = 1
                self._sizes[ptr] = t.untyped_storage().nbytes()
                self.live += self._sizes[ptr]
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, ptr)
        return out

    def _release(self, ptr: int) -> None:
        self._refs[ptr] -= 1
        if not self._refs[ptr]:
            del self._refs[ptr]
            self.live -= self._sizes.pop(ptr)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
