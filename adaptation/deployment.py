"""The ``adaptation`` Serve deployment: one actor per application that keeps the data,
runs adaptation, and holds the draft version every replica must serve.

Why one deployment and not a buffer per replica: an operator must be able to list and
drop a domain's data in one call (a Serve handle reaches one replica of a deployment,
never all of them), training must see every replica's traffic, and every replica must
serve the same approved draft. Replicas send each finished request here without waiting
for the reply, and ask every ``poll_interval_s`` which version to serve (a new or
restarted replica asks at once), fetching the weights when it changed.

A run (:func:`adaptation.candidate.run`) trains in a Ray task with the trainer's own
resources, never in a serving process; one runs at a time. It starts when a replica
reports the monitor's drift alert for a domain (``trainer.on_drift``), or on demand.

Operators reach it through Ray (never through the clients' HTTP port)::

    h = serve.get_deployment_handle("SpecServeAdaptation", "specserve")
    h.summary.remote().result()       # {domain: {requests, tokens, oldest_age_s}}
    h.drop.remote("python").result()  # forget one domain's requests now
    h.adapt.remote("prose").result()  # a run now; returns its verdict and scores
    h.status.remote().result()        # the version served, runs and their outcomes
    h.versions.remote().result()      # every version kept: origin, scores, live check
    h.rollback.remote().result()      # serve the version before again (or rollback(to=2))
    h.set_enabled.remote(False).result()  # no run starts or deploys until True again
    h.export.remote(2, "/models/draft-v2").result()  # a Hugging Face directory

A version a run deployed is watched: its live acceptance on the domain, over its first
``rollback.window_rounds`` drafted rounds there (the monitor's counts per version), is
compared with the version before it (:mod:`adaptation.swap_check`); more than
``rollback.max_drop`` lower and it is rolled back by itself. Every outcome goes to the
monitor (metrics ``specserve_adaptation_runs_total{outcome}`` and friends, and an
OpenTelemetry log record).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import asdict
from typing import Any

import ray
from ray import serve
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from adaptation.candidate import DraftSource, load_draft, run
from adaptation.config import AdaptationConfig, TrainerConfig
from adaptation.pacing import ServingPace
from adaptation.retention import RetainedRequest, RetentionBuffer
from adaptation.serving_watch import ServingWatch
from adaptation.swap_check import Counts, check_swap
from adaptation.trigger import PendingDomain, run_data, should_run, start_pending
from adaptation.versions import DraftVersion, VersionHistory

logger = logging.getLogger("specserve.adaptation")

MONITOR_CALL_TIMEOUT_S = 30.0
KEEP_WEIGHTS = 8  # versions whose weights stay in the object store (rollback targets)
EXPORT_TIMEOUT_S = 600.0


def _run_task(
    source, current, domain, records, config, num_threads, base_version, monitor, baseline
):
    """:func:`adaptation.candidate.run` in a task of its own: its threads bounded, its
    process at the OS priority ``config.niceness`` (the worker exits after it:
    ``max_calls=1``, so no later task inherits either), and paced by serving's speed
    (``config.max_serving_slowdown``; ``baseline``: serving's speed before the run, from
    ``monitor``; no monitor: not paced)."""
    import torch

    if config.niceness:
        os.nice(config.niceness)
    torch.set_num_threads(num_threads)
    watch = None
    if monitor is not None and config.max_serving_slowdown < 1.0:
        pace = ServingPace(config.max_serving_slowdown, baseline, config.pacing_window_s)
        watch = ServingWatch(monitor, pace)
    try:
        result = run(
            source,
            current,
            domain,
            records,
            config,
            logger.info,
            base_version,
            pace=watch.after_step if watch else None,
        )
    finally:
        pacing = watch.stop() if watch else None
    result.pacing = pacing
    return result


def _source_weights_task(source):
    """Version 0's state dict (the checkpoint as deployed), in the serving dtype."""
    import torch

    dtype = getattr(torch, source.dtype)
    return {k: v.to(dtype) for k, v in load_draft(source, None).state_dict().items()}


