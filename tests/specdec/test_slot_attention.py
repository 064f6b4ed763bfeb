"""The slot-attention kernels (:mod:`specdec.slot_attention`) against the masks reference.

On a CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, which
``available`` requires there); with ``--device cuda`` compiled, as a server runs them.
"""

import random

import pytest
import torch
from transformers import AutoTokenizer
from transformers.integrations.sdpa_attention import repeat_kv

from specdec import slot_attention as sa
from specdec.attention import FULL, SLIDING, AttentionLayout, build_masks
from specdec.runner import ModelRunner
from tests.specdec.test_families import assert_greedy_speculation_is_generate
from tests.specdec.test_row_attention import GQA, MIXED, STEPS, _model
from tests.specdec.test_row_attention import SLIDING as SLIDING_CFG

pytest.importorskip("triton")


@pytest.fixture
def kernels(device) -> torch.device:
    """The kernels' device: compiled on CUDA, else Triton's interpreter (tests/conftest.py
    sets TRITON_INTERPRET where no GPU is)."""
    assert sa.runs_on(torch.device(device))
    return torch.device(device)


def _reference(query, key, value, positions, kv_len, scale, window, slots):
    """SDPA over keys copied out per query head, masked by :func:`build_masks`."""
    b, heads, n, _ = query.shape
    groups = heads // key.shape[1]
    k = repeat_kv(key[slots, :, :kv_len].float(), groups)
    v = repeat_kv(value[slots, :, :kv_len].float(), groups)
    layout = AttentionLayout(1, (SLIDING if window else FULL,), window, False)
    mask = build_masks(layout, positions.expand(b, n), kv_len)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float(), k, v, attn_mask=mask, scale=scale
    )  # [b, heads, n, dv]
    return out.transpose(1, 2)


# (rows, heads, kv heads, queries, head dim, value dim, keys, window, splits, dtype):
# one query of one head; Llama 3's 4:1 groups at ragged ends in several key spans; a
# window and head sizes off the powers of two; keys and values of other sizes (latent
# attention); more (group head, query) rows than one program takes; bfloat16; more spans
# than a merge program reads at once (sa.MERGE_CHUNK), some of them past a row's end.
CASES = [
    (1, 4, 1, 1, 16, 16, 40, None, 1, torch.float32),
    (3, 8, 2, 5, 16, 16, 100, None, None, torch.float32),
    (2, 4, 4, 9, 24, 24, 130, 17, 3, torch.float32),
    (2, 4, 2, 3, 24, 8, 70, None, 2, torch.float32),
    (1, 16, 1, 9, 16, 16, 50, 7, 2, torch.float32),
    (2, 32, 8, 6, 64, 64, 300, None, None, torch.bfloat16),
    (1, 4, 2, 2, 16, 16, 1000, None, 32, torch.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}x{c[2]}heads-{c[3]}q-{c[9]}")
def test_the_kernels_equal_masked_attention(case, kernels):
    """Ragged rows read from shuffled slots, each query bounded by its own position (and
    window): the kernels give masked SDPA's output; a window one key off does not."""
    b, heads, kv_heads, n, d, dv, kv_len, window, splits, dtype = case
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=kernels)

    key, value = randn(5, kv_heads, kv_len + 3, d), randn(5, kv_heads, kv_len + 3, dv)
    query = randn(b, heads, n, d)
    slots = torch.tensor(rng.sample(range(5), b), device=kernels)
    ends = [rng.randint(n, kv_len) for _ in range(b)]
    positions = torch.tensor([[e - n + j for j in range(n)] for e in ends], device=kernels)
    got = sa.slot_attention(query, key, value, positions, kv_len, d**-0.5, window, slots, splits)
    assert got.shape == (b, n, heads, dv) and got.dtype == dtype
    want = _reference(query, key, value, positions, kv_len, d**-0.5, window, slots)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.float(), want, **tol)
    if window:  # the twin that must fail: the window one key wider
        wider = _reference(query, key, value, positions, kv_len, d**-0.5, window + 1, slots)
        assert not torch.allclose(got.float(), wider, **tol)


