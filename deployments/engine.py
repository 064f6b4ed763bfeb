"""The engine: continuous batching of speculative rounds over a draft and a target actor.

One engine lives in each Serve replica. It owns the request queue and the rounds; the
workers own the models. A round, for every running sequence at once:

* sequential mode: ``draft.propose`` -> ``target.verify``;
* overlap mode: ``draft.propose`` (usually a speculation-cache hit, no drafting), then
  ``target.verify`` and ``draft.speculate`` run *concurrently*: the draft prepares the
  next round's drafts for the expected outcomes while the target verifies this one.

New requests join between rounds. A dead draft degrades the engine to target-only
decoding (same output) while a replacement loads; a dead target is replaced and every
running sequence is re-prefilled from the tokens it already has, so nothing is lost.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import EngineConfig, WorkerResources
from deployments.placement import placement_for
from deployments.workers import DraftWorker, TargetWorker
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState

logger = logging.getLogger("specserve.engine")


class EngineError(RuntimeError):
    """A request could not be completed; the message says why."""


class EngineOverloadedError(EngineError):
    """Too many requests are waiting; retry later (HTTP 503)."""


@dataclass
class RequestStats:
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0  # verification rounds that carried drafts
    cache_hits: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass
class RequestOutput:
    """A streamed piece of a request's output."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    stats: RequestStats


@dataclass
class _Request:
    seq: SequenceState
    k: int
    queue: asyncio.Queue
    stats: RequestStats = field(default_factory=RequestStats)
    aborted: bool = False
    params_dict: dict[str, Any] = field(init=False)  # what workers receive

    def __post_init__(self) -> None:
        self.params_dict = asdict(self.seq.params)  # once, not every round


@dataclass
class RoundTimings:
    """Accumulated time per round phase, for benchmarks and metrics.

    ``*_wait_s`` is what the engine waited for (transport included); ``*_compute_s`` is
    what the workers report computing. The overhead is everything on the critical path
    that is not model work: transport, serialization, engine bookkeeping.
    """

    rounds: int = 0
    total_s: float = 0.0  # whole rounds as the engine saw them
    draft_wait_s: float = 0.0  # waiting for proposals (a miss drafts here)
    verify_wait_s: float = 0.0  # waiting for the target (and the overlapped speculation)
    draft_compute_s: float = 0.0
    verify_compute_s: float = 0.0
    speculate_compute_s: float = 0.0  # overlapped with verification
    critical_compute_s: float = 0.0  # per round: draft + max(verify, speculate)

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.critical_compute_s


class SpeculationBudget:
    """Chooses how widely to speculate each round, from measured costs and hit rates.

    Drafting ahead is free only while it finishes before the target does; with many
    sequences the branches can outlast verification and slow every round. Levels, widest
    first: (fanout, with rejection branches), (fanout, bonus only), (1, bonus only), and
    off (None). The expected round time at a level is
    ``max(T_verify, T_speculate) + (1 - hit rate) * T_draft`` (a miss drafts on the
    critical path); the level with the smallest estimate is used. Estimates are moving
    averages; a level unused for ``explore_every`` rounds is tried again so that the
    estimates follow the load.
    """

    def __init__(self, spec, explore_every: int = 50, decay: float = 0.8):
        levels = [(spec.speculation_fanout, True), (spec.speculation_fanout, False), (1, False)]
        if not spec.speculate_rejections:
            levels = levels[1:]
        self.levels: list[tuple[int, bool] | None] = [*dict.fromkeys(levels), None]
        self.adaptive = spec.adaptive_overlap
        self.decay = decay
        self.explore_every = explore_every
        self.spec_s: dict = {}  # level -> seconds of speculation per round
        self.hit: dict = {}  # level -> fraction of drafting rows served from the cache
        self.verify_s: float | None = None
        self.draft_s: float | None = None  # fresh drafting, per round with a miss
        self.last_used: dict = {}
        self.rounds = 0

    def _avg(self, old: float | None, value: float) -> float:
        return value if old is None else self.decay * old + (1 - self.decay) * value

    def cost(self, level) -> float:
        if level is None:
            return self.verify_s + self.draft_s
        spec = self.spec_s.get(level, 0.0)
        return max(self.verify_s, spec) + (1 - self.hit.get(level, 1.0)) * self.draft_s

    def next_level(self) -> tuple[int, bool] | None:
        self.rounds += 1
        if not self.adaptive:
            return self.levels[0]
        stale = [
            lv
            for lv in self.levels
            if self.rounds - self.last_used.get(lv, -(10**9)) > self.explore_every
        ]
        if stale:
            level = stale[0]
        elif self.verify_s is None or self.draft_s is None:
            level = self.levels[0]
        else:
            level = min(self.levels, key=self.cost)
        self.last_used[level] = self.rounds
        return level

    def observe_round(self, verify_s: float, speculate_s: float | None, level) -> None:
        self.verify_s = self._avg(self.verify_s, verify_s)
        if level is not None and speculate_s is not None:
            self.spec_s[level] = self._avg(self.spec_s.get(level), speculate_s)

    def observe_proposals(self, level, hits: int, rows: int, draft_s: float) -> None:
        """How the proposals prepared by the previous round's speculation (at ``level``) did."""
        if rows and level is not None:
            self.hit[level] = self._avg(self.hit.get(level), hits / rows)
        if hits < rows:
            self.draft_s = self._avg(self.draft_s, draft_s)


