"""The draft versions an application has served, and which one it serves now (pure).

Version numbers only grow: a replica loads a version newer than the one it serves, the
monitor's per-version acceptance and the ``specserve.draft_version`` gauge never see a
number twice, and a rollback is a new version that serves an older one's weights
(``weights_of``). Version 0 is the draft as deployed. A restarted adaptation deployment
(its history and weights lost) learns from the replicas which number they serve and goes
on above it (:meth:`VersionHistory.restart_after`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

Origin = Literal["deployed", "trained", "rolled_back"]


@dataclass
class DraftVersion:
    """One served draft version and where it came from."""

    version: int
    weights_of: int  # the version whose weights it serves (itself unless a rollback)
    origin: Origin
    domain: str | None  # the domain its run trained for (a rollback: the one it undid)
    created: float  # unix time [s]
    reason: str  # why it exists (the run's verdict, or why the rollback)
    held_back_before: float | None = None  # the run's agreement on its domain, before ...
    held_back_after: float | None = None  # ... and after training
    watch: str = ""  # the live check's word on it ("watching", "kept: ...", "rolled back: ...")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class VersionHistory:
    """Served versions, oldest first (the newest ``max_kept`` and version 0 are kept)."""

    def __init__(self, max_kept: int = 32, clock=time.time):
        self.max_kept, self.clock = max_kept, clock
        self.versions = [DraftVersion(0, 0, "deployed", None, clock(), "the draft as deployed")]

    @property
    def current(self) -> DraftVersion:
        return self.versions[-1]

    def get(self, version: int) -> DraftVersion:
        for v in self.versions:
            if v.version == version:
                return v
        known = [v.version for v in self.versions]
        raise ValueError(f"draft version {version} is not in the history {known}")

    def add_trained(
        self, domain: str, reason: str, before: float | None, after: float | None
    ) -> DraftVersion:
        n = self.current.version + 1
        return self._add(DraftVersion(n, n, "trained", domain, self.clock(), reason, before, after))

    def rollback_target(self, to: int | None) -> DraftVersion:
        """The version whose weights a rollback to ``to`` serves (None: the version served
        before the current one); ValueError when there is nothing to go back to."""
        if to is None:
            if len(self.versions) < 2:
                raise ValueError("no version before the one served: nothing to roll back to")
            target = self.versions[-2]
        else:
            target = self.get(to)
        if target.weights_of == self.current.weights_of:
            raise ValueError(f"version {self.current.version} already serves those weights")
        return target

    def add_rollback(self, target: DraftVersion, reason: str) -> DraftVersion:
        """A new version serving ``target``'s weights (from :meth:`rollback_target`)."""
        cur = self.current
        n = cur.version + 1
        return self._add(
            DraftVersion(n, target.weights_of, "rolled_back", cur.domain, self.clock(), reason)
        )

    def restart_after(self, newest: int) -> DraftVersion:
        """A fresh history (this process restarted) learns that replicas serve version
        ``newest``, made before the restart and lost with it: the draft as deployed
        serves again as version ``newest + 1``."""
        why = f"the adaptation deployment restarted; versions up to {newest} were lost"
        return self._add(DraftVersion(newest + 1, 0, "rolled_back", None, self.clock(), why))

    def weights_in_use(self, recent: int | None = None) -> set[int]:
        """The versions whose weights the newest ``recent`` versions (None: every kept
        one) or the one served serve: what must stay stored."""
        kept = self.versions if recent is None else self.versions[-recent:]
        return {v.weights_of for v in kept} | {self.current.weights_of}

    def _add(self, v: DraftVersion) -> DraftVersion:
        self.versions.append(v)
        if len(self.versions) > self.max_kept + 1:  # version 0 always stays
            del self.versions[1]
        return v
