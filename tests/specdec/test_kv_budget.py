"""The KV budget: slot arithmetic (pure), and a runner that allocates once and never grows."""

import pytest
import torch

from specdec.kv_budget import GiB, KVBudgetError, budget_bytes, plan_slots
from specdec.peak_memory import PeakMemory
from specdec.proposers import DraftModelProposer
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.speculation_cache import SpeculativeDrafter

# ----- the arithmetic ----------------------------------------------------------------------


def test_llama_8b_at_8k_is_one_gib_a_slot():
    # 32 layers x 8 KV heads x 128 dims x (K + V) x 2 bytes (bf16) = 128 KiB per token.
    per_token = 32 * 8 * 128 * 2 * 2
    plan = plan_slots(per_token, 8192, 32, budget=int(60 * GiB), free_bytes=int(64 * GiB))
    assert plan.bytes_per_slot == GiB
    assert plan.num_slots == 32 and plan.total_bytes == 32 * GiB  # capped at what is wanted
    tight = plan_slots(per_token, 8192, 32, budget=int(6.5 * GiB), free_bytes=int(7 * GiB))
    assert tight.num_slots == 6  # fewer than max_num_seqs: the rest wait


def test_the_activation_reserve_is_never_the_caches():
    per_token = 32 * 8 * 128 * 2 * 2  # 1 GiB a slot at 8192
    # Sized to what is wanted: 4 slots fit 6 GiB free, not 6 GiB less a 3 GiB reserve.
    assert plan_slots(per_token, 8192, 4, None, 6 * GiB).num_slots == 4
    with pytest.raises(KVBudgetError, match=r"3\.00 GiB free once 3\.00 GiB is kept"):
        plan_slots(per_token, 8192, 4, None, 6 * GiB, reserved_bytes=3 * GiB)
    # A budget in bytes that the reserve leaves no room for is refused, with both figures.
    with pytest.raises(KVBudgetError, match="kept for the passes' activations"):
        plan_slots(per_token, 8192, 4, 5 * GiB, 6 * GiB, reserved_bytes=3 * GiB)
    plan = plan_slots(per_token, 8192, 4, 3 * GiB, 6 * GiB, reserved_bytes=2 * GiB)
    assert plan.num_slots == 3 and plan.reserved_bytes == 2 * GiB


def test_budget_from_bytes_or_fraction():
    assert budget_bytes(1000, None, 10**9) == 1000
    assert budget_bytes(None, 0.5, 1000) == 500
    assert budget_bytes(None, None, 1000) is None
    with pytest.raises(KVBudgetError, match="kv_cache_memory_bytes"):
        budget_bytes(None, 0.5, None)


