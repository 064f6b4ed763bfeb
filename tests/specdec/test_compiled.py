"""Compiled execution (specdec.execution): exact as eager, and no recompiles once warm.

A compiled runner traces its model once per pass shape at warm-up; sizes (rows, queries,
keys) are dynamic, and the runner canonicalises everything else, so rounds of any
lengths, batch compositions, draft lengths and greedy/sampled mixes run the warm graphs.
``torch._dynamo.config.error_on_recompile`` turns a recompile into a failure.
"""

from __future__ import annotations

import contextlib
import logging
import random

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from torch.overrides import TorchFunctionMode
from transformers import AutoTokenizer

from specdec.execution import (
    CompiledForward,
    PassShape,
    compile_cache_dir,
    default_execution_mode,
)
from specdec.proposers import DraftModelProposer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState
from tests.model_families import FAMILIES
from tests.specdec.test_families import assert_greedy_speculation_is_generate

ALL_SHAPES = {PassShape(r, q) for r in (True, False) for q in (True, False)}


def compiled(path: str, **kwargs) -> ModelRunner:
    runner = ModelRunner(path, execution_mode="torch_compile", **kwargs)
    assert runner.execution_mode == "torch_compile"
    return runner


@pytest.fixture(scope="module")
def warm_pair(tiny_target, tiny_draft, device):
    """A compiled target and draft (Llama, grouped-query heads), warmed up."""
    target = compiled(tiny_target, max_num_seqs=6, max_model_len=256, device=device)
    draft = compiled(tiny_draft, max_num_seqs=6, max_model_len=256, device=device)
    for runner in (target, draft):
        assert set(runner.warm_up()) == ALL_SHAPES
        assert runner.num_seqs == 0  # the warm-up's sequences are gone
    return target, draft


def run_rounds(target: ModelRunner, draft: ModelRunner, steps: int, seed: int) -> None:
    """Requests with prompts of 2-30 tokens joining and leaving, verification of changing
    row subsets (out of slot order), k from 0 to 6, greedy, sampled and seeded rows mixed,
    random acceptance and rollbacks; every sequence freed at the end."""
    proposer = DraftModelProposer(draft, min_confidence=0.3)
    proposer.fused = None  # the runner's graphs alone (fused steps: test_draft_steps.py)
    rng = random.Random(seed)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=5, seed=11),
    ]
    live: dict[str, SequenceState] = {}
    for step in range(steps):
        if len(live) < 5 and rng.random() < 0.5:  # a request joins
            sid = f"s{step}"
            prompt = [rng.randrange(3, 90) for _ in range(rng.randrange(2, 30))]
            live[sid] = SequenceState(sid, prompt, kinds[step % 3], device=target.device)
            target.prefill([sid], [prompt[:-1]])
        if not live:
            continue
        rows = rng.sample(sorted(live), rng.randint(1, len(live)))
        seqs = [live[sid] for sid in rows]
        proposal = proposer.propose(seqs, rng.randint(0, 6))
        counts = proposal.host_num_draft_tokens
        drafts = proposal.host_draft_token_ids
        feed = [[s.last_token_id, *d[:n]] for s, d, n in zip(seqs, drafts, counts, strict=True)]
        starts = [target.length(sid) for sid in rows]
        logits = target.forward(rows, feed)
        assert [t.shape[0] for t in logits] == [len(f) for f in feed]
        accepted = [rng.randint(0, n) for n in counts]
        proposer.observe(seqs, accepted)
        for sid, seq, start, a, f in zip(rows, seqs, starts, accepted, feed, strict=True):
            target.rollback(sid, start + 1 + a)
            seq.append([*f[1 : 1 + a], rng.randrange(3, 90)], None)
        if len(live) > 2 and rng.random() < 0.3:  # a request leaves
            sid = rng.choice(sorted(live))
            target.free(sid)
            proposer.free(sid)
            del live[sid]
    for sid in list(live):
        target.free(sid)
        proposer.free(sid)


