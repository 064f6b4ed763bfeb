"""A direct connection between an engine core and its draft actor, for the round messages.

Why: a Ray actor call costs about 1.5 ms from ``.remote()`` to the callee's thread on this
project's 2-core machine, and a round that misses the draft's prepared branches pays two
of them (the outcome out, the drafts back) on its critical path: measured at batch 1 on
the demo pair, 3 ms of a 7 ms wait for drafts, next to 6.7 ms of verification. One TCP
connection per core and draft carries the same bytes in tens of microseconds, written
straight from the sending loop's thread and read by a thread that blocks in ``recv``
(nothing polls: a Ray Compiled Graph's channels would, and on a small machine that costs
the other processes their cores).

What travels: length-prefixed frames, each one encoded message
(:func:`deployments.messages.encode` when it gives bytes). A push that carries arrays (a
sampled row's ``q``) goes by Ray instead, which moves large arrays out of band; so the
channel never carries arrays, and nothing on it is ever unpickled.

Who may connect: the draft's :class:`ChannelServer` listens on its node's address with a
random token that only Ray's control plane carries (:class:`deployments.messages.
ChannelAddress`, returned by the draft actor to its core). A connection's first frame must
be that token, whole within :data:`HANDSHAKE_TIMEOUT_S`, compared in constant time;
anything else is closed. Each connection is handled on its own thread, at most
:data:`MAX_HANDSHAKES` of them at once before the token is shown, so a stalled or hostile
peer delays nobody else. Frames above :data:`MAX_FRAME_BYTES` end their connection.

A send that cannot finish within :data:`SEND_TIMEOUT_S` (a peer that stopped reading)
raises, like a broken connection: the sender then closes the connection (a part of a frame
may have gone) and goes back to Ray calls, and the core resynchronises its draft
(:class:`deployments.core.draft_link.ActorDraftLink`).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

from deployments.messages import ChannelAddress

logger = logging.getLogger("specserve.channel")

HANDSHAKE_TIMEOUT_S = 5.0  # a peer must show the whole token within this [s]
MAX_HANDSHAKES = 16  # connections at once that have not shown the token yet
SEND_TIMEOUT_S = 5.0  # longest a frame may take to go into the kernel [s]
# A full resync of every running row (prompt and output ids, ~3 bytes a token in msgpack)
# stays far below this; a larger message goes by Ray.
MAX_FRAME_BYTES = 64 << 20
_LENGTH = struct.Struct("!I")  # a frame's payload length [bytes], network order
_ACCEPTED = b"ok"


class FrameSocket:
    """One end of a connection: whole frames out (any thread, one at a time) and in (one
    reader thread)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()
        self.closed = False
        # Sends give up after SEND_TIMEOUT_S; reads block (the socket stays in blocking
        # mode, so a reader waits as long as the line is quiet).
        timeval = struct.pack("ll", int(SEND_TIMEOUT_S), int(SEND_TIMEOUT_S % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)

    def send(self, payload: bytes) -> None:
        """Write one frame; raises OSError if the connection is gone or the peer does not
        take it in time, ValueError (nothing written) if it is over the limit."""
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {len(payload)} bytes is over {MAX_FRAME_BYTES}")
        with self._send_lock:
            self.sock.sendall(_LENGTH.pack(len(payload)) + payload)

    def recv(self) -> bytearray | None:
        """The next frame's payload; None once the peer closed the connection. Raises
        OSError (or ValueError for a frame over the limit: the connection is unusable)."""
        head = self.read_exact(_LENGTH.size)
        if head is None:
            return None
        (size,) = _LENGTH.unpack(head)
        if size > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {size} bytes is over {MAX_FRAME_BYTES}")
        payload = self.read_exact(size)
        if payload is None:
            raise ConnectionError("connection closed inside a frame")
        return payload

    def read_exact(self, size: int, deadline: float | None = None) -> bytearray | None:
        """``size`` bytes; None if the peer closed before the first. With ``deadline``
        (``time.monotonic()``), raises TimeoutError once it passes."""
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("handshake took too long")
                self.sock.settimeout(left)
            n = self.sock.recv_into(view[got:])
            if n == 0:
                if got:
                    raise ConnectionError("connection closed inside a frame")
                return None
            got += n
        return buf

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):  # (already shut by the peer)
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def read_frames(conn: FrameSocket, on_frame: Callable[[bytearray], None], name: str) -> None:
    """Hand every frame of ``conn`` to ``on_frame`` until the connection ends (a reader
    thread's body). A broken or oversized frame, or ``on_frame`` raising (a frame that is
    not the message it should be), ends it, logged; the connection is closed either way."""
    try:
        while (payload := conn.recv()) is not None:
            on_frame(payload)
    except Exception as exc:
        if not conn.closed:
            logger.warning("%s channel: connection ended: %r", name, exc)
    finally:
        conn.close()


