"""The direct channel between a core and its draft (``deployments/workers/channel.py``,
``deployments/core/draft_channel.py``).

First the sockets alone (loopback, no Ray): frames whole and in order, connections that
do not show the token, or misbehave after it, refused without disturbing a connection in
use, and a peer that stops reading failing the sender instead of hanging it. Then the
core's link against a real draft actor: a channel that breaks (a message may be lost in
it without an error) starts the draft over instead of leaving it waiting for that message,
and the draft's own guards (gaps in the numbers show as a stall; a second copy of a
message is ignored)."""

import struct
import threading
import time
from dataclasses import asdict

import msgspec
import pytest
import ray
import torch

from deployments.config import ModelSpec
from deployments.core.draft_link import ActorDraftLink
from deployments.messages import (
    ChannelAddress,
    DraftItem,
    DraftPush,
    DraftRestart,
    DraftRoundMessage,
    DraftWorkerConfig,
    RoundFeedback,
    decode,
    encode,
)
from deployments.workers import channel
from deployments.workers.channel import ChannelServer, connect
from deployments.workers.draft_worker import DraftWorker
from deployments.workers.drafting import pushed_drafts
from specdec.qcodec import quantize_q
from specdec.sampling import SamplingParams, probs_for
from specdec.speculation_cache import Drafts


class _Inbox:
    """What a server's connections delivered, in order."""

    def __init__(self):
        self.frames: list[bytes] = []
        self.conns = []
        self._cv = threading.Condition()

    def __call__(self, payload, conn) -> None:
        with self._cv:
            self.frames.append(bytes(payload))
            self.conns.append(conn)
            self._cv.notify_all()

    def wait_for(self, n: int, timeout_s: float = 5.0) -> list[bytes]:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.frames) >= n, timeout_s), self.frames
            return list(self.frames)


def _server() -> tuple[ChannelServer, _Inbox]:
    inbox = _Inbox()
    return ChannelServer("127.0.0.1", inbox), inbox


def _raw(address: ChannelAddress):
    import socket

    return socket.create_connection((address.host, address.port), timeout=5)


def _read_to_end(sock) -> bytes:
    """What the server sent before it closed (a close with unread input is a reset)."""
    sock.settimeout(10)
    data = b""
    try:
        while chunk := sock.recv(64):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_frames_arrive_whole_in_order_and_replies_come_back():
    server, inbox = _server()
    client = connect(server.address)
    sizes = [0, 1, 3, 70_000, 5, 2_000_000]
    for i, n in enumerate(sizes):
        client.send(bytes([i % 256]) * n)
    frames = inbox.wait_for(len(sizes))
    assert frames == [bytes([i % 256]) * n for i, n in enumerate(sizes)]
    inbox.conns[0].send(b"reply")  # the server's side answers on the same connection
    assert client.recv() == b"reply"
    with pytest.raises(ValueError):  # over the limit: refused before a byte is written
        client.send(b"x" * (channel.MAX_FRAME_BYTES + 1))
    client.send(b"still fine")
    assert inbox.wait_for(len(sizes) + 1)[-1] == b"still fine"
    assert server.connections == 1 and server.refused == 0
    client.close()
    server.close()


@pytest.mark.parametrize(
    "attack",
    ["wrong token", "short token", "garbage length", "closes at once", "oversized frame"],
)
def test_hostile_connections_are_refused_and_the_one_in_use_keeps_working(attack):
    server, inbox = _server()
    good = connect(server.address)
    good.send(b"before")
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
        bad.sendall(struct.pack("!I", channel.MAX_FRAME_BYTES + 1) + b"x" * 64)
    if attack != "closes at once":
        # the server closes it (after its word "ok" for the one that showed the token)
        expected = struct.pack("!I", 2) + b"ok" if attack == "oversized frame" else b""
        assert _read_to_end(bad) == expected
    good.send(b"after")
    assert inbox.wait_for(2) == [b"before", b"after"]  # nothing of the attacker's
    assert _wait(lambda: server.refused == (attack != "oversized frame"), 5)
    assert server.connections == (2 if attack == "oversized frame" else 1)
    good.close()
    server.close()