def test_refusals_give_the_arithmetic():
    with pytest.raises(KVBudgetError, match="holds no sequence of max_model_len=8192"):
        plan_slots(131072, 8192, 4, budget=GiB // 2, free_bytes=None)
    with pytest.raises(KVBudgetError, match=r"needs 4\.00 GiB .* 2\.00 GiB free"):
        plan_slots(131072, 8192, 4, budget=None, free_bytes=2 * GiB)
    with pytest.raises(KVBudgetError, match="device has"):
        plan_slots(131072, 8192, 4, budget=8 * GiB, free_bytes=2 * GiB)
    assert plan_slots(131072, 8192, 4, budget=None, free_bytes=None).num_slots == 4


# ----- the runner ---------------------------------------------------------------------------


def _tensors(runner):
    return [(layer.keys, layer.values) for layer in runner.cache.layers]


def test_cache_is_allocated_once_at_max_model_len(tiny_target):
    runner = ModelRunner(tiny_target, max_num_seqs=3, max_model_len=64)
    before = [(k.data_ptr(), v.data_ptr()) for k, v in _tensors(runner)]
    for keys, _ in _tensors(runner):
        assert keys.shape[0] == 3 and keys.shape[2] == 64 + 1  # + the scratch column
    runner.prefill(["a", "b", "c"], [[1, 2, 3], list(range(5, 40)), [7]])
    runner.forward(["a", "b", "c"], [[4, 5, 6, 7, 8], [9], [1, 2]])  # ragged, padded
    runner.free("a")
    runner.fork("b", "b2")
    runner.forward(["c", "b2"], [list(range(10, 60)), [3]])  # b2 ends at 37, c at 53
    runner.rollback("b2", 10)
    assert [(k.data_ptr(), v.data_ptr()) for k, v in _tensors(runner)] == before
    usage = runner.kv_usage()
    assert usage["num_slots"] == 3 and usage["used_slots"] == 3
    assert usage["used_tokens"] == 36 + 53 + 10


def test_budget_sets_the_slot_count(tiny_target):
    probe = ModelRunner(tiny_target, max_num_seqs=1, max_model_len=64)
    per_slot = probe.kv_plan.bytes_per_slot
    runner = ModelRunner(
        tiny_target, max_num_seqs=8, max_model_len=64, kv_cache_memory_bytes=int(2.5 * per_slot)
    )
    assert runner.max_num_seqs == 2 and runner.kv_plan.wanted_slots == 8
    runner.add("a")
    runner.add("b")
    with pytest.raises(RuntimeError, match="KV slots"):
        runner.add("c")
    with pytest.raises(KVBudgetError, match="holds no sequence"):
        ModelRunner(tiny_target, max_model_len=64, kv_cache_memory_bytes=per_slot - 1)


def test_fork_and_free_copy_only_live_tokens(tiny_target):
    runner = ModelRunner(tiny_target, max_num_seqs=3, max_model_len=64)
    runner.prefill(["a", "b"], [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]])
    keys = runner.cache.layers[0].keys  # [slots, heads, capacity, dim]
    keys[2].fill_(7.0)  # the free slot: what a copy must leave alone past the live tokens
    runner.fork("b", "b2")  # into slot 2
    assert torch.equal(keys[2, :, :6], keys[1, :, :6])
    assert bool((keys[2, :, 6:] == 7.0).all())
    keys[0, :, 6:].fill_(-3.0)
    runner.free("a")  # the last slot (b2, 6 live tokens) moves into slot 0
    assert torch.equal(keys[0, :, :6], keys[2, :, :6])
    assert bool((keys[0, :, 6:] == -3.0).all())


def test_branches_never_take_slots_kept_for_sequences(tiny_draft):
    """The draft's branches and sequences share one budget: branches get only the slots
    not kept for sequences (main_slots), and a sequence past main_slots is refused."""
    runner = ModelRunner(tiny_draft, max_num_seqs=6, max_model_len=64)
    drafter = SpeculativeDrafter(DraftModelProposer(runner), main_slots=4)
    params = SamplingParams(temperature=1.0, seed=3)
    for i in range(2):
        drafter.add(f"s{i}", [5 + i, 6, 7], params)
    ids = ["s0", "s1"]
    drafter.propose(ids, [3, 3])
    assert drafter.branch_slots() == 6 - 4  # two sequences may still come
    branches = drafter.speculate(ids, budget=8)
    assert len(branches) == 2 and runner.num_free_slots == 2
    for i in range(2, 4):
        drafter.add(f"s{i}", [5 + i, 6, 7], params)
    assert not drafter.has_room()
    drafter.propose(["s2", "s3"], [2, 2])  # their kept slots are there
    assert runner.num_free_slots == 0 and drafter.branch_slots() == 0


# ----- the activation reserve --------------------------------------------------------------


def test_peak_memory_counts_what_a_block_allocated_at_its_peak():
    """Tensors made inside count while they live (a freed one still set the peak); views
    and in-place results of tensors from before the block count nothing."""
    before = torch.zeros(1 << 20)  # 4 MiB, from before the block
    with PeakMemory(torch.device("cpu")) as peak:
        before.add_(1)
        view = before[:1000]  # noqa: F841
        a = torch.ones(1 << 18)  # 1 MiB
        b = torch.ones(1 << 19)  # 2 MiB, live with a: 3 MiB
        del a, b
        c = torch.ones(1 << 18)  # 1 MiB: the peak stays at 3 MiB
    assert peak.bytes == 3 << 20
    assert c.shape == (1 << 18,)


