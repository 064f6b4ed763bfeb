"""The model-family matrix through Ray Serve: each family's tiny pair deployed as a user
deploys it (the draft in an actor of its own for the Llama 3 target with its own draft and
with Qwen 2's, whose vocabularies differ; colocated with the target for the others, a
process fewer to start per family), greedy output through the engine (a Serve handle, token
ids) and over HTTP (text prompts, encoded by the server) equal to transformers ``generate``
of the target, drafts accepted, a seeded sampled request speculating; a pair whose
tokenizers disagree is refused at startup and Serve reports the application as failed."""

import time
from dataclasses import replace

import httpx
import pytest
import torch
from openai import OpenAI
from ray import serve
from transformers import AutoModelForCausalLM, AutoTokenizer

from deployments.app import build_specserve_app
from deployments.config import AppConfig
from tests.conftest import EAGER
from tests.model_families import FAMILIES, build_family, build_tokenizer
from tests.specdec.test_families import prompts, reference

NEW_TOKENS = 20
# Families whose draft runs in an actor of its own: token ids, never vocabularies, cross
# between the processes (Qwen 2's draft has another vocabulary size than Llama 3's target).
ACTOR_DRAFT = frozenset({"llama3", "llama3-qwen2-draft"})


def family_app(name: str, target: str, draft: str, tokenizer: str, draft_tokenizer=None):
    shape = {} if name in ACTOR_DRAFT else {"draft_placement": "colocated"}
    cfg = AppConfig.model_validate(
        {
            "engine": {
                # KV slots are allocated at max_model_len: the families' real 32k-128k
                # contexts would take gigabytes for these 40-token prompts.
                "target": {
                    "model": target,
                    "tokenizer": tokenizer,
                    "num_threads": 1,
                    "max_model_len": 512,
                    **EAGER,
                },
                "draft": {
                    "model": draft,
                    "tokenizer": draft_tokenizer or tokenizer,
                    "num_threads": 1,
                    "max_model_len": 512,
                    **EAGER,
                },
                "served_model_name": name,
                "engine_resources": {"num_cpus": 0.5},
                "target_resources": {"num_cpus": 1},
                "draft_resources": {"num_cpus": 1},
                "speculation": {"num_speculative_tokens": 4, "policy": "fixed"},
                "faults": {"startup_timeout_s": 120},
                **shape,
            },
            "monitoring": {"enabled": False},
        }
    )
    return build_specserve_app(config=cfg, name=name)


def eos_ids(model, tokenizer) -> list[int]:
    """Every id the server stops at: the tokenizer's EOS and generation_config's."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_served_exactly_over_the_engine_and_http(name, family_models, serve_http):
    target_dir, draft_dir, tok_dir = family_models[name]
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    hf = AutoModelForCausalLM.from_pretrained(target_dir)
    eos = eos_ids(hf, tokenizer)
    handle = serve.run(
        family_app(name, target_dir, draft_dir, tok_dir), name=name, route_prefix=f"/{name}"
    )
    client = OpenAI(base_url=f"{serve_http}/{name}/v1", api_key="unused", max_retries=0)
    try:
        drafted = accepted = 0
        for i, prompt in enumerate(prompts(tokenizer)):
            expected = reference(hf, prompt, NEW_TOKENS, eos)
            # The engine, token ids in: exactly the reference.
            chunks = list(
                handle.options(stream=True).generate.remote(
                    {
                        "prompt_token_ids": prompt,
                        "params": {"temperature": 0.0, "max_tokens": NEW_TOKENS},
                    }
                )
            )
            assert [t for c in chunks for t in c["new_token_ids"]] == expected, (name, i)
            drafted += chunks[-1]["stats"]["drafted"]
            accepted += chunks[-1]["stats"]["accepted"]
            # HTTP, text in: the server encodes it as the tokenizer does by default (BOS
            # where the family adds one), so the text out is the reference's.
            text = tokenizer.decode(prompt, skip_special_tokens=True)
            resp = client.completions.create(
                model=name, prompt=text, max_tokens=NEW_TOKENS, temperature=0
            )
            assert resp.usage.prompt_tokens == len(prompt), name
            assert resp.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
            spec = resp.model_extra["speculation"]
            drafted += spec["drafted"]
            accepted += spec["accepted"]
        assert 0 < accepted < drafted, (name, accepted, drafted)
        sampled = client.completions.create(
            model=name, prompt=text, max_tokens=16, temperature=1.0, seed=5
        )
        assert sampled.model_extra["speculation"]["drafted"] > 0
        print(  # the matrix's figures (pytest -s)
            f"family {name}: greedy equal (engine and HTTP, 3 prompts), accepted {accepted} "
            f"of {drafted} drafts; seeded T=1: {sampled.model_extra['speculation']}"
        )
        if tokenizer.chat_template:  # a template that renders BOS gets no second one
            messages = [{"role": "user", "content": "w5 w6 w7"}]
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            chat = client.chat.completions.create(model=name, messages=messages, max_tokens=4)
            assert chat.usage.prompt_tokens == len(ids)
            if tokenizer.bos_token_id is not None and FAMILIES[name].bos is not None:
                assert ids.count(tokenizer.bos_token_id) == 1
    finally:
        serve.delete(name)


def test_pair_with_disagreeing_tokenizers_is_refused_and_deploy_fails(
    family_models, serve_http, tmp_path
):
    """Same size, two ids swapped: sizes agree, mappings do not. The replica refuses at
    startup with the reason, and Serve marks the application failed (no crash loop)."""
    target_dir, draft_dir, tok_dir = family_models["llama3"]
    llama = FAMILIES["llama3"]
    swapped = dict(llama.specials)
    swapped["<|eot_id|>"], swapped["<|start_header_id|>"] = 128006, 128009
    other = tmp_path / "other-tokenizer"
    build_tokenizer(replace(llama, specials=swapped), other)
    name = "refused"
    with pytest.raises(RuntimeError):
        serve.run(
            family_app(name, target_dir, draft_dir, tok_dir, str(other)),
            name=name,
            route_prefix=f"/{name}",
        )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            app = serve.status().applications[name]
            if app.status == "DEPLOY_FAILED":
                break
            time.sleep(0.5)
        assert app.status == "DEPLOY_FAILED", app
        message = " ".join([app.message, *(d.message for d in app.deployments.values())])
        assert "does not agree with the target's on 2 of 128256 token ids" in message
        assert "<|eot_id|>" in message
        assert httpx.get(f"{serve_http}/{name}/health").status_code >= 400
    finally:
        serve.delete(name)


def test_build_family_is_deterministic(tmp_path):
    """The matrix's models come from their seed alone (a failure reproduces)."""
    a = build_family(FAMILIES["mistral"], tmp_path / "a")
    b = build_family(FAMILIES["mistral"], tmp_path / "b")
    wa = AutoModelForCausalLM.from_pretrained(a[0]).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(b[0]).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
