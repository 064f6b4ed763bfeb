"""lm-evaluation-harness 0.4.13, ``--model local-completions``, unmodified, on the two small
local tasks of ``tests/clients/lm_eval_tasks/``: ``specserve_gen`` (``generate_until``)
and ``specserve_choice`` (``multiple_choice``, loglikelihood), six documents each.

What lm-eval sends (``lm_eval/models/openai_completions.py``, ``api_models.py``): token-id
prompts without BOS (its Hugging Face tokenizer, ``add_special_tokens=False``), a batch of
them per request (``--batch_size``), ``num_concurrent`` requests at once. ``generate_until``:
``temperature: 0``, ``max_tokens``, ``stop`` = the task's ``until`` plus the EOS string,
``seed``. Loglikelihood: ``echo: true``, ``logprobs: 1``, ``max_tokens: 1``, and it sums
``choices[i].logprobs.token_logprobs[ctxlen:-1]`` (the continuation's prompt tokens) and
compares each with ``max(top_logprobs)`` for ``is_greedy``.

Both are checked against the target model run here in one process: every greedy
generation must be the target's own (exact_match 1.0), and every choice's log-likelihood
the sum of the target's log-probabilities of its tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.generate import generate_autoregressive
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from tests.clients.conftest import MODEL, client_env, client_exe, run_client
from tests.conftest import DEMO_TARGET, ROOT

TASKS = ROOT / "tests" / "clients" / "lm_eval_tasks"
MAX_GEN_TOKS = 16  # the task's generation_kwargs


def docs(task: str) -> list[dict]:
    return [json.loads(r) for r in (TASKS / f"{task}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TARGET)


def reference_generation(runner: ModelRunner, tokenizer, prompt: str) -> str:
    """The target's greedy continuation of lm-eval's token ids, cut at the task's ``until``."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=MAX_GEN_TOKS)
    out = generate_autoregressive(runner, ids, params, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out.token_ids, skip_special_tokens=True).split("\n")[0]


def reference_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """Sum of the target's log-probabilities of the continuation's tokens, split as
    lm-eval splits them (``TemplateLM._encode_pair``: trailing context spaces move to the
    continuation, the whole is encoded once and cut at the context's length)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctxlen = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return sum(logp[i - 1, whole[i]].item() for i in range(ctxlen, len(whole)))


def run_lm_eval(server_url: str, tmp_path: Path, task: str) -> tuple[dict, list[dict]]:
    """``lm_eval`` on one task, from the repository root (the tasks' data paths are
    relative to it); returns its results and its logged samples."""
    model_args = ",".join(
        [
            f"base_url={server_url}/v1/completions",
            f"model={MODEL}",
            f"tokenizer={DEMO_TARGET}",
            "tokenizer_backend=huggingface",
            "num_concurrent=2",
            "max_retries=1",  # a failed request fails the run instead of being retried
            "timeout=120",
        ]
    )
    out = tmp_path / "out"
    argv = [client_exe("lm_eval"), "run", "--model", "local-completions"]
    argv += ["--model_args", model_args, "--tasks", task, "--include_path", str(TASKS)]
    argv += ["--batch_size", "2"]  # prompt batches: a list of token lists per request
    argv += ["--output_path", str(out), "--log_samples", "--seed", "1234"]
    run_client(argv, client_env(tmp_path), cwd=ROOT, log_dir=tmp_path)
    results = list(out.rglob("results_*.json"))
    samples = list(out.rglob(f"samples_{task}_*.jsonl"))
    assert len(results) == 1 and len(samples) == 1, f"lm_eval wrote {list(out.rglob('*'))}"
    rows = [json.loads(line) for line in samples[0].read_text().splitlines()]
    return json.loads(results[0].read_text()), rows


def test_generate_until_scores_the_targets_own_greedy_text(server_url, tmp_path, tokenizer):
    rows = docs("specserve_gen")
    runner = ModelRunner(DEMO_TARGET)
    targets = {r["prompt"]: r["target"] for r in rows}
    assert targets == {p: reference_generation(runner, tokenizer, p) for p in targets}
    assert len(set(targets.values())) == len(rows) == 6 and all(targets.values())

    results, samples = run_lm_eval(server_url, tmp_path, "specserve_gen")

    score = results["results"]["specserve_gen"]["exact_match,none"]
    assert isinstance(score, float) and 0.0 <= score <= 1.0
    assert results["n-samples"]["specserve_gen"]["effective"] == len(rows)
    assert {s["doc"]["prompt"]: s["resps"][0][0] for s in samples} == targets
    assert score == 1.0


def test_multiple_choice_loglikelihoods_are_the_targets(server_url, tmp_path, tokenizer):
    """Needs ``echo`` with ``logprobs`` (prompt log-probabilities)."""
    rows = docs("specserve_choice")

    results, samples = run_lm_eval(server_url, tmp_path, "specserve_choice")

    acc = results["results"]["specserve_choice"]["acc,none"]
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0
    assert len(samples) == len(rows)
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval()
    correct = 0
    for s in samples:
        assert len(s["resps"]) == len(s["doc"]["choices"])
        logliks = []
        # the log's arguments: {"gen_args_<i>": {"arg_0": context, "arg_1": continuation}}
        args = [s["arguments"][f"gen_args_{i}"] for i in range(len(s["resps"]))]
        for arg, resp in zip(args, s["resps"], strict=True):
            context, continuation = arg["arg_0"], arg["arg_1"]
            # lm-eval's sample log writes each response as strings: ["-1.95...", "False"]
            loglik, is_greedy = float(resp[0][0]), resp[0][1]
            ref = reference_loglikelihood(model, tokenizer, context, continuation)
            assert loglik == pytest.approx(ref, abs=1e-3), (context, continuation)
            assert loglik < 0 and str(is_greedy) in ("True", "False")
            logliks.append(loglik)
        correct += max(range(len(logliks)), key=logliks.__getitem__) == s["doc"]["answer"]
    assert acc == pytest.approx(correct / len(rows))
