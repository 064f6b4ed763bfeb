"""``vllm bench serve`` replayed: vLLM itself cannot be installed here, so this module sends
the request bodies and headers its OpenAI backends send and parses the SSE as they parse
it, then computes its headline metrics.

Mirrored, not copied, from vllm-project/vllm: ``vllm/benchmarks/lib/endpoint_request_func.py``
at 02cfb534df5674737558730b10f23d1b7aef9b7c (``StreamedResponseHandler``,
``async_request_openai_completions``, ``async_request_openai_chat_completions``) and
``vllm/benchmarks/serve.py`` at 009e6d4a1cd6ba3fb2a9fc00f4ec06f5297232a1
(``get_first_model_from_server``, ``calculate_metrics``, ``--dataset-name random``):

- without ``--model`` it takes ``data[0]["id"]`` and ``data[0]["root"]`` of ``/v1/models``;
- the random data set turns ``ignore_eos`` on; each request carries ``x-request-id:
  bench-<8 hex>-<i>``, the chat backend also ``Content-Type: application/json``;
- completions: ``model, prompt, repetition_penalty: 1.0, max_tokens, logprobs: null,
  stream: true, stream_options: {include_usage: true}, ignore_eos: true``; chat:
  ``model, messages: [{role: user, content: [{type: text, text}]}],
  max_completion_tokens, stream, stream_options, ignore_eos``; no temperature unless
  ``--temperature`` is given;
- SSE: bytes as they arrive (``iter_any``), each stripped, events split on blank lines,
  a buffered ``data:`` line taken early once it is complete JSON or ``[DONE]``; ``:``
  comments and ``[DONE]`` skipped. The first event with non-empty ``choices`` is the first
  token (TTFT; for chat the role chunk), every later one appends an inter-token latency;
  an event without choices but with ``usage`` gives ``output_tokens``. A request succeeds
  when it got a 200 and at least one such event.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import random
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import pytest
from transformers import AutoTokenizer

from tests.clients.conftest import MODEL
from tests.conftest import DEMO_TARGET

REQUESTS = 16
MAX_CONCURRENCY = 4
INPUT_LEN = 32
OUTPUT_LEN = 16


class SSEBuffer:
    """Server-sent events out of arbitrarily split bytes, as vLLM's benchmark reads them."""

    def __init__(self):
        self.text = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")()  # a character may be split

    def feed(self, data: bytes) -> list[str]:
        self.text += self.decoder.decode(data)
        events = []
        while "\n\n" in self.text:
            event, self.text = self.text.split("\n\n", 1)
            if event.strip():
                events.append(event.strip())
        # The chunk was stripped of its trailing blank line: a complete data line is taken.
        if self.text.startswith("data: "):
            payload = self.text[len("data: ") :].strip()
            complete = payload == "[DONE]"
            if payload and not complete:
                try:
                    json.loads(payload)
                    complete = True
                except json.JSONDecodeError:
                    pass  # more bytes to come
            if complete:
                events.append(self.text.strip())
                self.text = ""
        return events


@dataclass
class Outcome:
    """vLLM's ``RequestFuncOutput``, the fields its metrics read."""

    success: bool = False
    status: int = 0
    error: str = ""
    text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int | None = None
    prompt_len: int | None = None
    request_id: str = ""
    echoed_request_id: str | None = None


