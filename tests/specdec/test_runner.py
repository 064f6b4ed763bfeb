"""Model runner: batched ragged forward and KV rollback against full recomputation."""

import pytest
import torch

from specdec.generate import generate_autoregressive, generate_speculative
from specdec.proposers import DraftModelProposer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState
from tests.conftest import GPT2_POSITIONS, VOCAB


@pytest.fixture(scope="module")
def runner(tiny_target, device):
    return ModelRunner(tiny_target, max_num_seqs=4, device=device)


def full_logits(runner, tokens):
    """Reference: the model over the whole sequence, no cache."""
    with torch.no_grad():
        return runner.model(torch.tensor([tokens], device=runner.device)).logits[0].float()


SEQS = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [11, 12, 13], "c": [20, 21, 22, 23, 24, 25, 26, 27, 28]}


def test_ragged_batched_forward_matches_full_pass(runner):
    for sid in SEQS:
        runner.add(sid)
    try:
        # Prefill chunks of different lengths in one batch, then continue out of slot order.
        outs = runner.forward(list(SEQS), [v[:3] for v in SEQS.values()])
        for toks, out in zip(SEQS.values(), outs, strict=True):
            torch.testing.assert_close(out, full_logits(runner, toks)[:3], atol=1e-5, rtol=1e-4)
        outs = runner.forward(["c", "a"], [SEQS["c"][3:], SEQS["a"][3:]])
        torch.testing.assert_close(
            outs[0], full_logits(runner, SEQS["c"])[3:], atol=1e-5, rtol=1e-4
        )
        torch.testing.assert_close(
            outs[1], full_logits(runner, SEQS["a"])[3:], atol=1e-5, rtol=1e-4
        )
        assert runner.length("a") == 7 and runner.length("b") == 3 and runner.length("c") == 9
    finally:
        for sid in SEQS:
            runner.free(sid)


def test_rollback_then_reappend_equals_fresh_prefill(runner):
    runner.add("s")
    try:
        runner.forward(["s"], [[3, 4, 5, 6]])
        runner.forward(["s"], [[7, 8, 9, 10]])  # speculative suffix ...
        runner.rollback("s", 5)  # ... of which only [7] is kept
        assert runner.length("s") == 5
        out = runner.forward(["s"], [[40, 41]])
        fresh = full_logits(runner, [3, 4, 5, 6, 7, 40, 41])[-2:]
        torch.testing.assert_close(out[0], fresh, atol=1e-5, rtol=1e-4)
    finally:
        runner.free("s")


