"""Attention of a round's few queries per row over the cache, as two Triton kernels.

Why a kernel of our own: a round's passes (decode, verification of k + 1 positions, a
draft's steps) ask something no fused PyTorch kernel takes. Rows are ragged, so each
query needs its own causal bound (a mask), and Llama 3 groups 4 query heads per KV head.
SDPA's flash kernel takes no mask and its memory-efficient kernel no groups, so the CUDA
path folded each group's heads into one head's queries and masked them
(:func:`specdec.row_attention.grouped_masked_attention`): measured on an H200 (8B target,
batch 1, 6 queries, 844 keys, CUDA graphs), that attention took 32 us a layer, 12 % of the
pass's device time, beside the kernels that built and repeated its masks.

Here one program takes one row's one KV head and one span of keys (flash-decoding: the
keys of a long context are split across programs, so a batch of one row still fills the
GPU), with all the queries of the group's heads as the rows of its tiles: keys and values
are read once per KV head, never copied per query head. Each query's bounds come from its
position (keys at or before it; in a sliding layer fewer than ``window`` back, as
transformers counts), so no mask is ever built. A second kernel merges the spans' partial
softmaxes. Scores and sums are float32; the probabilities meet the values in the values'
dtype, as flash attention does.

The kernels are compiled at first use (``triton.jit`` then), so ``TRITON_INTERPRET=1``
set before that runs them on a CPU: the tests compare them there with the mask path.
"""

from __future__ import annotations

import functools

import torch

