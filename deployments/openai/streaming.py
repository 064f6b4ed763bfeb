"""Streamed responses as server-sent events: each chunk a ``data:`` line of JSON, then
``data: [DONE]``.

:class:`ResponseStream` is what chat and completions streams share (chunk envelope,
usage, the end of each choice, errors once the response has begun); their subclasses
(:mod:`~deployments.openai.serving_chat`, :mod:`~deployments.openai.serving_completion`)
shape each choice's parts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from deployments.frontend.engine_client import RequestOutput
from deployments.openai.choices import Choice, stop_choices, usage
from deployments.openai.errors import APIError, unavailable
from deployments.openai.protocol import Usage

if TYPE_CHECKING:
    from deployments.openai.serving import OpenAIServing

logger = logging.getLogger("specserve.openai")

DONE = "data: [DONE]\n\n"


def sse(body: dict[str, Any]) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {json.dumps(body)}\n\n"


def error_event(exc: Exception, rid: str) -> str:
    """The event that reports ``exc`` once the response has begun (its status is sent).
    Call it while handling ``exc``: anything but an :class:`APIError` is logged with its
    traceback and reported as the engine's failure, naming only its type."""
    if not isinstance(exc, APIError):
        logger.exception("stream %s failed", rid)
        exc = unavailable(f"generation failed: {type(exc).__name__}", "engine_error")
    info = {"message": exc.message, "type": exc.type, "param": exc.param}
    return sse({"error": {**info, "code": exc.code}})


class ClosingStreamingResponse(StreamingResponse):
    """A streamed response that closes its body's generator however the response ended.

    Starlette sends each event from a task of its own and stops that task when the client
    leaves; a stop that lands while an event is being sent leaves the generator suspended
    at its ``yield``, never closed: its sequences would keep generating until the garbage
    collector finalised it. Closing it here (shielded from the cancellation that ended the
    response) runs its ``finally`` now; ``on_close`` then frees what a body that never
    started holds (a generator closed before its first step runs no ``finally``)."""

    def __init__(self, content, *, on_close=None, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close  # async callable, or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._close()

    async def _close(self) -> None:
        try:  # (an error here must not hide the one that ended the response)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                await self.on_close()
        except Exception:
            logger.exception("closing a streamed response failed")


class ChoiceOutputs:
    """The outputs of several choices as they come: each choice's stream is pumped into
    one queue, so a fast choice is not held behind a slow one. A choice's outputs arrive
    in order, then ``None`` at its end; an error of any choice is raised by :meth:`next`."""

    def __init__(self, choices: list[Choice]):
        self.choices = choices
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._pump(c)) for c in self.choices]

    async def next(self) -> tuple[Choice, RequestOutput | None]:
        c, item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return c, item

    async def close(self) -> None:
        """Stop pumping and free every choice's sequence (also those never started), to
        the end even if the response is being cancelled again meanwhile."""
        with anyio.CancelScope(shield=True):
            await stop_choices(self.tasks, self.choices)

    async def _pump(self, c: Choice) -> None:
        try:
            out = c.first if c.started else await c.gen.__anext__()
        except StopAsyncIteration:
            out = None
        except Exception as exc:
            await self.queue.put((c, exc))
            return
        try:
            while out is not None:
                await self.queue.put((c, out))
                out = await c.gen.__anext__() if not out.finished else None
        except StopAsyncIteration:
            pass
        except Exception as exc:
            await self.queue.put((c, exc))
            return
        await self.queue.put((c, None))


class ResponseStream:
    """The events of one streamed response over its started choices."""

    object = ""  # each chunk's "object"

    def __init__(self, serving: OpenAIServing, req, rid: str, choices: list[Choice], args):
        self.serving, self.rid, self.choices, self.args = serving, rid, choices, args
        self.created = int(time.time())
        self.include_usage = req.stream_options is not None and req.stream_options.include_usage
        # vLLM's continuous usage: only together with include_usage, on every chunk that
        # carries a choice: that choice's prompt and the tokens it has generated so far.
        self.continuous = self.include_usage and bool(req.stream_options.continuous_usage_stats)
        self.lasts: dict[int, Any] = {c.index: c.first for c in choices}

    async def close(self) -> None:
        """Free every choice's sequence: for a response closed before its body started
        (its first choice's began before the response did; no pumps ran)."""
        await stop_choices([], self.choices)

    async def events(self) -> AsyncIterator[str]:
        outputs = ChoiceOutputs(self.choices)
        try:
            for event in self.opening():
                yield event
            outputs.start()
            open_choices = len(self.choices)
            while open_choices:
                c, item = await outputs.next()
                for event in self.on_output(c, item):
                    yield event
                if item is None:
                    open_choices -= 1
        except Exception as exc:  # the response has begun: an error event, then the end
            yield error_event(exc, self.rid)
            yield DONE
            return
        finally:
            await outputs.close()
        if self.include_usage:
            total = usage(self.choices, list(self.lasts.values()))
            yield self.chunk([], {"usage": total.model_dump()})
        yield DONE

    # ----- what chat and completions shape differently ---------------------------------

    def opening(self) -> Iterator[str]:
        """Events before any output (chat's role, completions' echoed prompts)."""
        yield from ()

    def part(self, c: Choice, out: RequestOutput | None, text: str) -> dict[str, Any]:
        """The part of a chunk that carries ``text`` (and ``out``'s logprobs) of ``c``."""
        raise NotImplementedError

    def end_fields(self) -> dict[str, Any]:
        """The empty content of a choice's last part, which carries its finish reason."""
        raise NotImplementedError

    # ----- shared ----------------------------------------------------------------------

    def on_output(self, c: Choice, out: RequestOutput | None) -> Iterator[str]:
        """The events of one output of ``c``; ``None``: ``c`` has ended."""
        if out is None:
            yield self.end(c, self.lasts[c.index])
            return
        self.lasts[c.index] = out
        text = out.text or ""
        if (text or out.logprobs) and not c.score_only:
            yield self.chunk([self.part(c, out, text)], self.usage_so_far(c, out))

    def end(self, c: Choice, last: RequestOutput | None) -> str:
        """A choice's last chunk: its finish reason and its speculation report."""
        done = {"index": c.index, "finish_reason": c.finish_reason(last), **self.end_fields()}
        report = self.serving.report(last, self.args, c.params).model_dump()
        return self.chunk([done], {"speculation": report, **(self.usage_so_far(c, last) or {})})

    def chunk(self, parts: list[dict], extra: dict | None = None) -> str:
        body = {
            "id": self.rid,
            "object": self.object,
            "created": self.created,
            "model": self.serving.model_name,
            "choices": parts,
        }
        body.update(extra or {})
        return sse(body)

    def usage_so_far(self, c: Choice, out: RequestOutput | None) -> dict | None:
        """Continuous usage of ``c`` up to ``out`` (None: not asked for)."""
        if not self.continuous:
            return None
        prompt = len(c.prompt_ids)
        done = out.num_output_tokens if out and not c.score_only else 0
        total = Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)
        return {"usage": total.model_dump()}