def test_free_compacts_slots_and_keeps_other_caches(runner):
    for sid in SEQS:
        runner.add(sid)
    runner.forward(list(SEQS), list(SEQS.values()))
    runner.free("a")  # 'c' moves from the last slot into 'a's slot
    outs = runner.forward(["c", "b"], [[1], [2]])
    torch.testing.assert_close(
        outs[0][-1], full_logits(runner, [*SEQS["c"], 1])[-1], atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(
        outs[1][-1], full_logits(runner, [*SEQS["b"], 2])[-1], atol=1e-5, rtol=1e-4
    )
    runner.free("b")
    runner.free("c")
    assert runner.num_seqs == 0


def test_errors_are_clear(runner):
    runner.add("x")
    try:
        with pytest.raises(KeyError, match="already exists"):
            runner.add("x")
        with pytest.raises(ValueError, match="cannot roll"):
            runner.rollback("x", 3)
        with pytest.raises(ValueError, match="at least one token"):
            runner.forward(["x"], [[]])
        with pytest.raises(ValueError, match="max_model_len"):
            runner.forward(["x"], [list(range(90)) * 6])
        for i in range(3):
            runner.add(i)
        with pytest.raises(RuntimeError, match="max_num_seqs"):
            runner.add("overflow")
    finally:
        for sid in ["x", 0, 1, 2]:
            runner.free(sid)


# ----- absolute positions: a tiny GPT-2 (learned wpe, n_positions = GPT2_POSITIONS) -------

TOL = {"atol": 1e-5, "rtol": 1e-4}


@pytest.fixture(scope="module")
def gpt2(tiny_gpt2_target, device):
    return ModelRunner(tiny_gpt2_target, max_num_seqs=4, device=device)


def gpt2_full(runner, tokens):
    """Reference: one sequence alone through the HF model, no cache, positions 0..len-1."""
    assert len(tokens) <= GPT2_POSITIONS
    with torch.no_grad():
        return (
            runner.model(torch.tensor([tokens], device=runner.device), use_cache=False)
            .logits[0]
            .float()
        )


def _tokens(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


def test_gpt2_context_limit_comes_from_n_positions(tiny_gpt2_target, gpt2):
    assert gpt2.max_model_len == GPT2_POSITIONS
    assert ModelRunner(tiny_gpt2_target, max_model_len=4096).max_model_len == GPT2_POSITIONS
    assert ModelRunner(tiny_gpt2_target, max_model_len=40).max_model_len == 40
    gpt2.add("x")
    try:
        gpt2.forward(["x"], [_tokens(GPT2_POSITIONS, 0)])  # exactly the limit is fine
        assert gpt2.length("x") == GPT2_POSITIONS
        with pytest.raises(ValueError, match="max_model_len"):
            gpt2.forward(["x"], [[5]])
    finally:
        gpt2.free("x")


def test_gpt2_position_embeddings_matter(gpt2):
    """Guard for the tests below: a shifted position visibly changes the logits, so a
    runner that fed wrong positions to real tokens could not pass them."""
    toks = _tokens(8, 1)
    with torch.no_grad():
        ids, positions = torch.tensor([toks]), torch.arange(1, 9)[None]
        shifted = gpt2.model(ids.to(gpt2.device), position_ids=positions.to(gpt2.device)).logits
    assert not torch.allclose(shifted[0], gpt2_full(gpt2, toks), atol=1e-2)


def test_gpt2_ragged_batches_near_the_context_limit_match_full_passes(gpt2):
    """Rows of different lengths and starts in one pass, one of them ending at the
    context limit while its padded positions run past it (wpe has no entry there)."""
    seqs = {"near": _tokens(GPT2_POSITIONS, 2), "short": _tokens(20, 3), "mid": _tokens(40, 4)}
    for sid in seqs:
        gpt2.add(sid)
    try:
        # 1. Ragged prefill from a common start (padding, but no position past the limit).
        lens = {"near": 58, "short": 4, "mid": 30}
        outs = gpt2.forward(list(seqs), [seqs[s][: lens[s]] for s in seqs])
        for sid, out in zip(seqs, outs, strict=True):
            torch.testing.assert_close(out, gpt2_full(gpt2, seqs[sid][: lens[sid]]), **TOL)

        # 2. Different starts, 'near' pads from 58 to 58 + 8 - 1 = 65 >= n_positions.
        #    Out of slot order, so the rows are reordered too.
        adds = {"short": 8, "near": 3, "mid": 1}
        outs = gpt2.forward(list(adds), [seqs[s][lens[s] : lens[s] + adds[s]] for s in adds])
        for sid, out in zip(adds, outs, strict=True):
            end = lens[sid] + adds[sid]
            torch.testing.assert_close(out, gpt2_full(gpt2, seqs[sid][:end])[lens[sid] :], **TOL)
            lens[sid] = end
            assert gpt2.length(sid) == end

        # 3. Speculative-style: 'near' verifies 3 positions, keeps 1, re-appends up to the
        #    very last position (62..63) while padded to 62 + 6 - 1 = 67; its padding must not
        #    clobber the real key written at position 63 in the same pass.
        gpt2.forward(["near"], [[7, 8, 9]])  # 61..63, then rejected after the first
        gpt2.rollback("near", 62)
        near = [*seqs["near"][:61], 7, 11, 12]
        outs = gpt2.forward(["mid", "near"], [seqs["mid"][31:37], [11, 12]])
        torch.testing.assert_close(outs[0], gpt2_full(gpt2, seqs["mid"][:37])[31:], **TOL)
        torch.testing.assert_close(outs[1], gpt2_full(gpt2, near)[62:], **TOL)
        assert gpt2.length("near") == GPT2_POSITIONS

        # 4. The cache of the full row is intact: roll back and re-verify its tail alone.
        gpt2.rollback("near", 60)
        out = gpt2.forward(["near"], [near[60:]])[0]
        torch.testing.assert_close(out, gpt2_full(gpt2, near)[60:], **TOL)
    finally:
        for sid in seqs:
            gpt2.free(sid)


def test_gpt2_ragged_last_only_prefill_and_decode_near_the_limit(gpt2):
    """``prefill`` / ``forward_padded(last_only=True)``: the per-row logits_to_keep path."""
    prompts = {"p": _tokens(61, 5), "q": _tokens(6, 6)}
    logits = gpt2.prefill(list(prompts), list(prompts.values()))  # [2, vocab]
    try:
        for row, toks in enumerate(prompts.values()):
            torch.testing.assert_close(logits[row], gpt2_full(gpt2, toks)[-1], **TOL)
        # 'p' appends 2 (61, 62) padded to 61 + 5 - 1 = 65; 'q' appends 5.
        more = {"p": [20, 21], "q": [30, 31, 32, 33, 34]}
        logits = gpt2.forward_padded(list(more), list(more.values()), last_only=True)
        for row, sid in enumerate(more):
            full = gpt2_full(gpt2, prompts[sid] + more[sid])
            torch.testing.assert_close(logits[row], full[-1], **TOL)
        # One-token decode with different starts (a 4D mask, no padding).
        logits = gpt2.forward_padded(["q", "p"], [[40], [41]], last_only=True)
        torch.testing.assert_close(
            logits[0], gpt2_full(gpt2, prompts["q"] + more["q"] + [40])[-1], **TOL
        )
        torch.testing.assert_close(
            logits[1], gpt2_full(gpt2, prompts["p"] + more["p"] + [41])[-1], **TOL
        )
        assert gpt2.length("p") == GPT2_POSITIONS
    finally:
        gpt2.free("p")
        gpt2.free("q")


@pytest.fixture(scope="module")
def gpt2_proposer(tiny_gpt2_draft, device):
    return DraftModelProposer(ModelRunner(tiny_gpt2_draft, max_num_seqs=4, device=device))


def _greedy_drafts(model, tokens, k):
    """Reference drafting: argmax over a full no-cache pass, ``k`` times."""
    tokens = list(tokens)
    out = []
    with torch.no_grad():
        for _ in range(k):
            ids = torch.tensor([tokens], device=model.device)
            t = int(model(ids, use_cache=False).logits[0, -1].argmax())
            out.append(t)
            tokens.append(t)
    return out


def test_gpt2_batched_drafting_near_the_limit_matches_single_sequences(gpt2_proposer):
    """The draft resynchronises rows with different feeds and starts in one padded pass."""
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    near = SequenceState("near", _tokens(58, 7), greedy)
    short = SequenceState("short", _tokens(3, 8), greedy)
    model = gpt2_proposer.runner.model
    try:
        prop = gpt2_proposer.propose([near, short], 2)
        for row, seq in enumerate([near, short]):
            assert prop.draft_token_ids[row].tolist() == _greedy_drafts(model, seq.token_ids, 2)
        # Commit: 'near' keeps its first draft plus another token (2 new: 60 committed),
        # 'short' six unrelated ones. Next round the draft feeds 'near' 1 token at 59 and
        # 'short' 6 tokens at 3: 'near' is padded to 59 + 6 - 1 = 64 = n_positions.
        near.output_token_ids += [int(prop.draft_token_ids[0, 0]), 5]
        short.output_token_ids += [90, 91, 92, 93, 94, 95]
        prop = gpt2_proposer.propose([near, short], 3)
        for row, seq in enumerate([near, short]):
            assert prop.draft_token_ids[row].tolist() == _greedy_drafts(model, seq.token_ids, 3)
    finally:
        gpt2_proposer.free("near")
        gpt2_proposer.free("short")


GPT2_PROMPTS = [_tokens(1, 9), _tokens(40, 10), _tokens(60, 11)]


def _to_the_limit(prompt):
    """Greedy, generating until prompt + output fill the whole context (64 positions)."""
    return SamplingParams(temperature=0.0, max_tokens=GPT2_POSITIONS - len(prompt), ignore_eos=True)


@pytest.fixture(scope="module")
def gpt2_reference(gpt2):
    """Autoregressive greedy outputs, checked once against a plain no-cache greedy decode."""
    refs = [generate_autoregressive(gpt2, p, _to_the_limit(p)).token_ids for p in GPT2_PROMPTS]
    assert refs[1] == _greedy_drafts(gpt2.model, GPT2_PROMPTS[1], len(refs[1]))
    return refs


@pytest.mark.parametrize("k", [1, 3, 5])
def test_gpt2_greedy_speculative_equals_autoregressive_up_to_the_limit(
    gpt2, gpt2_proposer, gpt2_reference, k
):
    drafted = accepted = 0
    for prompt, ref in zip(GPT2_PROMPTS, gpt2_reference, strict=True):
        spec = generate_speculative(gpt2, gpt2_proposer, prompt, _to_the_limit(prompt), k)
        assert spec.token_ids == ref
        assert len(prompt) + len(spec.token_ids) == GPT2_POSITIONS
        assert spec.finish_reason == "length"
        drafted += spec.num_drafted
        accepted += spec.num_accepted
    assert 0 < accepted < drafted  # the draft neither always nor never agrees
    assert gpt2.num_seqs == 0 and gpt2_proposer.runner.num_seqs == 0


def test_transformers_minor_is_the_one_the_slot_cache_was_written_for():
    """Fails loudly when the installed transformers is not the pinned minor, and the
    check refuses other minors with the fix in its message."""
    import transformers

    from specdec.kv_cache import TRANSFORMERS_MINOR, TRANSFORMERS_MINORS, check_transformers_version

    check_transformers_version()  # the installed one
    major, minor = TRANSFORMERS_MINOR
    assert any(transformers.__version__.startswith(f"{a}.{b}.") for a, b in TRANSFORMERS_MINORS)
    assert TRANSFORMERS_MINORS == ((5, 17), (5, 23))  # the pin, and the GPU machine's
    for other in (f"{major}.{minor + 1}.0", f"{major}.{minor - 1}.2", f"{major + 1}.0.0", "dev"):
        with pytest.raises(RuntimeError, match=rf"install transformers=={major}\.{minor}\.\*"):
            check_transformers_version(other)
    for other in ("5.16.1", "5.18.0"):
        with pytest.raises(RuntimeError, match=r"tested on 5\.17\.x, 5\.23\.x"):
            check_transformers_version(other)
    check_transformers_version(f"{major}.{minor}.9")
    check_transformers_version("5.17.0")


def test_long_prefills_run_in_chunks_with_the_same_logits(tiny_target):
    """A prompt longer than prefill_chunk_size is prefilled in chunks (bounded masks)
    and gives the same last logits as one pass, ragged rows included."""
    whole = ModelRunner(tiny_target)
    chunked = ModelRunner(tiny_target, prefill_chunk_size=7)
    prompts = [list(range(3, 40)), list(range(10, 22)), [5]]
    ref = whole.prefill(["a", "b", "c"], prompts)
    out = chunked.prefill(["a", "b", "c"], prompts)
    assert torch.allclose(out, ref, atol=1e-5)
    assert [chunked.length(s) for s in "abc"] == [37, 12, 1]
    nxt = [[7], [8], [9]]
    assert torch.allclose(
        chunked.forward_padded(list("abc"), nxt), whole.forward_padded(list("abc"), nxt), atol=1e-5
    )


def test_max_model_len_defaults_to_at_most_8192(tmp_path, caplog):
    """A model with 131072 positions (Llama 3.1's) is served up to 8192 unless asked for
    more: a slot holds max_model_len tokens whatever a request uses. Below 8192 the model's
    limit stands; an explicit value is taken up to the limit."""
    import logging

    from specdec.runner import DEFAULT_MAX_MODEL_LEN
    from tests.conftest import save_tiny_llama

    path = save_tiny_llama(tmp_path, seed=0, layers=1, hidden=32)
    config = tmp_path / "config.json"
    config.write_text(
        config.read_text().replace(
            '"max_position_embeddings": 512', '"max_position_embeddings": 131072'
        )
    )
    with caplog.at_level(logging.INFO, logger="specserve.runner"):
        runner = ModelRunner(path, max_num_seqs=1)
    assert DEFAULT_MAX_MODEL_LEN == 8192 and runner.max_model_len == 8192
    assert "serving 8192 of its 131072 positions" in caplog.text
    assert ModelRunner(path, max_num_seqs=1, max_model_len=20000).max_model_len == 20000
    assert ModelRunner(path, max_num_seqs=1, max_model_len=10**6).max_model_len == 131072
    small = save_tiny_llama(tmp_path / "small", seed=0, layers=1, hidden=32)
    assert ModelRunner(small, max_num_seqs=1).max_model_len == 512


@pytest.mark.parametrize("per_row", [True, False])
def test_ragged_last_only_logits_with_either_logits_to_keep_form(runner, monkeypatch, per_row):
    """Ragged last-only passes give each row the logits after its own last token, whether
    the models take per-row positions ``[batch, 1]`` (transformers 5.2x) or only positions
    shared by every row ``[m]`` (5.17, the lent GPU machine's): the same numbers as full
    logits read at each row's end."""
    import specdec.runner

    if per_row and not specdec.runner._PER_ROW_LOGITS_TO_KEEP:
        pytest.skip("this transformers takes no per-row logits_to_keep (5.17)")
    monkeypatch.setattr(specdec.runner, "_PER_ROW_LOGITS_TO_KEEP", per_row)
    feeds = {"a": [5, 6, 7, 8, 9], "b": [10, 11], "c": [12, 13, 14], "d": [15, 16]}
    try:
        for sid in feeds:
            runner.add(sid)
        last = runner.forward_padded(list(feeds), list(feeds.values()), last_only=True)
        for sid in feeds:
            runner.rollback(sid, 0)
        full = runner.forward_padded(list(feeds), list(feeds.values()))  # [4, 5, vocab]
    finally:
        for sid in feeds:
            runner.free(sid)
    ends = [len(f) - 1 for f in feeds.values()]
    expected = full[torch.arange(len(feeds)), torch.tensor(ends)]
    torch.testing.assert_close(last, expected, rtol=1e-4, atol=1e-4)


def test_prefill_passes_stay_within_the_token_budget(tiny_target):
    """Prompts admitted together run as passes of at most ``max_num_batched_tokens``
    padded tokens (rows x longest chunk), counted at the model's own input, and give
    the same last logits as one unbounded pass."""
    from specdec.runner import _token_budget_groups

    assert _token_budget_groups([5, 5, 5, 9, 2], 12) == [[0, 1], [2], [3], [4]]
    assert _token_budget_groups([30, 1, 1], 12) == [[0], [1, 2]]
    prompts = {f"r{i}": list(range(3 + i, 3 + i + n)) for i, n in enumerate([10, 7, 13, 4, 9])}
    reference = ModelRunner(tiny_target, max_num_seqs=5)
    bounded = ModelRunner(tiny_target, max_num_seqs=5, max_num_batched_tokens=16)
    shapes = []
    bounded.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    want = reference.prefill(list(prompts), list(prompts.values()))
    got = bounded.prefill(list(prompts), list(prompts.values()))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert shapes and all(rows * n <= 16 for rows, n in shapes), shapes
    assert len(shapes) > 1  # 43 tokens over 5 rows: one pass of 5 x 13 would carry 65
    for sid, prompt in prompts.items():
        assert bounded.length(sid) == reference.length(sid) == len(prompt)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        ModelRunner(tiny_target, max_num_batched_tokens=0)


def test_the_kv_caches_sizes_are_constants_for_compiled_graphs(runner):
    """No cache tensor (nor the stack it is a view of) carries a dynamic-size mark: its
    slot count and capacity are constants of a compiled graph. Marked dynamic, the
    layers' aliasing views cost torch guards on every pair of them (specdec/kv_cache.py:
    a start from the compile cache 33 s against 24 s for the demo)."""
    tensors = [t for layer in runner.cache.layers for t in (layer.keys, layer.values)]
    tensors += [t._base for t in tensors if t._base is not None]
    assert len(tensors) > 2
    for t in tensors:
        assert not getattr(t, "_dynamo_weak_dynamic_indices", None)
        assert not getattr(t, "_dynamo_dynamic_indices", None)


def test_a_slot_copy_is_one_op_per_layout_over_all_layers(runner):
    """Fork and free copy live tokens across every layer at once: the layers' keys and
    values are views of one stacked tensor, and the forked row continues exactly as its
    source does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten.copy_.default
            return func(*args, **(kwargs or {}))

    layers = runner.cache.layers
    assert (
        len(layers) > 1 and len({layer.keys.untyped_storage().data_ptr() for layer in layers}) == 1
    )
    runner.add("src")
    try:
        runner.forward(["src"], [[5, 6, 7, 8]])
        with Copies() as copies:
            runner.fork("src", "dst")
        assert copies.count == 2  # keys and values, all layers in one op each
        a, b = runner.forward(["src", "dst"], [[9], [9]])
        torch.testing.assert_close(a, b)
    finally:
        for sid in ("src", "dst"):
            if runner.holds(sid):
                runner.free(sid)


def _sdpa_kernels(fn) -> set[str]:
    """The attention ops ``fn()`` ran (names from the profiler's CPU-side op records)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages() if "attention" in e.key}


def test_cuda_passes_never_run_cudnn_attention(tiny_target, device):
    """cuDNN's SDPA kernel builds a plan for every new shape, and a runner's keys grow
    every pass (on an H100 a 1B draft's decode step took 50 ms instead of 12): the runner's
    passes leave it out. It runs only bf16/fp16, so the runner here is bf16."""
    if torch.device(device).type != "cuda":
        pytest.skip("a choice among CUDA kernels (run with --device cuda)")
    runner = ModelRunner(
        tiny_target, max_num_seqs=2, device=device, dtype="bfloat16", execution_mode="eager"
    )
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # The check's power: with cuDNN's kernel first in PyTorch's order (as on Hopper), plain
    # SDPA on these shapes runs it and the profiler shows it.
    first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    first += [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    q = torch.randn(1, 4, 1, 16, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, 4, 9, 16, device=device, dtype=torch.bfloat16)
    with sdpa_kernel(first, set_priority=True):
        plain = _sdpa_kernels(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k))
    if not any("cudnn" in name for name in plain):
        pytest.skip(f"this GPU's SDPA does not run cuDNN's kernel here ({plain})")

    def passes():
        runner.add("s")
        runner.forward_padded(["s"], [[5, 6, 7, 8]], last_only=True)  # prefill
        for token in range(9, 13):  # decode, a new key length each
            runner.forward_padded(["s"], [[token]], last_only=True)
        runner.forward_padded(["s"], [[1, 2, 3]])  # a verification
        runner.free("s")

    with sdpa_kernel(first, set_priority=True):
        ran = _sdpa_kernels(passes)
    assert any("scaled_dot_product" in name for name in ran), ran
    assert not [name for name in ran if "cudnn" in name], ran
