"""Tensor parallelism in one machine, no Ray: rank 0 in this process, rank 1 in a process of
its own, a real gloo group between them. A model split over two ranks decodes exactly what
the whole model and transformers ``generate`` do; what cannot be split is refused with the
reason; a rank that dies fails its group's next pass instead of hanging it."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from contextlib import contextmanager
from functools import partial

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specdec.generate import generate_autoregressive, generate_speculative
from specdec.proposers import DraftModelProposer
from specdec.rank_group import DEFERRED, MIRRORED, free_port, lead, numbered, run_rank
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.shard_loading import load_shard
from specdec.tensor_parallel import ModelShard, TensorParallelError, shard_model, shard_plan
from tests.model_families import FAMILIES
from tests.specdec.test_families import prompts, reference

NEW_TOKENS = 24
# What the issue names: Llama 3 (8 query / 2 KV heads: KV split), Qwen 2.5 and Mistral (1 KV
# head: replicated on both ranks), Qwen 3 (q/k norms, head_dim of its own).
TP_FAMILIES = ["llama3", "qwen2.5", "qwen3", "mistral"]
RUNNER = {"max_model_len": 256, "max_num_seqs": 2}
SIX_HEADS = {"hidden_size": 96, "num_attention_heads": 6}


@contextmanager
def two_ranks(model: str, timeout_s: float = 30.0, follower: type = ModelRunner, **kwargs):
    """A runner of ``model`` split over two ranks: rank 0 here (yielded with rank 1's
    process), rank 1 (a ``follower``) in a spawned process following it."""
    make = partial(ModelRunner, model, **{**RUNNER, **kwargs})
    make_follower = partial(follower, model, **{**RUNNER, **kwargs})
    init = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    child = multiprocessing.get_context("spawn").Process(
        target=run_rank, args=(make_follower, 1, 2, init, "cpu", timeout_s), daemon=True
    )
    child.start()
    split = None
    try:
        split = lead(make, 2, init, "cpu", timeout_s)
        yield split, child
    finally:
        if split is not None:
            split.close()
        child.join(timeout_s)
        if child.is_alive():
            child.kill()


# ----- the plan (pure) --------------------------------------------------------------------


def _config(name: str, **overrides):
    cfg = dict(FAMILIES[name].target)
    cfg.update(overrides)
    return AutoConfig.for_model(**cfg)


def test_plans_split_or_replicate_kv_heads():
    llama = shard_plan(_config("llama3"), 2)  # 8 query / 2 KV heads
    assert (llama.local_heads, llama.local_kv_heads, llama.kv_replicas) == (4, 1, 1)
    qwen = shard_plan(_config("qwen2.5"), 2)  # 4 query / 1 KV head
    assert (qwen.local_heads, qwen.local_kv_heads, qwen.kv_replicas) == (2, 1, 2)
    assert shard_plan(_config("llama3"), 8).kv_replicas == 4  # 2 KV heads on 8 ranks


@pytest.mark.parametrize(
    ("name", "size", "overrides", "reason"),
    [
        ("gpt2", 2, {}, "no tensor-parallel plan"),
        ("phi3", 2, {}, "colwise_gather_output"),  # fused qkv gathered: not applied here
        ("deepseek-v3", 2, {}, "packed_colwise"),  # experts
        ("llama3", 3, {}, "8 attention heads do not split over 3"),
        ("llama3", 4, {"num_key_value_heads": 8}, None),  # (a valid one, for contrast)
        ("llama3", 2, {**SIX_HEADS, "num_key_value_heads": 3}, "3 key/value"),
        ("llama3", 2, {"intermediate_size": 255}, "255 features"),
        ("llama3", 0, {}, ">= 1"),
    ],
)
def test_plans_refuse_what_they_cannot_split(name, size, overrides, reason):
    config = _config(name, **overrides)
    if reason is None:
        assert shard_plan(config, size).world_size == size
        return
    with pytest.raises(TensorParallelError, match=reason):
        shard_plan(config, size)


def test_shards_put_back_together_are_the_model(family_models):
    """Each rank's slices of every planned layer, laid side by side, are the whole layer's
    weights: rows for column-wise layers (per KV head where it is replicated), columns for
    row-wise ones. (No pass runs: no sum is asked for.)"""
    for name in ("llama3", "qwen2.5"):
        target = family_models[name][0]
        whole = AutoModelForCausalLM.from_pretrained(target)
        plan = shard_plan(whole.config, 2)
        ranks = []
        for rank in range(2):
            model = AutoModelForCausalLM.from_pretrained(target)
            shard_model(model, plan, rank, all_reduce=_never)
            ranks.append(model.model.layers[0])
        layer = whole.model.layers[0]
        for proj, dim in (("q_proj", 0), ("o_proj", 1)):
            parts = [getattr(r.self_attn, proj).weight for r in ranks]
            assert torch.equal(torch.cat(parts, dim), getattr(layer.self_attn, proj).weight)
        for proj, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            parts = [getattr(r.mlp, proj).weight for r in ranks]
            assert torch.equal(torch.cat(parts, dim), getattr(layer.mlp, proj).weight)
        k = [r.self_attn.k_proj.weight for r in ranks]
        if plan.kv_replicas > 1:  # every rank holds the one KV head
            assert all(torch.equal(w, layer.self_attn.k_proj.weight) for w in k)
        else:
            assert torch.equal(torch.cat(k, 0), layer.self_attn.k_proj.weight)


def _never(tensor: torch.Tensor) -> None:
    raise AssertionError("no pass was expected")


def test_tensor_parallel_refuses_compiled_execution(family_models):
    class Alone:  # a group of two that is never joined: refused before anything runs
        world_size, rank = 2, 0
        all_reduce = staticmethod(_never)
        min_over_ranks = staticmethod(lambda n: n)

    with pytest.raises(TensorParallelError, match="runs eager"):
        ModelRunner(family_models["llama3"][0], execution_mode="torch_compile", shard=Alone())


# ----- two ranks ----------------------------------------------------------------------------


class PassCounter:
    """A split runner as its user sees it, counting the calls that run a pass."""

    def __init__(self, runner):
        self._runner, self.passes = runner, 0

    def __getattr__(self, name: str):
        attr = getattr(self._runner, name)
        if name not in MIRRORED - DEFERRED:
            return attr

        def counted(*args, **kwargs):
            self.passes += 1
            return attr(*args, **kwargs)

        return counted


@pytest.mark.parametrize("name", TP_FAMILIES)
def test_two_ranks_decode_what_the_whole_model_and_generate_do(name, family_models):
    target_dir, draft_dir, tok_dir = family_models[name]
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(target_dir)
    whole = ModelRunner(target_dir, **RUNNER)
    prompt = prompts(tokenizer)[0]
    expected = reference(hf, prompt, new_tokens=NEW_TOKENS)
    assert generate_autoregressive(whole, prompt, params).token_ids == expected
    with two_ranks(target_dir) as (split, child):
        plan = shard_plan(split.config, 2)  # each rank caches its share of the KV heads
        assert split.kv_bytes_per_token * plan.num_kv_heads == (
            whole.kv_bytes_per_token * plan.local_kv_heads
        )
        assert generate_autoregressive(split, prompt, params).token_ids == expected
        # Speculative decoding with a whole draft beside the split target: the same text,
        # each pass one broadcast that carries the bookkeeping since the last (rollbacks).
        draft = ModelRunner(draft_dir, **RUNNER)
        proposer = DraftModelProposer(
            draft, vocab_limit=min(split.vocab_size, draft.vocab_size, len(tokenizer))
        )
        counted, group = PassCounter(split), split.group
        before = (group.messages, group.calls)
        spec = generate_speculative(counted, proposer, prompt, params, 4)
        assert spec.token_ids == expected
        assert spec.num_accepted > 0
        assert group.messages - before[0] == counted.passes
        assert group.calls - before[1] > counted.passes  # bookkeeping rode along
        split.stop_followers()
        child.join(30)
        assert child.exitcode == 0


@pytest.mark.parametrize("name", ["llama3", "qwen2.5"])
def test_a_split_draft_drafts_what_the_whole_draft_does(name, family_models):
    """The draft split over two ranks (as a draft worker holds it: rank 0 of its own group,
    no every-position logits): alone it decodes the whole draft's greedy tokens, and
    beside a whole target speculative decoding gives the target's greedy text, with about
    the drafts the whole draft had accepted accepted again, each draft pass one broadcast."""
    target_dir, draft_dir, tok_dir = family_models[name]
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt = prompts(tokenizer)[1]
    expected = reference(AutoModelForCausalLM.from_pretrained(target_dir), prompt, NEW_TOKENS)
    target = ModelRunner(target_dir, **RUNNER)
    limit = min(target.vocab_size, len(tokenizer))
    whole_draft = ModelRunner(draft_dir, **RUNNER, verifies=False)
    drafts_alone = generate_autoregressive(whole_draft, prompt, params).token_ids
    want = generate_speculative(
        target, DraftModelProposer(whole_draft, vocab_limit=limit), prompt, params, 4
    )
    assert want.token_ids == expected and want.num_accepted > 0
    with two_ranks(draft_dir, verifies=False) as (split, child):
        assert generate_autoregressive(split, prompt, params).token_ids == drafts_alone
        counted, before = PassCounter(split), split.group.messages
        proposer = DraftModelProposer(counted, vocab_limit=min(limit, split.vocab_size))
        got = generate_speculative(ModelRunner(target_dir, **RUNNER), proposer, prompt, params, 4)
        assert got.token_ids == expected
        # (sums in another order: a near tie may flip a draft, not the text)
        assert abs(got.num_accepted - want.num_accepted) <= 2, (got, want)
        assert split.group.messages - before == counted.passes > 0
        split.stop_followers()
        child.join(30)
        assert child.exitcode == 0


def test_a_rank_that_dies_fails_the_next_pass(family_models):
    """Rank 1 is killed between two passes: rank 0's next pass raises (its sum has no peer)
    (at the latest when the group's timeout expires), instead of waiting for ever."""
    target_dir = family_models["llama3"][0]
    with two_ranks(target_dir, timeout_s=20.0) as (split, child):
        split.prefill(["a"], [[1, 2, 3]])
        child.kill()
        child.join(10)
        with pytest.raises(RuntimeError):
            split.forward(["a"], [[4]])


def test_ranks_wait_idle_past_the_timeout(family_models):
    """The other ranks wait for rank 0's next call without a limit: idle for longer than
    the group's timeout (a server between requests), the group still serves; the timeout
    bounds only a pass that has begun."""
    target_dir = family_models["llama3"][0]
    with two_ranks(target_dir, timeout_s=2.0) as (split, child):
        first = split.prefill(["a"], [[1, 2, 3]])
        time.sleep(4.0)  # idle: what is under test, not a stand-in for work
        assert child.is_alive()
        second = split.forward(["a"], [[4]])[0]
        assert first.shape[-1] == second.shape[-1]
        split.stop_followers()
        child.join(30)
        assert child.exitcode == 0


@pytest.mark.parametrize("name", ["llama3", "qwen2.5", "qwen3"])
def test_a_rank_reads_only_its_share_of_the_checkpoint(name, family_models):
    """Read by parts (shapes on the meta device, rows or columns from the safetensors
    file), a rank's model is the whole model cut to its share: every parameter and buffer
    equal, the tied head (Qwen 3) tied, the replicated KV head (Qwen 2.5) whole, the
    generation config (its EOS ids) the checkpoint's."""
    target = family_models[name][0]
    config = AutoConfig.from_pretrained(target)
    plan = shard_plan(config, 2)
    for rank in range(2):
        shard = ModelShard(2, rank, _never, lambda n: n)
        part = load_shard(target, config, plan, shard, torch.float32, torch.device("cpu"))
        assert part is not None
        whole = AutoModelForCausalLM.from_pretrained(target)
        shard_model(whole, plan, rank, all_reduce=_never)
        got, want = part.state_dict(), whole.state_dict()
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), (name, rank, key)
        head, embed = part.get_output_embeddings(), part.get_input_embeddings()
        assert (head.weight is embed.weight) == bool(config.tie_word_embeddings)
        assert part.generation_config.eos_token_id == whole.generation_config.eos_token_id


