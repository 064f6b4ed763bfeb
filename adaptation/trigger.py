"""When a drifted domain gets a run, and what the run learns from (pure, no Ray).

A drift alert says a domain's traffic moved away from what the draft knows. The alert
fires some rounds after the shift, when the domain's retained requests are still mostly
from before it: a run started at that instant would learn the old traffic again. So a
firing domain is *pending*: it gets a run once ``min_requests`` of its requests finished
after the shift (from the detector's change point, where its CUSUM last stood at 0;
without one, ``lookback_s`` before the alert fired), and
another, on newer requests, every ``retry_after_s`` while the alert keeps firing and no
version deployed for it is still under its live check. The alert resolving ends it; an
alert that fires again while the draft served is the one adapted for it continues the
same drift (:func:`start_pending`).

The run's data keeps the two periods apart (:func:`run_data`): the domain's requests since
the shift train the candidate and judge its gain; its older requests (the traffic from
before the shift, which must not be forgotten) are replayed beside them and scored as one
more domain, so a candidate that loses more than ``max_loss`` on them is rejected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from adaptation.retention import RetainedRequest

BEFORE = "{domain} (before the drift)"  # the run-time name of a domain's older requests


@dataclass
class PendingDomain:
    """A domain whose drift alert fires, and its runs so far."""

    domain: str
    fired_at: float  # when the alert was first seen firing [s, the buffer's clock]
    since: float  # the domain's requests that finished from then on are drifted [s]
    last_run_at: float | None = None  # when its last run started [s]
    last_run_newest: float = 0.0  # finishing time of the newest request that run saw [s]


def start_pending(
    domain: str,
    now: float,
    lookback_s: float,
    previous: PendingDomain | None = None,
    continues: bool = False,
    change_point: float | None = None,
) -> PendingDomain:
    """A domain whose alert was just seen firing. Its requests that finished from the
    detector's ``change_point`` on (where its CUSUM last stood at 0; without one,
    ``lookback_s`` before now) are drifted, unless the alert ``continues`` the
    ``previous`` drift (the draft served was adapted for it, and it fires again:
    acceptance fell short of a baseline, or below break-even); then the drift began when
    the previous one did, and the requests before that stay the traffic not to forget."""
    if continues and previous is not None:
        since = previous.since
    else:
        since = change_point if change_point is not None else now - lookback_s
    return PendingDomain(domain, fired_at=now, since=since)


def should_run(
    pending: PendingDomain,
    records: Sequence[RetainedRequest],
    now: float,
    *,
    min_requests: int,
    retry_after_s: float,
    watching: bool,
) -> bool:
    """Whether ``pending`` gets a run now, given its domain's retained ``records``."""
    if watching:  # a version for it is being judged live: its verdict first
        return False
    if pending.last_run_at is not None and now - pending.last_run_at < retry_after_s:
        return False
    since = pending.since
    recent = sum(1 for r in records if r.finished_at >= since)
    fresh = sum(
        1 for r in records if r.finished_at >= since and r.finished_at > pending.last_run_newest
    )
    # the first run needs min_requests drifted requests; a retry as many new ones again
    need_new = min_requests if pending.last_run_at is not None else 1
    return recent >= min_requests and fresh >= need_new


def run_data(
    records: Mapping[str, Sequence[RetainedRequest]], domain: str, since: float
) -> dict[str, list[RetainedRequest]]:
    """Every domain's requests as a run takes them: ``domain``'s since ``since`` under its
    name, its older ones under :data:`BEFORE` (replayed and scored as another domain),
    the other domains as they are."""
    out = {d: list(rs) for d, rs in records.items() if d != domain}
    mine = records.get(domain, ())
    out[domain] = [r for r in mine if r.finished_at >= since]
    older = [r for r in mine if r.finished_at < since]
    if older:
        out[BEFORE.format(domain=domain)] = older
    return out
