"""The engine core's link to its draft actor: messages out, drafts in.

The core tells the draft each round's outcomes (one fire-and-forget message, or one
Compiled Graph execution) and the draft pushes drafts back, keyed by the round they are
for and the outcome they guessed (``(round_for, guess)``); :meth:`DraftLink.gather` takes
the drafts a round needs, waiting up to a deadline for those not prepared ahead. The
link knows nothing of scheduling or models: which rows want drafts, and what to do with
rows the draft lost or gave up on, is the core's (its scheduler's) decision.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import ray

from deployments.core.draft_channel import CoreChannel
from deployments.messages import (
    DraftItem,
    DraftPush,
    DraftRoundMessage,
    DraftStatus,
    PushedDraft,
    RoundFeedback,
    decode,
    encode,
)

logger = logging.getLogger("specserve.draft_link")


@dataclass
class Gathered:
    """What :meth:`DraftLink.gather` found for a round."""

    found: dict[Hashable, PushedDraft] = field(default_factory=dict)  # sid -> its drafts
    resync: list[Hashable] = field(default_factory=list)  # the draft lost track: send in full
    gave_up: list[Hashable] = field(default_factory=list)  # ... and gave up: target-only
    timed_out: list[Hashable] = field(default_factory=list)  # no drafts in time
    had_draft: bool = False  # a draft was connected when the wait ended
    lost_draft: bool = False  # the compiled graph broke: the draft was ended
    waited_s: float = 0.0


class DraftLink(ABC):
    """The core's side of its draft, whichever shape it has: round messages out
    (:meth:`send`), each round's drafts in (:meth:`gather`), and what the draft said of
    rows it lost or gave up on, kept until the round that needs them asks.

    :class:`ActorDraftLink` talks to a draft actor; :class:`deployments.core.colocated.
    ColocatedDraftLink` drafts in the core's process. The core sees only this interface.
    """

    def __init__(self):
        self.round = 0  # the round the core runs next (older drafts are worthless)
        self._resync: set[Hashable] = set()  # the draft lost track: send in full
        self._give_up: set[Hashable] = set()  # ... and gave up: target-only

    @property
    @abstractmethod
    def has_draft(self) -> bool:
        """A draft is connected: rows may be given drafts."""

    @abstractmethod
    def send(
        self,
        items: list[DraftItem],
        freed: list[Hashable],
        feedback: RoundFeedback,
        full_items: Callable[[], list[DraftItem]],
    ) -> bool:
        """The round that just ended (or admissions and frees between rounds); a draft new
        to this core gets ``full_items()`` instead of ``items``. False if the draft was lost."""

    @abstractmethod
    def gather(self, need: dict[Hashable, tuple], timeout_s: float) -> Gathered:
        """Each row's drafts for round :attr:`round` (``need``: seq_id -> the guess they
        must continue), waiting up to ``timeout_s`` for those not prepared ahead."""

    def kept(self) -> set[Hashable]:
        """Sequences the link holds anything for (empty once nothing runs)."""
        return self._resync | self._give_up

    def forget(self, seq_id: Hashable) -> None:
        """The sequence ended: drop what is held for it."""
        self._resync.discard(seq_id)
        self._give_up.discard(seq_id)

    @abstractmethod
    def drop_pushes(self, seq_id: Hashable) -> None:
        """Drafts prepared for the sequence are worthless (it left the draft)."""

    def _note(self, draft: PushedDraft) -> bool:
        """Keep what a row without drafts said (lost, gave up); True if it said that."""
        if draft.status is DraftStatus.DRAFTS:
            return False
        self._resync.add(draft.seq_id)
        if draft.status is DraftStatus.GAVE_UP:  # drafting failed for it alone
            self._give_up.add(draft.seq_id)
        return True

    def _take_resync(self, sid: Hashable, out: Gathered) -> bool:
        """Move ``sid``'s lost/gave-up word into ``out``; False if there is none."""
        if sid not in self._resync:
            return False
        self._resync.discard(sid)
        out.resync.append(sid)
        if sid in self._give_up:
            self._give_up.discard(sid)
            out.gave_up.append(sid)
        return True


