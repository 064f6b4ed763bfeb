"""The engine core's end of the direct channel to its draft actor
(:mod:`deployments.workers.channel` says why it exists and what it carries).

It connects off the loop for each new draft, writes round messages from the caller's (the
loop's) thread, hands every push it reads to the link, and when the connection breaks
tells the link at once (``on_break``): a message written just before a break may be lost
inside the kernel without an error, and the draft takes messages strictly in order, so
the link's next message must be a full resynchronisation (``first``), whichever way it
goes. It then reconnects, a few times per draft; meanwhile, and for good after that, the
link sends by Ray calls.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import ray

from deployments.workers.channel import FrameSocket, connect, read_frames

logger = logging.getLogger("specserve.draft_channel")


class CoreChannel:
    """A connection to the current draft's channel, or none (then the link uses Ray)."""

    RECONNECTS = 3  # per draft, after a break
    TIMEOUT_S = 10.0  # longest wait for a draft's address and handshake [s]

    def __init__(self, on_push: Callable[[bytearray], None], on_break: Callable[[], None]):
        self._on_push = on_push
        self._on_break = on_break
        self._lock = threading.Lock()
        self._generation = 0  # grows with every draft set: a stale connect is dropped
        self._draft = None  # the draft actor connected to (or being connected to)
        self._conn: FrameSocket | None = None
        self._reconnects = 0
        self.sent = {"channel": 0, "ray": 0}  # round messages, by route (the loop's count)

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def open(self, draft) -> None:
        """Connect to ``draft`` from now on (None: to nothing), dropping any connection
        to the one before (its reader ends; no break is reported for it)."""
        with self._lock:
            self._generation += 1
            generation, conn, self._conn = self._generation, self._conn, None
            self._draft, self._reconnects = draft, self.RECONNECTS
        if conn is not None:
            conn.close()
        if draft is not None:
            self._start(draft, generation)

    def send(self, wire: bytes) -> bool:
        """Write one message; False if there is no connection, the message is over the
        frame limit (nothing written), or the connection broke (``on_break`` was called
        before this returns)."""
        conn = self._conn
        if conn is None:
            self.sent["ray"] += 1
            return False
        try:
            conn.send(wire)
        except ValueError:  # too large for a frame: this one goes by Ray
            self.sent["ray"] += 1
            return False
        except OSError as exc:
            logger.warning("direct channel to the draft failed (%r)", exc)
            self._drop(conn)
            self.sent["ray"] += 1
            return False
        self.sent["channel"] += 1
        return True

    def _start(self, draft, generation: int) -> None:
        threading.Thread(
            target=self._run, args=(draft, generation), name="specserve-channel", daemon=True
        ).start()

    def _run(self, draft, generation: int) -> None:
        """Connect, then read pushes until the connection ends (this thread's life)."""
        try:
            address = ray.get(draft.channel_address.remote(), timeout=self.TIMEOUT_S)
            conn = connect(address, self.TIMEOUT_S)
        except Exception as exc:
            logger.warning("no direct channel to the draft (%r): messages go by Ray", exc)
            return
        with self._lock:
            stale = generation != self._generation
            if not stale:
                self._conn = conn
        if stale:  # another draft was set meanwhile
            conn.close()
            return
        logger.info("direct channel to the draft at %s:%d", address.host, address.port)
        try:
            read_frames(conn, self._on_push, "core")
        finally:
            self._drop(conn)

    def _drop(self, conn: FrameSocket) -> None:
        """``conn`` ended (a failed send, or its reader saw the end): close it and, if it
        was the current one, report the break and connect again (a few times a draft)."""
        with self._lock:
            current = self._conn is conn
            if current:
                self._conn = None
            again = current and self._reconnects > 0
            if again:
                self._reconnects -= 1
            draft, generation = self._draft, self._generation
        conn.close()
        if current:
            self._on_break()
        if again:
            self._start(draft, generation)
