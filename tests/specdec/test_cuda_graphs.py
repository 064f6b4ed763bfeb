"""CUDA-graph execution (specdec.cuda_graphs): padded static passes, exact as eager.

On CUDA (``--device cuda``) every pass of a graph's shape replays its recorded graph; on
a CPU nothing is recorded and the same padded passes (rows up to a bucket, keys up to a
block, padded rows writing to scratch) run eagerly, so the padding's exactness is checked
here on every machine and the recording on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer
from transformers.integrations.sdpa_attention import repeat_kv

from specdec.cuda_graphs import MAX_GRAPH_QUERY_LEN, GraphShape, batch_buckets
from specdec.host_syncs import HostSyncCounter
from specdec.proposers import DraftModelProposer
from specdec.row_attention import grouped_masked_attention
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState
from tests.specdec.test_families import assert_greedy_speculation_is_generate

GREEDY = SamplingParams(temperature=0.0)
KV_BLOCK = 16  # small, so that the passes here cross several key blocks


def graphed(path: str, device: str, **kwargs) -> ModelRunner:
    runner = ModelRunner(path, execution_mode="cuda_graph", device=device, **kwargs)
    assert runner.execution_mode == "cuda_graph"
    runner._graphs().kv_block = KV_BLOCK
    return runner


def test_batch_buckets_cover_every_row_count():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]


def test_repeated_recording_failures_turn_graphs_off(tiny_target, device, caplog):
    """A model whose passes cannot be recorded stops paying two passes and a failed
    recording for each new shape: after three failures every pass runs eager (logged),
    and each failed shape's buffers are let go."""
    runner = graphed(tiny_target, device, max_num_seqs=2, max_model_len=64)
    graphs = runner._graphs()
    shapes = [GraphShape(1, q, 16) for q in (1, 2, 3)]
    for shape in shapes[:2]:
        graphs._new_inputs(shape)
        graphs._failed(shape, RuntimeError("a host read"))
        assert not graphs.disabled and shape not in graphs.inputs
    ids = torch.zeros(1, 1, dtype=torch.long)
    args = (ids, ids, ids, torch.zeros(1, dtype=torch.long))
    assert graphs(shapes[0], *args) is None  # a failed shape: the caller runs eager
    with caplog.at_level("WARNING", logger="specserve.execution"):
        graphs._failed(shapes[2], RuntimeError("a host read"))
    assert graphs.disabled and "every pass runs eager" in caplog.text
    assert graphs(GraphShape(1, 4, 16), *args) is None
    runner.prefill(["a"], [[5, 6, 7]])  # and the runner still answers, eagerly
    assert runner.forward(["a"], [[8]])[0].shape[0] == 1


