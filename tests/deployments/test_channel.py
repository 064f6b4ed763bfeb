"""The direct channel between a core and its draft (``deployments/workers/channel.py``):
frames whole and in order, the wire's arrays intact, and connections that do not show the
token (or misbehave after it) refused without disturbing a connection in use. Real
sockets on the loopback interface, no Ray."""

import queue
import socket
import struct
import time

import numpy as np
import pytest
import torch

from deployments.messages import (
    ChannelAddress,
    DraftPush,
    DraftStatus,
    decode,
    encode,
)
from deployments.workers import channel
from deployments.workers.channel import ChannelServer, connect, pack, unpack
from deployments.workers.drafting import pushed_drafts
from specdec.qcodec import quantize_q
from specdec.sampling import SamplingParams, probs_for
from specdec.speculation_cache import Drafts


def _server():
    got: queue.Queue = queue.Queue()
    server = ChannelServer("127.0.0.1", lambda payload, conn: got.put((payload, conn)))
    return server, got


def _echo_until(conn, got, payload: bytes) -> bytes:
    """Send ``payload`` on a client connection and return what the server received."""
    conn.send(payload)
    received, _ = got.get(timeout=5)
    return received


def test_wire_round_trip_keeps_bytes_and_arrays():
    assert unpack(pack(b"\x01\x02")) == b"\x01\x02"
    arrays = [
        np.arange(15, dtype=np.float16).reshape(3, 5),
        np.array([7, -1], dtype=np.int64),
        np.zeros((0, 4), dtype=np.int32),
        np.arange(12, dtype=np.float32).reshape(3, 4).T,  # not contiguous
    ]
    data, back = unpack(pack((b"msg", arrays)))
    assert data == b"msg" and len(back) == len(arrays)
    for a, b in zip(arrays, back, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_a_sampled_push_survives_the_channel():
    """A push with a sampled row's 16-bit q, as the draft builds it, decodes to the same
    message after the channel's framing."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4)
    probs = probs_for([params] * 2, torch.randn(2, 64))  # [k=2, vocab]
    top = torch.zeros(2, 1)
    drafts = Drafts([3, 9], quantize_q(probs), top.long(), top)
    push = DraftPush(4, pushed_drafts([("req-1", (5,), drafts)], version=2))
    wire = encode(push)
    assert not isinstance(wire, bytes)  # q travels as an array
    again = decode(DraftPush, unpack(pack(wire)))
    assert again.round_for == 4 and again.drafts[0].token_ids == [3, 9]
    assert again.drafts[0].status is DraftStatus.DRAFTS and again.drafts[0].draft_version == 2
    assert torch.equal(again.drafts[0].q.weights("cpu"), push.drafts[0].q.weights("cpu"))


def test_frames_arrive_whole_in_order_and_replies_come_back():
    server, got = _server()
    client = connect(server.address)
    sizes = [0, 1, 3, 70_000, 5, 2_000_000]
    for i, n in enumerate(sizes):
        client.send(bytes([i % 256]) * n)
    for i, n in enumerate(sizes):
        payload, conn = got.get(timeout=5)
        assert payload == bytes([i % 256]) * n
    conn.send(b"reply")  # the server's side answers on the same connection
    assert client.recv() == b"reply"
    assert server.connections == 1 and server.refused == 0
    client.close()
    server.close()


def _raw(address: ChannelAddress) -> socket.socket:
    return socket.create_connection((address.host, address.port), timeout=5)


@pytest.mark.parametrize(
    "attack",
    ["wrong token", "short token", "garbage length", "closes at once", "oversized frame"],
)
def test_hostile_connections_are_refused_and_the_one_in_use_keeps_working(attack):
    server, got = _server()
    good = connect(server.address)
    assert _echo_until(good, got, b"before") == b"before"
    bad = _raw(server.address)
    if attack == "wrong token":
        bad.sendall(struct.pack("!I", 32) + bytes(32))
    elif attack == "short token":
        bad.sendall(struct.pack("!I", 3) + server.address.token[:3])
    elif attack == "garbage length":
        bad.sendall(b"\xff" * 40)
    elif attack == "closes at once":
        bad.close()
    else:  # shows the token, then announces a frame past the limit
        bad.sendall(struct.pack("!I", 32) + server.address.token)
        assert bad.recv(16)  # the server's word: accepted
        bad.sendall(struct.pack("!I", channel.MAX_FRAME_BYTES + 1) + b"x" * 64)
    if attack != "closes at once":
        bad.settimeout(5)
        # the server closes the connection (after its word, for the accepted one)
        tail = b""
        while chunk := bad.recv(64):
            tail += chunk
        assert tail in (b"", struct.pack("!I", 2) + b"ok")
    assert _echo_until(good, got, b"after") == b"after"
    assert got.empty()  # nothing of the attacker reached the draft
    if attack in ("wrong token", "short token", "garbage length"):
        deadline = time.monotonic() + 5
        while server.refused < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.refused == 1
    assert server.connections == (2 if attack == "oversized frame" else 1)
    good.close()
    server.close()


def test_a_stalled_peer_blocks_no_other_connection(monkeypatch):
    """A peer that connects and says nothing holds only its own thread, and is dropped
    at the handshake deadline."""
    monkeypatch.setattr(channel, "HANDSHAKE_TIMEOUT_S", 0.5)
    server, got = _server()
    stalled = _raw(server.address)
    good = connect(server.address)  # connects while the stalled one waits
    assert _echo_until(good, got, b"hello") == b"hello"
    stalled.settimeout(5)
    assert stalled.recv(1) == b""  # dropped at the deadline
    assert server.refused == 1
    stalled.close()
    good.close()
    server.close()


def test_connect_fails_on_a_wrong_token_instead_of_hanging():
    server, _ = _server()
    address = ChannelAddress(server.address.host, server.address.port, b"x" * 32)
    with pytest.raises(OSError):
        connect(address, timeout_s=5)
    assert repr(address).count("x") == 0  # the token stays out of logs
    server.close()


def test_a_peer_closing_inside_a_frame_ends_only_its_reader():
    server, got = _server()
    client = connect(server.address)
    client.sock.sendall(struct.pack("!I", 100) + b"only part")
    client.close()
    other = connect(server.address)
    assert _echo_until(other, got, b"fine") == b"fine"
    other.close()
    server.close()