def test_a_slow_handshake_is_cut_at_its_deadline_and_blocks_no_one(monkeypatch):
    """A peer that drips its handshake byte by byte gets the handshake's time in all,
    not per byte, and holds only its own thread meanwhile."""
    monkeypatch.setattr(channel, "HANDSHAKE_TIMEOUT_S", 1.0)
    server, inbox = _server()
    slow = _raw(server.address)
    start = time.monotonic()
    dripped = struct.pack("!I", 32) + server.address.token
    with pytest.raises(OSError):  # the server hangs up on it
        for byte in dripped:
            slow.sendall(bytes([byte]))
            good = connect(server.address)  # others connect meanwhile
            good.send(b"hi")
            good.close()
            time.sleep(0.1)
    assert time.monotonic() - start < 3.0  # 36 bytes x 0.1 s would be 3.6 s
    assert _wait(lambda: server.refused == 1, 5)
    assert server.connections >= 5 and set(inbox.frames) == {b"hi"}
    slow.close()
    server.close()


def test_too_many_waiting_handshakes_are_refused_at_once(monkeypatch):
    monkeypatch.setattr(channel, "MAX_HANDSHAKES", 2)
    server, inbox = _server()
    good = connect(server.address)
    stalled = [_raw(server.address) for _ in range(2)]  # hold both handshake places
    time.sleep(0.2)
    extra = _raw(server.address)
    assert _read_to_end(extra) == b""  # closed without waiting for it
    assert server.refused == 1
    good.send(b"unaffected")
    assert inbox.wait_for(1) == [b"unaffected"]
    for s in [*stalled, extra]:
        s.close()
    good.close()
    server.close()


def test_a_peer_that_stops_reading_fails_the_sender_instead_of_hanging_it(monkeypatch):
    monkeypatch.setattr(channel, "SEND_TIMEOUT_S", 0.5)
    release = threading.Event()
    server = ChannelServer("127.0.0.1", lambda payload, conn: release.wait(30))
    client = connect(server.address)
    start = time.monotonic()
    with pytest.raises(OSError):
        for _ in range(200):  # the server's reader is stuck: the buffers fill up
            client.send(b"x" * (1 << 20))
    assert time.monotonic() - start < 20
    release.set()
    client.close()
    server.close()


def test_connect_fails_on_a_wrong_token_and_keeps_it_out_of_logs():
    server, _ = _server()
    address = ChannelAddress(server.address.host, server.address.port, b"x" * 32)
    with pytest.raises(OSError):
        connect(address, timeout_s=5)
    assert "x" * 32 not in repr(address) and "token" not in repr(server.address)
    server.close()


def test_a_peer_closing_inside_a_frame_ends_only_its_reader():
    server, inbox = _server()
    client = connect(server.address)
    client.sock.sendall(struct.pack("!I", 100) + b"only part")
    client.close()
    other = connect(server.address)
    other.send(b"fine")
    assert inbox.wait_for(1) == [b"fine"]
    other.close()
    server.close()


def test_a_frame_cannot_carry_q_arrays():
    """A sampled row's push travels by Ray (its q as arrays beside the bytes); its bytes
    alone, as a channel frame would hold them, do not decode: whoever holds the token
    cannot hand the core a q of its own."""
    params = SamplingParams(temperature=0.8, max_tokens=4)
    probs = probs_for([params] * 2, torch.randn(2, 64))  # [k = 2, vocab]
    top = torch.zeros(2, 1)
    drafts = Drafts([3, 9], quantize_q(probs), top.long(), top)
    data, arrays = encode(DraftPush(4, pushed_drafts([("s", (5,), drafts)], version=1)))
    assert arrays
    with pytest.raises(msgspec.ValidationError):
        decode(DraftPush, data)


# ----- the core's link and the draft -------------------------------------------------------