class ChannelServer:
    """The listening end (the draft's, or the core's for output polls): accepts connections
    that show the token, and hands each frame to ``on_frame(payload, conn)`` on that
    connection's own thread; ``name`` says whose it is in the logs."""

    def __init__(
        self, host: str, on_frame: Callable[[bytearray, FrameSocket], None], name: str = "draft"
    ):
        self._on_frame = on_frame
        self.name = name
        self._token = secrets.token_bytes(32)
        self._sock = socket.create_server((host, 0), backlog=16)
        self.address = ChannelAddress(host, self._sock.getsockname()[1], self._token)
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._lock = threading.Lock()
        self.connections = 0  # accepted (token shown)
        self.refused = 0  # closed at the handshake
        threading.Thread(target=self._accept, name="specserve-channel", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:  # closed
                return
            if not self._handshakes.acquire(blocking=False):  # too many waiting peers
                self._count_refused("too many handshakes at once")
                sock.close()
                continue
            try:
                threading.Thread(
                    target=self._serve, args=(sock,), name="specserve-channel-conn", daemon=True
                ).start()
            except RuntimeError as exc:  # no thread to spare: refuse this one, go on
                self._handshakes.release()
                self._count_refused(repr(exc))
                sock.close()

    def _serve(self, sock: socket.socket) -> None:
        try:
            try:
                conn = FrameSocket(sock)
                self._check_token(conn)
            finally:  # (before the peer hears back: its place is free when it does)
                self._handshakes.release()
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections += 1
            conn.send(_ACCEPTED)
        except OSError as exc:  # (PermissionError and TimeoutError are)
            self._count_refused(repr(exc))
            sock.close()
            return
        read_frames(conn, lambda payload: self._on_frame(payload, conn), self.name)

    def _check_token(self, conn: FrameSocket) -> None:
        """The connection's first frame is the whole token within the handshake's time,
        or it is refused (PermissionError, TimeoutError)."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        head = conn.read_exact(_LENGTH.size, deadline)
        if head is None or _LENGTH.unpack(head)[0] != len(self._token):
            raise PermissionError("not a channel handshake")
        shown = conn.read_exact(len(self._token), deadline)
        if not hmac.compare_digest(bytes(shown or b""), self._token):
            raise PermissionError("wrong token")

    def _count_refused(self, why: str) -> None:
        with self._lock:
            self.refused += 1
        logger.warning("%s channel: refused a connection: %s", self.name, why)

    def close(self) -> None:
        self._sock.close()


def connect(address: ChannelAddress, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> FrameSocket:
    """The core's end: connect, show the token and wait for the server's word (raises
    OSError, e.g. PermissionError or TimeoutError, if it does not come within
    ``timeout_s``). The server is the one at the address the draft gave over Ray."""
    sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
    try:
        conn = FrameSocket(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.send(address.token)
        if conn.recv() != _ACCEPTED:
            raise PermissionError("the listener refused the channel")
        sock.settimeout(None)
    except BaseException:
        with contextlib.suppress(OSError):
            sock.close()
        raise
    return conn