def test_a_call_that_fails_on_every_rank_leaves_the_group_in_step(family_models):
    """A pass for a sequence no rank holds raises on every rank before any sum: the
    group checks that all raised alike and stays usable (the engine then fails that
    request alone); the same pass again still fails, and a good one still decodes. A call
    that cannot be mirrored (new weights, which come whole) is refused."""
    target_dir = family_models["llama3"][0]
    whole = ModelRunner(target_dir, **RUNNER)
    expected = whole.prefill(["a"], [[1, 2, 3]])
    with two_ranks(target_dir) as (split, child):
        for _ in range(2):
            with pytest.raises(Exception):  # noqa: B017 (whatever the runner raises for it)
                split.forward(["nobody"], [[4]])
            assert not split.broken
        # Bookkeeping that fails here changed nothing and is not sent.
        messages = split.group.messages
        with pytest.raises(KeyError):
            split.free("nobody")
        split.add("b")  # (these ride on the next pass)
        with pytest.raises(ValueError):
            split.rollback("b", 5)  # past its length
        split.free("b")
        assert not split.broken and split.group.messages == messages
        assert torch.allclose(split.prefill(["a"], [[1, 2, 3]]), expected, atol=1e-5)
        with pytest.raises(AttributeError, match="split over ranks"):
            split.load_weights({})
        split.stop_followers()
        child.join(30)
        assert child.exitcode == 0