try:  # (a CPU install has no Triton: the SDPA paths serve there)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_N = 32  # keys per tile
MAX_BLOCK_M = 64  # query rows (group heads x queries) per program
MERGE_CHUNK = 16  # spans a merge program reads at once


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: Triton installed, and a CUDA device or
    Triton's interpreter (``TRITON_INTERPRET=1`` when Triton was imported) for a CPU."""
    if triton is None:
        return False
    return device.type == "cuda" or _interpreting()


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def slot_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    kv_len: int,
    scale: float,
    window: int | None = None,
    slots: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of ``query [b, heads, n, d]`` at ``query_positions [b | 1, n]`` (int64,
    absolute) over cache positions ``[0, kv_len)`` of ``key [rows, kv_heads, >= kv_len, d]``
    and ``value [rows, kv_heads, >= kv_len, dv]``: row ``slots[i]`` of them for query row
    ``i`` (``slots [b]`` int64; None: row ``i``). A query at position ``p`` reads keys
    ``<= p`` and, with ``window``, ``> p - window``; every query must read at least one key.
    Query head ``h`` reads KV head ``h // (heads // kv_heads)`` (transformers' order).
    ``num_splits``: spans of keys per row and KV head (None: enough to fill the device).
    Returns ``[b, n, heads, dv]`` in the query's dtype (transformers' attention output)."""
    b, heads, n, d = query.shape
    kv_heads, dv = key.shape[1], value.shape[3]
    groups = heads // kv_heads
    rows_m = groups * n  # a program's query rows: (group head, query) pairs
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(rows_m)))
    m_blocks = triton.cdiv(rows_m, block_m)
    # Powers of two (the kernels are specialised on both), so that passes of every key
    # count compile a handful of variants; a split past the keys reads nothing.
    splits = triton.next_power_of_2(
        num_splits or _splits(query.device, b * kv_heads * m_blocks, kv_len)
    )
    span = triton.cdiv(triton.cdiv(kv_len, splits), BLOCK_N) * BLOCK_N  # keys per split
    if slots is None:
        slots = torch.arange(b, device=query.device)
    positions = query_positions.expand(b, n)
    block_d, block_dv = (max(16, triton.next_power_of_2(x)) for x in (d, dv))
    f32 = dict(dtype=torch.float32, device=query.device)
    acc = torch.empty(b, kv_heads, m_blocks, splits, block_m, block_dv, **f32)
    stats = torch.empty(2, b, kv_heads, m_blocks, splits, block_m, **f32)  # max, sum
    interpret = _interpreting()
    split_kernel, merge_kernel = _kernels(interpret)
    split_kernel[(b * kv_heads, m_blocks, splits)](
        query, key, value, slots, positions, acc, stats,
        *query.stride(), *key.stride(), *value.stride(), *positions.stride(),
        n, groups, kv_heads, d, dv, kv_len, span, window or 0, scale,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=block_d, BLOCK_DV=block_dv,
        TILES=triton.next_power_of_2(span // BLOCK_N), SLIDING=bool(window),
        # float32 products in float32 (no TF32); the interpreter's are wrong off float32
        DOT_F32=query.dtype == torch.float32 or interpret,
    )  # fmt: skip
    out = torch.empty(b, n, heads, dv, dtype=query.dtype, device=query.device)
    # One program per (row, KV head) and query row of the group: at batch 1 a program per
    # (row, KV head) alone was 8 programs for Llama 3, 15 us a layer on an H200.
    merge_kernel[(b * kv_heads, rows_m)](
        acc, stats, out, *out.stride(), n, groups, kv_heads, dv, m_blocks, stats[0].numel(),
        SPLITS=splits, CHUNK=min(splits, MERGE_CHUNK), BLOCK_M=block_m, BLOCK_DV=block_dv,
    )  # fmt: skip
    return out


def _splits(device: torch.device, programs: int, kv_len: int) -> int:
    """Spans of keys per (row, KV head, query block): a power of two, at most about two
    programs per streaming multiprocessor in all, each span at least one tile (4 programs
    on a CPU, for the tests)."""
    units = 2 * _multiprocessors(device) if device.type == "cuda" else 4
    wanted = max(1, min(triton.cdiv(kv_len, BLOCK_N), triton.cdiv(units, programs)))
    return 1 << (wanted.bit_length() - 1)  # (a power of two down: at most `units` in all)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _kernels(interpret: bool):
    """The two kernels, compiled (or interpreted) at first use; cached per mode."""
    del interpret  # (a cache key: triton.jit reads TRITON_INTERPRET when it wraps)
    return triton.jit(_split_kernel), triton.jit(_merge_kernel)


def _split_kernel(
    Q, K, V, Slots, Pos, Acc, Stats,
    sq_b, sq_h, sq_n, sq_d, sk_r, sk_h, sk_t, sk_d, sv_r, sv_h, sv_t, sv_d, sp_b, sp_n,
    n, groups, kv_heads, d, dv, kv_len, span, window, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, TILES: tl.constexpr, SLIDING: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """One (row, KV head) x one block of its query rows x one span of keys: the span's
    running max, sum and unnormalised output per query row, into ``Acc`` and ``Stats``."""
    row_head, m_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row, kv_head = row_head // kv_heads, row_head % kv_heads
    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] (group head, query) pairs
    real_m = m < groups * n
    head, qi = kv_head * groups + m // n, m % n
    dd, ddv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + row * sq_b + head[:, None] * sq_h + qi[:, None] * sq_n + dd[None, :] * sq_d,
        mask=real_m[:, None] & (dd[None, :] < d),
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    pos = tl.load(Pos + row * sp_b + qi * sp_n, mask=real_m, other=-1)  # [BLOCK_M]
    slot = tl.load(Slots + row)
    start = split * span
    stop = tl.minimum(tl.minimum(start + span, kv_len), tl.max(pos) + 1)  # (causal bound)
    first = start  # the earliest key any query of the block may read
    if SLIDING:
        first = tl.maximum(start, tl.min(tl.where(real_m, pos, kv_len)) - window + 1)
    k_base = K + slot * sk_r + kv_head * sk_h
    v_base = V + slot * sv_r + kv_head * sv_h
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Every tile of the span, those no query reads skipped. (A loop bounded by positions
    # read on the device would be shorter, but Triton's interpreter runs only loops of
    # constant bounds; TILES is a power of two, so few variants are ever compiled.)
    for tile in range(0, TILES):
        t0 = start + tile * BLOCK_N
        if (t0 < stop) & (t0 + BLOCK_N > first):
            # [BLOCK_N] cache positions, int64: a view's position stride can be large
            # (DeepSeek-V3's values expanded from its latents: heads x 256 elements)
            t = (t0 + tl.arange(0, BLOCK_N)).to(tl.int64)
            in_span = t < stop
            k = tl.load(
                k_base + t[None, :] * sk_t + dd[:, None] * sk_d,
                mask=in_span[None, :] & (dd[:, None] < d),
                other=0.0,
            )  # [BLOCK_D, BLOCK_N]
            if DOT_F32:
                s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = s * scale  # [BLOCK_M, BLOCK_N] float32
            seen = in_span[None, :] & (t[None, :] <= pos[:, None])
            if SLIDING:
                seen = seen & (t[None, :] > pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(s, 1))
            base = tl.where(new_max == float("-inf"), 0.0, new_max)  # (no key seen yet)
            p = tl.exp(s - base[:, None])
            rescale = tl.exp(run_max - base)
            v = tl.load(
                v_base + t[:, None] * sv_t + ddv[None, :] * sv_d,
                mask=in_span[:, None] & (ddv[None, :] < dv),
                other=0.0,
            )  # [BLOCK_N, BLOCK_DV]
            if DOT_F32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * rescale[:, None] + pv
            run_sum = run_sum * rescale + tl.sum(p, 1)
            run_max = new_max
    mm = tl.arange(0, BLOCK_M)
    cell = ((row_head * tl.num_programs(1) + m_block) * tl.num_programs(2) + split) * BLOCK_M
    tl.store(Acc + (cell + mm[:, None]) * BLOCK_DV + ddv[None, :], acc)
    tl.store(Stats + cell + mm, run_max)
    tl.store(Stats + tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2) * BLOCK_M
             + cell + mm, run_sum)  # fmt: skip


def _merge_kernel(
    Acc, Stats, Out, so_b, so_n, so_h, so_d, n, groups, kv_heads, dv, m_blocks, stats_numel,
    SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """The spans of one (row, KV head) x one query row of its group merged: each span's
    output scaled by its share of the whole softmax, written as ``Out [b, n, heads, dv]``.
    ``CHUNK`` spans are read at once (one load after another was latency-bound), merged
    online, as the split kernel merges its tiles."""
    row_head, m = tl.program_id(0), tl.program_id(1)  # m: a (group head, query) pair
    row, kv_head = row_head // kv_heads, row_head % kv_heads
    ddv = tl.arange(0, BLOCK_DV)
    # [CHUNK] cells of the spans' stats (and rows of Acc) for this query row
    cells = ((row_head * m_blocks + m // BLOCK_M) * SPLITS + tl.arange(0, CHUNK)) * BLOCK_M
    cells += m % BLOCK_M
    # the running max and sum over the spans merged so far ([] float32 each: tensors from
    # the start, as a loop-carried value keeps its type)
    top = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([CHUNK], tl.float32), 0)
    out = tl.zeros([BLOCK_DV], tl.float32)
    for c in range(0, SPLITS, CHUNK):
        at = cells + c * BLOCK_M
        span_max = tl.load(Stats + at)  # [CHUNK]
        new_top = tl.maximum(top, tl.max(span_max, 0))
        base = tl.where(new_top == float("-inf"), 0.0, new_top)  # (no key seen yet)
        rescale = tl.exp(top - base)
        weight = tl.exp(span_max - base)  # [CHUNK]
        total = total * rescale + tl.sum(weight * tl.load(Stats + stats_numel + at), 0)
        acc = tl.load(Acc + at[:, None] * BLOCK_DV + ddv[None, :])  # [CHUNK, BLOCK_DV]
        out = out * rescale + tl.sum(weight[:, None] * acc, 0)
        top = new_top
    out = out / tl.where(total > 0, total, 1.0)
    head, qi = kv_head * groups + m // n, m % n
    dst = Out + row * so_b + qi * so_n + head * so_h + ddv * so_d
    tl.store(dst, out.to(Out.dtype.element_ty), mask=ddv < dv)
