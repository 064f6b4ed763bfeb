"""The OpenAI-compatible HTTP app: routes, errors and limits, wired to :class:`OpenAIServing`.

The ingress and the engine share a process: a request costs one HTTP hop through Serve's
proxy and no DeploymentHandle hop; per-round traffic goes only to the worker actors.
Errors use OpenAI's error JSON; bad input never yields a 500, and every 503 and 429
carries ``Retry-After``.
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.config import AppConfig
from deployments.frontend.engine_client import EngineClient
from deployments.openai.api_keys import (
    ConcurrencyLimiter,
    ConcurrencyLimitExceeded,
    KeyStore,
    bearer_token,
)
from deployments.openai.errors import RETRY_AFTER_S, APIError
from deployments.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
)
from deployments.openai.serving import engine_health
from deployments.openai.serving_chat import OpenAIServingChat
from deployments.openai.serving_completion import OpenAIServingCompletion
from monitoring.domains import DomainResolver

logger = logging.getLogger("specserve.server")

ERRORS = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    429: {"model": ErrorResponse, "description": "The API key's concurrency limit is reached"},
    503: {"model": ErrorResponse, "description": "Engine not ready or overloaded"},
}


def error_response(
    status: int, message: str, type_: str, code=None, param=None, headers=None
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def api_path(scope: Scope) -> str:
    """The request's path below the app's route prefix (Serve mounts apps under one)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class KeyGate:
    """ASGI middleware in front of ``/v1/*``: 401 for a missing or unknown key, 429 with
    ``Retry-After`` for a key at its concurrency limit.

    Plain ASGI rather than an ``@app.middleware("http")`` function, because the place a
    request holds must last as long as its response: the gate releases it when the app's
    call returns, which for a stream is after its last event, or when the client leaves
    (Serve cancels the call), or on an error. An HTTP middleware function gets the response
    back once its headers are ready, before a stream's body has run.
    """

    def __init__(self, app: ASGIApp, keys: KeyStore, limiter: ConcurrencyLimiter):
        self.app, self.keys, self.limiter = app, keys, limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self.keys.enabled
            or not api_path(scope).startswith("/v1/")
        ):
            return await self.app(scope, receive, send)
        authorization = dict(scope["headers"]).get(b"authorization")
        client = self.keys.lookup(bearer_token(authorization))
        if client is None:
            refusal = error_response(
                401, "missing or incorrect API key", "authentication_error", "invalid_api_key"
            )
            return await refusal(scope, receive, send)
        try:
            lease = self.limiter.acquire(client)
        except ConcurrencyLimitExceeded as exc:
            logger.info("429 for API key %s: at its limit", client)
            refusal = error_response(
                429,
                str(exc),
                "rate_limit_error",
                "rate_limit_exceeded",
                headers={"Retry-After": str(exc.retry_after_s)},
            )
            return await refusal(scope, receive, send)
        with lease:
            await self.app(scope, receive, send)


def create_app(
    config: AppConfig, engine: EngineClient, tokenizer, replica_id: str = "", *, keys: KeyStore
) -> FastAPI:
    """The FastAPI app over an engine; the Serve deployment wraps it with ``serve.ingress``.
    ``keys`` are the replica's API keys (none: the API is open)."""
    app = FastAPI(title="SpecServe", version="0.1.0", description=__doc__)
    add_error_handlers(app)
    add_middlewares(
        app,
        max_body_bytes=config.max_body_bytes,
        keys=keys,
        limiter=ConcurrencyLimiter(config.rate_limit_retry_after_s),
        replica_id=replica_id,
    )
    add_routes(app, config, engine, tokenizer)
    return app


def add_middlewares(
    app: FastAPI,
    *,
    max_body_bytes: int,
    keys: KeyStore,
    limiter: ConcurrencyLimiter,
    replica_id: str,
) -> None:
    """The ASGI layers in front of the routes, innermost first (each one added wraps the
    ones before it): the body limit; the key gate, outside it so that a request's key is
    checked before anything reads its body; the replica's name, outermost, so that the key
    gate's refusals (401, 429) carry it as every other response does."""
    app.add_middleware(RequestLimits, max_body_bytes=max_body_bytes)
    app.add_middleware(KeyGate, keys=keys, limiter=limiter)
    app.add_middleware(ReplicaHeader, replica_id=replica_id)