class _Sender:
    """Issues fire-and-forget actor calls from its own thread, off the loop's path."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="specserve-sender", daemon=True).start()

    def send(self, method, *args) -> None:
        self._queue.put((method, args))

    def _run(self) -> None:
        while True:
            method, args = self._queue.get()
            try:
                method.remote(*args)
            except Exception:  # a dead actor: the frontend replaces it
                logger.exception("could not send to the draft")


class _DraftGraph:
    """The ``compiled_graph`` transport: one Compiled Graph execution per round message.

    The loop thread compiles ``draft.step`` into a graph the first time it messages a
    draft (the core is the graph's driver) and executes it for each message; the reply,
    the drafts for the round the message was about, is collected by :meth:`collect`
    before that round is verified. Replies must be read in order and only once, so a
    reply that does not come in time breaks the graph: it is torn down and the draft is
    given up (the frontend replaces a draft that died).
    """

    MAX_PENDING = 4  # messages without a round in between (admissions, aborts)

    def __init__(self):
        self.draft = None  # the draft actor the graph runs on
        self._dag = None
        self._refs: list = []  # CompiledDAGRefs of messages whose reply is not read yet
        self._early: list[DraftPush] = []  # replies read before their round needed them

    def execute(self, draft, msg: DraftRoundMessage) -> bool:
        """Send ``msg`` to ``draft``; False if the graph could not be built or used."""
        try:
            if draft is not self.draft:
                self.teardown()
                from ray.dag import InputNode

                with InputNode() as inp:
                    dag = draft.step.bind(inp)
                self._dag = dag.experimental_compile()
                self.draft = draft
            if len(self._refs) >= self.MAX_PENDING:  # bound the replies in flight
                early = self.collect(time.perf_counter() + 10.0)
                if early is None:
                    return False
                self._early = early
            self._refs.append(self._dag.execute(encode(msg)))
            return True
        except Exception:
            logger.exception("compiled graph to the draft failed")
            self.teardown()
            return False

    def collect(self, deadline: float) -> list[DraftPush] | None:
        """Every pending reply, oldest first; None if the graph broke."""
        replies, self._early = self._early, []
        try:
            while self._refs:
                ref = self._refs.pop(0)
                reply = ref.get(timeout=max(0.0, deadline - time.perf_counter()))
                replies.append(decode(DraftPush, reply))
        except Exception as exc:
            logger.warning("no reply from the draft through the compiled graph: %r", exc)
            self.teardown()
            return None
        return replies

    def teardown(self) -> None:
        self._refs.clear()
        self._early.clear()
        dag, self._dag, self.draft = self._dag, None, None
        if dag is not None:  # off the loop: a dead draft's graph may take long to go
            threading.Thread(target=_teardown, args=(dag,), daemon=True).start()


def _teardown(dag) -> None:
    try:
        dag.teardown()
    except Exception:
        logger.exception("compiled graph teardown failed")


class ActorDraftLink(DraftLink):
    """Messages to one draft actor at a time, and the drafts it pushed, per sequence.

    Thread-safe: pushes arrive on the actor's push thread, ``set_draft`` on a control
    thread, everything else on the loop thread. ``is_live(seq_id)`` says whether a
    sequence still runs (a push for one that ended is dropped); the core ends a sequence
    by first making it not live, then calling :meth:`forget`.
    """

    def __init__(
        self, transport: str, is_live: Callable[[Hashable], bool], direct_channel: bool = True
    ):
        super().__init__()
        self._is_live = is_live
        self._cv = threading.Condition()
        self._draft = None
        self._first = True  # the next message starts a new draft
        # sid -> {(round_for, guess): drafts}
        self._pushes: dict[Hashable, dict[tuple, PushedDraft]] = {}
        # Message numbers grow with time, so a replacement core's numbers are all larger
        # than those of the core it replaces (the draft drops stragglers from that one).
        self._msg_no = time.time_ns() // 1000
        self._sender = _Sender()
        self._graph = _DraftGraph() if transport == "compiled_graph" else None
        # The actor transport's direct connection to the draft (None: Ray calls only).
        self.channel = (
            CoreChannel(lambda wire: self.store(decode(DraftPush, wire)), self._resync_draft)
            if direct_channel and self._graph is None
            else None
        )

    @property
    def has_draft(self) -> bool:
        return self._draft is not None

    def set_draft(self, draft) -> None:
        """Use this draft actor from now on (None: none until one comes)."""
        with self._cv:
            self._draft = draft
            self._first = True
            self._cv.notify_all()
        if self.channel is not None:
            self.channel.open(draft)

    def _resync_draft(self) -> None:
        """The channel broke: a message may have been lost in it, and the draft takes
        messages in order, so the next one starts it over (``first``, in full)."""
        with self._cv:
            self._first = True

    def kept(self) -> set[Hashable]:
        with self._cv:
            return set(self._pushes) | super().kept()

    def forget(self, seq_id: Hashable) -> None:
        with self._cv:
            self._pushes.pop(seq_id, None)
            super().forget(seq_id)

    def drop_pushes(self, seq_id: Hashable) -> None:
        with self._cv:
            self._pushes.pop(seq_id, None)

    def store(self, push: DraftPush) -> None:
        """Drafts the draft actor pushed (or a compiled-graph reply)."""
        with self._cv:
            for draft in push.drafts:
                if not self._is_live(draft.seq_id):  # ended meanwhile: keep nothing for it
                    continue
                if self._note(draft) or push.round_for < self.round:
                    continue  # (a round already past: nobody will use its drafts)
                key = (push.round_for, draft.guess)
                self._pushes.setdefault(draft.seq_id, {})[key] = draft
            self._cv.notify_all()

    def send(
        self,
        items: list[DraftItem],
        freed: list[Hashable],
        feedback: RoundFeedback,
        full_items: Callable[[], list[DraftItem]],
    ) -> bool:
        with self._cv:
            draft, first = self._draft, self._first
        if draft is None:
            return True
        if first:
            items = full_items()
        if not items and not freed:
            return True  # (a first message stays first until one is sent: target-only rounds)
        with self._cv:  # (only a first message clears it: a break seen since sets it again)
            if first and self._draft is draft:
                self._first = False
        self._msg_no += 1
        msg = DraftRoundMessage(self._msg_no, first, self.round, items, freed, feedback)
        if self._graph is None:
            wire = encode(msg)
            if self.channel is None or not self.channel.send(wire):
                with self._cv:
                    resync = self._first and self._draft is draft  # the channel broke
                if resync:  # start the draft over, by Ray (or a new connection)
                    return self.send(items, freed, feedback, full_items)
                self._sender.send(draft.on_round, wire)
            return True
        if self._graph.execute(draft, msg):
            return True
        self.lose(draft)
        return False

    def gather(self, need: dict[Hashable, tuple], timeout_s: float) -> Gathered:
        out = Gathered()
        need = dict(need)
        t0 = time.perf_counter()
        deadline = t0 + timeout_s
        if self._graph is not None and need:
            deadline = self._collect_replies(out, deadline)
        with self._cv:
            while True:
                self._take_found(need, out)
                remaining = deadline - time.perf_counter()
                if not need or self._draft is None or remaining <= 0:
                    break
                self._cv.wait(remaining)
            out.timed_out = list(need)
            out.had_draft = self._draft is not None
            self._drop_past(out.found)
        out.waited_s = time.perf_counter() - t0
        return out

    def _collect_replies(self, out: Gathered, deadline: float) -> float:
        """Compiled graph: every reply this round needs is in flight; collect them all.
        Returns the new deadline: now (nothing more will come)."""
        draft = self._graph.draft
        replies = self._graph.collect(deadline)
        if replies is None:
            self.lose(draft)
            out.lost_draft = True
        for push in replies or []:
            self.store(push)
        return time.perf_counter()

    def _take_found(self, need: dict[Hashable, tuple], out: Gathered) -> None:
        """Move every needed row that has its drafts, or a word from the draft, into
        ``out`` (caller holds ``_cv``)."""
        for sid in list(need):
            got = self._pushes.get(sid, {}).pop((self.round, need[sid]), None)
            if got is not None:
                out.found[sid] = got
                del need[sid]
            elif self._take_resync(sid, out):
                del need[sid]

    def _drop_past(self, found: dict[Hashable, PushedDraft]) -> None:
        """Drafts for rounds already past are worthless (caller holds ``_cv``)."""
        for sid in found:
            pushes = self._pushes.get(sid, {})
            for key in [key for key in pushes if key[0] <= self.round]:
                del pushes[key]
            if not pushes:
                self._pushes.pop(sid, None)

    def lose(self, draft) -> None:
        """The compiled graph to this draft failed or its reply came too late: stop using
        it and end it, so that the frontend's watch on it sees a death and replaces it
        (a live draft nobody messages would hold its sequences forever)."""
        with self._cv:
            if self._draft is draft:
                self._draft = None
                if self.channel is not None:
                    self.channel.open(None)
        if draft is not None:
            ray.kill(draft, no_restart=True)
