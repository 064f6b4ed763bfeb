"""Finished requests kept per traffic domain: the data a draft can be adapted on.

Why the committed tokens: they are the target's own samples of its distribution, so
sequence-level distillation on them needs no extra target pass. Why bounded per domain
(tokens and age) and only for allowed domains: the prompt is user text, and whatever is
kept must be something an operator chose to keep, can list, and can drop at once.

Pure logic (no Ray); :class:`adaptation.deployment.AdaptationDeployment` holds one buffer
for the whole application.
"""

from __future__ import annotations

import hashlib
import json
import logging
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
        return record


@dataclass(frozen=True, slots=True)
class DomainSummary:
    """What is kept for one domain (no token ids: safe to log and to show)."""

    requests: int
    tokens: int
    oldest_age_s: float  # seconds since the oldest kept request finished


class RetentionBuffer:
    """Retained requests per domain, bounded by ``config``; optionally mirrored to files.

    ``clock`` gives unix seconds (a parameter so that tests can age records without
    waiting)."""

    def __init__(self, config: RetentionConfig, clock: Callable[[], float] = time.time):
        self.config = config
        self._clock = clock
        self._allowed = None if config.domains is None else frozenset(config.domains)
        self._kept: dict[str, deque[RetainedRequest]] = {}  # domain -> oldest first
        self._tokens: dict[str, int] = {}  # domain -> tokens kept
        self._dir = Path(config.directory).expanduser() if config.directory else None
        if self._dir is not None:
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._load()

    def allows(self, domain: str) -> bool:
        return self._allowed is None or domain in self._allowed

    def add(self, record: RetainedRequest) -> bool:
        """Keep ``record`` if its domain is allowed and it fits; returns whether it was
        kept. The domain's oldest requests make room (and any past ``max_age_s`` go)."""
        cfg = self.config
        if not self.allows(record.domain) or not record.prompt_token_ids:
            return False
        if record.num_tokens > min(cfg.max_request_tokens, cfg.max_tokens_per_domain):
            return False
        removed = self._expire(record.domain, self._clock())  # (may delete the deque)
        kept = self._kept.setdefault(record.domain, deque())
        while kept and self._tokens[record.domain] + record.num_tokens > cfg.max_tokens_per_domain:
            self._tokens[record.domain] -= kept.popleft().num_tokens
            removed += 1
        kept.append(record)
        self._tokens[record.domain] = self._tokens.get(record.domain, 0) + record.num_tokens
        if removed:
            self._rewrite(record.domain)
        else:
            self._append(record)
        return True

    def records(self, domain: str) -> list[RetainedRequest]:
        """The domain's kept requests, oldest first (expired ones dropped first)."""
        if self._expire(domain, self._clock()):
            self._rewrite(domain)
        return list(self._kept.get(domain, ()))

    def drop(self, domain: str) -> int:
        """Forget every request of ``domain`` (memory and file); returns how many."""
        gone = len(self._kept.pop(domain, ()))
        self._tokens.pop(domain, None)
        if self._dir is not None:
            self._file(domain).unlink(missing_ok=True)
        return gone

    def summary(self) -> dict[str, DomainSummary]:
        """Per domain with anything kept: counts and the oldest's age (expired dropped)."""
        now = self._clock()
        for domain in list(self._kept):
            if self._expire(domain, now):
                self._rewrite(domain)
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
        while kept and now - kept[0].finished_at > self.config.max_age_s:
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
        fd = os.open(self._file(record.domain), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(record.to_json() + "\n")

    def _rewrite(self, domain: str) -> None:
        """Write the domain's file anew from memory (after something was removed), through
        a temporary file and a rename, so a crash leaves the old file or the new one."""
        if self._dir is None:
            return
        path = self._file(domain)
        kept = self._kept.get(domain)
        if not kept:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(r.to_json() + "\n" for r in kept)
        os.replace(tmp, path)

    def _load(self) -> None:
        """Read the directory's files back, under today's bounds: records of domains no
        longer allowed, expired or past the token cap are dropped, and so are lines that
        do not parse (counted in the log)."""
        assert self._dir is not None
        bad = 0
        records: list[RetainedRequest] = []
        for path in sorted(self._dir.glob("*.jsonl")):
            parsed, unreadable = _read_lines(path.read_text().splitlines())
            records += parsed
            bad += unreadable
            path.unlink()  # rewritten below from what is kept
        records.sort(key=lambda r: r.finished_at)
        kept = sum(self.add(r) for r in records)
        logger.info(
            "retention: %d requests read back from %s (%d dropped by today's bounds, "
            "%d unreadable lines)",
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
