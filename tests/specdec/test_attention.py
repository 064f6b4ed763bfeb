"""Masks per layer type, refusals, and the tokenizer agreement check (pure, no Ray)."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from specdec.attention import (
    FULL,
    SLIDING,
    UnsupportedModelError,
    attention_layout,
    build_masks,
)
from specdec.vocab import check_tokenizers


def test_layouts_of_the_families():
    mistral = attention_layout(AutoConfig.for_model("mistral", sliding_window=8))
    assert mistral.layer_types == (SLIDING,) * mistral.num_layers and not mistral.keyed
    assert mistral.sliding_window == 8
    gemma2 = attention_layout(AutoConfig.for_model("gemma2", num_hidden_layers=4, sliding_window=8))
    assert gemma2.keyed and gemma2.layer_types == (SLIDING, FULL, SLIDING, FULL)
    qwen = attention_layout(AutoConfig.for_model("qwen2", num_hidden_layers=3))
    assert qwen.keyed and not qwen.has_sliding and qwen.sliding_window is None
    gpt2 = attention_layout(AutoConfig.for_model("gpt2", n_layer=3))
    assert gpt2.num_layers == 3 and not gpt2.has_sliding and not gpt2.keyed
    # A composite config: the decoder's layers and layer types come from text_config.
    gemma3 = attention_layout(
        AutoConfig.for_model(
            "gemma3",
            text_config={"num_hidden_layers": 6, "sliding_window": 16},
            vision_config={"num_hidden_layers": 1},
        )
    )
    assert gemma3.num_layers == 6 and gemma3.layer_types.count(FULL) == 1


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (
            SimpleNamespace(num_hidden_layers=2, layer_types=["chunked_attention"] * 2),
            "chunked_attention",
        ),
        (
            SimpleNamespace(
                num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]
            ),
            "linear_attention",
        ),
        (
            SimpleNamespace(
                num_hidden_layers=2, layer_types=["sliding_attention"] * 2, sliding_window=None
            ),
            "without a positive sliding_window",
        ),
        (SimpleNamespace(num_hidden_layers=3, layer_types=["full_attention"] * 2), "lists 2"),
        (SimpleNamespace(hidden_size=8), "num_hidden_layers"),
    ],
)
def test_layouts_it_cannot_mask_are_refused_with_the_reason(config, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        attention_layout(config)


def test_sliding_mask_keeps_exactly_the_window():
    layout = attention_layout(AutoConfig.for_model("gemma2", num_hidden_layers=2, sliding_window=4))
    q = torch.tensor([[20, 21], [5, 6]])  # two ragged rows, two queries each
    masks = build_masks(layout, q, kv_len=24)
    full, sliding = masks[FULL][:, 0], masks[SLIDING][:, 0]  # [2, 2, 24]
    assert full[0, 0].nonzero().flatten().tolist() == list(range(21))
    assert sliding[0, 0].nonzero().flatten().tolist() == [17, 18, 19, 20]
    assert sliding[0, 1].nonzero().flatten().tolist() == [18, 19, 20, 21]
    assert sliding[1, 0].nonzero().flatten().tolist() == [2, 3, 4, 5]
    additive = build_masks(layout, q, kv_len=24, additive_dtype=torch.bfloat16)
    assert additive[SLIDING].dtype == torch.bfloat16
    assert torch.equal(additive[SLIDING][:, 0] == 0, sliding)
    assert (additive[SLIDING][:, 0][~sliding] == torch.finfo(torch.bfloat16).min).all()


class _Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizers_must_map_the_targets_tokens_to_the_same_ids():
    target = {"<s>": 0, "a": 1, "b": 2, "c": 3}
    check_tokenizers(_Tok(target), _Tok(target))
    check_tokenizers(_Tok(target), _Tok({**target, "d": 4}))  # the draft may know more
    with pytest.raises(UnsupportedModelError, match=r"on 2 of 4 token ids \(e\.g\. 'b'"):
        check_tokenizers(_Tok(target), _Tok({**target, "b": 3, "c": 2}))  # same size
    with pytest.raises(UnsupportedModelError, match="'c': target 3, draft missing"):
        check_tokenizers(_Tok(target), _Tok({"<s>": 0, "a": 1, "b": 2}))
