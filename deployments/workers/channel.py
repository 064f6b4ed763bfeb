"""A direct connection between an engine core and its draft actor, for the round messages.

Why: a Ray actor call costs about 1.5 ms from ``.remote()`` to the callee's thread on this
project's 2-core machine, and a round that misses the draft's prepared branches pays two
of them (the outcome out, the drafts back) on its critical path: measured at batch 1 on
the demo pair, 3 ms of a 7 ms wait for drafts, next to 6.7 ms of verification. One TCP
connection per core and draft carries the same bytes in tens of microseconds, written
straight from the sending loop's thread and read by a thread that blocks in ``recv``
(nothing polls: a Ray Compiled Graph's channels would, and on a small machine that costs
the other processes their cores).

What travels: length-prefixed frames. A frame's payload is the msgpack array
``[message bytes, [[dtype, shape, raw bytes], ...]]`` of a :data:`deployments.messages.Wire`
(:func:`pack`, :func:`unpack`); nothing on the channel is ever unpickled.

Who may connect: the draft's :class:`ChannelServer` listens on its node's address with a
random token that only Ray's control plane carries (:class:`deployments.messages.
ChannelAddress`, returned by the draft actor to its core). A connection's first frame must
be that token within :data:`HANDSHAKE_TIMEOUT_S`, compared in constant time; anything else
is closed, and each connection is handled on its own thread, so a stalled or hostile peer
delays nobody else. Frames above :data:`MAX_FRAME_BYTES` end their connection.

Ray stays the fallback: a core that cannot connect, or whose connection breaks, sends by
actor calls again (the draft orders messages by number, whichever way they came).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Callable

import msgspec
import numpy as np

from deployments.messages import ChannelAddress, Wire

logger = logging.getLogger("specserve.channel")

HANDSHAKE_TIMEOUT_S = 5.0  # a peer must connect and show the token within this [s]
MAX_FRAME_BYTES = 256 << 20  # a batch-32 push of dense 16-bit q at 128k vocab is ~41 MB
_LENGTH = struct.Struct("!I")  # a frame's payload length [bytes], network order
_ACCEPTED = b"ok"
_Payload = tuple[bytes, list[tuple[str, list[int], bytearray]]]  # message, [dtype, shape, data]


def pack(wire: Wire) -> bytes:
    """A frame's payload: the message's bytes and each array's dtype, shape and bytes."""
    data, arrays = (wire, []) if isinstance(wire, bytes) else wire
    parts = [
        [a.dtype.str, list(a.shape), np.ascontiguousarray(a).reshape(-1).view(np.uint8).data]
        for a in arrays
    ]
    return msgspec.msgpack.encode([data, parts])


def unpack(payload: bytes) -> Wire:
    """The :data:`Wire` that :func:`pack` wrote (its arrays writable, as torch wants)."""
    data, parts = msgspec.msgpack.decode(payload, type=_Payload)
    if not parts:
        return data
    return data, [np.frombuffer(raw, dtype=np.dtype(dt)).reshape(shape) for dt, shape, raw in parts]


class FrameSocket:
    """One end of a connection: whole frames out (any thread, one at a time) and in (one
    reader thread)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, payload: bytes) -> None:
        """Write one frame; raises OSError if the connection is gone."""
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {len(payload)} bytes is over {MAX_FRAME_BYTES}")
        with self._send_lock:
            self.sock.sendall(_LENGTH.pack(len(payload)) + payload)

    def recv(self) -> bytes | None:
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

    def read_exact(self, size: int) -> bytes | None:
        """``size`` bytes; None if the peer closed before the first."""
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = self.sock.recv_into(view[got:])
            if n == 0:
                if got:
                    raise ConnectionError("connection closed inside a frame")
                return None
            got += n
        return bytes(buf)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):  # (already shut by the peer)
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def read_frames(conn: FrameSocket, on_frame: Callable[[bytes], None], name: str) -> None:
    """Hand every frame of ``conn`` to ``on_frame`` until the connection ends (a reader
    thread's body); a broken or oversized frame ends it, logged."""
    try:
        while (payload := conn.recv()) is not None:
            on_frame(payload)
    except (OSError, ValueError) as exc:
        if not conn.closed:
            logger.warning("%s: connection ended: %r", name, exc)
    finally:
        conn.close()


class ChannelServer:
    """The draft's listening end: accepts connections that show the token, and hands each
    frame to ``on_frame(payload, conn)`` on that connection's own thread."""

    def __init__(self, host: str, on_frame: Callable[[bytes, FrameSocket], None]):
        self._on_frame = on_frame
        self._token = secrets.token_bytes(32)
        self._sock = socket.create_server((host, 0), backlog=16)
        self.address = ChannelAddress(host, self._sock.getsockname()[1], self._token)
        self.connections = 0  # accepted (token shown)
        self.refused = 0  # closed at the handshake
        threading.Thread(target=self._accept, name="specserve-channel", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(
                target=self._serve, args=(sock,), name="specserve-channel-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = FrameSocket(sock)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            self._check_token(conn)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.send(_ACCEPTED)
        except OSError as exc:  # (PermissionError is one)
            self.refused += 1
            logger.warning("channel: refused a connection: %r", exc)
            conn.close()
            return
        self.connections += 1
        read_frames(conn, lambda payload: self._on_frame(payload, conn), "channel")

    def _check_token(self, conn: FrameSocket) -> None:
        """The connection's first frame is the token, or it is refused (PermissionError)."""
        head = conn.read_exact(_LENGTH.size)
        if head is None or _LENGTH.unpack(head)[0] != len(self._token):
            raise PermissionError("not a channel handshake")
        if not hmac.compare_digest(conn.read_exact(len(self._token)) or b"", self._token):
            raise PermissionError("wrong token")

    def close(self) -> None:
        self._sock.close()


def connect(address: ChannelAddress, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> FrameSocket:
    """The core's end: connect, show the token and wait for the server's word (raises
    OSError or PermissionError if it does not come within ``timeout_s``)."""
    sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
    conn = FrameSocket(sock)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.send(address.token)
        if conn.recv() != _ACCEPTED:
            raise PermissionError("the draft refused the channel")
        sock.settimeout(None)
    except BaseException:
        conn.close()
        raise
    return conn
