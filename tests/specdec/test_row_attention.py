"""Attention by row positions against the reference path of 4-D masks (pure, no Ray).

The same random weights run through two runners, one per attention backend, over every
shape of pass the engine makes: prefill from position 0, ragged prefill chunks, one-token
decode at a common end and at ragged ends, multi-token verification with padded rows,
sequences longer than a sliding window. Grouped-query models must attend on their KV heads
as stored (no copy out to every query head) and without a mask where none is needed.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig, AutoModelForCausalLM

from specdec.row_attention import ROW_ATTENTION
from specdec.runner import ModelRunner

GQA = {  # Llama 3's 4:1 grouping at toy size
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
SLIDING = {  # every layer slides over 6 keys, grouped 2:1
    **GQA,
    "model_type": "mistral",
    "num_key_value_heads": 4,
    "sliding_window": 6,
}
MIXED = {  # Qwen 2 with a sliding layer and a full one
    **GQA,
    "model_type": "qwen2",
    "use_sliding_window": True,
    "sliding_window": 5,
    "max_window_layers": 1,
    "layer_types": ["full_attention", "sliding_attention"],
}


def _model(cfg: dict, seed: int = 0):
    kwargs = dict(cfg)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _pair(cfg: dict) -> tuple[ModelRunner, ModelRunner]:
    """Two runners over the same weights: attention by rows, and the masks reference."""
    rows = ModelRunner(_model(cfg), max_num_seqs=4, max_model_len=64)
    masks = ModelRunner(_model(cfg), max_num_seqs=4, max_model_len=64, attention_backend="masks")
    assert rows._row_attention and not masks._row_attention
    assert rows.model.config._attn_implementation == ROW_ATTENTION
    return rows, masks


# Each step: (sequence ids, tokens appended to each); covers every kind of pass.
STEPS = [
    (["a", "b", "c"], [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15, 16, 17]]),
    (["a", "b"], [[20], [21]]),  # decode at a common end (no mask)
    (["c", "a"], [[22, 23, 24, 25, 26], [27]]),  # ragged: padded queries
    (["a", "b", "c"], [[30], [31], [32]]),  # decode at ragged ends
    (["b", "a"], [[40, 41, 42, 43, 44], [45, 46, 47, 48, 49]]),  # verify, k + 1 = 5
    (["c"], [[50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]]),  # past every window
]


@pytest.mark.parametrize("cfg", [GQA, SLIDING, MIXED], ids=["llama-gqa", "mistral", "qwen2"])
def test_rows_equal_the_mask_reference_on_every_kind_of_pass(cfg):
    rows, masks = _pair(cfg)
    for runner in (rows, masks):
        for sid in "abc":
            runner.add(sid)
    for step, (ids, toks) in enumerate(STEPS):
        got = rows.forward(ids, toks)
        want = masks.forward(ids, toks)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=f"step {step}")
        if step == 2:  # a rollback, as after a rejection, then the same again
            for runner in (rows, masks):
                runner.rollback("c", 5)
            torch.testing.assert_close(
                rows.forward(["c"], [[70, 71]])[0], masks.forward(["c"], [[70, 71]])[0]
            )
    for sid in "abc":
        assert rows.length(sid) == masks.length(sid)


def test_a_sliding_window_is_applied(tmp_path):
    """The window must bite: the same tokens with a wide window give other logits."""
    narrow = ModelRunner(_model(SLIDING), max_num_seqs=1, max_model_len=64)
    wide = ModelRunner(_model({**SLIDING, "sliding_window": 64}), max_num_seqs=1, max_model_len=64)
    toks = list(range(1, 21))
    for runner in (narrow, wide):
        runner.add("s")
    assert not torch.allclose(narrow.forward(["s"], [toks])[0], wide.forward(["s"], [toks])[0])


class _SDPACalls(TorchFunctionMode):
    """Records each scaled_dot_product_attention call's key heads and mask."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[int, int, torch.Tensor | None, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query, key = args[0], args[1]
            self.calls.append(
                (query.shape[1], key.shape[1], kwargs.get("attn_mask"), kwargs.get("is_causal"))
            )
        return func(*args, **kwargs)


def test_grouped_query_attention_reads_kv_heads_in_place():
    rows, masks = _pair(GQA)
    heads, kv_heads = GQA["num_attention_heads"], GQA["num_key_value_heads"]
    for runner in (rows, masks):
        runner.add("a")
        runner.add("b")
    seen = {}
    for name, runner in (("rows", rows), ("masks", masks)):
        with _SDPACalls() as mode:
            runner.forward(["a", "b"], [[1, 2, 3, 4], [5, 6, 7]])  # ragged prefill
            runner.forward(["a", "b"], [[8, 9], [10, 11]])  # verify at ragged ends
        seen[name] = mode.calls
    assert len(seen["rows"]) == 2 * GQA["num_hidden_layers"]
    assert all(q == heads and k == kv_heads for q, k, _, _ in seen["rows"])
    # The reference copies keys out to every query head: what the rows path saves.
    assert all(k == heads for _, k, _, _ in seen["masks"])


def test_no_mask_where_each_query_reads_its_own_prefix():
    rows, _ = _pair(GQA)
    rows.add("a")
    rows.add("b")
    with _SDPACalls() as mode:
        rows.forward(["a", "b"], [[1, 2, 3], [4, 5, 6]])  # from position 0: causal flag
        rows.forward(["a", "b"], [[7], [8]])  # one query at the common end
        rows.forward(["a"], [[9, 10]])  # a continuation needs its mask
    layers = GQA["num_hidden_layers"]
    prefill, decode, verify = (mode.calls[i * layers : (i + 1) * layers] for i in range(3))
    assert all(mask is None and causal for _, _, mask, causal in prefill)
    assert all(mask is None and not causal for _, _, mask, causal in decode)
    # [1, 1, 2, 6]: the row's two queries over its six keys, one mask shared by the layers
    assert all(mask is not None and tuple(mask.shape) == (1, 1, 2, 6) for *_, mask, _ in verify)
    assert verify[0][2] is verify[1][2]


def test_the_model_run_directly_is_plain_sdpa():
    """Callers that run the runner's model themselves (references, logprob scoring) get
    transformers' own masks: switching the backend changes nothing for them."""
    rows, masks = _pair(GQA)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    pad = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": pad}):
            torch.testing.assert_close(
                rows.model(ids, **kwargs).logits, masks.model(ids, **kwargs).logits
            )


def test_families_sdpa_cannot_compute_keep_the_masks():
    gemma2 = {
        **GQA,
        "model_type": "gemma2",
        "head_dim": 8,
        "sliding_window": 4,
        "attn_logit_softcapping": 50.0,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    kwargs = dict(gemma2)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    runner = ModelRunner(model, max_num_seqs=1, max_model_len=32)
    assert not runner._row_attention
    with pytest.raises(ValueError, match="attention_backend"):
        ModelRunner(_model(GQA), attention_backend="flash")
