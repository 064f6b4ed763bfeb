"""Acceptance per (domain, draft version), over each pair's most recent rounds: what the
adaptation deployment judges a freshly swapped draft by (pure, no Ray).

The drift detector pools every version of a domain; a swap needs the two versions apart
(replicas swap seconds apart, so rounds of both arrive interleaved for a while). Each
observed batch adds one chunk ``(rounds, accepted, rejections)`` per pair; a pair keeps
the newest chunks that cover ``window_rounds`` rounds, so memory is bounded by the
pairs, and the pairs by ``max_versions`` per domain and ``max_domains`` domains (the
rest pool under ``overflow_domain``, as in the drift detector).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class VersionAcceptance:
    """Recent drafted rounds, accepted tokens and rejections per (domain, version)."""

    def __init__(
        self,
        window_rounds: int = 4096,
        max_versions: int = 8,
        max_domains: int = 64,
        overflow_domain: str = "other",
    ):
        self.window_rounds, self.max_versions = window_rounds, max_versions
        self.max_domains, self.overflow_domain = max_domains, overflow_domain
        # domain -> version -> chunks [(rounds, accepted, rejections)], oldest first;
        # versions in the order first seen (the oldest is dropped past max_versions)
        self._chunks: dict[str, OrderedDict[int, deque[tuple[int, int, int]]]] = {}

    def observe(
        self,
        domains: Sequence[str],
        versions: Sequence[int],
        drafted: Sequence[int],
        accepted: Sequence[int],
    ) -> None:
        """One batch of drafted rounds (four equal-length sequences, one entry per round)."""
        if not len(domains) == len(versions) == len(drafted) == len(accepted):
            raise ValueError("need one domain, version, drafted and accepted per round")
        sums: dict[tuple[str, int], list[int]] = {}
        for domain, version, d, a in zip(domains, versions, drafted, accepted, strict=True):
            if d <= 0:
                continue  # no drafts: no evidence
            s = sums.setdefault((domain, int(version)), [0, 0, 0])
            s[0] += 1
            s[1] += a
            s[2] += a < d
        for (domain, version), (n, acc, rej) in sums.items():
            self._add(domain, version, (n, acc, rej))

    def _add(self, domain: str, version: int, chunk: tuple[int, int, int]) -> None:
        if domain not in self._chunks and len(self._chunks) >= self.max_domains:
            domain = self.overflow_domain
        by_version = self._chunks.setdefault(domain, OrderedDict())
        chunks = by_version.get(version)
        if chunks is None:
            chunks = by_version[version] = deque()
            while len(by_version) > self.max_versions:
                by_version.popitem(last=False)
        chunks.append(chunk)
        total = sum(c[0] for c in chunks)
        while len(chunks) > 1 and total - chunks[0][0] >= self.window_rounds:
            total -= chunks.popleft()[0]

    def counts(
        self, domain: str, last_rounds: int | None = None
    ) -> dict[int, tuple[int, int, int]]:
        """``{version: (rounds, accepted, rejections)}`` on ``domain``: over each version's
        newest batches that cover ``last_rounds`` rounds (None: all kept, at least
        ``window_rounds`` where that many were seen)."""
        out = {}
        for version, chunks in self._chunks.get(domain, {}).items():
            n = a = r = 0
            for cn, ca, cr in reversed(chunks):
                if last_rounds is not None and n >= last_rounds:
                    break
                n, a, r = n + cn, a + ca, r + cr
            out[version] = (n, a, r)
        return out
