"""What a draft does with the core's round messages, wherever the draft runs.

The draft actor (:class:`deployments.workers.draft_worker.DraftWorker`) and a draft
colocated in the core's process apply the same round messages to a
:class:`~specdec.speculation_cache.SpeculativeDrafter` and draft the same way, so they
propose the same tokens (seeded rows draw the same numbers) and fail the same way: a
sequence the draft fails on alone is given up (decoded target-only), never the batch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from deployments.messages import DraftItem, DraftStatus, PushedDraft
from specdec.low_rank import LowRankUpdate
from specdec.qcodec import DeviceQ, encode_batch
from specdec.sampling import SamplingParams

if TYPE_CHECKING:  # (the draft model's stack: not for the replica that starts workers)
    from specdec.speculation_cache import Drafts, SpeculativeDrafter

logger = logging.getLogger("specserve.drafting")


def new_drafter(
    runner, min_confidence: float, main_slots: int, vocab_limit: int | None = None
) -> SpeculativeDrafter:
    """The drafter over a loaded draft runner, for the draft worker and a colocated draft
    alike. Its stack (the draft steps, transformers, dynamo) is imported here, where a
    worker drafts, not with this module: the Serve replica imports the workers' modules to
    start them and never drafts."""
    from specdec.proposers import DraftModelProposer
    from specdec.speculation_cache import SpeculativeDrafter

    proposer = DraftModelProposer(runner, min_confidence, vocab_limit)
    return SpeculativeDrafter(proposer, main_slots=main_slots)


def pushed_drafts(
    rows: list[tuple[Hashable, tuple, Drafts]], *, version: int, on_device: bool = False
) -> list[PushedDraft]:
    """Each ``(seq_id, guess, drafts)`` row's drafts for the core, keyed by the outcome
    they continue.

    Tokens, not vocabularies: a greedy row carries its ids; a sampled row its q in 16 bits,
    over its support when top-k/top-p truncated it (:class:`specdec.qcodec.CompactQ`), all
    rows' q read from the device together (:func:`specdec.qcodec.encode_batch`), each
    stamped with the weights ``version`` that drafted it (the monitor's acceptance per
    version, the core's cue to re-measure its policy). With
    ``on_device`` (a draft in the core's own process) q stays where it is
    (:class:`specdec.qcodec.DeviceQ`): nothing travels, so nothing is read."""
    sampled = [d.probs for _, _, d in rows if d.probs is not None]
    if on_device:
        qs = iter([DeviceQ(w, None, None, w.shape[-1]) for w in sampled])
    else:
        qs = iter(encode_batch(sampled))
    return [
        PushedDraft(
            sid,
            DraftStatus.DRAFTS,
            tuple(guess),
            d.tokens,
            None if d.probs is None else next(qs),
            d.speculative,
            version,
        )
        for sid, guess, d in rows
    ]


class DraftRounds:
    """Applies round messages to a drafter and drafts the rows that want drafts."""

    def __init__(self, drafter: SpeculativeDrafter):
        self.drafter = drafter
        self.failed_sequences = 0  # given up on (decoded target-only since)
        self.version = 0  # of the draft weights drafting now (0: as deployed)

    def load_weights(self, version: int, weights) -> None:
        """New draft weights (a state dict, or a LowRankUpdate over the version served
        now), between messages or rounds (see :class:`WeightsHandoff`)."""
        if isinstance(weights, LowRankUpdate) and weights.base_version != self.version:
            raise ValueError(
                f"low-rank update over version {weights.base_version}, but version "
                f"{self.version} serves: it needs the full weights"
            )
        self.drafter.load_weights(weights)
        self.version = version

    def apply(
        self, first: bool, items: list[DraftItem], freed: list[Hashable]
    ) -> tuple[list[Hashable], list[int], dict[Hashable, tuple], list[PushedDraft]]:
        """Take a round message's frees and items (:class:`deployments.messages.DraftItem`).

        Returns the rows to draft, their k, the guess each drafts for (what the round
        committed), and pushes for rows the draft lost track of or gave up on."""
        drafter = self.drafter
        if first:  # a new core (or this draft is new to it): nothing held is valid
            for sid in list(drafter.seqs):
                drafter.free(sid)
        for sid in freed:
            drafter.free(sid)
        ids, ks, guesses, lost = [], [], {}, []
        for item in items:
            sid = item.seq_id
            try:
                if item.restart is not None:
                    self._restart(sid, item.restart)
                elif drafter.length(sid) != item.base_len:
                    lost.append(PushedDraft(sid, DraftStatus.LOST))
                    continue
                else:
                    drafter.commit(sid, item.new_token_ids)
            except Exception as exc:  # this sequence alone: it goes on target-only
                self._raise_if_group_failed()
                lost.append(self.give_up(sid, exc))
                continue
            if item.num_speculative_tokens > 0:
                ids.append(sid)
                ks.append(item.num_speculative_tokens)
                guesses[sid] = tuple(item.new_token_ids)
        return ids, ks, guesses, lost

    def _restart(self, sid: Hashable, restart) -> None:
        """Start ``sid`` from its committed tokens (new, new to this draft, or lost)."""
        if sid not in self.drafter.seqs and not self.drafter.has_room():
            raise RuntimeError("the draft's KV budget has no slot for it")
        prompt, output = restart.prompt_token_ids, restart.output_token_ids
        params = SamplingParams(**restart.sampling_params)
        self.drafter.add(sid, [*prompt, *output], params, len(prompt))

    def propose(
        self, ids: list, ks: list[int], lost: list[PushedDraft]
    ) -> list[tuple[Hashable, Drafts]]:
        """``drafter.propose`` for the batch; if it fails, each sequence alone, rebuilt from
        its committed tokens (the failed pass may have left its KV half-written). Rows
        that fail alone are given up (their items appended to ``lost``)."""
        if not ids:
            return []
        try:
            return list(zip(ids, self.drafter.propose(ids, ks), strict=True))
        except Exception:
            self._raise_if_group_failed()
            logger.exception("batched drafting failed; retrying each sequence alone")
        done = []
        for sid, k in zip(ids, ks, strict=True):
            try:
                seq = self.drafter.seqs[sid]
                tokens, params = list(seq.token_ids), seq.params
                self.drafter.free(sid)
                self.drafter.add(sid, tokens, params, len(seq.prompt_token_ids))
                done.append((sid, self.drafter.propose([sid], [k])[0]))
            except Exception as exc:
                self._raise_if_group_failed()
                lost.append(self.give_up(sid, exc))
        return done

    def _raise_if_group_failed(self) -> None:
        """Re-raise the failure in hand where it broke a split draft's group
        (:class:`specdec.rank_group.MirroredRunner` ``broken``): no row can be drafted here
        again, and a row given up now would stay target-only after the worker's
        replacement; the worker exits instead (see DraftWorker._exit_with_group)."""
        if getattr(self.drafter.proposer.runner, "broken", False):
            raise

    def give_up(self, sid: Hashable, exc: BaseException) -> PushedDraft:
        """Drafting ``sid`` failed: free it and tell the core to decode it target-only
        (a draft-side fault of one request must not end the loop that serves all)."""
        logger.warning("drafting %r failed (%r); it continues target-only", sid, exc)
        self.failed_sequences += 1
        with contextlib.suppress(Exception):
            self.drafter.free(sid)
        return PushedDraft(sid, DraftStatus.GAVE_UP)


class WeightsHandoff:
    """New draft weights, handed from an actor call's thread to the loop thread that owns
    the draft (the draft actor's loop, or the core's with a colocated draft).

    The caller waits until the loop has loaded them between two messages or rounds (so a
    round's drafts and q come from one version), or refused them (the old weights serve
    on); weights its caller gave up on (a timeout) are withdrawn, never loaded later.
    Every method runs with ``cv`` held (the lock that guards what calls hand the loop)."""

    def __init__(self, cv: threading.Condition, what: str):
        self._cv, self._what = cv, what
        self._pending: tuple[int, dict] | None = None
        self._error: str | None = None  # why the last weights were refused
        self.version = 0  # the version loaded

    @property
    def waiting(self) -> bool:
        return self._pending is not None

    def offer(
        self, version: int, weights: dict, timeout_s: float, failed: Callable[[], str | None]
    ) -> int:
        """The caller's side: returns the version now served; raises ValueError if the
        weights were refused, TimeoutError, or RuntimeError with ``failed()``'s reason
        once the loop has failed."""
        mine = self._pending = (version, weights)
        self._error = None
        self._cv.notify_all()
        deadline = time.monotonic() + timeout_s
        while self._pending is mine and not failed():
            if not self._cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                self._pending = None  # withdrawn: never loaded after the caller gave up
                raise TimeoutError(f"the {self._what} loop did not take version {version}")
        if failed():
            raise RuntimeError(failed())
        if self._error is not None:
            raise ValueError(self._error)
        return self.version

    def take(self, load: Callable[[int, dict], None]) -> None:
        """The loop's side, between messages or rounds: ``load(version, weights)``."""
        version, weights = self._pending
        self._pending = None
        try:
            load(version, weights)
            self.version = version
            logger.info("%s draft weights version %d loaded", self._what, version)
        except Exception as exc:  # refused (checked and converted before any copy): the
            # old weights serve on; the loop must not end for a bad upload
            self._error = f"{type(exc).__name__}: {exc}"
            logger.warning("%s draft weights version %d refused: %s", self._what, version, exc)
        self._cv.notify_all()