class SpecEngine:
    """Drives speculative rounds for many concurrent requests (asyncio, one event loop)."""

    def __init__(self, config: EngineConfig, placement_group=None, tokenizer=None):
        self.config = config
        self.placement = placement_for(config)
        self.pg = placement_group
        self.tokenizer = tokenizer  # only needed for stop strings
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None
        self.target = None
        self.draft = None
        self.target_info: dict[str, Any] = {}
        self.draft_info: dict[str, Any] = {}
        self._target_restarts = 0
        self._draft_restarting: asyncio.Task | None = None
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._fatal: str | None = None
        self.aborted = 0  # requests whose client went away before they finished
        self.timings = RoundTimings()
        self.speculation_budget = SpeculationBudget(config.speculation)
        self._spec_level: tuple[int, bool] | None = None  # level of the last speculation
        self.speculation_budget = SpeculationBudget(config.speculation)

    # ----- workers ----------------------------------------------------------------------

    def _options(self, res: WorkerResources, bundle_index: int | None) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "num_cpus": res.num_cpus,
            "num_gpus": res.num_gpus,
            "resources": dict(res.resources) or None,
            "max_concurrency": 1,
        }
        if res.accelerator_type:
            opts["accelerator_type"] = res.accelerator_type
        if self.pg is not None and bundle_index is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=bundle_index
            )
        return opts

    def _spawn_target(self):
        cfg = self.config
        return (
            ray.remote(TargetWorker)
            .options(**self._options(cfg.target_resources, self.placement.target_bundle))
            .remote(cfg.target.model_dump(), cfg.scheduler.max_num_seqs)
        )

    def _spawn_draft(self):
        cfg = self.config
        spec = cfg.speculation
        return (
            ray.remote(DraftWorker)
            .options(**self._options(cfg.draft_resources, self.placement.draft_bundle))
            .remote(
                cfg.draft.model_dump(),
                cfg.scheduler.max_num_seqs,
                spec.speculation_fanout,
                spec.speculate_rejections,
                spec.max_speculative_tokens,
            )
        )

    async def _await_ready(self, actor) -> dict[str, Any]:
        return await asyncio.wait_for(
            actor.ready.remote(), timeout=self.config.faults.restart_timeout_s
        )

    async def start(self) -> None:
        """Create the workers and wait until both have loaded their models."""
        self._wakeup = asyncio.Event()
        self.target = self._spawn_target()
        if self.config.draft is not None:
            self.draft = self._spawn_draft()
            self.target_info, self.draft_info = await asyncio.gather(
                self._await_ready(self.target), self._await_ready(self.draft)
            )
        else:
            self.target_info = await self._await_ready(self.target)
        self._loop_task = asyncio.create_task(self._loop())

    @property
    def ready(self) -> bool:
        """Both workers up (the draft may be restarting: target-only still serves)."""
        return self.target is not None and self._fatal is None and bool(self.target_info)

    def health(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "target": bool(self.target_info),
            "draft": self.draft is not None and bool(self.draft_info),
            "draft_restarting": self._draft_restarting is not None,
            "target_restarts": self._target_restarts,
            "running": len(self._running),
            "waiting": len(self._waiting),
            "aborted": self.aborted,
            "error": self._fatal,
        }

    async def shutdown(self) -> None:
        if self._loop_task:
            self._loop_task.cancel()
        for actor in (self.target, self.draft):
            if actor is not None:
                ray.kill(actor)

    # ----- requests ---------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        num_speculative_tokens: int | None = None,
        speculation: bool = True,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's output. Cancelling the iterator frees its sequence."""
        if self._fatal:
            raise EngineError(self._fatal)
        if not self.ready:
            raise EngineError("engine is not ready")
        if len(self._waiting) >= self.config.scheduler.max_waiting:
            raise EngineOverloadedError("too many requests waiting; retry later")
        max_len = self.target_info["max_model_len"]
        if len(prompt_token_ids) + params.max_tokens > max_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the context length {max_len}"
            )
        spec = self.config.speculation
        k = (
            spec.num_speculative_tokens
            if num_speculative_tokens is None
            else num_speculative_tokens
        )
        if not 0 <= k <= spec.max_speculative_tokens:
            raise ValueError(
                f"num_speculative_tokens must be in [0, {spec.max_speculative_tokens}]"
            )
        if not speculation or self.config.draft is None:
            k = 0
        rid = request_id or f"req-{next(self._ids)}"
        req = _Request(SequenceState(rid, list(prompt_token_ids), params), k, asyncio.Queue())
        self._waiting.append(req)
        self._wakeup.set()
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not req.seq.finished and not req.aborted:
                req.aborted = True
                self.aborted += 1
                self._wakeup.set()

    def _emit(self, req: _Request, new: list[int]) -> None:
        seq = req.seq
        req.queue.put_nowait(
            RequestOutput(
                seq.seq_id,
                new,
                seq.finished,
                seq.finish_reason,
                len(seq.prompt_token_ids),
                len(seq.output_token_ids),
                RequestStats(**asdict(req.stats)),
            )
        )

    def _commit(self, req: _Request, tokens: list[int]) -> None:
        seq = req.seq
        before = len(seq.output_token_ids)
        seq.append(tokens, self.eos_token_id)
        if not seq.finished and seq.params.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids[-64:])
            if any(s in text for s in seq.params.stop):
                seq.finish_reason = "stop"
        self._emit(req, seq.output_token_ids[before:])

    # ----- the loop ---------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if not self._running and not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
            try:
                await self._admit()
                await self._reap()
                if self._running:
                    await self._round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never leave requests hanging
                logger.exception("engine round failed")
                self._fail_all(EngineError(f"engine failure: {exc!r}"))

    def _fail_all(self, exc: BaseException) -> None:
        for req in [*self._running, *self._waiting]:
            req.queue.put_nowait(exc)
        self._running.clear()
        self._waiting.clear()

    async def _reap(self) -> None:
        """Free finished and aborted sequences on both workers."""
        done = [r for r in self._running if r.seq.finished or r.aborted]
        if not done:
            return
        self._running = [r for r in self._running if not (r.seq.finished or r.aborted)]
        ids = [r.seq.seq_id for r in done]
        await self._call_target("free", ids)
        await self._call_draft("free", ids)

    async def _admit(self) -> None:
        """Prefill waiting requests (up to max_num_seqs running) and emit first tokens."""
        while self._waiting and self._waiting[0].aborted:
            self._waiting.popleft()
        room = self.config.scheduler.max_num_seqs - len(self._running)
        batch = []
        while self._waiting and len(batch) < room:
            req = self._waiting.popleft()
            if not req.aborted:
                batch.append(req)
        if not batch:
            return
        items = [(r.seq.seq_id, r.seq.prompt_token_ids, r.params_dict, True) for r in batch]
        try:
            firsts = await self._call_target("prefill", items)
        except Exception as exc:
            # These requests are in neither queue now: fail them here, or they would hang.
            error = exc if isinstance(exc, EngineError) else EngineError(f"prefill failed: {exc!r}")
            for req in batch:
                req.queue.put_nowait(error)
            raise
        for req, tok in zip(batch, firsts, strict=True):
            self._commit(req, [tok])
            self._running.append(req)

    async def _round(self) -> None:
        t_round = time.perf_counter()
        reqs = [r for r in self._running if not (r.seq.finished or r.aborted)]
        if not reqs:
            return
        # Never draft past max_tokens: such drafts could not be committed.
        ks = [
            max(0, min(r.k, r.seq.params.max_tokens - len(r.seq.output_token_ids) - 1))
            if self.draft is not None
            else 0
            for r in reqs
        ]
        drafts: list[tuple[list[int], Any, bool]] = [([], None, False)] * len(reqs)
        draft_compute = spec_compute = 0.0
        t0 = time.perf_counter()
        if any(ks):
            items = [
                (r.seq.seq_id, r.seq.token_ids, r.params_dict, k)
                for r, k in zip(reqs, ks, strict=True)
            ]
            proposed = await self._call_draft("propose", items)
            if proposed is not None:
                drafts, draft_compute = proposed
                rows = sum(1 for d in drafts if d[0])
                hits = sum(1 for d in drafts if d[2])
                self.speculation_budget.observe_proposals(
                    self._spec_level, hits, rows, draft_compute
                )
            else:
                ks = [0] * len(reqs)
        t1 = time.perf_counter()
        verify_items = [
            (r.seq.seq_id, r.seq.last_token_id, d[0], d[1])
            for r, d in zip(reqs, drafts, strict=True)
        ]
        speculate = None
        overlap = self.config.speculation.mode == "overlap" and self.draft is not None
        level = self.speculation_budget.next_level() if overlap and any(ks) else None
        self._spec_level = level
        if level is not None:
            spec_items = [(r.seq.seq_id, k) for r, k in zip(reqs, ks, strict=True) if k > 0]
            fanout, rejections = level
            speculate = asyncio.ensure_future(
                self._call_draft("speculate", spec_items, fanout, rejections)
            )
        verified = await self._call_target("verify", verify_items)
        if speculate is not None:
            speculated = await speculate
            if speculated is not None:
                spec_compute = speculated[1]
        t2 = time.perf_counter()
        if verified is None:  # the target was replaced; sequences were re-prefilled
            return
        results, verify_compute = verified
        if overlap and any(ks):
            self.speculation_budget.observe_round(verify_compute, spec_compute, level)
        for req, (tokens, accepted), d in zip(reqs, results, drafts, strict=True):
            if d[0]:
                req.stats.drafted += len(d[0])
                req.stats.accepted += accepted
                req.stats.rounds += 1
                req.stats.cache_hits += int(d[2])
            self._commit(req, tokens)
        timings = self.timings
        timings.rounds += 1
        timings.draft_wait_s += t1 - t0
        timings.verify_wait_s += t2 - t1
        timings.draft_compute_s += draft_compute
        timings.verify_compute_s += verify_compute
        timings.speculate_compute_s += spec_compute
        timings.critical_compute_s += draft_compute + max(verify_compute, spec_compute)
        timings.total_s += time.perf_counter() - t_round

    # ----- fault handling ---------------------------------------------------------------

    async def _call_draft(self, method: str, *args):
        """Call the draft; on failure switch to target-only and start a replacement."""
        if self.draft is None:
            return None
        try:
            return await getattr(self.draft, method).remote(*args)
        except RayActorError as exc:
            logger.warning("draft worker failed (%s); continuing target-only", exc)
            self._replace_draft()
            return None

    def _replace_draft(self) -> None:
        dead, self.draft, self.draft_info = self.draft, None, {}
        if dead is not None:
            ray.kill(dead, no_restart=True)
        if self._draft_restarting is None:
            self._draft_restarting = asyncio.create_task(self._restart_draft())

    async def _restart_draft(self) -> None:
        try:
            actor = self._spawn_draft()
            info = await self._await_ready(actor)
            self.draft, self.draft_info = actor, info
            logger.info("replacement draft worker ready on node %s", info["node_id"])
        except Exception:
            logger.exception("could not start a replacement draft; serving target-only")
        finally:
            self._draft_restarting = None

    async def _call_target(self, method: str, *args):
        """Call the target; on failure replace it, re-prefill, and report None (or fail)."""
        try:
            return await getattr(self.target, method).remote(*args)
        except (RayActorError, GetTimeoutError) as exc:
            logger.warning("target worker failed during %s: %s", method, exc)
        await self._replace_target()
        if method in ("free",):
            return None
        if method == "prefill":
            return await self._call_target(method, *args)
        return None

    async def _replace_target(self) -> None:
        while True:
            if self._target_restarts >= self.config.faults.max_target_restarts:
                self._fatal = (
                    f"target worker died and was not restarted "
                    f"(max_target_restarts={self.config.faults.max_target_restarts})"
                )
                self._fail_all(EngineError(self._fatal))
                raise EngineError(self._fatal)
            self._target_restarts += 1
            ray.kill(self.target, no_restart=True)
            self.target_info = {}
            self.target = self._spawn_target()
            try:
                self.target_info = await self._await_ready(self.target)
                # Resume every running sequence from the tokens it already has.
                live = [r for r in self._running if not (r.seq.finished or r.aborted)]
                if live:
                    await self.target.prefill.remote(
                        [(r.seq.seq_id, r.seq.token_ids, r.params_dict, False) for r in live]
                    )
                logger.info("target worker replaced (%d restarts)", self._target_restarts)
                return
            except (RayActorError, asyncio.TimeoutError) as exc:
                logger.warning("replacement target failed: %s", exc)