@pytest.mark.parametrize("trust", [False, True], ids=["every-guard", "input-guards"])
def test_rounds_of_every_composition_never_recompile(warm_pair, trust):
    """Every guard checked (``trust_warm_guards`` off): a Python value a graph was
    specialised on that varied between rounds would recompile here, an error. Then as
    served (the warm graphs' input tensors' guards alone): the same rounds run."""
    target, draft = warm_pair
    for runner in warm_pair:
        runner._compiled.trust_warm_guards = trust
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            run_rounds(target, draft, steps=40, seed=0)
    finally:
        for runner in warm_pair:
            runner._compiled.trust_warm_guards = True
    for runner in warm_pair:
        assert runner.compile_seconds.keys() == ALL_SHAPES
        assert not runner._compiled.eager_shapes


def test_rounds_past_a_sliding_window_never_recompile(family_models, device):
    """Mistral's window (12 here) is crossed by every sequence: still the same graphs."""
    target_dir, draft_dir, _ = family_models["mistral"]
    target = compiled(target_dir, max_num_seqs=6, max_model_len=256, device=device)
    draft = compiled(draft_dir, max_num_seqs=6, max_model_len=256, device=device)
    for runner in (target, draft):
        assert runner.attention.has_sliding
        assert set(runner.warm_up()) == ALL_SHAPES
        runner._compiled.trust_warm_guards = False  # every guard: a recompile is seen
    with torch._dynamo.config.patch(error_on_recompile=True):
        run_rounds(target, draft, steps=40, seed=1)
    for runner in (target, draft):  # (a frozen graph that missed would have gone eager)
        assert not runner._compiled.eager_shapes


class _PassThrough(TorchFunctionMode):
    """A function mode that changes nothing (as a profiler's or a counter's would)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_warm_graph_whose_guards_miss_runs_eager_instead_of_compiling(
    tiny_target, device, caplog
):
    """After warm-up nothing compiles in a request: a pass the graph was not made for (here
    under a function mode, which its guards check) runs eager, logged, with the same
    logits, and its shape stays eager."""
    target = compiled(tiny_target, max_num_seqs=2, max_model_len=64, device=device)
    target.warm_up()
    eager = ModelRunner(tiny_target, max_num_seqs=2, max_model_len=64, device=device)
    for runner in (target, eager):
        runner.prefill(["a"], [list(range(5, 15))])
    with _PassThrough(), caplog.at_level(logging.WARNING, logger="specserve.execution"):
        got = target.forward(["a"], [[7, 8]])[0]
    torch.testing.assert_close(got, eager.forward(["a"], [[7, 8]])[0], rtol=1e-4, atol=1e-4)
    assert target._compiled.eager_shapes == {PassShape(True, False)}
    assert "runs eager" in caplog.text


def test_a_warm_graph_checks_no_python_value_unless_every_guard_is_asked():
    """Once frozen, a warm graph checks its input tensors' guards alone: a Python value
    it was specialised on (here a flag) is not checked, and the warm graph runs whatever
    it is (so everything that picks a graph must be in its shape key). Asked for every
    guard (``every_guard``: a pass recorded once; ``trust_warm_guards`` off: the tests of
    recompiles), the changed value misses the graph and the shape runs eager, exact."""
    for ask in ("every_guard", "untrusted"):
        graphs = CompiledForward(lambda x, negate: -x if negate else x + 0, f"flag-{ask}")
        x = torch.ones(3)
        assert graphs("s", [], x=x, negate=False).tolist() == [1.0] * 3
        graphs.freeze()
        assert graphs("s", [], x=x, negate=True).tolist() == [1.0] * 3  # unchecked: stale
        if ask == "untrusted":
            graphs.trust_warm_guards = False
        with graphs.every_guard() if ask == "every_guard" else contextlib.nullcontext():
            assert graphs("s", [], x=x, negate=True).tolist() == [-1.0] * 3
        assert graphs.eager_shapes == {"s"}


def _skips_guards(graphs, shape) -> bool:
    """Whether a call of ``shape`` would evaluate only its input tensors' guards."""
    with graphs._guard_stance(shape):
        return torch._dynamo.eval_frame._is_skip_guard_eval_unsafe_stance()


