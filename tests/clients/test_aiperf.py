"""AIPerf 0.13 (``aiperf profile``), unmodified: streamed chat and completions at concurrency
4, synthetic prompts of 32 tokens (the demo tokenizer's), 16 output tokens with
``ignore_eos`` (``--extra-inputs``), token counts from the server's ``usage``; on chat also
``stream_options.continuous_usage_stats`` (``--per-chunk-usage``: the usage so far on every
chunk, which AIPerf uses to take the first chunk's token count out of inter-token latency).
"""

from __future__ import annotations

import json

import pytest

from tests.clients.conftest import MODEL, client_env, client_exe, run_client

REQUESTS = 16
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16


@pytest.mark.parametrize(
    ("endpoint", "extra"),
    [("chat", ["--per-chunk-usage"]), ("completions", [])],
    ids=["chat", "completions"],
)
def test_aiperf_profile(server_url, tokenizer_path, tmp_path, endpoint, extra):
    out = tmp_path / "artifacts"
    argv = [client_exe("aiperf"), "profile", "--model", MODEL, "--url", server_url]
    argv += ["--endpoint-type", endpoint, "--streaming", "--concurrency", "4"]
    argv += ["--request-count", str(REQUESTS), "--tokenizer", tokenizer_path]
    argv += ["--synthetic-input-tokens-mean", str(PROMPT_TOKENS)]
    argv += ["--synthetic-input-tokens-stddev", "0"]
    argv += ["--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0"]
    argv += ["--extra-inputs", "ignore_eos:true", "--use-server-token-count", *extra]
    argv += ["--artifact-dir", str(out), "--ui-type", "none"]
    argv += ["--no-server-metrics", "--no-gpu-telemetry", "--record-processors", "1"]
    run_client(argv, client_env(tmp_path, hub_offline=False), cwd=tmp_path)

    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    assert summary["error_summary"] == [] and summary["was_cancelled"] is False
    assert summary["request_count"]["avg"] == REQUESTS
    assert summary.get("request_error_rate", {"avg": 0})["avg"] == 0
    records = [json.loads(r) for r in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == REQUESTS
    for record in records:
        assert not record.get("error") and not record["metadata"]["was_cancelled"], record
    # ignore_eos: exactly the asked length, as the server's usage reports it
    osl = summary["output_sequence_length"]
    assert osl["min"] == osl["max"] == OUTPUT_TOKENS
    assert summary["input_sequence_length"]["min"] >= PROMPT_TOKENS
    ttft, itl = summary["time_to_first_token"], summary["inter_token_latency"]
    assert ttft["unit"] == itl["unit"] == "ms"
    assert ttft["min"] > 0 and ttft["avg"] > 0 and itl["avg"] > 0
    # AIPerf stamps each SSE message with the network read it came in, and ITL is
    # (last content message - first) / tokens after the first. On 2 busy cores the
    # client's loop can sleep through a whole (short) stream and read it in one read:
    # that record's ITL is 0 with the server streaming token by token. A server that
    # sent everything at the end would read 0 on every record; most must be above 0.
    itls = [r["metrics"]["inter_token_latency"]["value"] for r in records]
    assert all(v >= 0 for v in itls) and sum(v > 0 for v in itls) > len(itls) // 2, itls