# ----- errors and limits ---------------------------------------------------------------------


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours, FastAPI's validation errors, Starlette's."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


async def _api_error(_: Request, exc: APIError):
    return error_response(
        exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers or None
    )


async def _validation_error(_: Request, exc: RequestValidationError):
    """A 400 naming the first invalid field (``param``) and up to five problems."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    if first.get("type") == "json_invalid":
        return error_response(
            400, "request body is not valid JSON", "invalid_request_error", "invalid_json"
        )
    message = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
        for e in errors[:5]
    )
    code = "unsupported_parameter" if first.get("type") == "extra_forbidden" else None
    return error_response(400, message, "invalid_request_error", code or "invalid_value", loc)


async def _http_error(_: Request, exc: StarletteHTTPException):
    return error_response(exc.status_code, str(exc.detail), "invalid_request_error")


class ReplicaHeader:
    """ASGI middleware: every response names its replica (``x-specserve-replica``), so
    that an operator can tell which replica answered (or refused) a request.

    Plain ASGI, as the other layers here, rather than an ``@app.middleware("http")``
    function: such a function runs the app in a task of its own and relays a stream's body
    through a channel without a buffer, so every event of a stream waits at a relay step
    outside the stream's generator. A client that left then cancelled the stream there,
    the generator stayed suspended, and its sequences kept generating until the garbage
    collector finalised it (CI at 61515ad: a sequence still running 30 s after its client
    left)."""

    def __init__(self, app: ASGIApp, replica_id: str):
        self.app = app
        self.header = (b"x-specserve-replica", replica_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


class RequestLimits:
    """ASGI middleware: a 413 for a ``/v1/*`` body over ``max_body_bytes``, by its length
    header or, for a chunked upload, by reading it up to the limit (plain ASGI: see
    :class:`ReplicaHeader`)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and api_path(scope).startswith("/v1/"):
            too_large, receive = await self._body_too_large(scope, receive)
            if too_large:
                refusal = error_response(
                    413,
                    f"request body exceeds {self.max_body_bytes} bytes",
                    "invalid_request_error",
                    "body_too_large",
                )
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    async def _body_too_large(self, scope: Scope, receive: Receive) -> tuple[bool, Receive]:
        """Whether the body exceeds the limit, by its length header; a chunked upload is
        read up to the limit and handed on as read (the returned ``receive`` replays it)."""
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            return length.isdigit() and int(length) > self.max_body_bytes, receive
        if scope["method"] != "POST":
            return False, receive
        chunks, size, more = [], 0, True
        while more and size <= self.max_body_bytes:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees it
                return False, _replay([message], receive)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        if size > self.max_body_bytes:
            return True, receive
        return False, _replay([{"type": "http.request", "body": b"".join(chunks)}], receive)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that gives ``messages`` first, then what ``receive`` gives."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


# ----- routes --------------------------------------------------------------------------------


def add_routes(app: FastAPI, config: AppConfig, engine: EngineClient, tokenizer) -> None:
    """The OpenAI routes and ``/health``. (The route functions' names and docstrings are
    the OpenAPI schema's operation ids and descriptions.)"""
    domains = DomainResolver(config.monitoring)  # one per replica: it bounds what it saw
    completion = OpenAIServingCompletion(config, engine, tokenizer, domains)
    chat = OpenAIServingChat(config, engine, tokenizer, domains)
    created = int(time.time())
    root = config.engine.target.model

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(req: CompletionRequest, request: Request):
        return await completion.create(req, headers=request.headers)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await chat.create(req, headers=request.headers)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERRORS[401]})
    async def models():
        return ModelList(data=[ModelCard(id=completion.model_name, created=created, root=root)])

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health():
        body, status = engine_health(engine)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
        return JSONResponse(body.model_dump(), status_code=status, headers=headers)
