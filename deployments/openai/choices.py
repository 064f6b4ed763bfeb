"""The choices of one response: each a sequence of its own in the engine (one per prompt
and sample), started together, stopped together, and counted together in ``usage``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from deployments.frontend.engine_client import RequestOutput
from deployments.openai.protocol import Usage
from specdec.sampling import SamplingParams

MAX_CHOICES = 64  # prompts x n per request: each is a sequence of its own


@dataclass
class Choice:
    """One choice of a response: a prompt's sequence (its n-th sample when n > 1)."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo: str
    prompt_index: int
    score_only: bool = False  # max_tokens 0: the prompt alone is returned (and scored)
    gen: Any = None  # the engine's output stream, once started
    first: RequestOutput | None = None
    started: bool = False  # ``first`` was awaited (a stream awaits the first choice's only)

    def finish_reason(self, last: RequestOutput | None) -> str:
        """``last``'s reason; "length" without one, or when only the prompt is returned."""
        return last.finish_reason if last is not None and not self.score_only else "length"


async def start_choices(choices: list[Choice], wait_all: bool) -> None:
    """Wait for the first output of each choice's stream (``wait_all``), or of the first
    only (a stream: the others' first outputs come through the stream as their sequences
    are admitted), so that a refused request becomes a status. On any failure, or
    cancellation, every sequence is freed."""
    tasks = [asyncio.create_task(_first_output(c)) for c in (choices if wait_all else choices[:1])]
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
    except BaseException:
        await stop_choices(tasks, choices)
        raise


async def _first_output(c: Choice) -> None:
    try:
        c.first = await c.gen.__anext__()
    except StopAsyncIteration:
        c.first = None
    c.started = True


async def stop_choices(tasks: list[asyncio.Task], choices: list[Choice]) -> None:
    """Cancel ``tasks`` and wait for them, then close every choice's stream: closing a
    stream aborts its sequence in the engine (closing one that never started is a no-op)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(
        *(c.gen.aclose() for c in choices if c.gen is not None), return_exceptions=True
    )


def usage(choices: list[Choice], lasts: list[Any]) -> Usage:
    """Prompt tokens once per prompt (its n choices share it), output tokens of all."""
    prompt = sum({c.prompt_index: len(c.prompt_ids) for c in choices}.values())
    out = sum(
        last.num_output_tokens
        for c, last in zip(choices, lasts, strict=True)
        if last is not None and not c.score_only
    )
    return Usage(prompt_tokens=prompt, completion_tokens=out, total_tokens=prompt + out)