def _export_task(source, weights, directory):
    """The draft with ``weights`` as a Hugging Face directory (model, config, tokenizer)."""
    import shutil

    import torch
    from transformers import AutoTokenizer

    if os.path.exists(directory) and os.listdir(directory):
        raise ValueError(f"{directory} exists and is not empty: not overwritten")
    try:
        model = load_draft(source, weights).to(getattr(torch, source.dtype))
        model.save_pretrained(directory)
        try:  # a draft directory without its own tokenizer exports without one
            tok = AutoTokenizer.from_pretrained(
                source.model, trust_remote_code=source.trust_remote_code
            )
            tok.save_pretrained(directory)
        except (OSError, ValueError):
            pass
    except BaseException:  # half a model must not block the next try ("not empty")
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return sorted(os.listdir(directory))


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("adaptation background task failed", exc_info=task.exception())


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=1024,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=10,
)
class AdaptationDeployment:
    """Holds the application's :class:`RetentionBuffer` and draft versions; see the
    module docstring."""

    async def __init__(
        self,
        config: dict[str, Any],
        draft: dict[str, Any] | None = None,
        monitor=None,
        model: str = "",
    ):
        self.config = AdaptationConfig.model_validate(config)
        self.buffer = RetentionBuffer(self.config.retention)
        # Expired requests leave memory and disk even in domains nobody sends to.
        loop = asyncio.get_running_loop()
        self._tasks = {loop.create_task(self._sweep_forever())}
        self.source = None if draft is None else DraftSource(**draft)
        self.monitor, self.model = monitor, model  # (no monitor: no events, no rollback)
        self.enabled = self.config.enabled
        self.history = VersionHistory()
        # Held while a version is added after an await (a rollback loading weights, a
        # restart's renumbering): no other version may slip in between.
        self._versions_lock = asyncio.Lock()
        self._refs: dict[int, Any] = {}  # version -> its state dict in the object store
        # version -> (base version, its LowRankUpdate in the object store): adapter runs
        self._updates: dict[int, tuple[int, Any]] = {}
        self._run: asyncio.Task | None = None
        self._run_ended = float("-inf")  # when the last run's task ended [monotonic s]
        self._pending: dict[str, PendingDomain] = {}  # domains whose drift alert fires
        self._episodes: dict[str, PendingDomain] = {}  # each domain's latest drift
        self._wake = asyncio.Event()  # a replica reported an alert: look at once
        self.runs: list[dict[str, Any]] = []  # each run's summary, newest last
        self.outcomes = dict.fromkeys(
            ("started", "deployed", "rejected", "failed", "rolled_back", "kept"), 0
        )
        if monitor is not None:  # (drift alerts come from the monitor)
            self._spawn(self._adapt_forever())

    @property
    def version(self) -> int:
        return self.history.current.version

    async def retain(
        self, domain: str, prompt_token_ids: list[int], output_token_ids: list[int]
    ) -> bool:
        """A replica's request that just finished; returns whether it was kept."""
        record = RetainedRequest(domain, tuple(prompt_token_ids), tuple(output_token_ids), 0.0)
        return self.buffer.add(record)  # (stamped with the buffer's clock)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.buffer.sweep_interval_s())
            try:
                self.buffer.sweep()
            except Exception:  # a full disk, say: the next sweep tries again
                logger.exception("retention sweep failed")

    async def summary(self) -> dict[str, dict[str, float]]:
        """Per domain: requests and tokens kept, and the oldest's age in seconds."""
        return {domain: asdict(s) for domain, s in self.buffer.summary().items()}

    async def records(self, domain: str) -> list[dict[str, Any]]:
        """The domain's kept requests, oldest first (token ids: an operator's view)."""
        return [asdict(r) for r in self.buffer.records(domain)]

    async def drop(self, domain: str) -> int:
        """Forget every kept request of ``domain``, in memory and on disk; how many."""
        gone = self.buffer.drop(domain)
        logger.info("retention: dropped %d requests of domain %r", gone, domain)
        return gone

    # ----- versions -----------------------------------------------------------------------

    async def served_version(self, serving: int = 0) -> int:
        """The draft version every replica must serve (0: the deployed checkpoint).
        ``serving``: the version the asking replica serves. One newer than any this
        deployment made means it restarted (Serve replaced it) and lost the adapted
        weights: every replica then goes back to the draft as deployed, as a version
        newer than the one it serves (numbers only grow)."""
        if serving > self.version:
            async with self._versions_lock:
                if serving > self.version:
                    await self._renumber_after_restart(serving)
        return self.version

    async def _renumber_after_restart(self, serving: int) -> None:
        if 0 not in self._refs:
            self._refs[0] = await self._weights_of_version(0)
        v = self.history.restart_after(serving)
        logger.warning(
            "adaptation restarted: replicas go back to the deployed draft as version %d", v.version
        )
        self._event("rolled_back", "", f"restarted: adapted versions up to {serving} were lost")

    async def weights(self, version: int, serving: int | None = None) -> list:
        """What a replica serving version ``serving`` loads to serve ``version``, as
        ObjectRefs in a list (so that it fetches them from the object store itself):
        ``[state dict]``, or for a version an adapter run made, to a replica serving its
        base, ``[LowRankUpdate, state dict]`` (the factors to ship, the whole for its
        replacements). [] if ``version`` is not the version served."""
        if version != self.version:
            return []
        current = self.history.current
        full = self._refs.get(current.weights_of)
        if full is None:
            return []
        update = self._updates.get(current.version)
        if update is not None and serving == update[0]:
            return [update[1], full]
        return [full]

    async def versions(self) -> list[dict[str, Any]]:
        """Every version kept, oldest first: origin, domain, scores, the live check."""
        return [v.as_dict() for v in self.history.versions]

    async def rollback(self, to: int | None = None, reason: str = "by an operator") -> int:
        """Serve the weights of version ``to`` again (None: of the version served before
        this one) as a new version, which replicas load as they load any; returns it."""
        async with self._versions_lock:
            return await self._rollback(to, reason)

    async def _rollback(self, to: int | None, reason: str) -> int:
        undone = self.history.current
        target = self.history.rollback_target(to)
        if target.weights_of not in self._refs:
            self._refs[target.weights_of] = await self._weights_of_version(target.weights_of)
        if self.history.current is not undone:  # a run deployed while the weights loaded
            raise RuntimeError(
                f"version {self.history.current.version} was deployed meanwhile: not rolled "
                "back (look at versions() and try again)"
            )
        undone.watch = (
            undone.watch if undone.watch.startswith("rolled") else f"rolled back: {reason}"
        )
        v = self.history.add_rollback(target, reason)
        self._forget_unused_weights()
        self.outcomes["rolled_back"] += 1
        self._event("rolled_back", undone.domain or "", reason)
        logger.warning(
            "draft version %d rolled back (version %d serves version %d's weights): %s",
            undone.version,
            v.version,
            target.weights_of,
            reason,
        )
        return v.version

    async def _weights_of_version(self, version: int):
        if version != 0:
            raise ValueError(f"the weights of version {version} are no longer kept")
        if self.source is None:
            raise RuntimeError("this application serves no draft model")
        ref = ray.remote(_source_weights_task).options(num_cpus=0).remote(self.source)
        await ref  # (a failure is raised here, not in every replica)
        return ref  # kept in the object store: replicas fetch it themselves

    def _forget_unused_weights(self) -> None:
        """Weights stay in the object store for the newest KEEP_WEIGHTS versions (and
        the one served); older versions keep their record only."""
        keep = self.history.weights_in_use(recent=KEEP_WEIGHTS)
        for version in [v for v in self._refs if v not in keep]:
            del self._refs[version]
        for version in [v for v in self._updates if v != self.history.current.version]:
            del self._updates[version]  # (only the version served ships as factors)

    async def export(self, version: int, directory: str) -> list[str]:
        """Write ``version`` as a Hugging Face directory (``directory`` must be new or
        empty), on the node this deployment runs on, to deploy for good; returns the
        files written."""
        if self.source is None:
            raise RuntimeError("this application serves no draft model")
        if not os.path.isabs(directory):  # (relative: the Ray worker's session directory)
            raise ValueError(f"directory must be an absolute path, got {directory!r}")
        weights_of = self.history.get(version).weights_of
        ref = self._refs.get(weights_of) if weights_of else None
        if weights_of and ref is None:
            raise ValueError(f"the weights of version {version} are no longer kept")
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        # No CPU reserved: this deployment's node may have none to give (a 0-CPU head).
        task = ray.remote(_export_task).options(num_cpus=0, scheduling_strategy=here)
        async with asyncio.timeout(EXPORT_TIMEOUT_S):
            return await task.remote(self.source, ref, directory)

    async def set_enabled(self, enabled: bool) -> bool:
        """Turn runs (on drift and on demand) off or on at run time; a run in flight when
        turned off is not deployed. Returns the previous setting."""
        before, self.enabled = self.enabled, bool(enabled)
        logger.info("adaptation %s", "enabled" if self.enabled else "turned off")
        return before

    async def status(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "version": self.version,
            "running": self._running(),
            "pending": {d: asdict(p) for d, p in self._pending.items()},
            "outcomes": dict(self.outcomes),
            "runs": list(self.runs),
        }

    # ----- runs ---------------------------------------------------------------------------

    async def on_drift(self, domain: str) -> bool:
        """A replica saw a drift alert change for ``domain``: the domain is pending
        adaptation if its alert fires (checked with the monitor; :mod:`adaptation.trigger`
        says when its run starts). Returns whether adaptation may start runs on drift."""
        if not (self.enabled and self.config.trainer.on_drift) or self.monitor is None:
            return False
        self._wake.set()  # (the loop asks the monitor whether it fires)
        return True

    async def _adapt_forever(self) -> None:
        """Every ``poll_interval_s`` (or at once when a replica reports an alert): the
        domains whose alert fires are pending; one of them gets a run when it is due."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.poll_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            try:
                async with asyncio.timeout(MONITOR_CALL_TIMEOUT_S):
                    status = await self.monitor.status.remote()
            except Exception as exc:  # the monitor restarting, say: next time
                logger.warning("adaptation: no drift state from the monitor: %r", exc)
                continue
            firing = {
                d: st.get("drift_since")
                for d, st in status["domains"].items()
                if st["state"] == "firing"
            }
            self._track(firing)
            if self.enabled and self.config.trainer.on_drift and not self._running():
                self._start_due()

    def _track(self, firing: dict[str, float | None]) -> None:
        """``firing``: each firing domain and its drift's change point (unix s, or None)."""
        now = self.buffer.now()
        for domain in [d for d in self._pending if d not in firing]:
            logger.info("adaptation: %r no longer drifts", domain)
            del self._pending[domain]
        for domain in firing.keys() - self._pending.keys():
            logger.info("adaptation: %r drifts: pending a run", domain)
            current = self.history.current
            continues = current.origin == "trained" and current.domain == domain
            previous = self._episodes.get(domain)
            lookback = self.config.trainer.lookback_s
            pending = start_pending(domain, now, lookback, previous, continues, firing[domain])
            self._pending[domain] = self._episodes[domain] = pending

    def _start_due(self) -> None:
        cfg, now = self.config.trainer, self.buffer.now()
        for pending in self._pending.values():
            records = self.buffer.records(pending.domain)
            watching = any(
                v.domain == pending.domain and v.watch == "watching" for v in self.history.versions
            )
            if should_run(
                pending,
                records,
                now,
                min_requests=cfg.min_requests,
                retry_after_s=cfg.retry_after_s,
                watching=watching,
            ):
                pending.last_run_at = now
                pending.last_run_newest = max(r.finished_at for r in records)
                everything = {d: self.buffer.records(d) for d in self.buffer.summary()}
                data = run_data(everything, pending.domain, pending.since)
                self._run = asyncio.get_running_loop().create_task(
                    self._train_quietly(pending.domain, data, cfg)
                )
                return

    async def _train_quietly(self, domain: str, data: dict, cfg: TrainerConfig) -> None:
        with contextlib.suppress(Exception):  # (a failure is recorded, logged and counted)
            await self._train(domain, data, cfg)

    def _running(self) -> bool:
        return self._run is not None and not self._run.done()

    async def adapt(self, domain: str, trainer: dict[str, Any] | None = None) -> dict[str, Any]:
        """Train, validate and (if it is better) deploy a draft for ``domain`` now, on
        all its retained requests; returns the run's summary (verdict, scores before and
        after, training). ``trainer``: :class:`TrainerConfig` settings for this run only."""
        if self.source is None:
            raise RuntimeError("this application serves no draft model: nothing to adapt")
        if not self.enabled:
            raise RuntimeError("adaptation is turned off (set_enabled(True) turns it on)")
        if self._running():
            raise RuntimeError("a run is in progress (status() says which): one at a time")
        domains = {d: self.buffer.records(d) for d in self.buffer.summary()}
        if len(domains.get(domain, ())) < 2:
            raise ValueError(f"domain {domain!r} has fewer than 2 retained requests")
        cfg = self.config.trainer
        if trainer:  # validated as a whole: a bad field is refused before anything runs
            cfg = TrainerConfig.model_validate({**cfg.model_dump(), **trainer})
        self._run = asyncio.current_task()
        return await self._train(domain, domains, cfg)

    async def _train(self, domain: str, data: dict, cfg: TrainerConfig) -> dict[str, Any]:
        """One run in a Ray task of its own (the trainer's resources), then its verdict."""
        if self.source is None:
            raise RuntimeError("this application serves no draft model: nothing to adapt")
        self.outcomes["started"] += 1
        self._event("started", domain, f"{len(data[domain])} requests to learn from")
        task = ray.remote(max_calls=1)(_run_task).options(
            num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus
        )
        served = self.history.current
        current = self._refs.get(served.weights_of)  # (resolved by Ray in the task)
        paced = self.monitor is not None and cfg.max_serving_slowdown < 1.0
        baseline = await self._baseline(cfg.pacing_window_s) if paced else None
        try:
            result = await task.remote(
                self.source,
                current,
                domain,
                data,
                cfg,
                cfg.num_threads,
                served.version,
                self.monitor,
                baseline,
            )
        except Exception as exc:
            self.outcomes["failed"] += 1
            self._note({"domain": domain, "outcome": "failed", "error": repr(exc)[:500]})
            self._event("failed", domain, repr(exc)[:500])
            raise
        finally:
            self._run_ended = time.monotonic()
        return self._conclude(result, served)

    async def _baseline(self, window_s: float) -> float | None:
        """Serving's speed before a run, over a window no earlier run trained in (a run
        right after another would take the slowdown it caused as normal)."""
        wait = self._run_ended + window_s - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        return await self._serving_speed(window_s)

    async def _serving_speed(self, window_s: float) -> float | None:
        """Serving's speed now (the monitor's; None: no monitor, no traffic, no answer)."""
        if self.monitor is None:
            return None
        try:
            async with asyncio.timeout(MONITOR_CALL_TIMEOUT_S):
                return await self.monitor.serving_speed.remote(window_s)
        except Exception as exc:
            logger.warning("could not read serving's speed before a run: %r", exc)
            return None

    def _conclude(self, result, served: DraftVersion) -> dict[str, Any]:
        """A run's verdict: deploy (and watch) or reject, noted and reported."""
        summary, verdict, domain = result.summary(), result.verdict, result.domain
        deploy = verdict.deploy and self.enabled and self.history.current is served
        if verdict.deploy and not deploy:  # turned off, or another version came meanwhile
            why = "adaptation was turned off" if not self.enabled else "a newer version serves"
            summary["verdict"]["reason"] = f"{verdict.reason}; not deployed: {why}"
        if deploy:
            before, after = result.before.get(domain), result.after.get(domain)
            v = self.history.add_trained(domain, verdict.reason, before, after)
            self._refs[v.version] = ray.put(result.weights)
            if result.update is not None:  # replicas serving its base get the factors
                self._updates[v.version] = (result.update.base_version, ray.put(result.update))
            self._forget_unused_weights()
            self.outcomes["deployed"] += 1
            summary["version"] = v.version
            if self.config.rollback.enabled and self.monitor is not None:
                v.watch = "watching"
                self._spawn(self._watch(v, served.version))
        else:
            self.outcomes["rejected"] += 1
        summary["outcome"] = "deployed" if deploy else "rejected"
        self._note(summary)
        tokens, seconds = result.train.get("tokens", 0), result.seconds
        self._event(
            summary["outcome"],
            domain,
            summary["verdict"]["reason"],
            gain=verdict.gain,
            tokens=tokens,
            seconds=seconds,
        )
        return summary

    async def _watch(self, version: DraftVersion, previous: int) -> None:
        """Judge ``version`` on its live rounds of its domain against ``previous`` (see
        :mod:`adaptation.swap_check`); roll it back by itself if it falls short."""
        cfg = self.config.rollback
        deadline = time.monotonic() + cfg.max_wait_s
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            if self.history.current is not version:  # a newer version, or a rollback
                if version.watch == "watching":
                    version.watch = f"superseded by version {self.history.current.version}"
                return
            try:
                async with asyncio.timeout(MONITOR_CALL_TIMEOUT_S):
                    counts = await self.monitor.acceptance.remote(version.domain, cfg.window_rounds)
            except Exception as exc:  # the monitor restarting, say: next time
                logger.warning("swap watch: no counts from the monitor: %r", exc)
                if time.monotonic() > deadline:
                    version.watch = "kept: no counts from the monitor before max_wait_s"
                    return
                continue
            if self.history.current is not version:
                continue  # a newer version (or a rollback) came meanwhile: said above
            decision = check_swap(
                Counts(*counts.get(previous, (0, 0, 0))),
                Counts(*counts.get(version.version, (0, 0, 0))),
                version.held_back_before,
                window_rounds=cfg.window_rounds,
                max_drop=cfg.max_drop,
                min_before_rounds=cfg.min_before_rounds,
                timed_out=time.monotonic() > deadline,
            )
            if decision.decision == "wait":
                continue
            if decision.decision == "roll_back":
                try:  # (rollback() notes the verdict on the version it undid)
                    await self.rollback(previous, reason=decision.reason)
                except Exception as exc:  # e.g. the checkpoint did not load: next poll
                    logger.warning("rollback of version %d failed: %r", version.version, exc)
                    continue
            else:
                version.watch = decision.reason
                self.outcomes["kept"] += 1
                self._event("kept", version.domain or "", decision.reason)
            return

    def _spawn(self, coro) -> None:
        """Run ``coro`` in the background; an exception that ends it is logged (a live
        check or a loop must never stop without a word)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    def _event(self, outcome: str, domain: str, reason: str, *, gain=None, tokens=0, seconds=0.0):
        """An outcome to the monitor (metrics and a log record), off the caller's path."""
        if self.monitor is None:
            return
        record = {
            "model": self.model,
            "outcome": outcome,
            "domain": domain,
            "version": self.version,
            "reason": reason,
            "gain": gain,
            "training_tokens": int(tokens),
            "training_s": float(seconds),
        }

        async def send() -> None:
            try:
                async with asyncio.timeout(MONITOR_CALL_TIMEOUT_S):
                    await self.monitor.adaptation_event.remote(record)
            except Exception as exc:
                logger.warning("adaptation event %s not reported: %r", outcome, exc)

        self._spawn(send())

    def _note(self, summary: dict[str, Any]) -> None:
        logger.info("adaptation run: %s", summary)
        self.runs = [*self.runs[-19:], summary]
