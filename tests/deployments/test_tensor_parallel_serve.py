"""A target split over two ranks (``target.tensor_parallel_size: 2``) through Ray Serve: the
core is rank 0, a TensorParallelRank actor rank 1, gloo between them. Greedy output through
the engine and over HTTP equals transformers ``generate`` of the target for the families
the issue names (the draft colocated); health shows each rank; with the draft in its own
actor, a rank SIGKILLed, or hung (SIGSTOP) past ``faults.rank_timeout_s``, under load takes
its group down, the core is replaced with a fresh group, and every request completes with
the same tokens."""

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI
from ray import serve
from transformers import AutoModelForCausalLM, AutoTokenizer

from deployments.app import build_specserve_app
from deployments.config import AppConfig
from tests.conftest import EAGER, wait_for
from tests.deployments.test_families_http import eos_ids
from tests.specdec.test_families import prompts, reference

NEW_TOKENS = 20


def split_app(
    name: str, family_dirs, draft_placement: str = "actor", draft_ranks: int = 1, **faults
):
    target, draft, tokenizer = family_dirs
    model = {"tokenizer": tokenizer, "num_threads": 1, "max_model_len": 512, **EAGER}
    cfg = AppConfig.model_validate(
        {
            "engine": {
                "target": {"model": target, "tensor_parallel_size": 2, **model},
                "draft": {"model": draft, "tensor_parallel_size": draft_ranks, **model},
                "served_model_name": name,
                "draft_placement": draft_placement,
                "engine_resources": {"num_cpus": 0.5},
                "target_resources": {"num_cpus": 1},
                "draft_resources": {"num_cpus": 1},
                "speculation": {"num_speculative_tokens": 4, "policy": "fixed"},
                "faults": {"startup_timeout_s": 180, **faults},
            },
            "monitoring": {"enabled": False},
        }
    )
    return build_specserve_app(config=cfg, name=name)


# The draft colocated (in rank 0's process: one process fewer to start per family); the
# draft actor beside a split target runs in the rank-kill test below and in the joint-law
# test (test_engine_law.py, "actor-tp2"); a split draft (its worker rank 0 of a group of
# its own) beside the split target in "actor-split".
@pytest.mark.parametrize(
    ("family", "draft_placement"),
    [
        ("llama3", "colocated"),  # 8 query / 2 KV heads: each rank holds one KV head
        ("qwen2.5", "colocated"),  # 1 KV head: replicated on both ranks
        ("qwen3", "colocated"),  # q/k norms, a head_dim of its own
        ("mistral", "colocated"),  # every layer slides
        ("llama3", "actor-split"),  # the draft over two ranks too
    ],
)
def test_split_target_served_exactly(family, draft_placement, family_models, serve_http):
    dirs = family_models[family]
    tokenizer = AutoTokenizer.from_pretrained(dirs[2])
    hf = AutoModelForCausalLM.from_pretrained(dirs[0])
    eos = eos_ids(hf, tokenizer)
    name = f"tp-{family.replace('.', '')}-{draft_placement}"
    split_draft = draft_placement == "actor-split"
    app = split_app(name, dirs, draft_placement.split("-")[0], draft_ranks=1 + split_draft)
    handle = serve.run(app, name=name, route_prefix=f"/{name}")
    client = OpenAI(base_url=f"{serve_http}/{name}/v1", api_key="unused", max_retries=0)
    try:
        assert _served_exactly(handle, client, name, tokenizer, hf, eos) > 0  # accepted
        group = _settled_group(handle)
        assert group["size"] == 2 and group["calls"] > 0
        assert [r["rank"] for r in group["ranks"]] == [1]
        assert group["ranks"][0]["calls"] == group["calls"]  # every call reached rank 1
        if split_draft:
            _draft_rank_killed_and_replaced(handle, client, name, tokenizer, hf, eos)
    finally:
        serve.delete(name)


def _served_exactly(handle, client, name, tokenizer, hf, eos) -> int:
    """Two prompts through the engine (token ids) and over HTTP (text) give transformers'
    greedy tokens; returns the drafts accepted over HTTP."""
    accepted = 0
    for prompt in prompts(tokenizer)[:2]:
        expected = reference(hf, prompt, NEW_TOKENS, eos)
        request = {
            "prompt_token_ids": prompt,
            "params": {"temperature": 0.0, "max_tokens": NEW_TOKENS},
        }
        chunks = list(handle.options(stream=True).generate.remote(request))
        assert [t for c in chunks for t in c["new_token_ids"]] == expected, name
        text = tokenizer.decode(prompt, skip_special_tokens=True)
        resp = client.completions.create(
            model=name, prompt=text, max_tokens=NEW_TOKENS, temperature=0
        )
        assert resp.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        accepted += resp.model_extra["speculation"]["accepted"]
    return accepted