def completions_request(model: str, prompt: str, request_id: str) -> tuple[dict, dict]:
    body = {
        "model": model,
        "prompt": prompt,
        "repetition_penalty": 1.0,
        "max_tokens": OUTPUT_LEN,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    return body, {"x-request-id": request_id}


def chat_request(model: str, prompt: str, request_id: str) -> tuple[dict, dict]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        "max_completion_tokens": OUTPUT_LEN,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    return body, {"Content-Type": "application/json", "x-request-id": request_id}


async def send(session, url: str, body: dict, headers: dict, chat: bool, rid: str) -> Outcome:
    out = Outcome(request_id=rid)
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as response:
            out.status = response.status
            out.echoed_request_id = response.headers.get("x-request-id")
            if response.status != 200:
                out.error = f"{response.status} {response.reason}: {await response.text()}"
                return out
            sse, first = SSEBuffer(), False
            async for data in response.content.iter_any():
                data = data.strip()
                if not data:
                    continue
                for event in sse.feed(data):
                    if event.startswith(":"):
                        continue
                    payload = event.removeprefix("data: ")
                    if payload == "[DONE]":
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(payload)
                    if choices := chunk.get("choices"):
                        piece = choices[0]["delta"].get("content") if chat else choices[0]["text"]
                        if first:
                            out.itl.append(now - last)
                        else:
                            first, out.ttft = True, now - start
                        out.text += piece or ""
                        last = now
                    elif usage := chunk.get("usage"):
                        out.output_tokens = usage.get("completion_tokens")
                        out.prompt_len = usage.get("prompt_tokens")
            out.success = first
            out.error = "" if first else "no chunk with choices: no TTFT"
            out.latency = last - start
    except Exception as exc:  # vLLM records the traceback as the request's error
        out.error = repr(exc)
    return out


def random_prompts(tokenizer, n: int, seed: int = 0) -> list[str]:
    """vLLM's random data set in short: random token ids, decoded to text."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    return [tokenizer.decode(rng.choices(ids, k=INPUT_LEN)) for _ in range(n)]


async def bench(base_url: str, chat: bool, prompts: list[str]) -> tuple[str, list[Outcome]]:
    prefix = f"bench-{uuid.uuid4().hex[:8]}-"
    connector = aiohttp.TCPConnector(
        limit=MAX_CONCURRENCY, limit_per_host=MAX_CONCURRENCY, keepalive_timeout=60
    )
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(f"{base_url}/v1/models") as r:  # no --model given
            card = (await r.json())["data"][0]
        model = card["id"]
        assert card["root"]  # vLLM reads it (KeyError without it)
        route, make = (
            ("chat/completions", chat_request) if chat else ("completions", completions_request)
        )
        url = f"{base_url}/v1/{route}"
        semaphore = asyncio.Semaphore(MAX_CONCURRENCY)

        async def limited(i: int, prompt: str) -> Outcome:
            rid = f"{prefix}{i}"
            body, headers = make(model, prompt, rid)
            async with semaphore:
                return await send(session, url, body, headers, chat, rid)

        outcomes = await asyncio.gather(*(limited(i, p) for i, p in enumerate(prompts)))
    return model, list(outcomes)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_vllm_bench_serve_replay(server_url, chat):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    prompts = random_prompts(tokenizer, REQUESTS)
    model, outcomes = asyncio.run(bench(server_url, chat, prompts))
    assert model == MODEL

    failed = [o for o in outcomes if not o.success]
    assert not failed, [(o.request_id, o.error) for o in failed]
    for prompt, o in zip(prompts, outcomes, strict=True):
        assert o.output_tokens == OUTPUT_LEN, (o.request_id, o.output_tokens)
        assert o.ttft > 0 and o.itl and all(x >= 0 for x in o.itl) and sum(o.itl) > 0
        assert o.latency > o.ttft and o.text
        assert o.echoed_request_id == o.request_id  # x-request-id went through
        if not chat:
            assert o.prompt_len == len(tokenizer(prompt)["input_ids"])
    # vLLM's calculate_metrics: output tokens from usage, TPOT over the tokens after the first
    ttfts = [o.ttft for o in outcomes]
    itls = [x for o in outcomes for x in o.itl]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in outcomes]
    assert sum(o.output_tokens for o in outcomes) == REQUESTS * OUTPUT_LEN
    assert np.mean(ttfts) > 0 and np.percentile(ttfts, 99) >= np.median(ttfts)
    assert np.mean(itls) > 0 and np.mean(tpots) > 0


def test_sse_buffer_reassembles_events_split_anywhere():
    """Events cut at every byte (inside a multi-byte character too) and network chunks
    stripped of their blank lines, as the replay reads them: each event once, in order.
    (Not next to a space: stripping the chunks, vLLM's reader would lose it, as this one.)"""
    events = ['data: {"choices": [{"text": "éü"}]}', 'data: {"usage": {}}', "data: [DONE]"]
    raw = "".join(e + "\n\n" for e in events).encode()
    for cut in (c for c in range(1, len(raw)) if b" " not in raw[c - 1 : c + 1]):
        sse, got = SSEBuffer(), []
        for part in (raw[:cut], raw[cut:]):
            if part.strip():
                got += sse.feed(part.strip())
        assert got == events, cut
