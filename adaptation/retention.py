"""Finished requests kept per traffic domain: the data a draft can be adapted on.

Why the committed tokens: they are the target's own samples of its distribution, so
sequence-level distillation on them needs no extra target pass. Why bounded per domain
(tokens and age) and only for allowed domains: the prompt is user text, and whatever is
kept must be something an operator chose to keep, can list, and can drop at once.

Pure logic (no Ray); :class:`adaptation.deployment.AdaptationDeployment` holds one buffer
for the whole application.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from adaptation.config import RetentionConfig

logger = logging.getLogger("specserve.adaptation")


@dataclass(frozen=True, slots=True)
class RetainedRequest:
    """One finished request, as training data."""

    domain: str  # the traffic domain it was served under
    prompt_token_ids: tuple[int, ...]  # [prompt_len] what the client sent, tokenized
    output_token_ids: tuple[int, ...]  # [output_len] what the target committed
    finished_at: float  # unix seconds

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def to_json(self) -> str:
        return json.dumps(
            {
                "domain": self.domain,
                "prompt_token_ids": list(self.prompt_token_ids),
                "output_token_ids": list(self.output_token_ids),
                "finished_at": self.finished_at,
            }
        )

    @classmethod
    def from_json(cls, line: str) -> RetainedRequest:
        """Parse one stored line; raises ValueError (or KeyError/TypeError) if malformed."""
        raw = json.loads(line)
        record = cls(
            str(raw["domain"]),
            tuple(int(t) for t in raw["prompt_token_ids"]),
            tuple(int(t) for t in raw["output_token_ids"]),
            float(raw["finished_at"]),
        )
        if not record.prompt_token_ids:
            raise ValueError("a retained request has no prompt")
        if not math.isfinite(record.finished_at):
            raise ValueError("a retained request has no finishing time")
        return record


@dataclass(frozen=True, slots=True)
class DomainSummary:
    """What is kept for one domain (no token ids: safe to log and to show)."""

    requests: int
    tokens: int
    oldest_age_s: float  # seconds since the oldest kept request finished


class RetentionBuffer:
    """Retained requests per domain, bounded by ``config``; optionally mirrored to files.

    A request is stamped with this buffer's clock when kept (whatever the sender said),
    so each domain's requests are in age order and the oldest go first. ``clock`` gives
    unix seconds (a parameter so that tests can age records without waiting).

    Files: a kept request is appended to its domain's file; requests that leave by the
    token cap leave the file at the next :meth:`sweep` (the deployment sweeps every
    :meth:`sweep_interval_s`), those that leave by age or a drop at once."""

    def __init__(self, config: RetentionConfig, clock: Callable[[], float] = time.time):
        self.config = config
        self._clock = clock
        self._allowed = None if config.domains is None else frozenset(config.domains)
        self._kept: dict[str, deque[RetainedRequest]] = {}  # domain -> oldest first
        self._tokens: dict[str, int] = {}  # domain -> tokens kept
        self._stale: set[str] = set()  # domains whose file holds requests no longer kept
        self._dir = Path(config.directory).expanduser() if config.directory else None
        if self._dir is not None:
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._dir.chmod(0o700)  # (mkdir's mode applies to a new directory only)
            self._load()

    def allows(self, domain: str) -> bool:
        return self._allowed is None or domain in self._allowed

    def sweep_interval_s(self) -> float:
        """How often :meth:`sweep` should run: a quarter of the age limit, at most 60 s."""
        return min(60.0, self.config.max_age_s / 4)

    def add(self, record: RetainedRequest, stamp: bool = True) -> bool:
        """Keep ``record`` if its domain is allowed and it fits; returns whether it was
        kept. ``stamp``: it finished now (this buffer's clock), else at its own time (a
        stored record read back; one already past ``max_age_s`` is not kept). The
        domain's oldest requests make room, and any past ``max_age_s`` go."""
        cfg, now = self.config, self._clock()
        if not self.allows(record.domain) or not record.prompt_token_ids:
            return False
        if record.num_tokens > min(cfg.max_request_tokens, cfg.max_tokens_per_domain):
            return False
        if stamp:
            record = dataclasses.replace(record, finished_at=now)
        elif not now - record.finished_at <= cfg.max_age_s:  # (NaN is never kept)
            return False
        domain = record.domain
        if self._expire(domain, now):  # (may delete the deque)
            self._rewrite(domain)
        kept = self._kept.setdefault(domain, deque())
        while kept and self._tokens[domain] + record.num_tokens > cfg.max_tokens_per_domain:
            self._tokens[domain] -= kept.popleft().num_tokens
            self._stale.add(domain)
        kept.append(record)
        self._tokens[domain] = self._tokens.get(domain, 0) + record.num_tokens
        self._append(record)
        return True

    def now(self) -> float:
        """This buffer's clock (what requests are stamped with) [s]."""
        return self._clock()

    def records(self, domain: str) -> list[RetainedRequest]:
        """The domain's kept requests, oldest first (expired ones dropped first)."""
        if self._expire(domain, self._clock()):
            self._rewrite(domain)
        return list(self._kept.get(domain, ()))

    def drop(self, domain: str) -> int:
        """Forget every request of ``domain`` (memory and file); returns how many."""
        gone = len(self._kept.pop(domain, ()))
        self._tokens.pop(domain, None)
        self._stale.discard(domain)
        if self._dir is not None:
            self._file(domain).unlink(missing_ok=True)
        return gone

    def sweep(self) -> None:
        """Drop every domain's expired requests and bring every file in line with what is
        kept (idle domains age out too)."""
        now = self._clock()
        for domain in list(self._kept):
            if self._expire(domain, now) or domain in self._stale:
                self._rewrite(domain)
        for domain in list(self._stale):  # (domains emptied meanwhile)
            self._rewrite(domain)

    def summary(self) -> dict[str, DomainSummary]:
        """Per domain with anything kept: counts and the oldest's age (expired dropped)."""
        self.sweep()
        now = self._clock()
        return {
            domain: DomainSummary(len(kept), self._tokens[domain], now - kept[0].finished_at)
            for domain, kept in self._kept.items()
            if kept
        }

    # ----- bounds and files -------------------------------------------------------------

    def _expire(self, domain: str, now: float) -> int:
        """Drop the domain's requests older than ``max_age_s``; returns how many."""
        kept = self._kept.get(domain)
        removed = 0
        while kept and not now - kept[0].finished_at <= self.config.max_age_s:
            self._tokens[domain] -= kept.popleft().num_tokens
            removed += 1
        if kept is not None and not kept:
            del self._kept[domain]
            self._tokens.pop(domain, None)
        return removed

    def _file(self, domain: str) -> Path:
        """The domain's file: named by a hash, since domain names come from clients."""
        assert self._dir is not None
        return self._dir / (hashlib.sha256(domain.encode()).hexdigest()[:32] + ".jsonl")

    def _append(self, record: RetainedRequest) -> None:
        if self._dir is None:
            return
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
        with os.fdopen(os.open(self._file(record.domain), flags, 0o600), "a") as f:
            f.write(record.to_json() + "\n")

    def _rewrite(self, domain: str) -> None:
        """Write the domain's file anew from memory (after something was removed), through
        a new temporary file and a rename, so a crash leaves the old file or the new one."""
        self._stale.discard(domain)
        if self._dir is None:
            return
        path = self._file(domain)
        kept = self._kept.get(domain)
        if not kept:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        with os.fdopen(os.open(tmp, flags, 0o600), "w") as f:
            f.writelines(r.to_json() + "\n" for r in kept)
        os.replace(tmp, path)

    def _load(self) -> None:
        """Read the directory's files back, under today's bounds: records of domains no
        longer allowed, expired or past the token cap are dropped, and so are lines that
        do not parse (counted in the log) and temporary files a crash left."""
        assert self._dir is not None
        bad = 0
        records: list[RetainedRequest] = []
        for path in sorted(self._dir.glob("*.tmp")):
            path.unlink()
        for path in sorted(self._dir.glob("*.jsonl")):
            try:
                lines = path.read_text().splitlines()
            except (OSError, UnicodeDecodeError):
                lines, bad = [], bad + 1
            parsed, unreadable = _read_lines(lines)
            records += parsed
            bad += unreadable
            path.unlink()  # rewritten below from what is kept
        records.sort(key=lambda r: r.finished_at)
        kept = sum(self.add(r, stamp=False) for r in records)
        self.sweep()
        logger.info(
            "retention: %d requests read back from %s (%d dropped by today's bounds, "
            "%d unreadable lines or files)",
            kept,
            self._dir,
            len(records) - kept,
            bad,
        )


def _read_lines(lines: Iterable[str]) -> tuple[list[RetainedRequest], int]:
    """``(records, unreadable lines)`` of a stored file's lines."""
    records, bad = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            records.append(RetainedRequest.from_json(line))
        except (ValueError, KeyError, TypeError):
            bad += 1
    return records, bad
