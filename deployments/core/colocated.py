"""A draft in the engine core's process: the shape for a pair that shares one device.

Two processes on one device time-slice it (two CUDA contexts, or two processes on a few
CPU cores), and every round pays an actor message each way; vLLM, SGLang and
TensorRT-LLM all run the draft in the target's process for that reason. Here the core's
loop drafts for a round right before verifying it, with the same drafter code the draft
actor runs (:class:`deployments.workers.drafting.DraftRounds`), so the tokens are the same ones
(seeded rows included). There is no overlap: the draft and the target take turns.

:class:`ColocatedDraftLink` has the interface of :class:`deployments.core.draft_link.DraftLink`,
so the core does not know which shape it runs in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from deployments.core.draft_link import Gathered
from deployments.workers.drafting import GIVE_UP, DraftRounds, push_item


class ColocatedDraftLink:
    """Applies the core's messages at once; drafts when a round gathers (one batch)."""

    def __init__(self, rounds: DraftRounds):
        self.rounds = rounds
        self.round = 0
        self._first = True  # the first message carries every sequence in full
        self._pending: dict[Hashable, tuple[int, tuple]] = {}  # sid -> (k, guess) to draft
        self._resync: set[Hashable] = set()  # the draft lost track: send in full
        self._give_up: set[Hashable] = set()  # ... and gave up: target-only

    @property
    def draft(self) -> ColocatedDraftLink:
        return self  # always there: it lives and dies with the core

    def set_draft(self, draft) -> None:
        raise RuntimeError("a colocated draft cannot be replaced: it is the core's own")

    def kept(self) -> set[Hashable]:
        return set(self._pending) | self._resync | self._give_up

    def forget(self, seq_id: Hashable) -> None:
        self._pending.pop(seq_id, None)
        self._resync.discard(seq_id)
        self._give_up.discard(seq_id)

    def drop_pushes(self, seq_id: Hashable) -> None:
        self._pending.pop(seq_id, None)

    def store(self, round_for: int, items: list[tuple]) -> None:
        raise RuntimeError("a colocated draft pushes nothing")

    def send(
        self,
        round_for: int,
        items: list[tuple],
        freed: list[Hashable],
        stats: tuple,
        full_items: Callable[[], list[tuple]],
    ) -> bool:
        first, self._first = self._first, False
        if first:
            items = full_items()
        ids, ks, guesses, lost = self.rounds.apply(first, items, freed)
        for sid, k in zip(ids, ks, strict=True):
            self._pending[sid] = (k, guesses[sid])
        self._take_lost(lost)
        return True

    def gather(self, need: dict[Hashable, tuple], timeout_s: float) -> Gathered:
        """Draft now for the rows that need drafts (``timeout_s`` does not apply: the
        drafts are made here, in one batch)."""
        t0 = time.perf_counter()
        out = Gathered(had_draft=True)
        ids, ks, guesses = [], [], {}
        for sid, guess in need.items():
            k, pending_guess = self._pending.pop(sid, (0, None))
            if k > 0 and pending_guess == guess:
                ids.append(sid)
                ks.append(k)
                guesses[sid] = guess
        lost: list[tuple] = []
        for sid, drafts in self.rounds.propose(ids, ks, lost):
            _, _, tokens, q, _ = push_item(sid, guesses[sid], drafts)
            out.found[sid] = (tokens, q, False)
        self._take_lost(lost)
        for sid in need:
            if sid in out.found:
                continue
            if sid in self._resync:
                self._resync.discard(sid)
                out.resync.append(sid)
                if sid in self._give_up:
                    self._give_up.discard(sid)
                    out.gave_up.append(sid)
            else:
                out.timed_out.append(sid)
        out.waited_s = time.perf_counter() - t0
        return out

    def lose(self, draft) -> None:  # nothing to lose: no transport
        pass

    def _take_lost(self, lost: list[tuple]) -> None:
        for sid, guess, *_ in lost:
            self._pending.pop(sid, None)
            self._resync.add(sid)
            if guess == GIVE_UP:
                self._give_up.add(sid)
