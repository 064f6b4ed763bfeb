"""The HTTP layer's ASGI pieces without Ray: a stream whose client left is closed at once
(its ``finally`` frees the request's sequences), whatever step the stream was at, without
the garbage collector; the layers in front of the routes as plain ASGI: the body limit
(413), the key gate (401, 429) and the replica's name on every response, refusals
included."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest
from fastapi import FastAPI
from starlette.responses import StreamingResponse

from deployments.config import ApiKey
from deployments.openai.api_keys import ConcurrencyLimiter, KeyStore
from deployments.openai.server import add_middlewares
from deployments.openai.streaming import ClosingStreamingResponse


class Body:
    """A stream's body that notes whether its ``finally`` ran (where the real one frees
    the request's sequences)."""

    def __init__(self):
        self.closed = False

    async def events(self):
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            self.closed = True


def http_scope(path="/v1/stream", method="GET", headers=()):
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": list(headers),
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
    }


async def cancelled_mid_send(app, scope, body: Body, block_at=3):
    """Run ``app`` until it waits in its ``block_at``-th send (a slow client; 3: the second
    event), then cancel it as Serve does when the client leaves; returns the messages sent
    and whether ``body`` was closed by then (read before ``asyncio.run`` ends, which closes
    every generator left open)."""
    sent, blocked = [], asyncio.Event()

    async def send(message):
        sent.append(message)
        if len(sent) == block_at:
            blocked.set()
            await asyncio.Event().wait()  # never returns: the client reads no more

    async def no_disconnect():
        await asyncio.Event().wait()

    task = asyncio.create_task(app(scope, no_disconnect, send))
    async with asyncio.timeout(10):
        await blocked.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(3):  # (a close scheduled by a finaliser would have run by now)
        await asyncio.sleep(0)
    return sent, body.closed


@pytest.fixture
def no_gc():
    """Nothing finalised by the garbage collector while the test runs."""
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("cls", [ClosingStreamingResponse, StreamingResponse])
def test_a_stream_cancelled_while_sending_closes_its_body_now(cls, no_gc):
    """The wrong twin, Starlette's own response, leaves the body suspended at its
    ``yield``: the body stays open for as long as the response object lives."""
    body = Body()
    response = cls(body.events(), media_type="text/event-stream")
    _, closed = asyncio.run(cancelled_mid_send(response, http_scope(), body))
    assert closed is (cls is ClosingStreamingResponse)


def test_a_stream_cancelled_before_its_body_started_frees_through_on_close(no_gc):
    """Cancelled in the response's first send: the body never ran (closing a generator
    that never started runs no ``finally``), so ``on_close`` frees what it would have."""
    body, freed = Body(), []

    async def on_close():
        freed.append(True)

    response = ClosingStreamingResponse(body.events(), on_close=on_close)
    asyncio.run(cancelled_mid_send(response, http_scope(), body, block_at=1))
    assert freed == [True] and not body.closed


KEY = "alice-3f9c2b7e0d"


def limited_app(
    body: Body, limit=64, keys: KeyStore | None = None, limiter: ConcurrencyLimiter | None = None
) -> FastAPI:
    """The server's middlewares (as ``create_app`` adds them) over a few routes; no keys:
    the API is open."""
    app = FastAPI()
    add_middlewares(
        app,
        max_body_bytes=limit,
        keys=keys or KeyStore([]),
        limiter=limiter or ConcurrencyLimiter(),
        replica_id="r-1",
    )

    @app.get("/v1/stream")
    async def stream():
        return ClosingStreamingResponse(body.events(), media_type="text/event-stream")

    @app.post("/v1/echo")
    async def echo(payload: dict):
        return payload

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def test_a_stream_through_the_limits_is_closed_when_cancelled_and_names_its_replica(no_gc):
    body = Body()
    sent, closed = asyncio.run(cancelled_mid_send(limited_app(body), http_scope(), body))
    assert closed
    assert (b"x-specserve-replica", b"r-1") in sent[0]["headers"]


async def call(app, scope, chunks: list[bytes]):
    """One request whose body arrives in ``chunks``; (status, headers, body) back."""
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], dict(sent[0]["headers"]), body


@pytest.mark.parametrize("sized", [True, False], ids=["content-length", "chunked"])
def test_bodies_over_the_limit_get_413_and_others_reach_the_app_whole(sized):
    app = limited_app(Body(), limit=64)
    small = json.dumps({"prompt": "x" * 20}).encode()
    large = json.dumps({"prompt": "x" * 200}).encode()
    for payload, status in ((small, 200), (large, 413)):
        chunks = [payload[:10], payload[10:30], payload[30:]]
        headers = [(b"content-type", b"application/json")]
        if sized:
            headers.append((b"content-length", str(len(payload)).encode()))
        scope = http_scope("/v1/echo", "POST", headers)
        got, names, body = asyncio.run(call(app, scope, chunks))
        assert (got, names[b"x-specserve-replica"]) == (status, b"r-1")
        if status == 200:
            assert json.loads(body) == json.loads(payload)
        else:
            assert json.loads(body)["error"]["code"] == "body_too_large"
    # Outside /v1/ no limit applies; the replica is named all the same.
    got, names, body = asyncio.run(call(app, http_scope("/health"), [b""]))
    assert (got, names[b"x-specserve-replica"], json.loads(body)) == (200, b"r-1", {"status": "ok"})


def test_the_key_gates_refusals_name_the_replica_and_read_no_body():
    """401 for a missing or wrong key and 429 for a key at its limit come from the gate,
    outside the body limit (a refused client's body is never read: these bodies are over
    the limit, a 413 if read), and name the replica as every other response does."""
    keys = KeyStore(
        [ApiKey.model_validate({"name": "a", "key": KEY, "max_concurrent_requests": 1})]
    )
    limiter = ConcurrencyLimiter(retry_after_s=2)
    app = limited_app(Body(), limit=64, keys=keys, limiter=limiter)
    large = json.dumps({"prompt": "x" * 200}).encode()
    typed = (b"content-type", b"application/json")
    wrong = (b"authorization", b"Bearer " + KEY[:-1].encode())
    for headers in ([typed], [typed, wrong]):
        scope = http_scope("/v1/echo", "POST", headers)
        got, names, body = asyncio.run(call(app, scope, [large[:10], large[10:]]))
        assert (got, names[b"x-specserve-replica"]) == (401, b"r-1")
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    authorized = [typed, (b"authorization", f"Bearer {KEY}".encode())]
    with limiter.acquire(keys.lookup(KEY)):  # the key's one place, taken
        scope = http_scope("/v1/echo", "POST", authorized)
        got, names, body = asyncio.run(call(app, scope, [large]))
    assert (got, names[b"x-specserve-replica"], names[b"retry-after"]) == (429, b"r-1", b"2")
    assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
    # With its place free the same key gets through the gate, and then meets the limit.
    got, names, body = asyncio.run(call(app, http_scope("/v1/echo", "POST", authorized), [large]))
    assert (got, names[b"x-specserve-replica"]) == (413, b"r-1")
    small = json.dumps({"prompt": "x"}).encode()
    got, _, body = asyncio.run(call(app, http_scope("/v1/echo", "POST", authorized), [small]))
    assert (got, json.loads(body)) == (200, {"prompt": "x"})