def test_warm_graphs_check_their_inputs_alone_and_an_unbuilt_shape_runs_eager(
    tiny_target, device, caplog
):
    """Once frozen, a shape the warm-up built is called with the guards on its input
    tensors alone (those on parameters and module attributes, which cannot change once
    warm, skipped: ``CompiledForward._guard_stance``); a shape it did not build, or a call
    under a function mode, has every guard evaluated, so it misses and runs eager with
    eager's logits instead of running another shape's graph. The built shape's graph keeps
    giving eager's logits."""
    target = compiled(tiny_target, max_num_seqs=2, max_model_len=64, device=device)
    eager = ModelRunner(tiny_target, max_num_seqs=2, max_model_len=64, device=device)
    prompt = list(range(5, 45))  # longer than max_compiled_query_len: an eager prefill
    for runner in (target, eager):
        runner.prefill(["a"], [prompt])
    graphs = target._compiled
    decode, verify = PassShape(True, True), PassShape(True, False)

    def same(tokens: list[int]) -> None:
        got = target.forward(["a"], [tokens])[0]
        torch.testing.assert_close(got, eager.forward(["a"], [tokens])[0], rtol=1e-4, atol=1e-4)

    same([7])  # builds the one-row decode graph alone
    graphs.freeze()  # as a warm-up leaves it
    assert set(target.compile_seconds) == {decode}
    assert _skips_guards(graphs, decode)
    assert not _skips_guards(graphs, verify)
    with _PassThrough():
        assert not _skips_guards(graphs, decode)
    with caplog.at_level(logging.WARNING, logger="specserve.execution"):
        same([8, 9])  # a shape never built
    assert graphs.eager_shapes == {verify} and "runs eager" in caplog.text
    for token in (3, 4, 5):
        same([token])
    assert graphs.eager_shapes == {verify}


def test_compiled_logits_equal_eager(warm_pair, tiny_target, device):
    """The same ragged passes through the graphs and eagerly: the same logits."""
    target, _ = warm_pair
    eager = ModelRunner(tiny_target, max_num_seqs=6, max_model_len=256, device=device)
    for runner in (target, eager):
        runner.prefill(["a", "b"], [list(range(5, 25)), list(range(9, 16))])
    passes = [
        (["a"], [[7]]),
        (["b", "a"], [[7], [8]]),
        (["a", "b"], [[7, 3, 4], [8]]),
        (["b"], [[7, 3, 4, 5, 6]]),
    ]
    try:
        for ids, tokens in passes:
            got = target.forward(ids, tokens)
            want = eager.forward(ids, tokens)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    finally:
        for runner in (target, eager):
            for sid in ("a", "b"):
                runner.free(sid)


def test_each_runner_keeps_its_graphs_to_itself(warm_pair):
    """A target and a draft of one class (one ``forward`` code object in transformers) keep
    their graphs apart: each runner's own code object holds its graphs, one per shape, and
    nothing else (shared, every pass would search the other's guards too, and a process
    building many runners would reach torch's limit of graphs per code object)."""
    target, draft = warm_pair
    assert type(target.model).forward is type(draft.model).forward
    assert target._compiled.code is not draft._compiled.code
    for runner in (target, draft):
        entries = _debug_get_cache_entry_list(runner._compiled.code)
        assert len(entries) == len(runner.compile_seconds) == len(ALL_SHAPES)


