"""A worker call's time limit never drops a cancellation of its caller.

CI at bc59354: a streamed request with four choices whose client left; one choice was
aborted, the other three generated to their end. Their pumps were awaiting the core's
answer to their add (``EngineClient._call``) when the cancellation came, and Python 3.11's
``asyncio.wait_for`` returns the answer when it lands in the same loop turn as the
cancellation, dropping it. The calls use ``asyncio.timeout`` now (ruff bans ``wait_for``:
pyproject.toml). No Ray: the call is awaited on a plain future."""

from __future__ import annotations

import asyncio
import sys

import pytest

from deployments.config import EngineConfig
from deployments.frontend.engine_client import EngineClient
from tests.conftest import DEMO_TARGET


async def answer_lands_as_caller_is_cancelled(call) -> str:
    """Start ``call(future)`` in a task, then resolve the future and cancel the task in
    the same loop turn; "cancelled" or what the task returned."""
    answer = asyncio.get_running_loop().create_future()

    async def caller():
        await call(answer)
        return "went on"  # what a dropped cancellation lets happen

    task = asyncio.create_task(caller())
    await asyncio.sleep(0)  # the task now waits on the answer
    answer.set_result({"added": 1})
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


def test_a_worker_call_passes_on_a_cancellation_that_lands_with_its_answer():
    engine = EngineClient(EngineConfig.model_validate({"target": {"model": DEMO_TARGET}}))
    assert asyncio.run(answer_lands_as_caller_is_cancelled(engine._call)) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's wait_for is built on timeout")
def test_the_race_drops_the_cancellation_through_wait_for():
    """The wrong twin: the same race through ``asyncio.wait_for`` goes on."""

    async def call(answer):
        return await asyncio.wait_for(answer, 60)  # noqa: TID251 (the twin shows why)

    assert asyncio.run(answer_lands_as_caller_is_cancelled(call)) == "went on"


def test_a_worker_call_still_times_out():
    engine = EngineClient(
        EngineConfig.model_validate(
            {"target": {"model": DEMO_TARGET}, "faults": {"call_timeout_s": 0.05}}
        )
    )

    async def never_answered():
        await engine._call(asyncio.get_running_loop().create_future())

    with pytest.raises(TimeoutError):
        asyncio.run(never_answered())
