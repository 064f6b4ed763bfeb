"""The draft distribution ``q`` in 16 bits, and its compact form between actors.

A sampled row's ``q`` must reach the verifier exactly as the draft sampled from it, but a
float32 ``[k, vocab]`` tensor is 501 KiB per draft token at vocabulary 128256. So the
draft *samples from a 16-bit q*: ``probs_for`` gives ``q`` in float32, :func:`quantize_q`
rounds it to float16 weights ``w`` (what travels), and both sides use
:func:`dequantize_q`'s ``w / sum(w)``. The sum is taken in float64, where the sum of
float16 probabilities is exact whatever the order (every value is a multiple of 2^-24 and
every partial sum is below 2), so the draft and the verifier, on any device, get the same
float32 ``q`` bit for bit. Rejection sampling is exact for any ``q`` the draft really
sampled from, so the rounding changes acceptance by a hair and the output law not at all.

On the wire (:class:`CompactQ`) a row with full support is 2 bytes per vocabulary entry;
a row that top-k/top-p truncated is its support's ids (int32) and weights (float16), 6
bytes per support entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def quantize_q(q: torch.Tensor) -> torch.Tensor:
    """float32 probabilities ``[..., vocab]`` -> float16 weights (the canonical q)."""
    return q.to(torch.float16)


def dequantize_q(w: torch.Tensor) -> torch.Tensor:
    """float16 weights ``[..., vocab]`` -> the float32 distribution the draft sampled from.

    float32 input is taken as a distribution already and returned unchanged. All-zero
    rows (padding) stay zero."""
    if w.dtype != torch.float16:
        return w
    w64 = w.to(torch.float64)
    total = w64.sum(dim=-1, keepdim=True)  # exact: see the module docstring
    return (w64 / total.clamp(min=2.0**-24)).to(torch.float32)


@dataclass
class CompactQ:
    """``q`` of one row's drafts as sent between actors: float16 weights ``[n, width]``,
    dense, or each position's support alone (ragged: ids and weights of every position's
    non-zero entries, concatenated, with ``counts`` per position)."""

    values: np.ndarray  # [n, width] dense, or [total support] float16
    ids: np.ndarray | None  # [total support] int32; None when dense
    counts: np.ndarray | None  # [n] int32 support size per position; None when dense
    width: int  # vocabulary entries the weights cover

    @classmethod
    def encode(cls, w: torch.Tensor) -> CompactQ:
        """From float16 weights ``[n, width]`` (any device): the smaller of the two forms."""
        n, width = w.shape
        nonzero = w != 0
        total = int(nonzero.sum())
        if 3 * total >= n * width:  # 2 bytes per entry beat 6 per support entry
            return cls(w.cpu().numpy(), None, None, width)
        rows, ids = nonzero.nonzero(as_tuple=True)  # row-major: position by position
        counts = torch.bincount(rows, minlength=n)
        return cls(
            w[rows, ids].cpu().numpy(),
            ids.to(torch.int32).cpu().numpy(),
            counts.to(torch.int32).cpu().numpy(),
            width,
        )

    def head(self, k: int) -> CompactQ:
        """The first ``k`` draft positions (a prefix of drafts is a valid draft)."""
        if self.ids is None:
            return CompactQ(self.values[:k], None, None, self.width)
        end = int(self.counts[:k].sum())
        return CompactQ(self.values[:end], self.ids[:end], self.counts[:k], self.width)

    def __len__(self) -> int:
        return len(self.values) if self.counts is None else len(self.counts)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.ids is None else self.ids.nbytes + self.counts.nbytes
        return self.values.nbytes + extra

    def weights(self, device: torch.device | str) -> torch.Tensor:
        """float16 ``[n, width]`` on ``device`` (zero outside the support)."""
        values = torch.from_numpy(self.values).to(device)
        if self.ids is None:
            return values
        n = len(self.counts)
        out = torch.zeros(n, self.width, dtype=torch.float16, device=device)
        counts = torch.from_numpy(self.counts).to(device=device, dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(n, device=device), counts)
        ids = torch.from_numpy(self.ids).to(device=device, dtype=torch.long)
        out[rows, ids] = values
        return out
