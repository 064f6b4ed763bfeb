"""The engine core: a loop next to the target model that runs rounds back to back.

As in vLLM v1 (a busy engine-core loop, a separate frontend), scheduling of the running
sequences lives here, in the target's process, not in the Serve replica. A round:

1. take the drafts for every running sequence from what the draft actor *pushed*: on a
   speculation-cache hit they arrived while the previous round was being verified, so
   the round starts at once, with no actor call and no engine code in between; on a miss
   the loop waits for the fresh drafts the draft actor sends when it learns the outcome;
2. verify them all in one target pass and commit;
3. tell the draft actor the outcomes (one fire-and-forget message per round, sent by a
   sender thread so the loop never pays for Ray's call path) and publish the committed
   tokens to the frontend, which long-polls :meth:`EngineCore.get_outputs`;
4. record the round (one :class:`specdec.stats.RoundStats`) for the policy, the timings
   and the monitor.

The loop is the one that executes; it asks the :class:`~deployments.core.scheduler.Scheduler`
what to run (admission on free KV slots, draft lengths) and talks to the draft through a
:class:`~deployments.core.draft_link.DraftLink` (an actor, or colocated). Admissions and
aborts arrive as messages between rounds. Every call into this actor runs in a
concurrency group of its own (control, requests, push, poll), so a long-poll never blocks a
push, and all of them run while the loop thread is inside torch (which releases the GIL).
Every message in and out is a named type of :mod:`deployments.messages`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Hashable
from functools import partial
from typing import Any, ClassVar

import msgspec
import ray
import torch

from deployments.config import ModelSpec
from deployments.core.colocated import ColocatedDraftLink
from deployments.core.draft_link import ActorDraftLink, DraftLink
from deployments.core.logprobs import score_prompt, token_logprobs
from deployments.core.output_hold import OutputHold
from deployments.core.round_stats import RoundTimings, Telemetry
from deployments.core.scheduler import RunningSeq, Scheduler
from deployments.messages import (
    ChannelAddress,
    ColocatedDraftConfig,
    DraftItem,
    DraftPush,
    DriftAlert,
    EngineCoreConfig,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    OutputsRequest,
    PushedDraft,
    RoundFeedback,
    TelemetrySnapshot,
    Wire,
    decode,
    encode,
)
from deployments.workers.channel import ChannelServer, FrameSocket
from deployments.workers.drafting import DraftRounds, WeightsHandoff, new_drafter
from deployments.workers.model_loader import (
    configure_thread,
    group_health,
    load_runner,
    load_split,
    pin_thread,
    warm_up,
    worker_info,
)
from specdec.ngram import ngram_propose
from specdec.policy import SpeculationLength
from specdec.proposer_choice import ProposerChoice
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState
from specdec.stats import RoundStats, RowOutcome, SpecCounts
from specdec.verify import VerifyRow, sample_next, verify_rows

__all__ = ["EngineCore", "RoundTimings", "Telemetry", "token_logprobs"]

logger = logging.getLogger("specserve.core")
_OUTPUTS_REQUEST = msgspec.msgpack.Decoder(OutputsRequest)
POLICY_STATE_EVERY_S = 0.05  # how fresh the policy snapshot drain_telemetry returns is

# (seq_id, feed [last committed token, *drafts], its verification row): one row of a pass
RoundRow = tuple[Hashable, list[int], VerifyRow]


def _generation_eos(runner) -> frozenset[int]:
    """The EOS ids of the model's ``generation_config`` (an int or a list of them)."""
    eos = getattr(getattr(runner.model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class EngineCore:
    """Target model + the scheduling loop of one replica (a threaded Ray actor)."""

    # "requests": one thread, so that a caller's add_requests and abort run in the order it
    # sent them (Ray hands an in-order actor's calls to their group in that order; with two
    # threads an abort sent while its add was running could take the lock first, and the
    # add then cleared it: the request generated to max_tokens for a client long gone).
    # That order holds while the actor stays in order: no max_concurrency,
    # allow_out_of_order_execution or task retries in its options (worker_launch).
    CONCURRENCY_GROUPS: ClassVar[dict[str, int]] = {
        "control": 2,
        "requests": 1,
        "push": 1,
        "poll": 1,
    }
    MAX_FAILURES_IN_A_ROW = 16

    def __init__(self, config: EngineCoreConfig):
        self.spec = ModelSpec.model_validate(config.spec)
        self._cpu_affinity = config.cpu_affinity
        self.cores: list[int] = []  # what the loop thread is pinned to (empty: not pinned)
        self.ranks: list[dict[str, Any]] = []  # a tensor-parallel target's other ranks' info
        self._rank_actors: list[Any] = list(config.ranks)  # ... and their actors
        self.runner, self.draft_runner = self._load_models(config)
        self.scheduler = self._make_scheduler(config)
        self.ngram_max, self.ngram_min = config.ngram_max, config.ngram_min
        self._policy_state: dict[str, dict] = {}  # the policy's choices, for drain_telemetry
        self._policy_state_at = float("-inf")  # when the loop last published them
        self._drift: list[DriftAlert] = []  # drift alerts for the policy, from calls
        # Round outcomes for the monitor, drained by the frontend (off the loop's path).
        self._telemetry = Telemetry() if config.telemetry else None
        # Every id that ends a sequence: the tokenizer's and generation_config's (models
        # list several there, e.g. end-of-text and end-of-turn).
        self.eos_token_ids = frozenset(config.eos_token_ids) | _generation_eos(self.runner)
        self.draft_timeout_s = config.draft_timeout_s
        self._cv = threading.Condition()  # guards what the calls hand to the loop
        self._new: list[EngineCoreRequest] = []
        self._aborts: set[Hashable] = set()
        self._seq_ids: set[Hashable] = set()  # every request added and not yet ended
        # A colocated draft's new weights, for the loop to load between rounds.
        self.draft_weights = WeightsHandoff(self._cv, "colocated")
        self._draft_version = 0  # the newest draft weights' version the core was told of
        self.link: DraftLink = (
            ActorDraftLink(config.transport, self._seq_ids.__contains__, config.direct_channel)
            if config.colocated_draft is None
            else self._colocated_link(config.colocated_draft)
        )
        self._out_cv = threading.Condition()
        self._outputs_channel: ChannelServer | None = None  # the replica's direct polls
        self._outbox: list[EngineCoreOutput] = []
        self._out_base = 0
        self._hold = OutputHold()  # final-only requests' outputs until they end
        self._verify_avg: float | None = None
        self._last_round_end: float | None = None  # perf_counter at the last round's end
        self._prefill_s = 0.0  # admissions' prefills since then [s]
        self.timings = RoundTimings()
        self._paused_base = self._resumed_base = 0  # scheduler counts at the last reset
        self.error: str | None = None
        self.failed_requests = 0  # failed alone, each with its own error (see _fail)
        self._failures_in_a_row = 0
        self._stopped = False
        # time.monotonic() when the loop began what it is doing now; None while it waits for
        # work (or warms up): a hung loop (a stuck device call) shows in the polls'
        # stalled_s, which this thread's hang cannot stop the poll thread from answering.
        self._busy_since: float | None = None
        # Compiling the models' graphs (execution_mode torch_compile) is the loop thread's
        # first work: requests that come meanwhile wait in the queue, /health says warming.
        self.warming = True
        self.compile_seconds: dict[str, dict[str, float]] = {}
        self._thread = threading.Thread(target=self._loop_guarded, name="specserve-core")
        self._thread.daemon = True
        self._thread.start()

    def _exit_with_group(self) -> None:
        """Leave with a failed tensor-parallel group (a rank died or hung past
        ``faults.rank_timeout_s``): the process exits without ending its requests, so that
        the replica replaces the core, with a fresh group, and resumes each request from
        its committed tokens, as for any target that died. The ranks exit as their next
        collective fails."""
        logger.error("tensor-parallel group failed: exiting for a replacement")
        logging.shutdown()
        os._exit(1)

    def _make_scheduler(self, config: EngineCoreConfig) -> Scheduler:
        """The scheduler, bounded by both models' lengths, with the config's policies."""
        draft_max_model_len = (
            self.draft_runner.max_model_len if self.draft_runner else config.draft_max_model_len
        )
        # k per domain and batch size for requests that do not set their own (None: fixed).
        policy = SpeculationLength(config.length_policy) if config.length_policy else None
        choice = ProposerChoice(config.proposer_choice) if config.proposer_choice else None
        return Scheduler(
            config.max_num_seqs,
            self.runner.max_model_len,
            draft_max_model_len or self.runner.max_model_len,
            policy,
            choice,
        )

    def _load_models(self, config: EngineCoreConfig):
        """The target's runner, and a colocated draft's (loaded first: the target plans
        one KV budget for both) or None."""
        if config.colocated_draft is None:
            return self._load_target(config), None
        draft_spec = ModelSpec.model_validate(config.colocated_draft.spec)
        draft_runner = load_runner(draft_spec, config.max_num_seqs, defer_kv=True, verifies=False)
        return self._load_target(config, kv_shared_with=draft_runner), draft_runner

    def _load_target(self, config: EngineCoreConfig, **kwargs):
        """The target whole, or rank 0's share of it with the other ranks (the config's
        TensorParallelRank actors) joining this process's group as it loads; then their
        ``ready`` (each loaded its share) within the startup wait."""
        make = partial(load_runner, self.spec, config.max_num_seqs, **kwargs)
        if not config.ranks:
            return make()
        runner, self.ranks = load_split(make, config.ranks, self.spec, config.rank_timeout_s)
        return runner

    def _colocated_link(self, cfg: ColocatedDraftConfig) -> ColocatedDraftLink:
        """The draft in this process, proposing the ids both models and the tokenizer
        share, keeping a slot for every target slot (the budget planned them together)."""
        limits = [self.runner.vocab_size, self.draft_runner.vocab_size]
        if cfg.tokenizer_size:
            limits.append(cfg.tokenizer_size)
        drafter = new_drafter(
            self.draft_runner, cfg.min_confidence, self.draft_runner.max_num_seqs, min(limits)
        )
        return ColocatedDraftLink(DraftRounds(drafter))

    # ----- calls (each in its concurrency group) ------------------------------------------

    @ray.method(concurrency_group="control")
    def ready(self) -> dict[str, Any]:
        info = {**worker_info(self.runner), "eos_token_ids": sorted(self.eos_token_ids)}
        if self.draft_runner is not None:
            info["draft"] = worker_info(self.draft_runner)
        if self.ranks:
            info["ranks"] = self.ranks
        return info

    @ray.method(concurrency_group="requests")
    def add_requests(self, items: list[EngineCoreRequest]) -> None:
        """Start requests; one with output tokens resumes after them (a replaced core)."""
        with self._cv:
            if self.error:
                raise RuntimeError(self.error)
            ids = [req.request_id for req in items]
            taken = [sid for sid in ids if sid in self._seq_ids]
            if taken or len(set(ids)) != len(ids):
                raise ValueError(f"request ids already in use: {taken or ids}")
            self._seq_ids.update(ids)
            self._aborts.difference_update(ids)  # left from an earlier request of that id
            self._new.extend(items)
            self._cv.notify_all()

    @ray.method(concurrency_group="requests")
    def abort(self, seq_ids: list[Hashable]) -> None:
        with self._cv:
            self._aborts.update(seq_ids)
            self._cv.notify_all()

    @ray.method(concurrency_group="control")
    def set_draft(self, draft, max_model_len: int | None = None) -> None:
        """Use this draft actor from now on (None: serve target-only until one comes);
        ``max_model_len``: the draft's context limit (no drafts past it)."""
        if not isinstance(self.link, ActorDraftLink):
            raise RuntimeError("a colocated draft cannot be replaced: it is the core's own")
        with self._cv:
            if max_model_len:
                self.scheduler.draft_max_model_len = max_model_len
            self.link.set_draft(draft)
            self._cv.notify_all()

    @ray.method(concurrency_group="control")
    def load_draft_weights(self, version: int, weights: dict, timeout_s: float = 60.0) -> int:
        """A colocated draft's new weights (a state dict) as ``version``: the loop loads
        them between rounds (a round's drafts and q come from one version), drops what
        the old weights prepared and rebuilds each sequence's draft cache at its next
        draft. Returns the version served. (A draft actor loads its own.)"""
        if not isinstance(self.link, ColocatedDraftLink):
            raise RuntimeError("the draft is an actor of its own: load its weights there")
        with self._cv:
            return self.draft_weights.offer(version, weights, timeout_s, lambda: self.error)

    @ray.method(concurrency_group="control")
    def note_draft_version(self, version: int) -> None:
        """The draft actor now serves weights ``version``: the length policy learns
        acceptance again from the next round (before any of its drafts come back: a
        domain at k = 0 would never draft to tell it)."""
        with self._cv:
            self._draft_version = max(self._draft_version, version)
            self._cv.notify_all()

    @ray.method(concurrency_group="control")
    def get_timings(self, reset: bool = False) -> dict[str, Any]:
        t, s = self.timings, self.scheduler
        t.paused, t.resumed = s.paused - self._paused_base, s.resumed - self._resumed_base
        out = t.as_dict()
        if reset:
            self.timings = RoundTimings()
            self._paused_base, self._resumed_base = s.paused, s.resumed
        return out

    @ray.method(concurrency_group="control")
    def drain_telemetry(self) -> TelemetrySnapshot | None:
        """Round records since the last call, the batch state and the policy's choices."""
        if self._telemetry is None:
            return None
        with self._cv:
            kv = self.runner.kv_usage()
            return TelemetrySnapshot(
                **self._telemetry.drain(),
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting) + len(self._new),
                kv_cache_usage=kv["usage"],
                kv_cache_token_usage=kv["token_usage"],
                policy=self._policy_state,  # published by the loop thread
            )

    @ray.method(concurrency_group="control")
    def on_drift(self, alerts: list[DriftAlert]) -> None:
        """Drift alerts: the policy takes them next round."""
        if self.scheduler.policy is None:  # fixed k: nothing to adjust
            return
        with self._cv:
            self._drift.extend(alerts)

    @ray.method(concurrency_group="control")
    def seq_ids(self) -> dict[str, list]:
        """Sequences the loop runs and those whose KV the target holds (equal unless a
        path leaks a slot; checked by the fault tests)."""
        with self._cv:
            out = {
                "running": list(self.scheduler.running),
                "runner": list(self.runner.seq_ids),
                # per-sequence state kept beside the batch: empty once nothing runs
                "kept": sorted(map(str, self.link.kept() | self._seq_ids)),
                "outputs_held": sorted(map(str, self._hold.request_ids())),
            }
            if self.draft_runner is not None:  # as the draft actor reports them
                drafter = self.link.rounds.drafter
                out["draft"] = {"drafter": list(drafter.seqs), "runner": self.draft_runner.seq_ids}
            return out

    @ray.method(concurrency_group="control")
    def health(self) -> dict[str, Any]:
        return {
            "warming": self.warming,
            "cores": self.cores,
            "compile_seconds": self.compile_seconds,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + len(self._new),
            "error": self.error,
            "failed_requests": self.failed_requests,
            "loop_alive": self._thread.is_alive(),
            "stalled_s": self.stalled_s(),  # busy without a pass committed [s]
            # the actor transport's route to the draft: channel connected, messages by route
            "draft_channel": (
                {"connected": channel.connected, "sent": dict(channel.sent)}
                if (channel := getattr(self.link, "channel", None)) is not None
                else None
            ),
            "kv_cache": self.runner.kv_usage(),
            "draft_kv_cache": None if self.draft_runner is None else self.draft_runner.kv_usage(),
            "draft_failed_sequences": (
                self.link.rounds.failed_sequences if self.draft_runner is not None else None
            ),
            "tensor_parallel": self._group_health(),
        }

    def _group_health(self) -> dict[str, Any] | None:
        """A split target's ranks as they answer now (None: the target is whole)."""
        return group_health(self.runner, self._rank_actors)

    @ray.method(concurrency_group="control")
    def stop(self) -> None:
        """End the loop once it is idle (a core used in process, as ``bench.syncs`` does;
        an actor simply dies)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=10)
        if self._outputs_channel is not None:
            self._outputs_channel.close()

    @ray.method(concurrency_group="push")
    def push_drafts(self, push: Wire) -> None:
        """Drafts from the draft actor: an encoded :class:`DraftPush` (the actor shape
        only: a colocated draft pushes nothing)."""
        if not isinstance(self.link, ActorDraftLink):
            raise RuntimeError("a colocated draft pushes nothing")
        self.link.store(decode(DraftPush, push))

    @ray.method(concurrency_group="poll")
    def get_outputs(self, cursor: int, timeout_s: float) -> bytes:
        """Long-poll: an encoded :class:`EngineCoreOutputs` of the outputs after ``cursor``
        (those before it are acknowledged and dropped), waiting up to ``timeout_s`` for one."""
        return self._take_outputs(cursor, timeout_s)

    @ray.method(concurrency_group="control")
    def outputs_channel_address(self) -> ChannelAddress:
        """Where the replica asks for outputs without a Ray call per round (the direct
        channel, :mod:`deployments.workers.channel`: a poll is one frame each way, served
        on the connection's own thread; opened on the first ask)."""
        with self._out_cv:
            if self._outputs_channel is None:
                host = ray.util.get_node_ip_address()
                self._outputs_channel = ChannelServer(host, self._on_outputs_request, "outputs")
            return self._outputs_channel.address

    def _on_outputs_request(self, payload: bytearray, conn: FrameSocket) -> None:
        """A poll over the channel, answered on it (raising ends the connection: the
        replica polls by Ray then). Outputs too large for a frame go by Ray alike."""
        request = _OUTPUTS_REQUEST.decode(payload)
        wire = self._take_outputs(request.cursor, min(max(request.timeout_s, 0.0), 60.0))
        if not isinstance(wire, bytes):
            raise ValueError("outputs with arrays travel by Ray")
        conn.send(wire)

    def _take_outputs(self, cursor: int, timeout_s: float) -> bytes:
        """:meth:`get_outputs`, whichever way the poll came."""
        with self._out_cv:
            drop = max(0, min(cursor - self._out_base, len(self._outbox)))
            del self._outbox[:drop]
            self._out_base += drop
            if not self._outbox and not self.error:
                self._out_cv.wait(timeout_s)
            cursor = self._out_base + len(self._outbox)
            return encode(EngineCoreOutputs(cursor, self._outbox, self.error, self.stalled_s()))

    def stalled_s(self) -> float:
        """Seconds the loop has gone, busy, without a model pass committed: since the
        later of its current iteration's start and the last pass (0 while it waits for
        work, and while it warms up). Progress is counted in passes, not iterations: one
        iteration may prefill every request a replaced core resumes. The frontend
        replaces a core stalled for longer than ``faults.iteration_timeout_s``."""
        since = self._busy_since
        if since is None:
            return 0.0
        last = self.runner.last_pass_at
        if self.draft_runner is not None:
            last = max(last, self.draft_runner.last_pass_at)
        return time.monotonic() - max(since, last)

    # ----- the loop -------------------------------------------------------------------------

    def _loop_guarded(self) -> None:
        configure_thread(self.spec)
        self.cores = pin_thread(self._cpu_affinity)
        try:
            self._warm_up()
            self._loop()
        except Exception as exc:  # Ray does not see this thread: surface the error
            self._busy_since = None  # (not stalled: failed, which the error says)
            logger.exception("engine core loop failed")
            if self.ranks:  # a pass failed mid-way: the group is out of step for good
                self._exit_with_group()
            with self._cv:  # (a waiting load_draft_weights learns of it at once)
                self.error = f"engine core failure: {exc!r}"
                self._cv.notify_all()
            self.warming = False  # (after the error: /health never reads "ok" between)
            sched = self.scheduler
            ended = list(sched.running) + [req.request_id for req in sched.waiting]
            with self._out_cv:
                for sid in ended:
                    self._outbox.append(
                        EngineCoreOutput(sid, [], True, "error", 0, SpecCounts(), self.error)
                    )
                self._out_cv.notify_all()

    def _warm_up(self) -> None:
        """Compile the target's graphs, and a colocated draft's (its fused draft steps
        too), before the first round (an error here is the loop's: the core fails,
        /health says so)."""
        for name, runner in (("target", self.runner), ("draft", self.draft_runner)):
            seconds = warm_up(runner) if runner is not None else {}
            if name == "draft" and isinstance(self.link, ColocatedDraftLink):
                seconds.update(self.link.rounds.drafter.warm_up())
            if seconds:  # (nothing when eager)
                self.compile_seconds[name] = seconds
        self.warming = False

    def _loop(self) -> None:
        """schedule (aborts, admissions) -> run (a round) -> postprocess (in the round)."""
        sched = self.scheduler
        while not self._stopped:
            self._busy_since = time.monotonic()  # (see stalled_s)
            with self._cv:
                while not (sched.running or self._new or self._aborts or sched.waiting):
                    if self._stopped:
                        return
                    if self.draft_weights.waiting:
                        self.draft_weights.take(self.link.rounds.load_weights)
                        continue
                    self._last_round_end = None  # idle time is no round's
                    self._busy_since = None
                    self._cv.wait()
                    self._busy_since = time.monotonic()
                if self.draft_weights.waiting:
                    self.draft_weights.take(self.link.rounds.load_weights)
                version = max(self._draft_version, self.draft_weights.version)
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, set()
                sched.has_draft = self.link.has_draft
            sched.new_draft(version)
            sched.enqueue(new)
            freed = self._apply_aborts(aborts)
            self._admit(freed)
            if sched.running:
                self._run_round()

    def _apply_aborts(self, aborts: set[Hashable]) -> list[Hashable]:
        """End aborted requests; returns those the draft must free."""
        running = self.scheduler.abort(aborts)
        with self._cv:
            self._seq_ids -= aborts - set(running)  # (waiting ones end here)
        freed = []
        for sid in running:
            if self._free(sid).k > 0:
                freed.append(sid)
        return freed

    def _free(self, sid: Hashable) -> RunningSeq | None:
        seq = self.scheduler.finish(sid)
        self.runner.free(sid)
        self._hold.drop(sid)
        with self._cv:
            self._seq_ids.discard(sid)
        self.link.forget(sid)  # (after the id stopped being live: no push lands after it)
        return seq

    def _admit(self, freed: list[Hashable]) -> None:
        """Prefill what the scheduler admits (KV slots free) and publish first tokens."""
        batch = self.scheduler.admit(self.runner.num_free_slots)
        if batch:
            self.scheduler.take_drift_alerts(self._take_alerts())
        items: list[DraftItem] = []
        t_prefill = time.perf_counter()
        started = self._isolated(batch, self._prefill)
        self._prefill_s += time.perf_counter() - t_prefill
        live = []
        for sid in started:
            seq = self.scheduler.running[sid]
            if seq.state.finished:
                self._free(sid)
            else:
                live.append(seq)
        if live:
            self.scheduler.admitted([seq.seq_id for seq in live])
        for seq in live:
            if (item := self.scheduler.next_round(seq)) is not None:
                items.append(item)
        if items or freed:
            self._message(items, freed)

    def _isolated(self, batch: list, step) -> list:
        """``step(batch)``; if it fails, each item alone, failing only those that fail alone.

        ``step`` is all-or-nothing (it leaves no state behind when it raises) and returns
        what succeeded; an item of ``batch`` is a request or a :data:`RoundRow`.
        """
        if not batch:
            return []
        try:
            done = step(batch)
        except Exception:
            if getattr(self.runner, "broken", False):  # a split target's group out of step
                raise  # for good: the loop exits for a replacement (_exit_with_group)
            done = []
            for item in batch:
                try:
                    done += step([item])
                except Exception as exc:
                    self._fail(_item_id(item), exc)
        # A device that fails every request (a sticky CUDA error) is not one bad request:
        # after enough failures in a row, end the loop so that the replica is replaced.
        self._failures_in_a_row = 0 if done else self._failures_in_a_row + len(batch)
        if self._failures_in_a_row >= self.MAX_FAILURES_IN_A_ROW:
            raise RuntimeError(f"{self._failures_in_a_row} requests in a row failed")
        return done

    # ----- prefill ----------------------------------------------------------------------------

    def _prefill(self, batch: list[EngineCoreRequest]) -> list[Hashable]:
        """Start ``batch``'s sequences (all or none) and publish their first tokens."""
        seqs: list[RunningSeq] = []
        feeds: list[list[int]] = []
        try:
            for req in batch:
                seq, feed = self._new_seq(req)
                seqs.append(seq)
                feeds.append(feed)
            fresh = [i for i, seq in enumerate(seqs) if not seq.state.output_token_ids]
            logits, prompt_lps = self._prefill_logits(seqs, feeds, fresh)
            firsts, first_lps = self._first_tokens(seqs, fresh, logits)
        except Exception:
            for seq in seqs:
                self.runner.free(seq.seq_id)
            raise
        for seq in seqs:
            self.scheduler.start(seq)
            seq.guess = (seq.state.last_token_id,) if seq.state.output_token_ids else ()
        outputs = []
        for i, tok, lps in zip(fresh, firsts, first_lps, strict=True):
            seqs[i].state.append([tok], self.eos_token_ids)
            seqs[i].guess = (tok,)
            outputs.append(self._output(seqs[i], [tok], lps, prompt_lps.get(i)))
        self._publish([out for out in outputs if out is not None])
        return [seq.seq_id for seq in seqs]

    def _new_seq(self, req: EngineCoreRequest) -> tuple[RunningSeq, list[int]]:
        """The request's sequence, with a KV slot, and the tokens its prefill feeds."""
        params = SamplingParams(**req.sampling_params).with_stops(self.eos_token_ids)
        state = SequenceState(
            req.request_id, list(req.prompt_token_ids), params, device=self.runner.device
        )
        state.output_token_ids = list(req.output_token_ids)
        self.runner.add(req.request_id)
        k, ngram = req.num_speculative_tokens, req.method == "ngram"
        seq = RunningSeq(
            state,
            0 if ngram and not req.auto_method else k,  # (0: the draft never hears of it)
            domain=req.domain,
            auto=req.auto_k,
            ngram_k=k if ngram or req.auto_method else 0,
            auto_method=req.auto_method,
            method=req.method,
            output_kind=req.output_kind,
        )
        # A resumed request already has its newest token: it is fed next round.
        return seq, state.token_ids if not req.output_token_ids else state.token_ids[:-1]

    def _prefill_logits(
        self, seqs: list[RunningSeq], feeds: list[list[int]], fresh: list[int]
    ) -> tuple[torch.Tensor, dict[int, list]]:
        """Prefill every row; returns the logits after each row's feed ([batch, vocab])
        and, for rows that score their prompt, its log-probabilities."""
        ids = [seq.seq_id for seq in seqs]
        # Rows that score their prompt need every position's logits (chunk by chunk,
        # score_prompt); the others only the last, in one batched pass.
        scoring = [i for i in fresh if seqs[i].state.params.prompt_logprobs is not None]
        rest = [i for i in range(len(seqs)) if i not in scoring]
        prompt_lps: dict[int, list] = {}
        last: list = [None] * len(seqs)  # per row: [vocab] logits after its feed
        if rest:
            batched = self.runner.forward_padded(
                [ids[i] for i in rest], [feeds[i] for i in rest], last_only=True
            )  # [len(rest), vocab]
            for r, i in enumerate(rest):
                last[i] = batched[r]
        for i in scoring:
            top = seqs[i].state.params.prompt_logprobs
            last[i], prompt_lps[i] = score_prompt(self.runner, ids[i], feeds[i], top)
        # [batch, vocab]: the batched pass itself unless scoring rows joined it
        return (torch.stack(last) if scoring else batched), prompt_lps

    def _first_tokens(
        self, seqs: list[RunningSeq], fresh: list[int], logits: torch.Tensor
    ) -> tuple[list[int], list]:
        """Sample the first token of each fresh row (resumed rows have theirs)."""
        if not fresh:
            return [], []
        states = [seqs[i].state for i in fresh]
        firsts = sample_next(
            logits[fresh],
            [st.params for st in states],
            [st.verify_generator_at(len(st.prompt_token_ids)) for st in states],
            [(st.prompt_token_ids, ()) for st in states],
        )
        first_lps = [
            token_logprobs(logits[i : i + 1], [tok], seqs[i].state.params.logprobs)
            for i, tok in zip(fresh, firsts, strict=True)
        ]
        return firsts, first_lps

    def _fail(self, sid: Hashable, exc: BaseException) -> None:
        """Fail one request alone: free its state here, tell the draft, tell its client."""
        logger.warning("request %r failed: %r", sid, exc)
        self.failed_requests += 1
        seq = self.scheduler.running.get(sid)
        counts = seq.counts.copy() if seq is not None else SpecCounts()
        n_out = len(seq.state.output_token_ids) if seq is not None else 0
        error = f"request failed in the engine core: {type(exc).__name__}: {exc}"
        out = EngineCoreOutput(sid, [], True, "error", n_out, counts, error)
        if seq is not None:
            out = self._hold.offer(out, seq.output_kind)  # with the tokens it held
            self._free(sid)
            if seq.k > 0:
                self._message([], [sid])
        else:
            with self._cv:
                self._seq_ids.discard(sid)
        self._publish([out])

    # ----- a round: gather -> verify -> commit -> message and publish -> record -------------

    def _run_round(self) -> None:
        sched = self.scheduler
        t_round = time.perf_counter()
        found, stats = self._gather()
        seqs = list(sched.running.values())
        asked = [seq.k_next for seq in seqs]  # (draft_item overwrites k_next in _commit)
        for seq in seqs:
            seq.resuming = False
        batch = self._round_rows(seqs, found)
        t_verify = time.perf_counter()
        results = dict(self._isolated(batch, self._verify))
        stats.verify_s = time.perf_counter() - t_verify
        a = self._verify_avg
        self._verify_avg = stats.verify_s if a is None else 0.8 * a + 0.2 * stats.verify_s
        self.link.round += 1
        sched.plan_round(len(seqs), self._take_alerts())
        items, freed, outputs = self._commit(seqs, batch, asked, results, found, stats)
        # First: the draft starts on it at once.
        by_draft = any(r.method == "draft_model" for r in stats.drafted_rows)
        representative = by_draft and not (
            sched.measuring_running_round or stats.resuming or stats.ngram_rows
        )
        self._message(items, freed, time.perf_counter() - t_round, stats.committed, representative)
        self._publish(outputs)
        now = time.perf_counter()
        stats.total_s = now - t_round
        since = self._last_round_end
        stats.wall_s = stats.total_s if since is None else now - since
        stats.prefill_s = 0.0 if since is None else self._prefill_s  # (idle: not in wall_s)
        self._last_round_end, self._prefill_s = now, 0.0
        self._record(stats)

    def _gather(self) -> tuple[dict[Hashable, PushedDraft], RoundStats]:
        """Each running sequence's drafts for this round (target-only for those without),
        and the round's stats as far as they are known before verification."""
        sched = self.scheduler
        seqs = list(sched.running.values())
        need = {seq.seq_id: seq.guess for seq in seqs if seq.k_next > 0}
        got = self.link.gather(need, self.draft_timeout_s)
        if got.lost_draft:
            sched.unsync_all()
        for sid in got.resync:
            sched.running[sid].synced = False
        for sid in got.gave_up:
            sched.give_up(sched.running[sid])
        for sid in got.timed_out:  # timed out or no draft: plain decode this round
            sched.running[sid].synced = False
        stats = RoundStats(
            batch_size=len(seqs),
            planned_k=max((seq.k_next for seq in seqs), default=0),  # the k this round costs
            # Rows back from a pause made the draft prefill their whole context first: this
            # round's time says what resuming costs, not what a round at planned_k does.
            resuming=any(seq.resuming and seq.k_next > 0 for seq in seqs),
            policy_rows=bool(seqs) and all(seq.auto for seq in seqs),
            ngram_rows=sum(seq.method_next == "ngram" for seq in seqs),
            draft_wait_s=got.waited_s,
            draft_timeouts=len(got.timed_out) if got.had_draft else 0,
        )
        return got.found, stats

    def _round_rows(
        self, seqs: list[RunningSeq], found: dict[Hashable, PushedDraft]
    ) -> list[RoundRow]:
        """One verification row per sequence: its drafts (cut to the k it asked for)."""
        batch = []
        for seq in seqs:
            st = seq.state
            gen = st.verify_generator_at(len(st.prompt_token_ids) + len(st.output_token_ids))
            if seq.ngram_next > 0:  # looked up here: deterministic, so q is a point mass
                tokens = ngram_propose(st.token_ids, seq.ngram_next, self.ngram_max, self.ngram_min)
                row = VerifyRow(
                    st.params, tokens, None, gen, st.prompt_token_ids, st.output_token_ids, True
                )
                batch.append((seq.seq_id, [st.last_token_id, *tokens], row))
                continue
            draft = found.get(seq.seq_id)
            tokens = draft.token_ids if draft is not None else []
            k = min(len(tokens), seq.k_next)
            q = None if draft is None or draft.q is None else draft.q.head(k)
            row = VerifyRow(st.params, tokens[:k], q, gen, st.prompt_token_ids, st.output_token_ids)
            batch.append((seq.seq_id, [st.last_token_id, *tokens[:k]], row))
        return batch

    def _verify(self, batch: list[RoundRow]) -> list[tuple[Hashable, tuple]]:
        """One target pass over the rows; all or nothing.

        Returns per row ``(seq_id, (tokens, accepted, logprobs or None))``.
        """
        ids = [sid for sid, _, _ in batch]
        cached = [self.runner.length(sid) for sid in ids]
        # A seeded row retried alone must draw the same numbers as it would have.
        gens = [row.generator for _, _, row in batch if row.generator is not None]
        states = [gen.get_state() for gen in gens]
        try:
            # [batch, k + 1, vocab]
            logits = self.runner.forward_padded(ids, [feed for _, feed, _ in batch])
            results = [
                (tokens, a, token_logprobs(logits[i, : len(tokens)], tokens, row.params.logprobs))
                for i, ((tokens, a), (_, _, row)) in enumerate(
                    zip(verify_rows(logits, [row for _, _, row in batch]), batch, strict=True)
                )
            ]
        except Exception:
            for sid, c in zip(ids, cached, strict=True):  # the pass may have advanced them
                self.runner.rollback(sid, c)
            for gen, state in zip(gens, states, strict=True):
                gen.set_state(state)
            raise
        for sid, c, (_tokens, a, _lps) in zip(ids, cached, results, strict=True):
            self.runner.rollback(sid, c + 1 + a)
        return list(zip(ids, results, strict=True))

    def _commit(self, seqs, batch, asked, results, found, stats: RoundStats):
        """Append each verified row's tokens, fill ``stats.rows``, and say what the draft
        needs next (items, freed) and what the frontend gets (outputs)."""
        sched = self.scheduler
        items: list[DraftItem] = []
        freed: list[Hashable] = []
        outputs: list[EngineCoreOutput] = []
        for seq, (_, _, row), k_asked in zip(seqs, batch, asked, strict=True):
            st = seq.state
            if st.seq_id not in results:  # failed alone (and freed)
                continue
            tokens, accepted, lps = results[st.seq_id]
            seq.base_len = len(st.prompt_token_ids) + len(st.output_token_ids)
            kept = st.append(tokens, self.eos_token_ids)
            seq.guess = tuple(tokens[:kept])
            self._count(seq, stats, row, accepted, found.get(st.seq_id), kept, k_asked)
            if (out := self._output(seq, tokens[:kept], lps and lps[:kept])) is not None:
                outputs.append(out)
            if st.finished:
                self._free(st.seq_id)
                if seq.k > 0:
                    freed.append(st.seq_id)
            elif (item := sched.next_round(seq)) is not None:
                items.append(item)  # target-only and n-gram rows never concern the draft
        for sid in sched.take_dropped():  # drafts prepared for rows that left the draft
            self.link.drop_pushes(sid)  # are worthless
            freed.append(sid)
        return items, freed, outputs

    @staticmethod
    def _count(seq, stats, row, accepted, draft, kept, k_asked) -> None:
        """One row's outcome: into the round's stats and the request's counts."""
        drafted = len(row.draft_token_ids)
        # the proposer the row had this round (its lookup may have found nothing)
        method = seq.method_next
        ngram = method == "ngram"
        hit = not ngram and draft is not None and draft.speculative
        asked_planned = bool(stats.planned_k) and k_asked == stats.planned_k
        version = draft.draft_version if draft is not None and not ngram else 0
        stats.rows.append(
            RowOutcome(
                seq.domain,
                drafted,
                accepted,
                hit,
                kept,
                asked_planned,
                version,
                method,
                seq.auto_method,
                k_asked,
            )
        )
        if drafted:
            seq.counts.observe(drafted, accepted, hit, ngram)

    def _record(self, stats: RoundStats) -> None:
        """The round's stats to the timings, the policy and (kept) the monitor."""
        sched = self.scheduler
        self.timings.add(stats)
        sched.observe_round(stats)
        if self._telemetry is None:
            return
        # The policy's snapshot costs ~10 us per domain: published at most every
        # POLICY_STATE_EVERY_S, and when the batch empties (its last word before idling).
        state = None
        now = time.monotonic()
        if sched.policy is not None and (
            now - self._policy_state_at >= POLICY_STATE_EVERY_S or not sched.running
        ):
            state, self._policy_state_at = sched.policy.state(), now
            if sched.choice is not None:  # which proposer each domain's rows get, and why
                for domain, buckets in sched.choice.state().items():
                    state.setdefault(domain, {})["proposers"] = buckets
        with self._cv:
            self._telemetry.add(stats)
            if state is not None:
                self._policy_state = state

    # ----- messages out -----------------------------------------------------------------------

    def _take_alerts(self) -> list[DriftAlert]:
        with self._cv:
            alerts, self._drift = self._drift, []
        return alerts

    def _message(
        self,
        items: list[DraftItem],
        freed: list[Hashable],
        round_s: float | None = None,
        tokens: int = 0,
        representative: bool = True,
    ) -> None:
        """Tell the draft about the round just ended (or admissions/frees between rounds)."""
        feedback = RoundFeedback(self._verify_avg, round_s, tokens, representative)
        if not self.link.send(items, freed, feedback, self.scheduler.full_items):
            self.scheduler.unsync_all()  # the compiled graph broke and the draft was ended

    def _output(
        self,
        seq: RunningSeq,
        new_tokens: list[int],
        logprobs: list | None = None,
        prompt_logprobs: list | None = None,
    ) -> EngineCoreOutput | None:
        """What to publish of this commit (None: held until the request ends)."""
        st = seq.state
        out = EngineCoreOutput(
            st.seq_id,
            list(new_tokens),
            st.finished,
            st.finish_reason,
            len(st.output_token_ids),
            seq.counts.copy(),
            None,
            logprobs,
            prompt_logprobs,
        )
        return self._hold.offer(out, seq.output_kind)

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        if outputs:
            with self._out_cv:
                self._outbox.extend(outputs)
                self._out_cv.notify_all()


def _item_id(item) -> Hashable:
    """The sequence id of a prefill request or a round row."""
    return item.request_id if isinstance(item, EngineCoreRequest) else item[0]