def test_a_restarted_runner_gets_its_graphs_from_the_compile_cache(warm_pair, tiny_target, device):
    """A runner of the same model and settings as one that compiled (a restart) gets
    every graph from Inductor's cache and generates none. (The KV cache's slot count and
    capacity are constants of the graphs: a runner with other ``max_num_seqs`` or
    ``max_model_len`` compiles its own, see ``specdec/kv_cache.py``.)"""
    before = {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")}

    def new(group: str, name: str) -> int:
        return counters[group][name] - before.get(group, {}).get(name, 0)

    other = compiled(tiny_target, max_num_seqs=6, max_model_len=256, device=device)
    assert set(other.warm_up()) == ALL_SHAPES
    assert new("inductor", "fxgraph_cache_miss") == 0
    hits = new("inductor", "fxgraph_cache_hit") + new("aot_autograd", "autograd_cache_hit")
    assert hits >= len(ALL_SHAPES)


def test_weights_loaded_into_a_compiled_draft_reach_its_graphs(warm_pair, tiny_target, device):
    """New weights are copied into the parameters in place, so the graphs built before
    compute with them: the compiled draft given the target's weights gives the eager
    target's logits, with no recompile (the draft's own weights restored after)."""
    _, draft = warm_pair
    own = {k: v.clone() for k, v in draft.model.state_dict().items()}
    eager = ModelRunner(tiny_target, max_num_seqs=6, max_model_len=256, device=device)
    draft.load_weights(eager.model.state_dict())
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for runner in (draft, eager):
                runner.prefill(["a", "b"], [list(range(5, 25)), list(range(9, 16))])
            for ids, tokens in ((["a"], [[7]]), (["b", "a"], [[7, 3], [8]])):
                got, want = draft.forward(ids, tokens), eager.forward(ids, tokens)
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    finally:
        draft.load_weights(own)
        for runner in (draft, eager):
            for sid in ("a", "b"):
                if sid in runner.seq_ids:
                    runner.free(sid)


# Families whose attention SDPA cannot compute (Gemma 2's soft-capping) attend by 4-D masks
# and run eager even when asked to compile (specdec.execution).
EAGER_FAMILIES = {"gemma2"}


# Each family's modules once: Kimi K2's are DeepSeek-V3's (its vocabulary and YaRN factor
# are checked eager, tests/specdec/test_families.py and over HTTP), and the Qwen 2 draft's
# pair has the Llama 3 target (drafts run eager here).
COMPILED_FAMILIES = [f for f in FAMILIES if f not in {"kimi-k2", "llama3-qwen2-draft"}]


@pytest.mark.parametrize("name", COMPILED_FAMILIES)
def test_compiled_family_greedy_equals_generate(name, family_models, device):
    """Speculative decoding on compiled graphs gives transformers' greedy output for every
    family of the matrix: grouped-query heads (Llama 3), padded untied vocabularies
    (Qwen 2.5), one window for every layer (Mistral), sliding and full layers mixed
    (Gemma 3), learned positions (GPT-2), latent attention with keys and values of
    different sizes (DeepSeek-V3, Kimi K2), ...; the prompts are longer than the windows."""
    target_dir, draft_dir, tok_dir = family_models[name]
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    mode = "eager" if name in EAGER_FAMILIES else "torch_compile"
    kw = dict(max_model_len=512, max_num_seqs=2, device=device)
    target = ModelRunner(target_dir, execution_mode="torch_compile", **kw)
    assert target.execution_mode == mode
    # The draft eager: which drafts are proposed never changes the greedy output, so each
    # family's exactness rests on the target's graphs (compiled drafts, fused steps
    # included, are compared with eager ones in test_draft_steps.py, for three families).
    draft = ModelRunner(draft_dir, execution_mode="eager", **kw)
    assert_greedy_speculation_is_generate(target, draft, target_dir, tokenizer, 16)
    if mode == "torch_compile":
        assert target.compile_seconds and not target._compiled.eager_shapes
        # (in a process that compiled other families' models before: none of theirs here)
        entries = _debug_get_cache_entry_list(target._compiled.code)
        assert len(entries) == len(target.compile_seconds)


def test_settings_and_cache_dir(tmp_path, tiny_draft):
    with pytest.raises(ValueError, match="execution_mode"):
        ModelRunner(tiny_draft, execution_mode="fast")
    assert default_execution_mode("cpu") == "torch_compile"
    assert default_execution_mode("cuda") == "cuda_graph"
    path = compile_cache_dir(tmp_path)
    assert path.parent == tmp_path and torch.__version__.split("+")[0] in path.name
    eager = ModelRunner(tiny_draft)
    assert eager.execution_mode == "eager" and eager.warm_up() == {}