def _draft_rank_killed_and_replaced(handle, client, name, tokenizer, hf, eos) -> None:
    """The split draft's rank 1 SIGKILLed: its worker's next pass fails, the worker exits
    with its group, requests go on target-only (unchanged), and a new draft with new ranks
    drafts again."""

    def draft_group():  # (the replica refreshes it with its health polls)
        group = handle.health_info.remote().result()["draft_tensor_parallel"]
        return group if group and group["calls"] > 0 else None

    draft_group = wait_for(draft_group, 30, "the split draft's health")
    assert draft_group["size"] == 2 and draft_group["ranks"][0]["role"] == "draft"
    old = draft_group["ranks"][0]["pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 300
    while True:  # requests all along: the first finds the group broken
        _served_exactly(handle, client, name, tokenizer, hf, eos)
        health = handle.health_info.remote().result()
        now = health["draft_tensor_parallel"]
        if health["draft"] and now and now["ranks"][0].get("pid") not in (None, old):
            break
        assert time.monotonic() < deadline, health
    assert _served_exactly(handle, client, name, tokenizer, hf, eos) > 0  # drafting again


def _settled_group(handle, wait_s: float = 30.0) -> dict:
    """The replica's ``tensor_parallel`` health once rank 1 has run every call rank 0
    broadcast (the health the replica holds is refreshed by its polls: a snapshot taken
    while a call ran may count it on rank 0 only); the last one seen if that never comes."""
    deadline = time.monotonic() + wait_s
    while True:
        group = handle.health_info.remote().result()["tensor_parallel"]
        # (the replica's copy of the core's health is refreshed by its polls: one from
        # before the requests reads 0 calls on both sides)
        settled = (
            group is not None
            and group["calls"] > 0
            and group["ranks"][0].get("calls") == group["calls"]
        )
        if settled or time.monotonic() > deadline:
            return group
        time.sleep(0.5)


def _rank_pid(handle) -> int:
    """Rank 1's process id, as the core's health reports it through the replica."""
    return _settled_group(handle)["ranks"][0]["pid"]


# A hung rank: the core's next pass waits rank_timeout_s for its sums, then the group fails
# as for a dead rank. (Serve's health check is not what replaces it: /health stays 200.)
HUNG_RANK_TIMEOUT_S = 10.0


def test_a_rank_killed_or_hung_under_load_loses_no_request(family_models, serve_http):
    """16 greedy requests through the engine, 8 at a time; once the first has finished,
    rank 1 is SIGKILLed. Its group fails at the next pass, the core exits and is replaced
    with a new group, and every request completes with the tokens transformers gives.
    Then the same on the new group with rank 1 SIGSTOPped (hung): its group fails after
    ``rank_timeout_s``, and the hung rank is killed, not left behind. (One app for both:
    a deployment and the reference fewer.)"""
    dirs = family_models["llama3"]
    tokenizer = AutoTokenizer.from_pretrained(dirs[2])
    hf = AutoModelForCausalLM.from_pretrained(dirs[0])
    eos = eos_ids(hf, tokenizer)
    base = prompts(tokenizer)
    jobs = [base[i % len(base)][: 20 + i % 17] for i in range(16)]  # mixed lengths
    expected = [reference(hf, p, 32, eos) for p in jobs]
    name = "tp-rank-loss"
    app = split_app(name, dirs, rank_timeout_s=HUNG_RANK_TIMEOUT_S)
    handle = serve.run(app, name=name, route_prefix=f"/{name}")
    stopped = []
    try:
        for restarts, sig in enumerate((signal.SIGKILL, signal.SIGSTOP), start=1):
            old = _rank_pid(handle)
            if sig == signal.SIGSTOP:
                stopped.append(old)
            _signal_under_load(handle, jobs, expected, old, sig)
            assert handle.health_info.remote().result()["target_restarts"] >= restarts
            assert _rank_pid(handle) != old  # a new group serves
            with pytest.raises(ProcessLookupError):  # the old rank is gone, not left behind
                wait_gone(old)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        serve.delete(name)


def _signal_under_load(handle, jobs, expected, pid: int, sig) -> None:
    """``jobs`` sent 8 at a time; ``sig`` to rank 1 (``pid``) once the first has finished;
    every output must be ``expected``."""
    first_done = []

    def complete(ids: list[int]) -> list[int]:
        request = {"prompt_token_ids": ids, "params": {"temperature": 0.0, "max_tokens": 32}}
        chunks = list(handle.options(stream=True).generate.remote(request))
        first_done.append(True)
        return [t for c in chunks for t in c["new_token_ids"]]

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, ids) for ids in jobs]
        deadline = time.monotonic() + 300
        while not first_done and time.monotonic() < deadline:
            time.sleep(0.01)  # (waits for the first answer; no work stands in)
        assert first_done, [f.exception() for f in futures if f.done()]
        os.kill(pid, sig)
        killed_at, done_before = time.monotonic(), len(first_done)
        outputs = [f.result(timeout=600) for f in futures]
    assert outputs == expected, sig.name
    print(  # the recovery's figures (pytest -s)
        f"rank 1 {sig.name} with {len(jobs) - done_before} requests unfinished: all "
        f"{len(jobs)} completed equal {time.monotonic() - killed_at:.1f} s after the signal"
    )


def wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    """Raises ProcessLookupError once ``pid`` has exited (reaped), else returns after
    ``timeout_s`` with it still there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        os.kill(pid, 0)
        time.sleep(0.2)
