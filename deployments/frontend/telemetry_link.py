"""The frontend's link to the monitor: finished-request records and the core's round
records go out in batches, drift alerts come back and are handed to the core's policy.

It runs as a task of its own every ``interval_s``, never on a round's path: the core only
appends round records to a list, and the request path only appends a
:class:`RequestRecord`. A monitor that fails or is slow costs records, never a round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from deployments.messages import DriftAlert, TelemetrySnapshot
from monitoring.records import (
    AlertCursor,
    RankRecord,
    ReportReply,
    RequestRecord,
    RoundBatch,
    RoundRecord,
)

logger = logging.getLogger("specserve.engine")

MAX_PENDING_RECORDS = 10_000  # finished-request records kept while the monitor is away
CANCELLED = ("GeneratorExit", "CancelledError")  # the client went away

# (round batch, finished requests, alert cursor) -> the monitor's reply (alerts, new cursor)
TelemetrySink = Callable[
    [RoundBatch, list[RequestRecord], AlertCursor | None], Awaitable[ReportReply]
]


class TelemetryLink:
    """Batches records for ``sink`` (the monitor) and forwards its drift alerts.

    ``current_core()`` returns the live core actor: a core replaced during a flush keeps
    neither the alerts nor the cursor of the old one (a new core's policy starts from the
    alerts firing now, see :meth:`reset`)."""

    def __init__(
        self,
        sink: TelemetrySink,
        *,
        model: str,
        replica: str,
        current_core: Callable[[], Any],
        timeout_s: float,
        interval_s: float = 1.0,
        draft_version: Callable[[], int] = lambda: 0,
        tensor_parallel: Callable[[], dict | None] = lambda: None,
    ):
        self.sink, self.model, self.replica = sink, model, replica
        self.draft_version = draft_version  # the adapted draft version served now
        # a split target's group as /health shows it (None: whole), see rank_records
        self.tensor_parallel = tensor_parallel
        self.current_core, self.timeout_s, self.interval_s = current_core, timeout_s, interval_s
        self.records: list[RequestRecord] = []
        # domain -> the draft version that drafted its latest round here (for /health)
        self.domain_versions: dict[str, int] = {}
        # Drift alerts seen so far; None until the monitor answers.
        self.cursor: AlertCursor | None = None

    def reset(self) -> None:
        """A new core: only the alerts that fire from now on reach its policy."""
        self.cursor = None

    def record_request(
        self,
        domain: str,
        operation: str,
        output_tokens: int,
        t_start: float,
        t_first: float | None,
        error_type: str | None,
    ) -> None:
        """One finished (or failed, or abandoned) request; times from ``perf_counter``."""
        if len(self.records) >= MAX_PENDING_RECORDS:
            return
        self.records.append(
            RequestRecord(
                model=self.model,
                replica=self.replica,
                domain=domain,
                operation=operation,
                time_to_first_token_s=None if t_first is None else t_first - t_start,
                duration_s=time.perf_counter() - t_start,
                output_tokens=output_tokens,
                error_type="cancelled" if error_type in CANCELLED else error_type,
            )
        )

    async def run(self) -> None:
        """Flush every ``interval_s`` until cancelled; a failed flush is retried next time."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # never end the flushing task: the next interval retries
                logger.exception("telemetry flush failed")

    async def flush_once(self) -> None:
        core = self.current_core()
        try:
            async with asyncio.timeout(self.timeout_s):
                drained = await core.drain_telemetry.remote()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a core being replaced: the frontend's poller handles it
            logger.debug("no telemetry from the core: %r", exc)
            return
        if drained is None:
            return
        requests, self.records = self.records, []
        try:
            async with asyncio.timeout(self.timeout_s):
                reply = await self.sink(self._batch(drained), requests, self.cursor)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("the monitor did not take telemetry: %r", exc)
            return
        if self.current_core() is not core:  # replaced meanwhile: the new core starts afresh
            return
        if reply.alerts:
            alerts = [DriftAlert(a.domain, a.current_alpha) for a in reply.alerts]
            try:
                async with asyncio.timeout(self.timeout_s):
                    await core.on_drift.remote(alerts)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the cursor: the alerts come again next flush
                logger.warning("could not hand drift alerts to the core: %r", exc)
                return
        if self.current_core() is core:
            self.cursor = reply.cursor

    def _batch(self, drained: TelemetrySnapshot) -> RoundBatch:
        """The core's snapshot as the monitor's record (its own type: the two deploy apart)."""
        for r in drained.rounds:
            if r.method == "draft_model":
                self.domain_versions[r.domain] = r.draft_version
        return RoundBatch(
            model=self.model,
            replica=self.replica,
            rounds=[
                RoundRecord(r.domain, r.drafted, r.accepted, r.cache_hit, r.draft_version, r.method)
                for r in drained.rounds
            ],
            verify_s=drained.verify_s,
            draft_wait_s=drained.draft_wait_s,
            overhead_s=drained.overhead_s,
            committed=drained.committed,
            running=drained.running,
            waiting=drained.waiting,
            kv_cache_usage=drained.kv_cache_usage,
            kv_cache_token_usage=drained.kv_cache_token_usage,
            policy=drained.policy,
            dropped=drained.dropped,
            draft_version=self.draft_version(),
            ranks=rank_records(self.tensor_parallel()),
        )


def rank_records(group: dict | None) -> tuple[RankRecord, ...]:
    """/health's ``tensor_parallel`` (:class:`TensorParallelState` as a dict) as the
    monitor's records: rank 0 (the core, which answered) and each other rank."""
    if not group:
        return ()
    core = RankRecord(0, True, group["calls"])
    others = [
        RankRecord(r["rank"], r.get("error") is None, r.get("calls") or 0) for r in group["ranks"]
    ]
    return (core, *others)
