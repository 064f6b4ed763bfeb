"""Counting the points where host code waits for the device.

On a GPU every read of a device value by Python (``.item()``, ``.tolist()``, ``bool()`` of
a tensor, a copy to the host) drains the device's queue: the host stops issuing kernels
until the ones before are done, and a round that reads per row or per draft step pays that
many idle gaps. The count does not depend on the device, so it can be taken on a CPU; where
each read comes from (the calling line) says what to remove. ``bench.syncs`` reports the
counts per round of the one-process round; a CUDA run can also use
``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that hand a device value to Python.
_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.numpy: "numpy",
}
_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.copy_}


class HostSyncCounter(TorchFunctionMode):
    """Counts host reads of tensor values while active (in the thread that enters it).

    ``total``: reads of every kind; ``by_kind`` and ``by_site`` (``file:line`` of the first
    caller outside torch) say which and where. A move to the host counts when its source
    is elsewhere (``.to("cpu")``, ``.cpu()``, a host tensor's ``copy_`` from a device one);
    on a CPU run only the reads count, which are the same calls a GPU would wait on.
    """

    def __init__(self):
        super().__init__()
        self.by_kind: Counter[str] = Counter()
        self.by_site: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _READS.get(func)
        if kind is None and func in _MOVES and _to_host(func, args, kwargs):
            kind = "to_host"
        if kind is not None:
            self.by_kind[kind] += 1
            self.by_site[_caller()] += 1
        return func(*args, **kwargs)


def _to_host(func, args, kwargs) -> bool:
    """Whether this move copies a device tensor to the host."""
    if func is torch.Tensor.copy_:
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu"
    src = args[0]
    if src.device.type == "cpu":
        return False
    if func is torch.Tensor.cpu:
        return True
    target = kwargs.get("device", next((a for a in args[1:] if _is_device(a)), None))
    return target is not None and torch.device(target).type == "cpu"


_DEVICE_TYPES = {"cpu", "cuda", "mps", "xpu", "meta"}


def _is_device(arg) -> bool:
    """Whether a positional argument of ``Tensor.to`` names a device (not a dtype)."""
    if isinstance(arg, torch.device):
        return True
    return isinstance(arg, str) and arg.split(":")[0] in _DEVICE_TYPES


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and name != __file__:
            return f"{_short(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _short(path: str) -> str:
    """A path relative to the repository when it is inside it (else the file's name)."""
    if path.startswith(_ROOT):
        return path[len(_ROOT) :]
    return path.rsplit("/", 1)[-1]


_ROOT = str(Path(__file__).resolve().parents[1]) + "/"
