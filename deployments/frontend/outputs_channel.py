"""The replica's direct channel to its engine core's outputs.

Why: the replica long-polls the core for committed tokens once per round. As a Ray actor
call that poll cost, profiled with py-spy at batch 1 on the demo pair (speculation off,
HTTP), about 10 % of a core in the replica submitting calls and 23 % of a core on the
core's poll thread, next to the loop's 93 %, on a machine with 2 cores. Over the direct
channel (:mod:`deployments.workers.channel`) a poll is one small frame each way: the same
question (:class:`deployments.messages.OutputsRequest`: cursor, timeout) and the same
answer (an encoded :class:`deployments.messages.EngineCoreOutputs`), so acknowledgement
and replay after a failure are unchanged.

A poll that breaks (the core died, or its connection did) goes by Ray instead, and the Ray
call tells a dead core from a live one exactly as before; a poll that times out counts as
a hung core, as a Ray call's timeout does. Connecting happens beside the polls (they go by
Ray until it is done, so a firewall that drops the packets delays no output); a core that
cannot be reached is not tried again, and after a break the channel connects again, a few
times per core, then stays on Ray.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from deployments.messages import OutputsRequest
from deployments.workers.channel import FrameSocket, connect

logger = logging.getLogger("specserve.outputs_channel")


class OutputsChannel:
    """One connection at a time, to the current core (the replica's ``_poll`` task is its
    only user)."""

    RECONNECTS = 3  # per core, after a break
    CONNECT_TIMEOUT_S = 10.0

    def __init__(self):
        self._target = None  # the core connected to (or being connected to)
        self._conn: FrameSocket | None = None
        self._connecting: asyncio.Task | None = None
        self._reconnects = 0  # connects left for this core
        self.polls = {"channel": 0, "ray": 0}  # by route

    async def poll(self, target, cursor: int, timeout_s: float, deadline_s: float):
        """The core's encoded outputs after ``cursor`` (a bytearray), or None: poll by Ray
        this time. Raises ``asyncio.TimeoutError`` if no answer comes in ``deadline_s``."""
        conn = self._connection(target)
        if conn is None:
            self.polls["ray"] += 1
            return None
        request = msgspec.msgpack.encode(OutputsRequest(cursor, timeout_s))
        try:
            async with asyncio.timeout(deadline_s):
                wire = await asyncio.to_thread(_ask, conn, request)
        except TimeoutError:
            self._drop()  # (its thread ends as the connection closes)
            raise
        except (OSError, ValueError) as exc:
            logger.warning("outputs channel to the core broke (%r): polling by Ray", exc)
            self._drop()
            self.polls["ray"] += 1
            return None
        except BaseException:  # cancelled: an answer may still come on it, for nobody
            self._drop()
            raise
        self.polls["channel"] += 1
        return wire

    def _connection(self, target) -> FrameSocket | None:
        """The connection to ``target`` if there is one; else starts connecting (beside
        the polls) while connects are left for it."""
        if target is not self._target:
            self.close()
            self._target, self._reconnects = target, self.RECONNECTS + 1
        idle = self._connecting is None or self._connecting.done()
        if self._conn is None and idle and self._reconnects > 0 and target is not None:
            self._reconnects -= 1
            self._connecting = asyncio.create_task(self._connect(target))
        return self._conn

    async def _connect(self, target) -> None:
        try:
            async with asyncio.timeout(self.CONNECT_TIMEOUT_S):
                address = await target.outputs_channel_address.remote()
            conn = await asyncio.to_thread(connect, address, self.CONNECT_TIMEOUT_S)
        except Exception as exc:  # (a core that cannot answer is the Ray poll's to see)
            logger.warning("no outputs channel to the core (%r): polling by Ray", exc)
            if target is self._target:
                self._reconnects = 0  # unreachable: not tried again (a break is)
            return
        if target is self._target and self._conn is None:
            self._conn = conn
        else:  # replaced or closed meanwhile
            conn.close()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        self._drop()
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        self._target = None


def _ask(conn: FrameSocket, request: bytes) -> bytearray:
    """One poll, in a worker thread: the question out, the answer back."""
    conn.send(request)
    wire = conn.recv()
    if wire is None:
        raise ConnectionError("the core closed the outputs channel")
    return wire
