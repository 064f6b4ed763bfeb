import pytest
import torch

from specdec.sampling import SamplingParams, logits_to_probs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k must be -1, 0"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"stop": [""]}, "stop must be a non-empty string"),
    ],
)
def test_invalid_params_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_temperature_zero_is_one_hot_argmax():
    logits = torch.tensor([[[0.1, 2.0, -1.0, 1.9]]])
    probs = logits_to_probs(logits, [0.0])
    assert probs.tolist() == [[[0.0, 1.0, 0.0, 0.0]]]


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    probs = logits_to_probs(logits, [0.5])
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, dim=-1))


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    probs = logits_to_probs(logits, [1.0, 1.0], top_k=[2, -1])
    assert (probs[0] > 0).tolist() == [False, True, True, False]
    torch.testing.assert_close(probs[0, 1:3], torch.softmax(torch.tensor([4.0, 3.0]), -1))
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], -1))


def test_top_p_keeps_smallest_set_reaching_p():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = logits_to_probs(probs_in.log(), [1.0], top_p=[0.75])
    # 0.5 < 0.75, 0.5 + 0.3 >= 0.75: the first two survive.
    torch.testing.assert_close(out, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # top_p smaller than the largest probability still keeps the argmax.
    out = logits_to_probs(probs_in.log(), [1.0], top_p=[0.1])
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_seeded_generators_repeat():
    params = SamplingParams(seed=1234)
    a = torch.rand(5, generator=params.make_generator(offset=1))
    b = torch.rand(5, generator=params.make_generator(offset=1))
    c = torch.rand(5, generator=params.make_generator(offset=2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert SamplingParams().make_generator() is None
