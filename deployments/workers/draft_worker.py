"""The draft actor with its own loop.

The target side is :class:`deployments.core.engine_core.EngineCore`. Token ids travel as
Python lists and draft probabilities as 16-bit weights (:class:`specdec.qcodec.CompactQ`,
only for sampled requests; greedy verification needs no ``q``), never logits of the
target; every message is a type of :mod:`deployments.messages`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from functools import partial
from typing import Any, ClassVar

import ray

from deployments.config import ModelSpec
from deployments.messages import (
    ChannelAddress,
    DraftPush,
    DraftRoundMessage,
    DraftWorkerConfig,
    PushedDraft,
    Wire,
    decode,
    encode,
)
from deployments.workers.channel import ChannelServer, FrameSocket
from deployments.workers.drafting import DraftRounds, WeightsHandoff, new_drafter, pushed_drafts
from deployments.workers.model_loader import (
    configure_thread,
    group_health,
    load_runner,
    load_split,
    pin_thread,
    warm_up,
    worker_info,
)
from specdec.policy import SpeculationWidth, WidthPolicyConfig

logger = logging.getLogger("specserve.workers")


class DraftWorker:
    """Drafts for the engine core and, in overlap mode, drafts ahead while it verifies.

    Messages from the core (:meth:`on_round`) are queued and handled in order by a loop
    thread: first the rows whose drafts were not prepared ahead are drafted and pushed
    (the core may be waiting for them), then the likeliest outcomes of the round now
    being verified are drafted and pushed. A newer message stops that speculation at the
    next draft step (or graph of up to 4 fused steps): once the outcome is known, only
    the branch that guessed it is worth anything. Greedy branches keep the drafts made
    by then; the one hit is drafted on from its last draft to what drafting afresh gives
    (only the missing steps on the critical path) and pushed with the message's reply.
    """

    # "stats" apart: a split draft's stats wait (bounded) for its ranks' answers, which must
    # not hold up the round messages and weights that "io" serves.
    CONCURRENCY_GROUPS: ClassVar[dict[str, int]] = {"io": 2, "watch": 1, "stats": 1}

    def __init__(self, config: DraftWorkerConfig):
        self.spec = ModelSpec.model_validate(config.spec)
        self._cpu_affinity = config.cpu_affinity
        self.cores: list[int] = []  # what the loop thread is pinned to (empty: not pinned)
        width, max_num_seqs = config.speculation_width, config.max_num_seqs
        make = partial(load_runner, self.spec, self.kv_slots(max_num_seqs, width), verifies=False)
        # A split draft (draft.tensor_parallel_size > 1): this worker is rank 0 of its group,
        # config.ranks the others, each loading its share as this one loads its own.
        self.ranks: list[dict[str, Any]] = []  # the other ranks' ready answers
        self._rank_actors = list(config.ranks)  # ... and their actors
        if config.ranks:
            self.runner, self.ranks = load_split(
                make, config.ranks, self.spec, config.rank_timeout_s
            )
        else:
            self.runner = make()
        # A draft's graphs are small: compiled here, before the worker reports ready.
        self.compile_seconds = warm_up(self.runner)
        self.drafter = new_drafter(
            self.runner, config.min_confidence, min(max_num_seqs, self.runner.max_num_seqs)
        )
        self.compile_seconds.update(self.drafter.warm_up())  # the fused draft steps
        self.rounds = DraftRounds(self.drafter)  # messages applied as a colocated draft does
        self.overlap = config.overlap and width > 0
        self.width = SpeculationWidth(
            WidthPolicyConfig(max_width=width, adaptive=config.adaptive_overlap)
        )
        self._cv = threading.Condition()
        # msg_no -> (message, the connection it came by; None: a Ray call): drafts go
        # back the way their message came.
        self._inbox: dict[int, tuple[DraftRoundMessage, FrameSocket | None]] = {}
        self._channel: ChannelServer | None = None  # opened when a core asks for it
        self.messages = {"channel": 0, "ray": 0}  # round messages received, by route
        self.pushes = {"channel": 0, "ray": 0}  # pushes sent, by route
        self._next_no: int | None = None
        self._core = None
        # compiled_graph transport: drafts go back as the reply to the core's message,
        # and prepared branches stay here until the next message shows which one hit.
        self._reply_in_step = config.transport == "compiled_graph"
        self._replies: dict[int, DraftPush] = {}
        self._stop_event = threading.Event()
        self._busy_since: float | None = None  # monotonic start of the message in hand
        self._waiting_since = time.monotonic()  # the loop's last return to its queue
        self.speculated = 0  # branches prepared
        self._speculated = False  # the last message's speculation ran (its hits count)
        self.error: str | None = None
        self.weights = WeightsHandoff(self._cv, "draft")  # new weights for the loop
        threading.Thread(target=self._loop_guarded, name="specserve-draft", daemon=True).start()

    @staticmethod
    def kv_slots(max_num_seqs: int, speculation_width: int) -> int:
        """KV slots of the draft's runner (and of each of a split draft's ranks): branches
        of the speculation cache are sequences too, from the same budget; slots for as many
        sequences as the core runs are kept, the rest hold branches."""
        return max_num_seqs * (1 + speculation_width)

    @ray.method(concurrency_group="io")
    def ready(self) -> dict[str, Any]:
        info = {**worker_info(self.runner), "compile_seconds": self.compile_seconds}
        if self.ranks:
            info["ranks"] = self.ranks
        return info

    @ray.method(concurrency_group="io")
    def set_core(self, core, vocab_limit: int | None = None, num_seqs: int | None = None) -> None:
        """Draft for ``core`` from now on, proposing only ids below ``vocab_limit`` (the
        ids the pair shares; see :class:`specdec.proposers.DraftModelProposer`), keeping
        KV slots for the ``num_seqs`` sequences the core can run at once."""
        with self._cv:
            self._core = core
            self.drafter.proposer.limit_vocab(vocab_limit)
            if num_seqs is not None:
                self.drafter.main_slots = min(num_seqs, self.runner.max_num_seqs)
                if self.drafter.main_slots < num_seqs:
                    logger.warning(
                        "the draft's KV budget holds %d of the %d sequences the target "
                        "runs at once: the others are decoded target-only",
                        self.drafter.main_slots,
                        num_seqs,
                    )

    @ray.method(concurrency_group="io")
    def channel_address(self) -> ChannelAddress:
        """Where the core connects for round messages without Ray calls
        (:mod:`deployments.workers.channel`; opened on the first ask)."""
        with self._cv:
            if self._channel is None:
                host = ray.util.get_node_ip_address()
                self._channel = ChannelServer(host, self._on_frame)
            return self._channel.address

    def _on_frame(self, payload: bytes, conn: FrameSocket) -> None:
        """A round message over the channel (a connection's reader thread; raising ends
        the connection, and the core resynchronises)."""
        msg = decode(DraftRoundMessage, payload)
        with self._cv:
            self.messages["channel"] += 1
            self._enqueue(msg, conn)

    @ray.method(concurrency_group="io")
    def on_round(self, msg: bytes) -> None:
        """A round's outcomes from the core (the actor transport, when the channel is
        not connected): an encoded :class:`DraftRoundMessage`."""
        msg = decode(DraftRoundMessage, msg)
        with self._cv:
            self.messages["ray"] += 1
            self._enqueue(msg)

    def step(self, msg: bytes) -> Wire:
        """The compiled-graph transport's node: an encoded message in, its round's drafts
        out (an encoded :class:`DraftPush`)."""
        msg = decode(DraftRoundMessage, msg)
        with self._cv:
            if self._enqueue(msg):
                while msg.msg_no not in self._replies and self.error is None:
                    self._cv.wait()
            return encode(self._replies.pop(msg.msg_no, DraftPush(msg.round_for, [])))

    def _enqueue(self, msg: DraftRoundMessage, route: FrameSocket | None = None) -> bool:
        """Queue a message for the loop (caller holds ``_cv``); False if it is stale.
        ``route``: the connection it came by (None: a Ray call or graph step)."""
        if self._next_no is not None and msg.msg_no < self._next_no:
            return False  # from a core that has been replaced, or a second copy
        if msg.first:  # a new core (or this draft is new to it): start from this message
            self._inbox = {no: m for no, m in self._inbox.items() if no > msg.msg_no}
            self._next_no = msg.msg_no
        if not self._inbox:
            self._waiting_since = time.monotonic()
        self._inbox[msg.msg_no] = (msg, route)
        self._cv.notify_all()
        return True

    @ray.method(concurrency_group="io")
    def load_weights(self, version: int, weights: dict, timeout_s: float = 60.0) -> int:
        """Serve the draft with ``weights`` (a state dict) as ``version`` from the next
        message on (:class:`WeightsHandoff`); branches prepared by the old weights are
        dropped and each sequence's cache is rebuilt at its next draft. Returns the
        version served."""
        with self._cv:
            return self.weights.offer(version, weights, timeout_s, lambda: self.error)

    @ray.method(concurrency_group="stats")
    def stats(self) -> dict[str, Any]:
        return {
            "hits": self.drafter.hits,
            "misses": self.drafter.misses,
            "seqs": len(self.drafter.seqs),
            "speculated": self.speculated,
            "width": self.width.width,  # at the batch bucket of the last round
            # batch bucket -> width (others at their start: see SpeculationWidth.widths)
            "widths": self.width.widths(),
            "goodput": self.width.goodput(),
            "acceptance": self.drafter.acceptance,
            "error": self.error,
            "failed_sequences": self.rounds.failed_sequences,
            "kv_cache": self.runner.kv_usage(),
            # a split draft's ranks: size, this rank 0's calls, each other rank's (None: whole)
            "tensor_parallel": group_health(self.runner, self._rank_actors),
            "cores": self.cores,
            "weights_version": self.weights.version,
            "messages": dict(self.messages),
            "pushes": dict(self.pushes),
            "channel": None
            if self._channel is None
            else {"connections": self._channel.connections, "refused": self._channel.refused},
        }

    @ray.method(concurrency_group="io")
    def seq_ids(self) -> dict[str, list]:
        """Sequences the drafter tracks, and every sequence (branches included) whose KV
        the draft model holds."""
        with self._cv:
            return {
                "drafter": list(self.drafter.seqs),
                "runner": list(self.runner.seq_ids),
            }

    @ray.method(concurrency_group="io")
    def stalled_s(self) -> float:
        """Seconds the loop has spent on the message it is handling, or messages have
        waited for it (0 when idle): the frontend replaces a draft whose loop hangs, or
        whose next message never came (a gap in the numbers the core cannot mend)."""
        since = self._busy_since
        with self._cv:
            if since is None and self._inbox:
                since = self._waiting_since
        return 0.0 if since is None else time.monotonic() - since

    @ray.method(concurrency_group="watch")
    def watch(self) -> str | None:
        """Returns only if the loop thread failed; the caller learns of death by an error."""
        self._stop_event.wait()
        return self.error

    # ----- the loop -------------------------------------------------------------------------

    def _has_next(self) -> bool:
        return self._next_no is not None and self._next_no in self._inbox

    def _should_stop(self) -> bool:
        """Speculation stops for a newer message or for new weights."""
        return self._has_next() or self.weights.waiting

    def _loop_guarded(self) -> None:
        configure_thread(self.spec)
        self.cores = pin_thread(self._cpu_affinity)
        try:
            while True:
                with self._cv:
                    while not self._has_next():
                        if self.weights.waiting:
                            self.weights.take(self.rounds.load_weights)
                            continue
                        self._cv.wait()
                    if self.weights.waiting:
                        self.weights.take(self.rounds.load_weights)
                    msg, route = self._inbox.pop(self._next_no)
                    self._next_no += 1
                    core = self._core
                    self._busy_since = time.monotonic()
                try:
                    self._handle(core, msg, route)
                finally:
                    self._busy_since = None
                    self._waiting_since = time.monotonic()
                if getattr(self.runner, "broken", False):  # (drafting caught it per row)
                    self._exit_with_group()
        except Exception as exc:
            logger.exception("draft loop failed")
            if self.ranks:  # a pass failed mid-way: the group may be out of step for good
                self._exit_with_group()
            with self._cv:
                self.error = f"draft loop failure: {exc!r}"
                self._cv.notify_all()
            self._stop_event.set()

    def _exit_with_group(self) -> None:
        """Leave with a failed split-draft group (a rank died, or hung past
        ``faults.rank_timeout_s``): the process exits, the core serves target-only and
        replaces this worker as any dead draft, with a fresh group (the launcher kills the
        old ranks)."""
        logger.error("the draft's tensor-parallel group failed: exiting for a replacement")
        logging.shutdown()
        os._exit(1)

    def _send(self, core, route: FrameSocket | None, msg_no: int, push: DraftPush) -> None:
        """Drafts to the core: the reply of a compiled-graph step, or a push."""
        if self._reply_in_step:
            with self._cv:
                self._replies[msg_no] = push
                self._cv.notify_all()
        elif push.drafts:
            self._push(core, route, push)

    def _push(self, core, route: FrameSocket | None, push: DraftPush) -> None:
        """A push the way its message came: over the channel, except a push with arrays
        (sampled rows' q: Ray moves them without a copy), or by a Ray call."""
        wire = encode(push)
        if route is not None and isinstance(wire, bytes) and not route.closed:
            try:
                route.send(wire)
                self.pushes["channel"] += 1
                return
            except (OSError, ValueError) as exc:  # the core or the connection went: Ray
                logger.warning("draft channel: push failed (%r); pushing by Ray", exc)
                route.close()  # (a part of a frame may have gone: the core resyncs)
        if core is not None:
            core.push_drafts.remote(wire)
            self.pushes["ray"] += 1

    def _handle(self, core, msg: DraftRoundMessage, route: FrameSocket | None) -> None:
        """Draft what the core waits for now, then (overlap) prepare the next round's."""
        feedback = msg.feedback
        if feedback.round_s is not None:
            self.width.observe_round(
                feedback.committed_tokens, feedback.round_s, not feedback.representative
            )
        ids = self._draft_now(core, msg, route)
        if not self.overlap:
            return
        if core is None and not self._reply_in_step:
            ids = []  # no core to push branches to: nothing prepared (the width hears so)
        # Goodput is per round: an admission's message (no round time) does not start one.
        budget = self.width.budget(len(ids), new_round=feedback.round_s is not None)
        if budget:
            self._speculate(core, route, ids, budget, msg.round_for + 1, feedback.verify_s)

    def _draft_now(self, core, msg: DraftRoundMessage, route: FrameSocket | None) -> list:
        """Apply the message, draft its rows and send what the core does not hold yet;
        returns the rows drafted (whose next outcomes may be prepared)."""
        ids, ks, guesses, lost = self.rounds.apply(msg.first, msg.items, msg.freed)
        proposed = self.rounds.propose(ids, ks, lost)
        # A complete branch (actor transport) was pushed ahead: it is at the core already;
        # one the message stopped (its drafts so far) goes now; a reply carries all.
        pushes: list[PushedDraft] = pushed_drafts(
            [
                (sid, guesses[sid], d)
                for sid, d in proposed
                if self._reply_in_step or not (d.speculative and d.complete)
            ],
            version=self.rounds.version,
        )
        if self._speculated:  # rounds nobody prepared branches for say nothing of hits
            hits = sum(d.speculative for _, d in proposed)
            self.width.observe_hits(hits, len(proposed))
        self._speculated = False
        self._send(core, route, msg.msg_no, DraftPush(msg.round_for, pushes + lost))
        return [sid for sid, _ in proposed]

    def _speculate(
        self, core, route: FrameSocket | None, ids: list, budget: int, round_for: int, verify_s
    ) -> None:
        """Draft the likeliest outcomes of the round being verified, for ``round_for``;
        a newer message stops it at the next draft step."""
        self._speculated = True
        t0 = time.perf_counter()
        try:
            branches = self.drafter.speculate(ids, budget, should_stop=self._should_stop)
        except Exception:  # all or nothing: no branch was kept; the round goes on without
            logger.exception("speculation failed; continuing without branches")
            self._speculated = False  # no branches: the next round says nothing of hits
            return
        # Cut short by the outcome: with nothing kept (cut), or with the greedy branches'
        # drafts so far, which serve a hit (sent then); the width policy judges both.
        complete = bool(branches) and all(br.drafts.complete for br in branches)
        stopped = bool(branches) and not complete
        self.width.observe_speculation(
            time.perf_counter() - t0, verify_s, branches is None, stopped
        )
        if branches:
            self.speculated += len(branches)
        if complete and not self._reply_in_step:  # else they wait for a message
            rows = [(br.seq_id, br.guess, br.drafts) for br in branches]
            drafts = pushed_drafts(rows, version=self.rounds.version)
            self._push(core, route, DraftPush(round_for, drafts))