def test_a_runner_keeps_its_largest_passes_peak_out_of_the_kv_budget(tiny_target):
    """The largest passes are measured at load; the plan keeps the larger peak out of the
    free memory. The verification's figure holds its logits (every position, every row,
    float32) and the sampler's copy of them, so it is at least twice that size."""
    runner = ModelRunner(
        tiny_target,
        max_num_seqs=4,
        max_model_len=256,
        max_num_batched_tokens=512,
        reserve_activations=True,
    )
    peaks = runner.activation_peaks
    assert set(peaks) == {"prefill", "verify"}
    logits = 4 * 32 * runner.vocab_size * 4  # rows x positions x vocab x float32
    assert peaks["verify"] >= 2 * logits
    # The prefill (2 rows x 256 tokens) keeps hidden states of every token.
    hidden = runner.model.config.hidden_size
    assert peaks["prefill"] >= 512 * hidden * 4
    assert runner.kv_plan.reserved_bytes == runner.activation_reserve_bytes == max(peaks.values())
    assert ModelRunner(tiny_target, max_num_seqs=4, max_model_len=256).kv_plan.reserved_bytes == 0


def test_the_reserve_covers_the_full_context_and_a_draft_keeps_no_verification_logits(
    tiny_target,
):
    """Attention's transients grow with the keys a pass reads: measured at two short
    contexts and carried to max_model_len, a longer max_model_len reserves more for the
    same rows. A draft (``verifies`` False) keeps only last-position logits: no
    sampler's copy of ``rows x positions x vocab`` logits."""

    def verify_peak(max_model_len, verifies=True):
        runner = ModelRunner(
            tiny_target,
            max_num_seqs=4,
            max_model_len=max_model_len,
            max_num_batched_tokens=256,
            reserve_activations=True,
            verifies=verifies,
        )
        return runner.activation_peaks["verify"], runner.vocab_size

    short, vocab = verify_peak(128)
    long, _ = verify_peak(2048)
    assert long > short
    drafted, _ = verify_peak(2048, verifies=False)
    assert long - drafted >= 4 * 32 * vocab * 4  # at least the sampler's copy of the logits


def test_a_colocated_pair_keeps_the_larger_of_its_two_reserves(tiny_target, tiny_draft):
    draft = ModelRunner(
        tiny_draft,
        max_num_seqs=2,
        max_model_len=128,
        defer_kv=True,
        reserve_activations=True,
        max_num_batched_tokens=4096,
    )
    target = ModelRunner(
        tiny_target,
        max_num_seqs=2,
        max_model_len=128,
        kv_shared_with=draft,
        reserve_activations=True,
        max_num_batched_tokens=128,
    )
    assert draft.activation_reserve_bytes > target.activation_reserve_bytes > 0
    assert target.kv_plan.reserved_bytes == draft.activation_reserve_bytes
    assert draft.kv_plan.reserved_bytes == target.kv_plan.reserved_bytes  # (its log says so)


def test_the_graphs_estimate_holds_their_pool_and_every_logits_buffer(tiny_target):
    """What a runner that replays CUDA graphs leaves them (``_graph_memory``, which such a
    runner measures at load, before its cache is planned; measured here by eager runners
    with no cache yet, as nothing is recorded off CUDA): the transients of the largest
    graphed pass (all rows x MAX_GRAPH_QUERY_LEN queries at max_model_len keys, growing
    with it) and one ``[rows, queries, vocab]`` logits buffer per row bucket and query
    count. (tests/specdec/test_cuda_graphs.py compares it with what recorded graphs hold
    on CUDA.)"""
    from specdec.cuda_graphs import GRAPH_POOL_SLACK, MAX_GRAPH_QUERY_LEN

    def estimate(max_model_len):
        runner = ModelRunner(tiny_target, max_model_len=max_model_len, defer_kv=True)
        return runner, runner._graph_memory(4)

    runner, short = estimate(128)
    assert runner.graph_reserve_bytes == 0  # (off CUDA: no graphs, nothing kept for them)
    graphed = ModelRunner(
        tiny_target,
        max_num_seqs=4,
        max_model_len=128,
        execution_mode="cuda_graph",
        reserve_activations=True,
    )
    assert "graphs" not in graphed.activation_peaks and graphed.graph_reserve_bytes == 0
    vocab, itemsize = runner.vocab_size, runner.model.dtype.itemsize
    buffers = (1 + 2 + 4) * sum(range(1, MAX_GRAPH_QUERY_LEN + 1)) * vocab * itemsize
    pool = short - buffers - GRAPH_POOL_SLACK
    # the pass's own logits at least (every position, every row), and its hidden states
    assert pool >= 4 * MAX_GRAPH_QUERY_LEN * (vocab + runner.model.config.hidden_size) * 4
    assert estimate(512)[1] > short  # more keys to attend (512: the tiny model's limit)