@pytest.mark.parametrize("cfg", [GQA, SLIDING_CFG, MIXED], ids=["llama-gqa", "mistral", "qwen2"])
def test_a_runner_on_the_kernels_equals_the_masks_reference(cfg, kernels, monkeypatch):
    """Every kind of pass of test_row_attention (prefill, ragged chunks, decode at common
    and ragged ends, verification with padded rows, past every window) with attention by
    rows on the kernels: the logits of the masks reference, and the kernels ran for every
    pass of up to MAX_SLOT_QUERIES queries."""

    def runner(backend: str) -> ModelRunner:
        return ModelRunner(
            _model(cfg), max_num_seqs=4, max_model_len=64, attention_backend=backend, device=kernels
        )

    rows, masks = runner("slots"), runner("masks")
    assert rows._slot_kernel and not masks._row_attention
    calls = _count_calls(monkeypatch)
    for r in (rows, masks):
        for sid in "abc":
            r.add(sid)
    for step, (ids, toks) in enumerate(STEPS):
        for g, w in zip(rows.forward(ids, toks), masks.forward(ids, toks), strict=True):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=f"step {step}")
    # every pass here has at most MAX_SLOT_QUERIES queries a row: each layer of each ran,
    # reading keys and values in the cache (its 4 slots), not copies of the pass's rows
    assert len(calls) == rows.attention.num_layers * len(STEPS)
    assert {n for n, _, _ in calls} == {len(max(toks, key=len)) for _, toks in STEPS}
    assert all(cache_rows == 4 and in_place for _, cache_rows, in_place in calls)


def _count_calls(monkeypatch) -> list[tuple[int, int, bool]]:
    """Each later call of the kernels as (queries a row, cache rows given, slots given)."""
    calls = []
    run = sa.slot_attention

    def counted(query, key, *args, **kwargs):
        slots = args[5] if len(args) > 5 else kwargs.get("slots")
        calls.append((query.shape[2], key.shape[0], slots is not None))
        return run(query, key, *args, **kwargs)

    monkeypatch.setattr(sa, "slot_attention", counted)
    return calls


@pytest.mark.parametrize("name", ["llama3", "gemma3", "deepseek-v3"])
def test_graphed_runners_on_the_kernels_decode_as_generate(
    name, family_models, kernels, monkeypatch
):
    """Target and draft as a server runs them on a GPU (``cuda_graph``: padded static
    passes, a round's draft steps as one graph; on a CPU the same passes eagerly) on the
    kernels: greedy speculative decoding gives transformers' greedy ``generate``. Grouped
    heads, sliding and full layers mixed, keys and values of other sizes (latent
    attention)."""
    target_dir, draft_dir, tok_dir = family_models[name]
    runners = [
        ModelRunner(
            path,
            execution_mode="cuda_graph",
            attention_backend="slots",
            max_num_seqs=2,
            max_model_len=256,
            device=kernels,
        )
        for path in (target_dir, draft_dir)
    ]
    calls = _count_calls(monkeypatch)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    # 6 tokens: a first round of 4 drafts and its verification, then a shorter round (each
    # kernel call runs in Triton's interpreter here: 12 tokens took 50 s of CI for Llama 3)
    assert_greedy_speculation_is_generate(*runners, target_dir, tokenizer, 6)
    assert {n for n, _, _ in calls} >= {1, 5}  # draft steps, verifications of 4 drafts
    # In place, except where the model attends over tensors it makes from the cache's
    # (DeepSeek-V3 expands its latents: over the whole cache, read in place): the probe
    # at load saw that, and the kernels read the pass's rows gathered.
    in_place = name != "deepseek-v3"
    assert all(r._kv_in_place == in_place for r in runners)
    assert all(flag == in_place for _, _, flag in calls)


def test_kernels_that_fail_at_load_leave_attention_by_rows(kernels, monkeypatch, caplog):
    """Kernels that cannot run (a failed Triton compile, say) fail the probe pass at load:
    the runner then attends by rows through SDPA, not by the 4-D masks, and says so."""

    def broken(*args, **kwargs):
        raise RuntimeError("the kernel did not compile")

    monkeypatch.setattr(sa, "slot_attention", broken)
    with caplog.at_level("WARNING", logger="specserve.runner"):
        runner = ModelRunner(
            _model(GQA), max_num_seqs=2, max_model_len=64, attention_backend="slots", device=kernels
        )
    assert runner._row_attention and not runner._slot_kernel
    assert "slot-attention kernels off" in caplog.text
    masks = ModelRunner(
        _model(GQA), max_num_seqs=2, max_model_len=64, attention_backend="masks", device=kernels
    )
    for r in (runner, masks):
        r.add("a")
    torch.testing.assert_close(
        runner.forward(["a"], [[1, 2, 3]])[0], masks.forward(["a"], [[1, 2, 3]])[0]
    )


def test_the_kernels_are_refused_where_inductor_compiles_attention(kernels):
    with pytest.raises(ValueError, match="torch_compile"):
        ModelRunner(
            _model(GQA),
            attention_backend="slots",
            execution_mode="torch_compile",
            device=kernels,
        )
