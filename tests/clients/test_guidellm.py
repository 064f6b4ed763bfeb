"""GuideLLM 0.8.1 (``guidellm run``), unmodified: synthetic prompts of 32 tokens (the demo
tokenizer's), 16 output tokens, streamed, at 4 concurrent streams on chat completions and as
a Poisson process at 4 requests/s on completions.

What it sends (``guidellm/backends/openai/request_handlers.py``): ``max_tokens`` (chat:
``max_completion_tokens``) with ``ignore_eos: true`` and ``stop: null`` to fix the output
length, ``stream_options: {include_usage: true, continuous_usage_stats: true}``, chat
content as a list of text parts; it counts tokens from the last ``usage`` it receives.
"""

from __future__ import annotations

import json

import pytest

from tests.clients.conftest import MODEL, client_env, client_exe, run_client

REQUESTS = 16
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16


@pytest.mark.parametrize(
    ("profile", "route", "strategy"),
    [
        ("kind=concurrent,streams=4", "/v1/chat/completions", "concurrent"),
        ("kind=poisson,rate=4", "/v1/completions", "poisson"),
    ],
    ids=["concurrent-chat", "poisson-completions"],
)
def test_guidellm_benchmark(server_url, tokenizer_path, tmp_path, profile, route, strategy):
    report_path = tmp_path / "benchmarks.json"
    argv = [client_exe("guidellm"), "run", "--disable-console-interactive"]
    argv += [
        "--backend",
        f"kind=openai_http,target={server_url},model={MODEL},request_format={route}",
    ]
    argv += ["--profile", profile]
    argv += ["--constraint", f"kind=max_requests,count={REQUESTS}"]
    argv += [
        "--data",
        f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
    ]
    argv += ["--tokenizer", f"kind=huggingface_auto,model={tokenizer_path}"]
    argv += ["--output", f"kind=json,path={report_path}"]
    run_client(argv, client_env(tmp_path), cwd=tmp_path)

    report = json.loads(report_path.read_text())
    [bench] = report["benchmarks"]
    assert bench["config"]["strategy"]["type_"] == strategy
    metrics = bench["metrics"]
    assert metrics["request_totals"] == {
        "successful": REQUESTS,
        "errored": 0,
        "incomplete": 0,
        "total": REQUESTS,
    }
    assert len(bench["requests"]["successful"]) == REQUESTS
    assert not bench["requests"]["errored"] and not bench["requests"]["incomplete"]
    for request in bench["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["ignore_eos"] is True and body["stream_options"]["continuous_usage_stats"]
        assert request["info"]["error"] is None and request["output"]
    # ignore_eos: exactly the asked length, as the server's usage reports it
    out = metrics["output_token_count"]["successful"]
    assert out["min"] == out["max"] == OUTPUT_TOKENS and out["count"] == REQUESTS
    assert metrics["prompt_token_count"]["successful"]["min"] >= PROMPT_TOKENS
    ttft = metrics["time_to_first_token_ms"]["successful"]
    assert ttft["count"] == REQUESTS and ttft["min"] > 0 and ttft["mean"] > 0
    itl = metrics["inter_token_latency_ms"]["successful"]
    assert itl["count"] == REQUESTS * (OUTPUT_TOKENS - 1) and itl["min"] > 0 and itl["mean"] > 0
