"""The engine frontend: what the Serve replica runs next to its HTTP API.

Rounds are not driven from here: the engine core (:mod:`deployments.core.engine_core`)
runs them in a loop next to the target, and the draft actor pushes drafts to it directly. This side
admits requests, streams committed tokens to clients (one long-poll per replica), stops
sequences at stop strings, aborts sequences whose client went away, and replaces
workers that die, so it is never on a round's critical path.

A dead draft degrades the core to target-only decoding (same output) while a replacement
loads; a dead target is replaced and every running request is resumed from the tokens it
already has, so nothing is lost (a final-only request's tokens the dead core still held,
at most ``output_hold.FLUSH_TOKENS``, are computed again).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, get_args

import ray
from ray.exceptions import RayActorError

from deployments.config import EngineConfig
from deployments.core.round_stats import RoundTimings
from deployments.frontend.detached_calls import DetachedCalls
from deployments.frontend.detokenizer import IncrementalDetokenizer
from deployments.frontend.outputs_channel import OutputsChannel
from deployments.frontend.request_state import (
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestOutput,
    RequestState,
    detokenize_until_stop,
)
from deployments.frontend.telemetry_link import TelemetryLink, TelemetrySink
from deployments.frontend.worker_launch import WorkerLauncher, ready_within, startup_cause
from deployments.messages import EngineCoreOutput, EngineCoreOutputs, OutputKind, decode
from specdec.low_rank import LowRankUpdate
from specdec.proposer_choice import METHODS as PROPOSERS
from specdec.sampling import SamplingParams
from specdec.stats import SpecCounts

logger = logging.getLogger("specserve.engine")

__all__ = [
    "EngineClient",
    "EngineError",
    "EngineOverloadedError",
    "InvalidRequestError",
    "RequestOutput",
    "RoundTimings",
    "SpecCounts",
]

POLL_TIMEOUT_S = 1.0
HEALTH_EVERY_S = 1.0  # how stale /health's running, waiting and KV figures may be under load


class EngineClient:
    """Frontend of one replica's engine: requests in, token streams out (asyncio)."""

    def __init__(
        self,
        config: EngineConfig,
        placement_group=None,
        tokenizer=None,
        telemetry: TelemetrySink | None = None,
        flush_interval_s: float = 1.0,
        replica: str = "",
        on_finished: Callable[[RequestState], None] | None = None,
    ):
        self.config = config
        # Called with each request that finished by a stop or its length (not an error or
        # an abort): the replica hands it to the adaptation deployment's retention.
        self.on_finished = on_finished
        self.launcher = WorkerLauncher(config, placement_group, tokenizer)
        self.tokenizer = tokenizer  # for text and stop strings (None: token ids only)
        # Round and request records go to ``telemetry`` (the monitor) every
        # ``flush_interval_s``, from a task of their own: never from the round's path.
        self.telemetry = (
            None
            if telemetry is None
            else TelemetryLink(
                telemetry,
                model=config.model_name,
                replica=replica,
                current_core=lambda: self.target,
                timeout_s=config.faults.call_timeout_s,
                interval_s=flush_interval_s,
                draft_version=lambda: self._draft_weights[0] if self._draft_weights else 0,
                tensor_parallel=lambda: self._core_health.get("tensor_parallel"),
            )
        )
        self.target = None  # the EngineCore actor (target model + round loop)
        self.draft = None
        self.target_info: dict[str, Any] = {}
        self.draft_info: dict[str, Any] = {}
        self._target_restarts = 0
        self._draft_restarting: asyncio.Task | None = None
        self._requests: dict[str, RequestState] = {}  # by seq_id, the core's id
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count()
        self._fatal: str | None = None
        self._core_health: dict[str, Any] = {}  # the core's health(), refreshed by _poll
        # The core's outputs over a direct connection (None: a Ray call per poll).
        self._outputs = OutputsChannel() if config.direct_channel else None
        self._draft_kv: dict[str, Any] | None = None  # the draft actor's KV, refreshed with it
        self._draft_tp: dict[str, Any] | None = None  # ... and a split draft's ranks
        self._core_health_at = float("-inf")
        # The draft weights every draft of this engine must serve, (version, state dict
        # in Ray's object store), once load_draft_weights has been called: a replacement
        # draft (or core, colocated) loads them before it drafts.
        self._draft_weights: tuple[int, Any] | None = None
        self.draft_update: str | None = None  # how the last version came: "full", "low_rank"
        # One weights load at a time (a caller's, or a replacement worker's), so that the
        # version recorded is the one every worker serves.
        self._weights_lock = asyncio.Lock()
        self.aborted = 0  # requests whose client went away before they finished
        self.draft_restart_failures = 0
        # A replacement target is loading: requests wait for it (it resumes them all).
        self._replacing_target = False
        # Adds and aborts, submitted as the engine's start's calls, not the requests'
        # (set by start(): a request's cancellation must not cancel them).
        self._detached: DetachedCalls | None = None

    # ----- workers ----------------------------------------------------------------------

    @property
    def colocated(self) -> bool:
        """The draft runs in the core's process (config ``draft_placement``)."""
        return self.launcher.colocated

    def _spawn_target(self):
        return self.launcher.spawn_target(
            self.draft_info.get("max_model_len"), self.telemetry is not None
        )

    async def _await_ready(self, actor) -> dict[str, Any]:
        return await ready_within(actor, self.config.faults.restart_timeout_s)

    async def _call(self, ref, extra_s: float = 0.0):
        """Await a worker call for at most ``call_timeout_s`` (+ ``extra_s``): a worker that
        does not answer is as good as dead (``TimeoutError``).

        ``asyncio.timeout``, not ``wait_for``: Python 3.11's ``wait_for`` returns the answer
        when it lands in the same loop turn as a cancellation of the caller, dropping the
        cancellation (CI: a streamed request's choices, cancelled as their client left while
        the core took them in, went on generating to their end)."""
        async with asyncio.timeout(self.config.faults.call_timeout_s + extra_s):
            return await ref

    async def start(self) -> None:
        """Create both workers, wait until both have loaded their models, connect them.

        Draft and target load at the same time (a large checkpoint takes minutes to
        download and load), each for at most ``faults.startup_timeout_s``; while they
        load, progress is logged every 30 s. A worker that fails to start fails the
        engine with its reason (Serve then reports the deployment as failed)."""
        cfg = self.config
        self._detached = DetachedCalls()
        try:
            if cfg.draft is not None and not self.colocated:
                self.draft = self.launcher.spawn_draft()
            self.target = self._spawn_target()
            workers = {"target": self.target}
            if self.draft is not None:
                workers["draft"] = self.draft
            results = await self.launcher.load(workers, cfg.faults.startup_timeout_s)
            failed = {n: r for n, r in results.items() if isinstance(r, BaseException)}
            if failed:
                raise EngineError(
                    "; ".join(
                        f"the {name} worker ({getattr(cfg, name).model}) failed to start: "
                        f"{startup_cause(exc, cfg.faults.startup_timeout_s)}"
                        for name, exc in failed.items()
                    )
                )
            self.target_info = results["target"]
            if self.colocated:
                self.draft_info = self.target_info.pop("draft")
                self._warn_unchecked_pair()
            if self.draft is not None:
                self.draft_info = results["draft"]
                self._warn_unchecked_pair()
                await self._connect(self.target, self.draft, self.draft_info)
            await self._refresh_health()  # /health's KV figures from the start
        except BaseException:  # failed, timed out or cancelled: no worker outlives the start
            await self.shutdown()
            raise
        if self.draft is not None:
            self._tasks.append(asyncio.create_task(self._watch_draft(self.draft)))
        self._tasks.append(asyncio.create_task(self._poll()))
        if self.telemetry is not None:
            self._tasks.append(asyncio.create_task(self.telemetry.run()))

    def _warn_unchecked_pair(self) -> None:
        """Without a tokenizer the pair's ids cannot be compared (app.preflight does it
        with one): say so when the row counts differ by more than padding would."""
        t_rows, d_rows = self.target_info["vocab_size"], self.draft_info["vocab_size"]
        if self.tokenizer is None and abs(t_rows - d_rows) > max(256, t_rows // 100):
            logger.warning(
                "target (%d logits rows) and draft (%d) have no tokenizer to compare and "
                "differ by more than padding: are they a pair? (output stays exact; "
                "acceptance may be near zero)",
                t_rows,
                d_rows,
            )

    def _vocab_limit(self, draft_info: dict[str, Any]) -> int:
        """Ids the draft may propose: rows both models have and, with a tokenizer, real
        tokens only (embedding rows past the tokenizer's size are padding)."""
        limit = min(self.target_info["vocab_size"], draft_info["vocab_size"])
        if self.tokenizer is not None:
            limit = min(limit, len(self.tokenizer))
        return limit

    async def _connect(self, core, draft, draft_info: dict[str, Any]) -> None:
        # The draft keeps KV slots for as many sequences as the target can run at once.
        num_seqs = self.target_info["kv_cache"]["num_slots"]
        await self._call(draft.set_core.remote(core, self._vocab_limit(draft_info), num_seqs))
        await self._call(core.set_draft.remote(draft, draft_info.get("max_model_len")))

    @property
    def ready(self) -> bool:
        """The target is up (the draft may be restarting: target-only still serves)."""
        return self.target is not None and self._fatal is None and bool(self.target_info)

    @property
    def status(self) -> str:
        """``ok``: serving with speculation; ``warming``: compiling the models' graphs at
        startup (requests wait for it); ``degraded``: serving target-only while a draft
        is away, or holding requests while a replacement target loads (they resume on
        it); ``unavailable``: cannot serve (the target failed for good). The HTTP /health
        and Serve's check_health both answer from this."""
        if not self.ready:
            return "unavailable"
        if self._core_health.get("warming"):
            return "warming"
        if self._replacing_target:
            return "degraded"
        if self.colocated:
            return "ok"  # the draft lives and dies with the target
        if self.config.draft is not None and not (self.draft is not None and self.draft_info):
            return "degraded"
        return "ok"

    def health(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "ready": self.ready,
            "target": bool(self.target_info),
            "draft": (self.draft is not None or self.colocated) and bool(self.draft_info),
            "draft_restarting": self._draft_restarting is not None,
            "target_restarting": self._replacing_target,
            "target_restarts": self._target_restarts,
            "running": self._core_health.get("running", 0),
            "waiting": self._core_health.get("waiting", 0),
            "kv_cache": self._core_health.get("kv_cache"),
            "draft_kv_cache": (
                self._core_health.get("draft_kv_cache") if self.colocated else self._draft_kv
            )
            if self.draft is not None or self.colocated
            else None,
            "aborted": self.aborted,
            "draft_version": self._draft_weights[0] if self._draft_weights else 0,
            "draft_versions": dict(self.telemetry.domain_versions) if self.telemetry else {},
            "draft_update": self.draft_update,
            "draft_channel": self._core_health.get("draft_channel"),
            # a split target's ranks: size, rank 0's calls, each other rank's (None: whole)
            "tensor_parallel": self._core_health.get("tensor_parallel"),
            "draft_tensor_parallel": self._draft_tp if self.draft is not None else None,
            "outputs_polls": None if self._outputs is None else dict(self._outputs.polls),
            "error": self._fatal,
        }

    async def load_draft_weights(
        self, version: int, weights: dict[str, Any] | LowRankUpdate, full=None
    ) -> int:
        """Serve the draft with ``weights`` (a state dict of the draft model, or a
        :class:`LowRankUpdate` over the version served now, with ``full``: an ObjectRef
        of the merged state dict) as ``version``, between rounds, without a lost or
        changed request; returns the version served. Weights that do not fit the draft
        are refused (ValueError) and the old ones stay. A draft or core replaced later
        loads the same version (``full`` for an update)."""
        if self.config.draft is None:
            raise EngineError("this engine serves without a draft model")
        if isinstance(weights, LowRankUpdate) and full is not None:
            # The whole, kept for replacements, in a copy this replica owns: an object is
            # lost with the process that put it (the adaptation replica, which may
            # restart), and no replacement could load this version then. (Fetched before
            # the lock: a replacement's reload waits on it.)
            full = ray.put(await full)
        async with self._weights_lock:
            served = self._draft_weights[0] if self._draft_weights else 0
            if version <= served:
                raise ValueError(f"draft version {version} is not newer than {served}")
            low_rank = isinstance(weights, LowRankUpdate)
            if low_rank and (weights.base_version != served or full is None):
                raise ValueError(
                    f"a low-rank update over version {weights.base_version} needs version "
                    f"{weights.base_version} served (it is {served}) and the full weights"
                )
            worker = self.target if self.colocated else self.draft
            if worker is None or self._replacing_target:
                raise EngineError("the draft's worker is being replaced: try again")
            ref = ray.put(weights)
            served = await self._call(self._load_weights(worker, version, ref), extra_s=60.0)
            self._draft_weights = (served, full if low_rank else ref)
            self.draft_update = "low_rank" if low_rank else "full"
            if not self.colocated:  # (a colocated draft's core knows: it loaded them)
                try:  # the load succeeded; a lost note costs re-measuring, not the swap
                    await self._call(self.target.note_draft_version.remote(served))
                except Exception as exc:
                    logger.warning("the core was not told of draft version %d: %r", served, exc)
            return served

    def _load_weights(self, worker, version: int, ref, timeout_s: float = 60.0):
        """The call that loads a draft version into ``worker`` (a draft, or a core with
        its draft colocated), which waits at most ``timeout_s`` for its loop to take it."""
        method = worker.load_draft_weights if self.colocated else worker.load_weights
        return method.remote(version, ref, timeout_s)

    async def round_timings(self, reset: bool = False) -> dict[str, Any]:
        """The core's per-round split (verify, draft waits, overhead), summed over rounds."""
        return await self._call(self._submit(self.target.get_timings, reset))

    async def seq_ids(self) -> dict[str, Any]:
        """What each worker holds, for leak checks: see EngineCore/DraftWorker.seq_ids."""
        out: dict[str, Any] = {"requests": sorted(map(str, self._requests))}
        out["target"] = await self._call(self.target.seq_ids.remote())
        if "draft" in out["target"]:  # colocated: the core holds the draft's sequences
            out["draft"] = out["target"].pop("draft")
        if self.draft is not None:
            out["draft"] = await self._call(self.draft.seq_ids.remote())
        return out

    async def shutdown(self) -> None:
        self._fail("the engine is shutting down")
        for task in self._tasks:
            task.cancel()
        if self._outputs is not None:
            self._outputs.close()
        for actor in (self.target, self.draft, *self.launcher.ranks):
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
        domain: str = "default",
        operation: str = "text_completion",
        method: str | None = None,
        output_kind: OutputKind = "delta",
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's output. Cancelling the iterator frees its sequence.

        Without ``num_speculative_tokens`` the length policy (``speculation.policy``)
        chooses k per round for the request's ``domain``, up to the configured k.
        ``method``: the proposer ("draft_model" or "ngram"); None: the configured rule
        (:meth:`SpeculationConfig.draft_plan`). ``output_kind`` "final_only": the caller
        reads only the end, so the core sends the first output and then the rest at once
        (``deployments/core/output_hold.py``); a request with stop strings stays "delta",
        since they are found in its text as it grows."""
        req = self._checked_request(
            prompt_token_ids,
            params,
            (speculation, num_speculative_tokens, method),
            request_id,
            domain,
            output_kind,
        )
        t_start, t_first, error_type = time.perf_counter(), None, None
        try:
            await self._start_request(req)
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if t_first is None and item.new_token_ids:
                    t_first = time.perf_counter()
                # Before the last yield: a consumer that has its last output closes the
                # stream without asking for more (the HTTP layer does).
                ended_well = item.finished and item.finish_reason in ("stop", "length")
                if ended_well and self.on_finished is not None:
                    self.on_finished(req)
                yield item
                if item.finished:
                    return
        except BaseException as exc:
            if not req.finished or not isinstance(exc, GeneratorExit):  # else: closed at its end
                error_type = type(exc).__name__
            raise
        finally:
            if self.telemetry is not None:
                n_out = len(req.output_token_ids)
                self.telemetry.record_request(
                    req.domain, operation, n_out, t_start, t_first, error_type
                )
            self._end_request(req)

    def _checked_request(
        self, prompt_token_ids, params, speculation_args, request_id, domain, output_kind
    ) -> RequestState:
        """A new request's registered state, once every check a caller gets has passed;
        ``speculation_args``: generate's ``(speculation, num_speculative_tokens, method)``."""
        speculation, num_speculative_tokens, method = speculation_args
        self._check_admission()
        self._check_request(prompt_token_ids, params, num_speculative_tokens, method)
        if output_kind not in get_args(OutputKind):
            raise InvalidRequestError(
                f"output_kind must be one of {get_args(OutputKind)}", "output_kind"
            )
        plan = self.config.speculation.draft_plan(
            speculation,
            num_speculative_tokens,
            params.seed is not None,
            self.config.draft is not None,
            method,
        )
        # Stop strings are found in the text as it grows: such a request stays "delta".
        kind = "delta" if params.stop else output_kind
        return self._new_request(request_id, prompt_token_ids, params, plan, domain, kind)

    def _check_admission(self) -> None:
        """The engine can take a request now (else EngineError, or overloaded)."""
        if self._fatal:
            raise EngineError(self._fatal)
        if not self.ready:
            raise EngineError("engine is not ready")
        sched = self.config.scheduler
        if len(self._requests) >= sched.max_num_seqs + sched.max_waiting:
            raise EngineOverloadedError("too many requests waiting; retry later")

    def _check_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        num_speculative_tokens,
        method: str | None = None,
    ) -> None:
        """What only the engine knows (vocabulary, context, k bounds); every caller's check,
        so a request that reaches the core cannot fail there for its input."""
        vocab = self.target_info["vocab_size"]
        if not prompt_token_ids or any(
            not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
            for t in prompt_token_ids
        ):
            raise InvalidRequestError(
                f"prompt token ids must be a non-empty list of integers in [0, {vocab})",
                "prompt",
            )
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be integers in [0, {vocab})", "stop_token_ids"
            )
        if params.top_k > vocab:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (disabled) or at most the vocabulary size {vocab}", "top_k"
            )
        max_len = self.target_info["max_model_len"]
        if len(prompt_token_ids) + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the context length {max_len}",
                "max_tokens",
            )
        spec = self.config.speculation
        asked = (
            spec.num_speculative_tokens
            if num_speculative_tokens is None
            else num_speculative_tokens
        )
        if not 0 <= asked <= spec.max_speculative_tokens:
            raise InvalidRequestError(
                f"num_speculative_tokens must be in [0, {spec.max_speculative_tokens}]",
                "speculation.num_speculative_tokens",
            )
        if method not in (None, *PROPOSERS):
            raise InvalidRequestError(
                f"method must be one of {list(PROPOSERS)}", "speculation.method"
            )

    def _new_request(
        self, request_id, prompt_token_ids, params, plan, domain, output_kind
    ) -> RequestState:
        """The request's state, registered under an id of the core's own (refused if the
        caller's id is in use). The core knows a request by ``seq_id``, never by the
        caller's id alone: a caller may use an id again as soon as its request ended, while
        the core may still hold the old one (its abort not yet applied) or its last output
        may still be on its way here, which would fail the new request or end it with the
        old one's tokens."""
        if request_id is not None and not isinstance(request_id, str):
            # ids cross to the core as strings (deployments.messages.SeqId)
            raise InvalidRequestError("request_id must be a string", "request_id")
        n = next(self._ids)
        rid = request_id or f"req-{n}"
        if any(r.request_id == rid for r in self._requests.values()):
            raise InvalidRequestError(f"request_id {rid!r} is already in use", "request_id")
        seq_id = rid if request_id is None else f"{rid}#{n}"
        detok = (
            IncrementalDetokenizer(self.tokenizer, params.stop)
            if self.tokenizer is not None
            else None
        )
        req = RequestState(
            rid,
            seq_id,
            list(prompt_token_ids),
            params,
            plan.k,
            asyncio.Queue(),
            detok,
            domain=domain,
            auto=plan.auto_k,
            method=plan.method,
            auto_method=plan.auto_method,
            output_kind=output_kind,
        )
        self._requests[seq_id] = req
        return req

    async def _start_request(self, req: RequestState) -> None:
        """Hand the request to the core (unless a replacement core will be given it)."""
        try:
            if not self._replacing_target:  # else the replacement starts it
                await self._call(self._submit(self.target.add_requests, [req.core_request()]))
        except (TimeoutError, RayActorError):
            pass  # the poller replaces the target and resumes every known request
        except Exception as exc:
            raise EngineError(f"could not start the request: {exc}") from exc

    def _end_request(self, req: RequestState) -> None:
        """Forget the request; one that did not finish is aborted in the core."""
        self._requests.pop(req.seq_id, None)
        if not req.finished:
            req.finished = True
            self.aborted += 1
            self._abort([req.seq_id])

    def _abort(self, rids: list[str]) -> None:
        if self.target is not None and not self._fatal:
            self._submit(self.target.abort, rids)  # fire and forget: a dead target frees nothing

    def _submit(self, method, *args):
        """``method.remote(*args)`` outside the calling request's Ray task (see
        :mod:`deployments.frontend.detached_calls`; set by start(), before any worker
        exists to call)."""
        return self._detached.submit(method, *args)

    def _deliver(self, out: EngineCoreOutput) -> None:
        rid, new, finished, reason = (
            out.request_id,
            out.new_token_ids,
            out.finished,
            out.finish_reason,
        )
        logprobs = out.logprobs
        req = self._requests.get(rid)
        if req is None or req.finished:
            return
        if out.error is not None:
            req.finished = True
            req.queue.put_nowait(EngineError(out.error))
            return
        text = None
        if req.detok is not None:
            new, text, stopped = detokenize_until_stop(req.detok, new, finished)
            if stopped:  # a stop string ends the text here: drop what came after it
                if not finished:
                    self._abort([rid])
                finished, reason = True, "stop"
                logprobs = logprobs and logprobs[: len(new)]
        req.output_token_ids.extend(new)
        req.finished = finished
        req.queue.put_nowait(
            RequestOutput(
                req.request_id,
                new,
                finished,
                reason,
                len(req.prompt_token_ids),
                len(req.output_token_ids),
                out.spec_counts,
                text,
                logprobs,
                out.prompt_logprobs,
            )
        )

    # ----- the output stream and fault handling -----------------------------------------

    async def _poll(self) -> None:
        """Long-poll the core for committed tokens; replace it when it dies."""
        cursor = 0
        while True:
            try:
                polled = decode(EngineCoreOutputs, await self._poll_once(cursor))
                cursor, outs, error = polled.cursor, polled.outputs, polled.error
            except asyncio.CancelledError:
                raise
            except (TimeoutError, RayActorError) as exc:
                logger.warning("target worker failed or hung: %r", exc)
                if not await self._replace_target("died"):
                    return
                cursor = 0
                continue
            except Exception as exc:  # an answer that cannot be read: fail loudly, never hang
                logger.exception("could not read the engine core's outputs")
                self._fail(f"engine failure: unreadable outputs: {exc!r}")
                return
            for out in outs:
                self._deliver(out)
            if error:
                self._fail(f"engine failure: {error}")
                return
            if stalled := self._stalled(polled.stalled_s):  # its loop hangs; it answers
                logger.warning("target worker %s: replacing it", stalled)
                if not await self._replace_target(stalled):
                    return
                cursor = 0
                continue
            # While the core warms up its figures are read at every poll, so /health says
            # "ok" as soon as the first outputs show the warm-up is over.
            warming = self._core_health.get("warming", False)
            if not outs or warming or time.monotonic() - self._core_health_at > HEALTH_EVERY_S:
                self._core_health_at = time.monotonic()
                await self._refresh_health()

    def _stalled(self, stalled_s: float) -> str | None:
        """Why the core counts as hung, from how long its loop has been busy without
        committing a model pass (None: it has not)."""
        limit = self.config.faults.iteration_timeout_s
        if stalled_s <= limit:
            return None
        return f"made no progress for {stalled_s:.0f} s (faults.iteration_timeout_s={limit:g})"

    async def _poll_once(self, cursor: int):
        """One long-poll: over the direct channel where it works, else a Ray call."""
        target = self.target
        if self._outputs is not None:
            deadline_s = self.config.faults.call_timeout_s + POLL_TIMEOUT_S
            wire = await self._outputs.poll(target, cursor, POLL_TIMEOUT_S, deadline_s)
            if wire is not None:
                return wire
        return await self._call(target.get_outputs.remote(cursor, POLL_TIMEOUT_S), POLL_TIMEOUT_S)

    async def _refresh_health(self) -> None:
        """The core's batch and KV figures, and the draft actor's KV (for /health); a
        worker that does not answer, or whose answer raised, keeps its last figures (its
        watcher handles it). Never raises: the output poll that calls it must live on."""
        if (health := await self._figures("engine core health", self.target.health)) is not None:
            self._core_health = health
        draft = self.draft
        stats = await self._figures("draft stats", draft.stats) if draft is not None else None
        if stats is not None:
            self._draft_kv, self._draft_tp = stats["kv_cache"], stats["tensor_parallel"]

    async def _figures(self, what: str, method) -> dict[str, Any] | None:
        """``method.remote()``'s answer, or None where the worker did not answer (dead or
        hung: its watcher's business) or the call raised in it (a RayTaskError, logged)."""
        try:
            return await self._call(method.remote())
        except (TimeoutError, RayActorError):
            return None
        except Exception as exc:
            logger.warning("%s failed: %r", what, exc)
            return None

    def _fail(self, message: str) -> None:
        self._fatal = message
        for req in list(self._requests.values()):
            if not req.finished:
                req.finished = True
                req.queue.put_nowait(EngineError(message))

    def _backoff(self, failures: int) -> float:
        f = self.config.faults
        return min(f.restart_backoff_max_s, f.restart_backoff_s * 2 ** max(0, failures - 1))

    async def _replace_target(self, reason: str) -> bool:
        """Start a new core, reconnect the draft, resume every request; False if fatal
        (the requests then fail with ``reason``: "died", or how the core hung).

        Requests that arrive meanwhile wait in ``_requests`` (``_replacing_target``): the
        snapshot of live requests and the end of that state happen with no await between
        them, so each request reaches the new core exactly once.
        """
        failures = 0
        self._replacing_target = True
        while True:
            if self._target_restarts >= self.config.faults.max_target_restarts:
                self._replacing_target = False
                self._fail(
                    f"target worker {reason} and was not restarted "
                    f"(max_target_restarts={self.config.faults.max_target_restarts})"
                )
                return False
            if failures:
                await asyncio.sleep(self._backoff(failures))
            self._target_restarts += 1
            try:
                await self._start_new_core()
            except Exception as exc:  # any failure of the new core: try another one
                failures += 1
                logger.warning("replacement target failed: %r", exc)
                continue
            await self._reattach_draft()
            live = [r.core_request() for r in self._requests.values() if not r.finished]
            self._replacing_target = False
            try:
                if live:
                    await self._call(self._submit(self.target.add_requests, live))
            except Exception as exc:
                failures += 1
                logger.warning("replacement target failed: %r", exc)
                continue
            logger.info("target worker replaced (%d restarts)", self._target_restarts)
            return True

    async def _start_new_core(self) -> None:
        """Kill the core, spawn a new one and wait until it is ready (raises if it is not):
        with the colocated draft, load the draft version served before."""
        ray.kill(self.target, no_restart=True)
        self._replacing_target = True
        self.target = self._spawn_target()
        if self.telemetry is not None:  # a new core's policy: only the alerts firing now
            self.telemetry.reset()
        self.target_info = await self._await_ready(self.target)
        if self.colocated:
            self.draft_info = self.target_info.pop("draft")
            async with self._weights_lock:  # the version served before
                if self._draft_weights is not None:
                    # (its loop takes them after compiling its graphs)
                    wait_s = self.config.faults.startup_timeout_s
                    load = self._load_weights(self.target, *self._draft_weights, wait_s)
                    await self._call(load, extra_s=wait_s)
        await self._refresh_health()  # the new core's (warming while it compiles)

    async def _reattach_draft(self) -> None:
        """The draft actor to the new core, before any request is resumed (so that they
        draft from their first round: a seeded request then draws exactly what it would
        have without the failure); a draft that cannot follow is replaced."""
        if self.draft is None:
            return
        if self.config.transport == "compiled_graph":
            # The dead core drove the draft's graph loop, which may never end: a fresh
            # draft is safer than compiling a second graph onto it.
            self._start_draft_replacement("its target was replaced")
            return
        try:
            await self._connect(self.target, self.draft, self.draft_info)
        except Exception as exc:  # the draft's problem, not the new target's
            self._start_draft_replacement(f"it could not reconnect: {exc!r}")

    def _start_draft_replacement(self, reason: str) -> None:
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(self._replace_draft(reason)))

    async def _watch_draft(self, draft) -> None:
        """Replace ``draft`` when it dies, its loop fails, or its loop stops making progress.

        Death and loop failure end the long-running ``watch`` call; a hung loop (a stuck
        device call) does not, so its progress is checked every ``liveness_period_s``.
        """
        faults = self.config.faults
        watch = asyncio.ensure_future(draft.watch.remote())
        reason = None
        try:
            while reason is None:
                done, _ = await asyncio.wait({watch}, timeout=faults.liveness_period_s)
                if done:
                    try:
                        reason = f"its loop failed: {watch.result()}"
                    except RayActorError as exc:
                        reason = f"it died: {exc}"
                    break
                try:
                    stalled = await self._call(draft.stalled_s.remote())
                except (TimeoutError, RayActorError) as exc:
                    reason = f"it does not answer: {exc!r}"
                    break
                if stalled > faults.call_timeout_s:
                    reason = f"its loop made no progress for {stalled:.0f} s"
        except asyncio.CancelledError:
            watch.cancel()
            raise
        watch.cancel()
        if draft is self.draft:
            logger.warning("draft worker lost (%s); continuing target-only", reason)
            await self._replace_draft(reason)

    async def _replace_draft(self, reason: str) -> None:
        """Serve target-only and start a new draft, retrying with backoff until one runs.

        Used when the draft died or hung, and after a target replacement in the
        compiled-graph transport (whose graph loop the dead core drove). One replacement
        runs at a time; it stops when the engine fails for good or shuts down.
        """
        if self._draft_restarting is not None:
            return
        self._draft_restarting = asyncio.current_task()
        dead, self.draft, self.draft_info = self.draft, None, {}
        self._draft_kv = self._draft_tp = None  # (the dead draft's figures)
        failures = 0
        try:
            with contextlib.suppress(Exception):  # a dead target is the poller's business
                await self._call(self.target.set_draft.remote(None))
            if dead is not None:
                ray.kill(dead, no_restart=True)
            while self._fatal is None:
                actor = self.launcher.spawn_draft()
                try:
                    info = await self._await_ready(actor)
                    async with self._weights_lock:  # the version served before
                        if self._draft_weights is not None:
                            await self._call(self._load_weights(actor, *self._draft_weights), 60)
                    await self._connect(self.target, actor, info)
                except asyncio.CancelledError:
                    ray.kill(actor, no_restart=True)
                    self.launcher.kill_ranks("draft")
                    raise
                except Exception as exc:
                    ray.kill(actor, no_restart=True)
                    self.launcher.kill_ranks("draft")  # (a split draft's: theirs too)
                    failures += 1
                    delay = self._backoff(failures)
                    logger.warning(
                        "replacement draft failed (%r); target-only, retrying in %.0f s",
                        exc,
                        delay,
                    )
                    self.draft_restart_failures += 1
                    await asyncio.sleep(delay)
                    continue
                self.draft, self.draft_info = actor, info
                self._tasks = [t for t in self._tasks if not t.done()]
                self._tasks.append(asyncio.create_task(self._watch_draft(actor)))
                logger.info("draft worker replaced (%s) on node %s", reason, info["node_id"])
                return
        finally:
            self._draft_restarting = None