def test_grouped_masked_attention_equals_repeated_heads():
    """Folding each group's query heads into one KV head's queries is the attention of
    the KV heads repeated per query head (transformers' repeat_kv), for masks per row and
    one mask shared by the rows."""
    gen = torch.Generator().manual_seed(0)
    b, heads, kv_heads, n, kv_len, d = 3, 8, 2, 4, 11, 16
    q = torch.randn(b, heads, n, d, generator=gen)
    k = torch.randn(b, kv_heads, kv_len, d, generator=gen)
    v = torch.randn(b, kv_heads, kv_len, d + 4, generator=gen)  # values of another size
    for rows in (b, 1):
        mask = torch.rand(rows, 1, n, kv_len, generator=gen) < 0.7
        mask[..., 0] = True  # every query reads something
        want = torch.nn.functional.scaled_dot_product_attention(
            q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=mask
        ).transpose(1, 2)
        got = grouped_masked_attention(q, k, v, mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the wrong fold (groups taken query-major) is not the same attention
    wrong = grouped_masked_attention(q.transpose(1, 2).reshape(b, heads, n, d), k, v, mask)
    assert not torch.allclose(wrong, want, atol=1e-3)


def test_graph_logits_equal_eager(tiny_target, device):
    """Ragged passes of 1-3 rows (padded to buckets 1, 2, 4), 1-5 queries, keys crossing
    blocks, rows out of slot order: the same logits as the eager runner's, and every
    recording (on CUDA) succeeded, with graphs dropped past the runner's bound and
    recorded again when needed."""
    kw = dict(max_num_seqs=4, max_model_len=128)
    runner = graphed(tiny_target, device, **kw)
    runner._graphs().max_graphs = 6
    eager = ModelRunner(tiny_target, device=device, **kw)
    rng = random.Random(0)
    ids = ["a", "b", "c"]
    for r in (runner, eager):
        r.prefill(ids, [list(range(5, 5 + 3 * i + 9)) for i in range(3)])
    held = None  # a result kept across later passes must not change (no view of a buffer)
    for step in range(24):
        if step == 12:  # "a" leaves (the last slot's row moves into its place), "d" joins
            for r in (runner, eager):
                r.free("a")
                r.prefill(["d"], [list(range(20, 31))])
            ids = ["b", "c", "d"]
        rows = rng.sample(ids, rng.randint(1, 3))
        tokens = [[rng.randrange(3, 90) for _ in range(rng.randint(1, 5))] for _ in rows]
        got = runner.forward(rows, tokens)
        want = eager.forward(rows, tokens)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        if held is not None:
            torch.testing.assert_close(held[0], held[1], rtol=0, atol=0)
        held = (got[0], got[0].clone())
        for sid in rows:  # roll some back, as rejected drafts are
            back = runner.length(sid) - rng.randint(0, 2)
            runner.rollback(sid, back)
            eager.rollback(sid, back)
    # a verification longer than a graph takes runs eager, the same
    long = [list(range(30, 42))]
    torch.testing.assert_close(
        runner.forward(["b"], long)[0], eager.forward(["b"], long)[0], rtol=1e-4, atol=1e-4
    )
    graphs = runner._graphs()
    assert max(s.queries for s in graphs.inputs) <= MAX_GRAPH_QUERY_LEN < 12
    assert not graphs.failed
    assert {s.batch for s in graphs.inputs} >= {1, 2, 4}  # 3 rows ran padded to 4
    assert len({s.kv_len for s in graphs.inputs}) >= 2
    if torch.device(device).type == "cuda":
        assert set(graphs.graphs) == set(graphs.inputs) <= set(graphs.record_seconds)
        assert len(graphs.graphs) == 6 and graphs.evicted > 0


def test_a_graphed_pass_reads_nothing_from_the_device(tiny_target, device):
    """A recorded pass must not read a device value into Python (a recording would fail
    there): the runner's whole graphed pass, padding included, reads none."""
    runner = graphed(tiny_target, device, max_num_seqs=4, max_model_len=64)
    runner.prefill(["a", "b", "c"], [[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    with HostSyncCounter() as syncs:
        runner.forward_padded(["c", "a", "b"], [[1, 2], [3], [4, 5]])
        runner.forward_padded(["a"], [[6]], last_only=True)
    assert syncs.total == 0, syncs.by_site


# Grouped heads with a padded vocabulary, one window for all layers, sliding and full
# layers mixed, learned positions, latent attention (keys and values of other sizes).
GRAPH_FAMILIES = ["llama3", "qwen2.5", "mistral", "gemma3", "gpt2", "deepseek-v3"]
# Families whose forward cannot be recorded on CUDA at these tiny float32 models' settings,
# so every pass runs eager (logged), as exact: DeepSeek-V3's experts, which transformers
# runs by a loop over the experts a batch hit (``nonzero``: sizes read from the device) or
# a fallback grouped matmul off bfloat16 ("Cannot copy between CPU and CUDA tensors during
# CUDA graph capture", H200, transformers 5.17).
UNRECORDABLE_ON_CUDA = {"deepseek-v3"}


@pytest.mark.parametrize("name", GRAPH_FAMILIES)
def test_graph_greedy_speculation_equals_generate(name, family_models, device):
    """Greedy speculative decoding with target and draft on graphs gives transformers'
    greedy output (prompts longer than the windows); no recording failed."""
    target_dir, draft_dir, tok_dir = family_models[name]
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    target = graphed(target_dir, device, max_num_seqs=2, max_model_len=256)
    draft = graphed(draft_dir, device, max_num_seqs=2, max_model_len=256)
    assert_greedy_speculation_is_generate(target, draft, target_dir, tokenizer, 20)
    graphs = target._graphs()
    if torch.device(device).type == "cuda" and name in UNRECORDABLE_ON_CUDA:
        # every recording failed (logged; the passes ran eager, exact as above)
        assert graphs.failed and not graphs.record_seconds
    else:
        assert 5 in {s.queries for s in graphs.inputs}  # verifications of 4 drafts on graphs
        assert not graphs.failed and not draft._graphs().failed


def test_compiled_runners_record_inductor_graphs_on_cuda(tiny_target, tiny_draft, device):
    """On CUDA, ``torch_compile`` runners replay Inductor's kernels as CUDA graphs (one
    Inductor graph per PassShape, recorded per padded shape): the same logits as eager."""
    if torch.device(device).type != "cuda":
        pytest.skip("CUDA graphs of Inductor kernels: run with --device cuda")
    kw = dict(max_num_seqs=4, max_model_len=128, device=device)
    runner = ModelRunner(tiny_target, execution_mode="torch_compile", **kw)
    eager = ModelRunner(tiny_target, **kw)
    assert runner.execution_mode == "torch_compile" and runner._graph_mode
    runner.warm_up()
    rng = random.Random(1)
    for r in (runner, eager):
        r.prefill(["a", "b"], [list(range(5, 25)), list(range(9, 16))])
    for _ in range(12):
        rows = rng.sample(["a", "b"], rng.randint(1, 2))
        tokens = [[rng.randrange(3, 90) for _ in range(rng.randint(1, 5))] for _ in rows]
        for g, w in zip(runner.forward(rows, tokens), eager.forward(rows, tokens), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    graphs = runner._graphs()
    assert not graphs.failed and graphs.record_seconds
    assert not runner._compiled.eager_shapes


def _reserving_runner(path: str, device: str) -> ModelRunner:
    """A graphed runner of 4 slots x 512 tokens whose KV budget reserves its graphs'
    memory (skips off CUDA, where nothing is recorded)."""
    if torch.device(device).type != "cuda":
        pytest.skip("the memory of recorded CUDA graphs: run with --device cuda")
    return ModelRunner(
        path,
        max_num_seqs=4,
        max_model_len=512,
        execution_mode="cuda_graph",
        kv_cache_memory_fraction=0.5,
        reserve_activations=True,
        device=device,
    )


def test_recorded_graphs_hold_no_more_than_the_kv_budget_leaves_them(tiny_target, device):
    """The KV budget leaves a graphed runner's graphs their memory: after every pass graph
    a server can replay is recorded (each row bucket, 1 to MAX_GRAPH_QUERY_LEN queries,
    every key block), their pool and logits buffers hold no more than the reserve, which
    the plan keeps out of the cache beside the eager passes' peak."""
    runner = _reserving_runner(tiny_target, device)
    reserve = runner.graph_reserve_bytes
    assert reserve > 0
    assert runner.kv_plan.reserved_bytes == runner.activation_reserve_bytes + reserve
    # The largest pass first: every later graph's transients fit in what it left in the
    # pool (one recording stream; measured on an H200 with a stream per recording, the
    # pool grew by a pass's peak per graph: 2.1 GB for 33 graphs of an 8B target, 0.25 GB
    # with one stream).
    queries = list(range(1, MAX_GRAPH_QUERY_LEN + 1))
    runner.record_graphs([4], [MAX_GRAPH_QUERY_LEN], [512])
    graphs = runner._graphs()
    largest = graphs.pool_bytes()
    recorded = runner.record_graphs(batch_buckets(4), queries, [256, 512])
    assert len(recorded) == len(batch_buckets(4)) * len(queries) * 2  # (the first among them)
    assert 0 < graphs.pool_bytes() <= largest + (8 << 20), (graphs.pool_bytes(), largest)
    assert 0 < runner.graph_memory_bytes <= reserve


def test_draft_rounds_record_into_the_reserved_pool(tiny_draft, device):
    """A graphed draft's rounds (GraphedDraftSteps) record into its runner's pool, after
    the largest pass: rounds of 1 to 8 steps at 1 to 4 rows, 300-odd keys, add no more than
    the allocator's rounding to it, so the KV budget's reserve still holds every graph."""
    runner = _reserving_runner(tiny_draft, device)
    runner.record_graphs([4], [MAX_GRAPH_QUERY_LEN], [512])
    graphs = runner.pass_graphs
    largest = graphs.pool_bytes()
    proposer = DraftModelProposer(runner)
    rounds = proposer.fused.recorder
    assert rounds._pool == graphs._pool and rounds._stream is graphs._stream
    proposer.warm_up(top_m=4)
    seqs = [SequenceState(f"row-{i}", list(range(3, 300 + 7 * i)), GREEDY) for i in range(4)]
    for batch in (1, 2, 3, 4):
        for k in range(1, 9):
            proposal = proposer.propose(seqs[:batch], k, top_m=4)
            assert proposal.host_num_draft_tokens == [k] * batch
    assert len(rounds.graphs) >= 8 and not rounds.failed
    assert 0 < graphs.pool_bytes() <= largest + (8 << 20), (graphs.pool_bytes(), largest)
    assert 0 < runner.graph_memory_bytes <= runner.graph_reserve_bytes
