"""A draft in the engine core's process: the shape for a pair that shares one device.

Two processes on one device time-slice it (two CUDA contexts, or two processes on a few
CPU cores), and every round pays an actor message each way; vLLM, SGLang and
TensorRT-LLM all run the draft in the target's process for that reason. Here the core's
loop drafts for a round right before verifying it, with the same drafter code the draft
actor runs (:class:`deployments.workers.drafting.DraftRounds`), so the tokens are the same ones
(seeded rows included). There is no overlap: the draft and the target take turns.

:class:`ColocatedDraftLink` implements :class:`deployments.core.draft_link.DraftLink`, as
the actor link does, so the core does not know which shape it runs in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from deployments.core.draft_link import DraftLink, Gathered
from deployments.messages import DraftItem, PushedDraft, RoundFeedback
from deployments.workers.drafting import DraftRounds, pushed_drafts


class ColocatedDraftLink(DraftLink):
    """Applies the core's messages at once; drafts when a round gathers (one batch)."""

    def __init__(self, rounds: DraftRounds):
        super().__init__()
        self.rounds = rounds
        self._first = True  # the first message carries every sequence in full
        self._pending: dict[Hashable, tuple[int, tuple]] = {}  # sid -> (k, guess) to draft

    @property
    def has_draft(self) -> bool:
        return True  # always there: it lives and dies with the core

    def kept(self) -> set[Hashable]:
        return set(self._pending) | super().kept()

    def forget(self, seq_id: Hashable) -> None:
        self._pending.pop(seq_id, None)
        super().forget(seq_id)

    def drop_pushes(self, seq_id: Hashable) -> None:
        self._pending.pop(seq_id, None)

    def send(
        self,
        items: list[DraftItem],
        freed: list[Hashable],
        feedback: RoundFeedback,
        full_items: Callable[[], list[DraftItem]],
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
        lost: list[PushedDraft] = []
        proposed = self.rounds.propose(ids, ks, lost)
        rows = [(sid, guesses[sid], d) for sid, d in proposed]
        pushes = pushed_drafts(rows, version=self.rounds.version, on_device=True)
        for push in pushes:
            out.found[push.seq_id] = push
        self._take_lost(lost)
        for sid in need:
            if sid not in out.found and not self._take_resync(sid, out):
                out.timed_out.append(sid)
        out.waited_s = time.perf_counter() - t0
        return out

    def _take_lost(self, lost: list[PushedDraft]) -> None:
        for draft in lost:
            self._pending.pop(draft.seq_id, None)
            self._note(draft)
