"""The retention buffer: what is kept per domain, for how long, and what an operator can
drop (pure logic, no Ray; the deployment's wiring is tests/deployments/test_serve_engine.py)."""

import json
import stat

import pytest

from adaptation.config import RetentionConfig
from adaptation.retention import RetainedRequest, RetentionBuffer


class Clock:
    """Unix seconds the test moves by hand."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def req(domain: str, n_prompt: int, n_out: int, at: float, first: int = 5) -> RetainedRequest:
    prompt = tuple(range(first, first + n_prompt))
    return RetainedRequest(domain, prompt, tuple(range(100, 100 + n_out)), at)


def buffer(clock=None, **settings) -> RetentionBuffer:
    return RetentionBuffer(RetentionConfig(enabled=True, **settings), clock or Clock())


def test_only_allowed_domains_are_kept():
    buf = buffer(domains=["python"])
    assert buf.add(req("python", 3, 2, 1_000_000.0))
    assert not buf.add(req("prose", 3, 2, 1_000_000.0))
    assert set(buf.summary()) == {"python"}
    assert buf.records("prose") == []


def test_the_oldest_requests_make_room_under_the_token_cap():
    buf = buffer(max_tokens_per_domain=20)
    first, second, third = (req("d", 5, 3, 1_000_000.0 + i, first=10 * i) for i in range(3))
    for r in (first, second):
        assert buf.add(r)
    assert buf.summary()["d"].tokens == 16
    assert buf.add(third)  # 24 > 20: the first goes
    assert [r.prompt_token_ids for r in buf.records("d")] == [
        second.prompt_token_ids,
        third.prompt_token_ids,
    ]
    assert buf.summary()["d"].tokens == 16
    # A request larger than the cap, or than max_request_tokens, is never kept.
    assert not buf.add(req("d", 15, 6, 1_000_000.0))
    assert not buffer(max_request_tokens=7).add(req("d", 5, 3, 1_000_000.0))
    assert not buf.add(RetainedRequest("d", (), (1, 2), 1_000_000.0))  # nothing to learn


def test_requests_past_their_age_are_dropped():
    """Ages run on the buffer's clock from when a request was kept, whatever time its
    sender claimed (a replica's clock ahead would otherwise keep it, and every request
    behind it, for longer)."""
    clock = Clock()
    buf = buffer(clock, max_age_s=60.0)
    buf.add(req("d", 3, 2, clock.now + 3600))  # a sender's clock an hour ahead
    clock.now += 40
    buf.add(req("d", 3, 2, float("nan"), first=50))
    assert buf.summary()["d"].requests == 2
    assert buf.summary()["d"].oldest_age_s == pytest.approx(40.0)
    clock.now += 30  # the first is now 70 s old
    assert [r.prompt_token_ids[0] for r in buf.records("d")] == [50]
    clock.now += 60
    assert buf.summary() == {} and buf.records("d") == []


def test_an_idle_domain_ages_out_at_a_sweep_from_memory_and_disk(tmp_path):
    clock = Clock()
    buf = buffer(clock, max_age_s=60.0, directory=str(tmp_path))
    buf.add(req("idle", 3, 2, 0.0))
    assert len(list(tmp_path.iterdir())) == 1 and buf.sweep_interval_s() == 15.0
    clock.now += 61
    buf.sweep()  # the deployment's periodic call; nothing else touched the domain
    assert buf._kept == {} and list(tmp_path.iterdir()) == []


def test_requests_the_token_cap_evicts_leave_the_file_at_the_next_sweep(tmp_path):
    buf = buffer(max_tokens_per_domain=16, directory=str(tmp_path))
    for i in range(3):  # 8 tokens each: the first goes at the third
        buf.add(req("d", 5, 3, 0.0, first=10 * i))
    (path,) = tmp_path.iterdir()
    assert len(path.read_text().splitlines()) == 3  # appended, not rewritten per request
    buf.sweep()
    firsts = [json.loads(x)["prompt_token_ids"][0] for x in path.read_text().splitlines()]
    assert firsts == [10, 20]


def test_an_operator_drops_a_domain():
    buf = buffer()
    for i in range(3):
        buf.add(req("python", 3, 2, 1_000_000.0 + i))
    buf.add(req("prose", 3, 2, 1_000_000.0))
    assert buf.drop("python") == 3
    assert buf.drop("python") == 0
    assert set(buf.summary()) == {"prose"}


def test_a_directory_keeps_requests_across_restarts(tmp_path):
    clock = Clock()
    where = tmp_path / "kept"
    buf = buffer(clock, directory=str(where), domains=["python", "prose", "../../etc/passwd"])
    kept = [req("python", 4, 3, 0.0, first=f) for f in (5, 9)]
    for r in kept:
        buf.add(r)
        clock.now += 1
    buf.add(req("prose", 2, 2, clock.now))
    buf.add(req("../../etc/passwd", 2, 2, clock.now))  # a client's domain name: a hash
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    files = sorted(where.iterdir())
    assert len(files) == 3 and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert all(f.parent == where and "passwd" not in f.name for f in files)
    # A line that does not parse is left out, not fatal.
    with open(next(f for f in files if "prose" in f.read_text()), "a") as f:
        f.write("{not json\n")

    (where / "stray.tmp").write_text("a crash's leftover")
    again = buffer(clock, directory=str(where), domains=["python", "prose"])
    back = again.records("python")
    assert [(r.prompt_token_ids, r.output_token_ids) for r in back] == [
        (r.prompt_token_ids, r.output_token_ids) for r in kept
    ]
    assert [r.finished_at for r in back] == [clock.now - 2, clock.now - 1]  # as kept
    assert again.summary()["prose"].requests == 1
    # The domain no longer allowed is gone, from memory and from disk.
    assert "../../etc/passwd" not in again.summary()
    assert len(list(where.iterdir())) == 2
    assert again.drop("python") == 2
    assert len(list(where.iterdir())) == 1
    lines = [json.loads(x) for f in where.iterdir() for x in f.read_text().splitlines()]
    assert [x["domain"] for x in lines] == ["prose"]


def test_a_restart_applies_todays_bounds(tmp_path):
    clock = Clock()
    buffer(clock, directory=str(tmp_path)).add(req("d", 3, 2, 0.0))
    clock.now += 120
    again = buffer(clock, directory=str(tmp_path), max_age_s=60.0)
    assert again._kept == {} and list(tmp_path.iterdir()) == []  # at once, not lazily
    (tmp_path / "x.jsonl").write_bytes(b"\xff\xfe not utf-8")
    assert buffer(clock, directory=str(tmp_path)).summary() == {}  # an unreadable file


def test_settings_are_checked():
    with pytest.raises(ValueError, match="max_tokens_per_domain"):
        RetentionConfig(enabled=True, max_tokens_per_domain=0)
    with pytest.raises(ValueError, match="max_age_s"):
        RetentionConfig(enabled=True, max_age_s=0)
    with pytest.raises(ValueError, match="extra"):
        RetentionConfig(enabled=True, keep_forever=True)
