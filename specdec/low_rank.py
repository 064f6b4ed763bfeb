"""New draft weights as low-rank factors: ``W += scale · B @ A`` per adapted weight.

A draft adapted with low-rank adapters (LoRA) differs from the weights it was trained on
by ``scale · B @ A`` in each adapted matrix: ``r · (in + out)`` numbers instead of
``in · out``. Shipping those factors to every replica instead of the whole model makes a
swap of a large draft cost megabytes. They only mean something on top of the weights they
were trained on, so an update names that version (``base_version``) and a worker serving
another refuses it (the full weights travel instead).

Every party merges with :func:`merged`, one order of operations in float32, rounded once
to the parameter's dtype: a replica that applies the factors and one that loads the full
merged weights the adaptation run computed hold the same bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LowRankUpdate:
    """An adapted draft as factors over the weights of ``base_version``."""

    base_version: int  # the draft version whose weights the factors apply to
    # weight name (a state-dict name of the draft) -> (A [rank, in], B [out, rank])
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float  # LoRA's alpha / rank

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values())


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale · B @ A``, computed in float32 and rounded once to weight's dtype."""
    delta = (b.float() @ a.float()) * scale  # [out, in]
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)


def unfit_factors(a, b, weight: torch.Tensor | None) -> str | None:
    """Why ``(a, b)`` cannot adapt ``weight`` (None: it can)."""
    if weight is None:
        return "unknown weight"
    if not all(isinstance(t, torch.Tensor) and not t.is_meta for t in (a, b)):
        return "not tensors with data"
    if weight.dim() != 2 or a.dim() != 2 or b.dim() != 2:
        return "not matrices"
    if a.shape[1] != weight.shape[1] or b.shape[0] != weight.shape[0] or a.shape[0] != b.shape[1]:
        return f"shapes {tuple(a.shape)} x {tuple(b.shape)} do not make {tuple(weight.shape)}"
    if not (a.is_floating_point() and b.is_floating_point()):
        return "not floating point"
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return "not finite"
    return None