PARAMS = asdict(SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
PROMPT = [5, 40, 7, 11]


def _draft_config(tiny_draft) -> DraftWorkerConfig:
    spec = ModelSpec(model=tiny_draft, num_threads=1, execution_mode="eager").model_dump()
    return DraftWorkerConfig(spec, 2, 0, False)


def _round(
    link: ActorDraftLink, committed: list[int], new: list[int], timeout_s: float = 5.0
) -> list[int]:
    """One round as the core runs it for the row ``s``, whose last round committed ``new``
    (the end of ``committed``): the message (in full if the link starts the draft over),
    then the drafts keyed by that outcome (empty if none came in time)."""
    base = len(committed) - len(new)
    restart = DraftRestart(PROMPT, committed[len(PROMPT) :], PARAMS)
    item = DraftItem("s", base, new, 3) if base > len(PROMPT) else None
    full = [DraftItem("s", 0, new, 3, restart)]
    assert link.send([item] if item else full, [], RoundFeedback(None, None, 0), lambda: full)
    got = link.gather({"s": tuple(new)}, timeout_s)
    return got.found["s"].token_ids if "s" in got.found else []


def test_a_broken_channel_starts_the_draft_over_instead_of_stalling_it(ray_local, tiny_draft):
    """The draft takes messages strictly by number, and a message written just as the
    connection breaks can vanish in the kernel without an error. The core must then start
    the draft over (a full message), or the draft would wait forever for the lost one."""
    actor = ray.remote(concurrency_groups=DraftWorker.CONCURRENCY_GROUPS)(DraftWorker)
    actor = actor.options(num_cpus=0)
    draft = actor.remote(_draft_config(tiny_draft))
    ray.get(draft.ready.remote())
    link = ActorDraftLink("actor", lambda sid: True)
    link.set_draft(draft)
    assert _wait(lambda: link.channel.connected)
    committed = list(PROMPT)
    drafts = _round(link, committed, [])
    assert len(drafts) == 3
    for _ in range(3):
        # The draft's end dies on a frame that is no message; the next message, written
        # right behind it, is lost with the connection (the write itself succeeded).
        link.channel._conn.send(b"\xc1")
        link.round += 1
        new = [*drafts[:1], 17]
        committed += new
        _round(link, committed, new, timeout_s=0.5)  # (its drafts may never come)
        assert _wait(lambda: link.channel.connected)  # it connects again
        link.round += 1
        new = [23]
        committed += new
        drafts = _round(link, committed, new)
        assert len(drafts) == 3  # the draft went on: no message left it waiting
        assert ray.get(draft.stalled_s.remote()) < 1.0  # (busy a moment after pushing)
    stats = ray.get(draft.stats.remote())
    assert stats["channel"]["connections"] == 4 and stats["messages"]["channel"] >= 4
    link.set_draft(None)
    assert not link.channel.connected
    ray.kill(draft)


def test_a_gap_in_the_numbers_shows_as_a_stall_and_a_second_copy_is_ignored(tiny_draft):
    """The draft's own guards, in process: a message whose predecessor never came makes
    ``stalled_s`` grow (the frontend replaces such a draft), and a second copy of a first
    message already handled neither restarts nor blocks it."""
    worker = DraftWorker(_draft_config(tiny_draft))
    items = [DraftItem("s", 0, [], 3, DraftRestart(PROMPT, [], PARAMS))]

    def message(no: int, first: bool, round_for: int, row: list) -> bytes:
        return encode(
            DraftRoundMessage(no, first, round_for, row, [], RoundFeedback(None, None, 0))
        )

    worker.on_round(message(10, True, 1, items))
    worker.on_round(message(11, False, 2, []))
    assert _wait(lambda: worker.stalled_s() == 0.0 and not worker._inbox)
    worker.on_round(message(10, True, 1, items))  # a second copy of message 10
    worker.on_round(message(12, False, 3, []))
    assert _wait(lambda: not worker._inbox), "message 12 waits behind the copy"
    assert worker.stalled_s() == 0.0
    worker.on_round(message(14, False, 4, []))  # 13 never comes
    time.sleep(0.3)
    assert worker.stalled_s() >= 0.25
