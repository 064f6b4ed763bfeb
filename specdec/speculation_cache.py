"""The speculation cache: drafts for the next round, prepared while the target verifies.

"Speculative Speculative Decoding" (ICLR 2026, https://arxiv.org/abs/2603.03251) keeps a
cache of next-round drafts keyed by the verification outcome; PEARL's post-verify
(https://arxiv.org/abs/2408.11850) is the one-outcome case. After the draft has proposed
``d_1..d_n`` for a sequence, :meth:`SpeculativeDrafter.speculate` drafts ahead for the
outcomes it expects:

* all ``n`` accepted and bonus token ``b``, for the ``fanout`` likeliest ``b`` under the
  draft's own next-token distribution;
* (optionally) a rejection at position ``j`` with recovered token ``r``, guessing ``r`` as
  the draft's best alternative to ``d_j``.

Each guess becomes a branch: a forked draft KV cache whose committed prefix is the
guessed outcome, drafted with the request's draft random stream. When the real outcome
arrives, :meth:`SpeculativeDrafter.propose` serves a branch whose prefix equals the real
committed tokens exactly (a hit: no drafting on the critical path) or drafts afresh (a
miss). Exactness holds on both paths: a branch's drafts are samples from ``q`` given the
very prefix that was realised, drawn independently of the verifier's random numbers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from specdec.proposers import DraftModelProposer
from specdec.sequence import SequenceState


@dataclass
class _Branch:
    state: SequenceState  # its token_ids are the guessed committed prefix
    tokens: list[int]  # the drafts prepared for that prefix
    probs: torch.Tensor | None  # [n, vocab] q of those drafts
    logits: torch.Tensor  # [n, vocab] raw draft logits (for the next guesses)


@dataclass
class DraftResult:
    """Drafts for one sequence, however they were obtained."""

    tokens: list[int]
    probs: torch.Tensor | None  # [n, vocab]; None for greedy rows (argmax matching needs no q)
    logits: torch.Tensor  # [n, vocab]
    hit: bool  # served from the speculation cache


class SpeculativeDrafter:
    """A draft model plus its speculation cache; batched over sequences."""

    def __init__(self, proposer: DraftModelProposer, fanout: int = 2, rejections: bool = True):
        self.proposer = proposer
        self.fanout = fanout
        self.rejections = rejections
        self._branches: dict[Hashable, list[_Branch]] = {}
        self._last: dict[Hashable, DraftResult] = {}
        self.hits = 0
        self.misses = 0

    def free(self, seq_id: Hashable) -> None:
        self._drop_branches(seq_id)
        self._last.pop(seq_id, None)
        self.proposer.free(seq_id)

    def _drop_branches(self, seq_id: Hashable) -> None:
        for br in self._branches.pop(seq_id, []):
            self.proposer.free(br.state.seq_id)

    def propose(self, seqs: Sequence[SequenceState], ks: Sequence[int]) -> list[DraftResult]:
        """Drafts of length ``ks[i]`` continuing each sequence's committed tokens."""
        results: list[DraftResult | None] = [None] * len(seqs)
        fresh: list[int] = []
        for i, seq in enumerate(seqs):
            hit = self._take_branch(seq, ks[i])
            if hit is not None:
                results[i] = hit
            elif ks[i] > 0:
                fresh.append(i)
            else:
                results[i] = DraftResult([], None, torch.zeros(0, 0), hit=False)
        if fresh:
            k = max(ks[i] for i in fresh)
            prop = self.proposer.propose([seqs[i] for i in fresh], k)
            for row, i in enumerate(fresh):
                n = ks[i]
                greedy = seqs[i].params.is_greedy
                results[i] = DraftResult(
                    prop.draft_token_ids[row, :n].tolist(),
                    None if greedy else prop.draft_probs[row, :n].clone(),
                    prop.draft_logits[row, :n].clone(),
                    hit=False,
                )
        for i, seq in enumerate(seqs):
            if ks[i] > 0:
                self.hits += int(results[i].hit)
                self.misses += int(not results[i].hit)
            self._last[seq.seq_id] = results[i]
        return results  # type: ignore[return-value]

    def _take_branch(self, seq: SequenceState, k: int) -> DraftResult | None:
        branches = self._branches.pop(seq.seq_id, [])
        realised = seq.token_ids
        chosen = None
        for br in branches:
            if chosen is None and k > 0 and br.state.token_ids == realised and br.tokens:
                chosen = br
            else:
                self.proposer.free(br.state.seq_id)
        if chosen is None:
            return None
        # The branch's cache becomes the sequence's cache.
        self.proposer.free(seq.seq_id)
        self.proposer.rename(chosen.state.seq_id, seq.seq_id)
        n = min(k, len(chosen.tokens))
        return DraftResult(
            chosen.tokens[:n],
            None if chosen.probs is None else chosen.probs[:n],
            chosen.logits[:n],
            hit=True,
        )

    def speculate(
        self,
        seqs: Sequence[SequenceState],
        ks: Sequence[int],
        fanout: int | None = None,
        rejections: bool | None = None,
    ) -> int:
        """Prepare next-round drafts for the likely outcomes of the drafts just proposed.

        Call after :meth:`propose` for the same sequences (with their committed tokens
        unchanged). ``fanout`` and ``rejections`` override the defaults for this call (the
        engine narrows them when speculation would outlast verification). Returns the
        number of branches prepared.
        """
        fanout = self.fanout if fanout is None else fanout
        rejections = self.rejections if rejections is None else rejections
        branch_states: list[SequenceState] = []
        parents: list[Hashable] = []
        look_ahead = []
        for seq, k in zip(seqs, ks, strict=True):
            last = self._last.get(seq.seq_id)
            if last is None or not last.tokens or k <= 0:
                continue
            look_ahead.append((seq, last, k))
        if not look_ahead:
            return 0
        # The draft's distribution one past its drafts: candidates for the bonus token.
        heads = [
            SequenceState(seq.seq_id, seq.token_ids + last.tokens, seq.params)
            for seq, last, _ in look_ahead
        ]
        bonus_logits = self.proposer.extend(heads)  # [batch, vocab]
        for row, (seq, last, _k) in enumerate(look_ahead):
            guesses: list[list[int]] = [
                [*last.tokens, int(b)] for b in bonus_logits[row].topk(fanout).indices
            ]
            if rejections:
                for j, tok in enumerate(last.tokens):
                    alt = last.logits[j].clone()
                    alt[tok] = float("-inf")
                    guesses.append([*last.tokens[:j], int(alt.argmax())])
            for g, ext in enumerate(guesses):
                bid = (seq.seq_id, "branch", g)
                self.proposer.fork(seq.seq_id, bid)
                branch_states.append(SequenceState(bid, seq.token_ids + ext, seq.params))
                parents.append(seq.seq_id)
        k = max(k for _, _, k in look_ahead)
        prop = self.proposer.propose(branch_states, k)
        for row, (state, parent) in enumerate(zip(branch_states, parents, strict=True)):
            greedy = state.params.is_greedy
            self._branches.setdefault(parent, []).append(
                _Branch(
                    state,
                    prop.draft_token_ids[row].tolist(),
                    None if greedy else prop.draft_probs[row].clone(),
                    prop.draft_logits[row].clone(),
                )
            )
        return len(branch_states)
