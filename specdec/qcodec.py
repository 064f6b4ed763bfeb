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
        if _dense_is_smaller(n, width, total):
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


def encode_batch(ws: list[torch.Tensor]) -> list[CompactQ]:
    """:meth:`CompactQ.encode` of many rows (float16 weights ``[n_i, width]`` each, on one
    device) in two reads of the device for the whole batch, not four per row: the support
    sizes of every position, then one packed copy of every row's chosen form (dense
    weights, or support weights and ids) as int32."""
    if not ws:
        return []
    width = ws[0].shape[1]
    flat = torch.cat(ws)  # [N, width] float16, rows one after another
    nonzero = flat != 0
    sizes = nonzero.sum(dim=-1).tolist()  # [N] support size per position: read 1
    spans, dense, sparse, offset = [], [], [], 0
    for w in ws:
        n = w.shape[0]
        support = sum(sizes[offset : offset + n])
        is_dense = _dense_is_smaller(n, width, support)
        spans.append((offset, n, support, is_dense))
        (dense if is_dense else sparse).extend(range(offset, offset + n))
        offset += n
    parts = []  # int32 on the device: dense weights, then support weights, then ids
    dev = flat.device
    if dense:
        parts.append(_as_int32(flat[torch.tensor(dense, device=dev)].flatten()))
    if sparse:
        at = torch.tensor(sparse, device=dev)
        total = sum(sizes[i] for i in sparse)
        rows, ids = torch.nonzero_static(nonzero[at], size=total).unbind(1)  # row-major
        parts += [_as_int32(flat[at][rows, ids]), ids.to(torch.int32)]
    packed = torch.cat(parts).cpu().numpy() if parts else np.empty(0, np.int32)  # read 2
    dense_vals = packed[: len(dense) * width].astype(np.int16).view(np.float16)
    support_total = (len(packed) - len(dense_vals)) // 2
    support_vals = packed[len(dense_vals) : len(dense_vals) + support_total]
    support_vals = support_vals.astype(np.int16).view(np.float16)
    support_ids = packed[len(dense_vals) + support_total :]
    out, d, sp = [], 0, 0
    for offset, n, support, is_dense in spans:
        if is_dense:
            out.append(
                CompactQ(
                    dense_vals[d * width : (d + n) * width].reshape(n, width), None, None, width
                )
            )
            d += n
        else:
            counts = np.asarray(sizes[offset : offset + n], dtype=np.int32)
            out.append(
                CompactQ(
                    support_vals[sp : sp + support], support_ids[sp : sp + support], counts, width
                )
            )
            sp += support
    return out


def _dense_is_smaller(positions: int, width: int, support: int) -> bool:
    """Whether ``positions`` rows of ``width`` weights go as dense (2 bytes an entry)
    rather than as their ``support`` non-zero entries (6 bytes each: id and weight)."""
    return 3 * support >= positions * width


def _as_int32(w: torch.Tensor) -> torch.Tensor:
    """float16 values as int32 carrying their 16 bits (undone with astype(int16).view)."""
    return w.view(torch.int16).to(torch.int32)


@dataclass
class DeviceQ(CompactQ):
    """Dense float16 weights ``[n, width]`` kept on the draft's device: a draft in the
    verifier's own process (colocated) sends nothing, so nothing is encoded or read."""

    values: torch.Tensor  # [n, width] float16, on the device

    def head(self, k: int) -> DeviceQ:
        return DeviceQ(self.values[:k], None, None, self.width)

    def weights(self, device: torch.device | str) -> torch.Tensor:
        return self.values.to(device)