class RaisesAfterItsSums(ModelRunner):
    """Rank 1's runner below: its second decode pass runs whole, its sums with rank 0's
    included, then raises on this rank alone, as an out-of-memory error in what follows
    the last sum (the logits' float copy) would. (Spawned: found by its module's name.)"""

    passes = 0

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        type(self).passes += 1
        if type(self).passes == 2:
            raise MemoryError("after its last sum, on rank 1 alone")
        return out


def test_a_call_that_fails_on_one_rank_after_its_sums_fails_the_group(family_models):
    """Rank 1 raises after its pass's last sum, so rank 0's pass returns and rank 0 goes
    on without a check: rank 1 may now hold a cache out of step with rank 0's, and every
    later sum would mix wrong shares in silence. Its loop fails at rank 0's next call
    instead, and rank 0's next pass raises: the group fails together."""
    target_dir = family_models["llama3"][0]
    with two_ranks(target_dir, timeout_s=10.0, follower=RaisesAfterItsSums) as (split, child):
        split.prefill(["a"], [[1, 2, 3]])
        split.forward(["a"], [[4]])
        split.forward(["a"], [[5]])  # rank 1 raises after its sums; rank 0 returns
        with pytest.raises(RuntimeError):
            split.forward(["a"], [[6]])
        assert split.broken
        child.join(30)
        assert child.exitcode not in (None, 0)  # rank 1's loop raised: it left the group


def test_a_bare_cuda_device_is_the_current_one():
    """A worker whose GPU Ray assigned asks for ``cuda``: its group joins on the current
    CUDA device, with the index ``torch.cuda.set_device`` needs; other devices as given."""
    assert numbered(torch.device("cuda"), current=lambda: 3) == torch.device("cuda", 3)
    assert numbered(torch.device("cuda", 1), current=lambda: 3) == torch.device("cuda", 1)
    assert numbered(torch.device("cpu")) == torch.device("cpu")


def test_a_rank_that_hangs_fails_the_pass_at_the_timeout(family_models):
    """Rank 1 is stopped (SIGSTOP: alive, answering nothing) between two passes: rank 0's
    next pass raises when the group's timeout expires, instead of waiting for ever."""
    target_dir = family_models["llama3"][0]
    with two_ranks(target_dir, timeout_s=3.0) as (split, child):
        split.prefill(["a"], [[1, 2, 3]])
        os.kill(child.pid, signal.SIGSTOP)
        try:
            with pytest.raises(RuntimeError):
                split.forward(["a"], [[4]])
            assert split.broken  # out of step for good: the core would exit
        finally:
            child.kill()
