"""The OpenAI-compatible HTTP API, served by the same replica that runs the engine.

The ingress and the engine share a process: a request costs one HTTP hop through Serve's
proxy and no DeploymentHandle hop; per-round traffic goes only to the worker actors.
Errors use OpenAI's error JSON; bad input never yields a 500.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.config import AppConfig
from deployments.detokenizer import IncrementalDetokenizer
from deployments.engine import EngineError, EngineOverloadedError, RequestOutput, SpecEngine
from deployments.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    SpeculationReport,
    Usage,
)
from specdec.sampling import SamplingParams

logger = logging.getLogger("specserve.server")

ERRORS = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    503: {"model": ErrorResponse, "description": "Engine not ready or overloaded"},
}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param=None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status,
            message,
            type_,
            code,
            param,
        )


def error_response(status: int, message: str, type_: str, code=None, param=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _bad(message: str, code: str | None = None, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


def create_app(config: AppConfig, engine: SpecEngine, tokenizer, replica_id: str = "") -> FastAPI:
    """The FastAPI app over an engine; the Serve deployment wraps it with ``serve.ingress``."""
    app = FastAPI(title="SpecServe", version="0.1.0", description=__doc__)
    model_name = config.engine.model_name
    created = int(time.time())

    # ----- errors and limits -------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.code, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
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
        return error_response(400, message, "invalid_request_error", "invalid_value", loc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.middleware("http")
    async def _limits_and_auth(request: Request, call_next):
        path, root = request.url.path, request.scope.get("root_path", "")
        if root and path.startswith(root):  # mounted under a route prefix
            path = path[len(root) :]
        if path.startswith("/v1/"):
            if config.api_key:
                auth = request.headers.get("authorization", "")
                given = auth[7:] if auth.lower().startswith("bearer ") else ""
                if not hmac.compare_digest(given.encode(), config.api_key.encode()):
                    return error_response(
                        401,
                        "missing or incorrect API key",
                        "authentication_error",
                        "invalid_api_key",
                    )
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
                return error_response(
                    413,
                    f"request body exceeds {config.max_body_bytes} bytes",
                    "invalid_request_error",
                    "body_too_large",
                )
            elif length is None and request.method == "POST":
                body = await request.body()  # chunked upload: enforce the limit on what arrived
                if len(body) > config.max_body_bytes:
                    return error_response(
                        413,
                        f"request body exceeds {config.max_body_bytes} bytes",
                        "invalid_request_error",
                        "body_too_large",
                    )
        response = await call_next(request)
        response.headers["x-specserve-replica"] = replica_id
        return response

    # ----- helpers -------------------------------------------------------------------------

    def check_ready() -> None:
        if not engine.ready:
            raise APIError(
                503, engine.health().get("error") or "engine is not ready", "service_unavailable"
            )

    def to_params(
        req: CompletionRequest | ChatCompletionRequest, prompt_len: int
    ) -> SamplingParams:
        if req.model != model_name:
            raise _bad(
                f"model '{req.model}' does not exist; this server serves '{model_name}'",
                "model_not_found",
                "model",
            )
        if req.n != 1:
            raise _bad(
                "n > 1 is not supported: send one request per choice", "unsupported_value", "n"
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise _bad("stop must be up to 4 non-empty strings", "invalid_value", "stop")
        for s in stop:
            check_text(s, "stop")
        vocab = engine.target_info["vocab_size"]
        if req.top_k > vocab:
            raise _bad(
                f"top_k must be -1, 0 (disabled) or at most the vocabulary size {vocab}",
                "invalid_value",
                "top_k",
            )
        context = engine.target_info["max_model_len"]
        room = context - prompt_len
        if room < 1:
            raise _bad(
                f"prompt is {prompt_len} tokens; the context length is {context}",
                "context_length_exceeded",
                "prompt",
            )
        max_tokens = (
            req.max_tokens if req.max_tokens is not None else min(config.default_max_tokens, room)
        )
        if prompt_len + max_tokens > context:
            raise _bad(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                f"the context length {context}",
                "context_length_exceeded",
                "max_tokens",
            )
        return SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=tuple(stop),
        )

    def speculation_args(req) -> dict[str, Any]:
        spec = req.speculation
        limit = config.engine.speculation.max_speculative_tokens
        if (
            spec is not None
            and spec.num_speculative_tokens is not None
            and spec.num_speculative_tokens > limit
        ):
            raise _bad(
                f"num_speculative_tokens must be <= {limit}",
                "invalid_value",
                "speculation.num_speculative_tokens",
            )
        return {
            "speculation": spec.enabled if spec else True,
            "num_speculative_tokens": spec.num_speculative_tokens if spec else None,
        }

    def report(out: RequestOutput | None, args: dict[str, Any]) -> SpeculationReport:
        s = out.stats if out else None
        k = args["num_speculative_tokens"]
        enabled = args["speculation"] and engine.config.draft is not None
        return SpeculationReport(
            enabled=enabled,
            num_speculative_tokens=(
                config.engine.speculation.num_speculative_tokens if k is None else k
            )
            if enabled
            else 0,
            drafted=s.drafted if s else 0,
            accepted=s.accepted if s else 0,
            acceptance_rate=round(s.acceptance_rate, 4) if s else 0.0,
            mean_acceptance_length=round(s.mean_acceptance_length, 4) if s else 0.0,
            rounds=s.rounds if s else 0,
            cache_hits=s.cache_hits if s else 0,
        )

    async def run(
        prompt_ids: list[int], params: SamplingParams, args: dict[str, Any]
    ) -> AsyncIterator[RequestOutput]:
        check_ready()
        stream = engine.generate(prompt_ids, params, **args)
        try:
            async for out in stream:
                yield out
        except EngineOverloadedError as exc:
            raise APIError(503, str(exc), "service_unavailable", "overloaded") from exc
        except EngineError as exc:
            raise APIError(503, str(exc), "service_unavailable", "engine_error") from exc
        except ValueError as exc:
            raise _bad(str(exc)) from exc
        finally:
            await stream.aclose()  # a client that went away frees its sequence now

    async def first_then_rest(gen: AsyncIterator[RequestOutput]):
        """Start generation before the response begins, so errors become proper statuses."""
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        return first

    def check_text(text: str, param: str) -> None:
        """JSON may carry lone UTF-16 surrogates (``"\\ud800"``): no tokenizer takes them."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _bad(
                f"{param} is not valid Unicode text (lone surrogate at {exc.start})",
                "invalid_value",
                param,
            ) from None

    def encode_prompt(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise _bad("prompt must not be empty", "invalid_value", "prompt")
            check_text(prompt, "prompt")
            return tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not prompt:
            raise _bad("prompt must not be empty", "invalid_value", "prompt")
        vocab = engine.target_info["vocab_size"]
        if any(t < 0 or t >= vocab for t in prompt):
            raise _bad(f"token ids must be in [0, {vocab})", "invalid_value", "prompt")
        return list(prompt)

    def encode_chat(req: ChatCompletionRequest) -> list[int]:
        messages = [m.model_dump() for m in req.messages]
        for i, m in enumerate(messages):
            check_text(m["content"], f"messages.{i}.content")
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise _bad(
                "this model has no chat template: use /v1/completions",
                "unsupported_value",
                "messages",
            )
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    async def respond(req, prompt_ids: list[int], chat: bool):
        params = to_params(req, len(prompt_ids))
        args = speculation_args(req)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        gen = run(prompt_ids, params, args)
        first = await first_then_rest(gen)
        detok = IncrementalDetokenizer(tokenizer, params.stop)
        if not req.stream:
            text, last = "", first
            if first is not None:
                text += detok.add(first.new_token_ids, final=first.finished)
                if not detok.stopped:
                    async for out in gen:
                        text += detok.add(out.new_token_ids, final=out.finished)
                        last = out
                        if detok.stopped:  # the text reached a stop string: stop generating
                            break
                await gen.aclose()
            usage = Usage(
                prompt_tokens=len(prompt_ids),
                completion_tokens=last.num_output_tokens if last else 0,
                total_tokens=len(prompt_ids) + (last.num_output_tokens if last else 0),
            )
            finish = "stop" if detok.stopped else (last.finish_reason if last else "length")
            if chat:
                return ChatCompletionResponse(
                    id=rid,
                    created=int(time.time()),
                    model=model_name,
                    choices=[{"index": 0, "message": {"content": text}, "finish_reason": finish}],
                    usage=usage,
                    speculation=report(last, args),
                )
            return CompletionResponse(
                id=rid,
                created=int(time.time()),
                model=model_name,
                choices=[{"index": 0, "text": text, "finish_reason": finish}],
                usage=usage,
                speculation=report(last, args),
            )

        async def events():
            created_at = int(time.time())
            obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(
                text: str | None, finish: str | None, extra: dict | None = None, role: bool = False
            ):
                if chat:
                    delta: dict[str, Any] = {}
                    if role:
                        delta["role"] = "assistant"
                    if text is not None:
                        delta["content"] = text
                    choice = {"index": 0, "delta": delta, "finish_reason": finish}
                else:
                    choice = {
                        "index": 0,
                        "text": text or "",
                        "finish_reason": finish,
                        "logprobs": None,
                    }
                body = {
                    "id": rid,
                    "object": obj,
                    "created": created_at,
                    "model": model_name,
                    "choices": [choice],
                }
                body.update(extra or {})
                return f"data: {json.dumps(body)}\n\n"

            if chat:
                yield chunk("", None, role=True)
            last = None
            try:
                if first is not None:
                    last = first
                    piece = detok.add(first.new_token_ids, final=first.finished)
                    if piece:
                        yield chunk(piece, None)
                async for out in gen:
                    if detok.stopped:
                        break
                    last = out
                    piece = detok.add(out.new_token_ids, final=out.finished)
                    if piece:
                        yield chunk(piece, None)
            except (EngineError, APIError) as exc:
                err = {
                    "error": {
                        "message": str(exc),
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                }
                yield f"data: {json.dumps(err)}\n\n"
                yield "data: [DONE]\n\n"
                return
            finally:
                await gen.aclose()
            n_out = last.num_output_tokens if last else 0
            usage = {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": n_out,
                "total_tokens": len(prompt_ids) + n_out,
            }
            yield chunk(
                None if chat else "",
                "stop" if detok.stopped else (last.finish_reason if last else "length"),
                {"usage": usage, "speculation": report(last, args).model_dump()},
            )
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ----- routes ---------------------------------------------------------------------------

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(req: CompletionRequest):
        return await respond(req, encode_prompt(req.prompt), chat=False)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(req: ChatCompletionRequest):
        return await respond(req, encode_chat(req), chat=True)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERRORS[401]})
    async def models():
        return ModelList(data=[ModelCard(id=model_name, created=created)])

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health():
        h = engine.health()
        # Ready only when the target and (if configured) the draft are both up.
        up = h["ready"] and (h["draft"] or engine.config.draft is None)
        body = Health(
            status="ok" if up else "unavailable",
            target=h["target"],
            draft=h["draft"],
            draft_restarting=h["draft_restarting"],
            running=h["running"],
            waiting=h["waiting"],
            aborted=h["aborted"],
        )
        return JSONResponse(body.model_dump(), status_code=200 if body.status == "ok" else 503)

    return app
