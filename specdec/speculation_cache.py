"""The speculation cache: drafts for the next round, prepared while the target verifies.

"Speculative Speculative Decoding" (ICLR 2026, https://arxiv.org/abs/2603.03251) keeps a
cache of next-round drafts keyed by the verification outcome; PEARL's post-verify
(https://arxiv.org/abs/2408.11850) is the one-outcome case. After the draft has proposed
``d_1..d_n`` for a sequence, :meth:`SpeculativeDrafter.speculate` drafts ahead for the
outcomes it expects, likeliest first, across all sequences within one budget:

* all ``n`` accepted and bonus token ``b``: probability ``alpha_1 ... alpha_n * pi(b)``;
* a rejection at position ``j`` with recovered token ``r``: ``alpha_1 ... alpha_(j-1)
  (1 - alpha_j) * pi_j(r) / (1 - pi_j(d_j))``,

where ``alpha_j`` is the acceptance rate at draft position ``j`` measured on this draft's
own outcomes (a draft that has just been accepted is more likely to be accepted again,
so the positions differ) and ``pi`` the draft's raw next-token probabilities. So when
all-accept is likely the budget goes to bonus candidates, and when early rejections are
likely it goes to recovered tokens there.

Each chosen outcome becomes a branch: a forked draft KV cache whose committed prefix is
the guessed outcome, drafted with the request's draft random stream. When the real
outcome is known, :meth:`SpeculativeDrafter.propose` serves a branch whose guessed tokens
equal the committed ones exactly (a hit: no drafting on the critical path) or drafts
afresh (a miss). Exactness holds on both paths: a branch's drafts are samples from ``q``
given the very prefix that was realised, drawn independently of the verifier's random
numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from specdec.proposers import DraftModelProposer
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState
from specdec.stats import alpha_hat


@dataclass
class Drafts:
    """Drafts for one sequence's next round, however they were obtained."""

    tokens: list[int]
    # [n, vocab] q as float16 weights (specdec.qcodec); None for greedy rows (argmax
    # matching needs no q)
    probs: torch.Tensor | None
    top_ids: torch.Tensor  # [n, m] the draft's likeliest tokens at each position
    top_probs: torch.Tensor  # [n, m] their raw probabilities
    speculative: bool = False  # prepared ahead in a branch (a speculation-cache hit)
    # False: a branch the real outcome stopped, holding the drafts made by then (a draft
    # worker pushes complete branches ahead, these only when they are hit)
    complete: bool = True
    # Stopped by the outcome before its own end (neither k drafts nor a confidence stop):
    # drafting afresh would give more drafts, these first; a hit drafts the rest
    cut: bool = False

    def trimmed(self, k: int) -> Drafts:
        """The first ``k`` drafts (a prefix of drafts is itself a valid draft)."""
        if k >= len(self.tokens):
            return self
        probs = None if self.probs is None else self.probs[:k]
        return Drafts(
            self.tokens[:k],
            probs,
            self.top_ids[:k],
            self.top_probs[:k],
            self.speculative,
            self.complete,
            False,  # (k drafts: all a round asks for)
        )

    def joined(self, rest: Drafts) -> Drafts:
        """These drafts followed by ``rest``, drafted from their end (greedy rows: no q)."""
        if self.probs is not None or rest.probs is not None:
            raise ValueError("only a greedy row's drafts (no q) are joined")
        return Drafts(
            self.tokens + rest.tokens,
            None,
            torch.cat([self.top_ids, rest.top_ids]),
            torch.cat([self.top_probs, rest.top_probs]),
            self.speculative,
            self.complete,
        )


@dataclass
class Branch:
    """Drafts prepared for one guessed outcome of a sequence's current round."""

    seq_id: Hashable  # the sequence it belongs to
    guess: tuple[int, ...]  # the tokens the round is guessed to commit
    state: SequenceState  # a sequence of its own: committed tokens + guess
    drafts: Drafts
    k: int = 0  # the drafts it was asked for (the sequence's k then) [tokens]


class SpeculativeDrafter:
    """A draft model, the sequences it drafts for, and their speculation cache."""

    def __init__(
        self,
        proposer: DraftModelProposer,
        top_m: int = 4,
        decay: float = 0.98,
        main_slots: int | None = None,
    ):
        self.proposer = proposer
        # KV slots kept for sequences (branches never take them): the draft's cache is one
        # budget, and a branch is worth less than drafting for a sequence at all. None:
        # only the sequences added so far are kept slots for.
        self.main_slots = main_slots
        self._device = proposer.runner.device  # the draft's: sequences, generators, drafts
        self.top_m = top_m
        self.decay = decay
        self.seqs: dict[Hashable, SequenceState] = {}
        self._last: dict[Hashable, Drafts] = {}  # drafts being verified now, per sequence
        self._k: dict[Hashable, int] = {}  # draft length asked for, per sequence
        self._branches: dict[Hashable, list[Branch]] = {}
        self._accepted = 4.0  # decayed sums for alpha_hat = A / (A + R); prior 0.8
        self._rejections = 1.0
        # Per draft position j: decayed counts of rounds that reached j and that accepted
        # its draft (prior 0.8); they grow with the longest k seen.
        self._reached: list[float] = []
        self._kept: list[float] = []
        self.hits = 0
        self.misses = 0

    def warm_up(self) -> dict[str, float]:
        """Build the proposer's fused draft steps for this drafter's top-m proposals (at
        startup, before any request; nothing when the draft runs eagerly)."""
        return self.proposer.warm_up(self.top_m)

    @property
    def max_model_len(self) -> int:
        return self.proposer.runner.max_model_len

    @property
    def acceptance(self) -> float:
        """alpha_hat over recent rounds (docs/architecture.md, Formulas: A / (A + rounds
        with a rejection)); the priors keep both counts above 0, so it always has one."""
        alpha = alpha_hat(self._accepted, self._rejections)
        return 0.0 if alpha is None else alpha

    # ----- sequences ----------------------------------------------------------------------

    def add(
        self,
        seq_id: Hashable,
        token_ids: list[int],
        params: SamplingParams,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Start (or restart) drafting for a sequence from all its committed tokens, the
        first ``num_prompt_tokens`` of them its prompt (default: all; penalties count
        the output apart from the prompt)."""
        self.free(seq_id)
        p = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self.seqs[seq_id] = SequenceState(
            seq_id,
            list(token_ids[:p]),
            params,
            output_token_ids=list(token_ids[p:]),
            device=self._device,
        )

    def free(self, seq_id: Hashable) -> None:
        self._drop_branches(seq_id)
        self._last.pop(seq_id, None)
        self._k.pop(seq_id, None)
        if self.seqs.pop(seq_id, None) is not None:
            self.proposer.free(seq_id)

    def has_room(self) -> bool:
        """Whether one more sequence may start (a KV slot is kept for it)."""
        return self.main_slots is None or len(self.seqs) < self.main_slots

    def branch_slots(self) -> int:
        """KV slots speculation may take now: free ones, less those kept for sequences
        that do not hold theirs yet (admitted, or still to come up to main_slots)."""
        runner = self.proposer.runner
        held = sum(1 for sid in self.seqs if runner.holds(sid))
        return runner.num_free_slots - (max(self.main_slots or 0, len(self.seqs)) - held)

    def length(self, seq_id: Hashable) -> int | None:
        seq = self.seqs.get(seq_id)
        return None if seq is None else len(seq.prompt_token_ids) + len(seq.output_token_ids)

    def commit(self, seq_id: Hashable, new_tokens: Sequence[int]) -> None:
        """The target committed ``new_tokens``; learn how many of our drafts it accepted."""
        seq = self.seqs[seq_id]
        last = self._last.pop(seq_id, None)
        if last is not None and last.tokens:
            n = len(last.tokens)
            a = 0
            while a < min(n, len(new_tokens) - 1) and last.tokens[a] == new_tokens[a]:
                a += 1
            self._accepted = self.decay * self._accepted + a
            self._rejections = self.decay * self._rejections + (a < n)
            while len(self._reached) < n:
                self._reached.append(1.0)
                self._kept.append(0.8)
            for j in range(min(n, a + 1)):  # positions 0..a were reached; 0..a-1 accepted
                self._reached[j] = self.decay * self._reached[j] + 1
                self._kept[j] = self.decay * self._kept[j] + (j < a)
        seq.output_token_ids.extend(int(t) for t in new_tokens)

    def position_acceptance(self, n: int) -> list[float]:
        """Measured acceptance rate at draft positions ``0..n-1`` (below 1: no certainty)."""
        return [
            min(0.999, self._kept[j] / self._reached[j]) if j < len(self._reached) else 0.8
            for j in range(n)
        ]

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """New draft weights, between rounds: every prepared branch was drafted by the old
        ones and goes; each sequence's draft cache is rebuilt at its next proposal
        (:meth:`DraftModelProposer.load_weights`). Sequences, their sampling state and
        the acceptance statistics stay."""
        self.proposer.load_weights(weights)  # refused weights leave everything as it was
        for seq_id in list(self._branches):
            self._drop_branches(seq_id)

    def _drop_branches(self, seq_id: Hashable) -> None:
        for br in self._branches.pop(seq_id, []):
            self.proposer.free(br.state.seq_id)

    # ----- drafting -----------------------------------------------------------------------

    def propose(self, seq_ids: Sequence[Hashable], ks: Sequence[int]) -> list[Drafts]:
        """``ks[i]`` drafts continuing each sequence's committed tokens (0: none).

        A branch whose guess equals what the last round committed is served as it is, or,
        where the outcome cut it short (:attr:`Drafts.cut`), with the rest of its drafts
        drafted now from its last: what drafting afresh would give, in fewer steps. The
        other rows are drafted in the same batch.
        """
        results: list[Drafts | None] = [None] * len(seq_ids)
        fresh: list[int] = []  # rows drafted now (afresh, or on from a cut branch)
        for i, sid in enumerate(seq_ids):
            hit = self._take_branch(sid, ks[i])
            results[i] = hit
            # (a cut branch asked for no more drafts than it holds is served as it is)
            more = hit is not None and hit.cut and ks[i] > len(hit.tokens)
            if (hit is None and ks[i] > 0) or more:
                fresh.append(i)
            elif hit is None:
                empty = torch.zeros(0, 0, device=self._device)
                results[i] = Drafts([], None, empty, empty)
        if fresh:
            self._draft_rows(seq_ids, ks, fresh, results)
        for i, sid in enumerate(seq_ids):
            if ks[i] > 0:
                self._k[sid] = ks[i]
                self.hits += int(results[i].speculative)
                self.misses += int(not results[i].speculative)
                self._last[sid] = results[i]
        return results  # type: ignore[return-value]

    def _draft_rows(
        self,
        seq_ids: Sequence[Hashable],
        ks: Sequence[int],
        rows: list[int],
        results: list[Drafts | None],
    ) -> None:
        """Draft ``rows`` in one batch: afresh, or from a cut branch's last draft (its
        drafts read as the sequence's, so the draft's cache, which holds them, is kept)."""
        heads = [results[i] for i in rows]
        states = [
            self.seqs[seq_ids[i]]
            if head is None
            else self._continued(self.seqs[seq_ids[i]], head.tokens)
            for i, head in zip(rows, heads, strict=True)
        ]
        made = [0 if head is None else len(head.tokens) for head in heads]
        want = [ks[i] - n for i, n in zip(rows, made, strict=True)]  # [rows] drafts to make
        prop = self.proposer.propose(states, max(want), self.top_m)
        params = [state.params for state in states]
        for i, head, drafts in zip(rows, heads, _drafts_of(prop, want, params), strict=True):
            results[i] = drafts if head is None else head.joined(drafts)

    def _continued(self, seq: SequenceState, drafts: list[int]) -> SequenceState:
        """``seq`` with ``drafts`` appended: what a cut branch drafts on from."""
        return SequenceState(
            seq.seq_id,
            seq.prompt_token_ids,
            seq.params,
            output_token_ids=seq.output_token_ids + drafts,
            device=self._device,
        )

    def _take_branch(self, seq_id: Hashable, k: int) -> Drafts | None:
        branches = self._branches.pop(seq_id, [])
        seq = self.seqs[seq_id]
        realised = seq.token_ids
        chosen = None
        for br in branches:
            if chosen is None and k > 0 and br.state.token_ids == realised and br.drafts.tokens:
                chosen = br
            else:
                self.proposer.free(br.state.seq_id)
        if chosen is None:
            return None
        # The branch's cache becomes the sequence's cache.
        self.proposer.free(seq_id)
        self.proposer.rename(chosen.state.seq_id, seq_id)
        drafts = chosen.drafts
        short = k > chosen.k and len(drafts.tokens) == chosen.k and drafts.probs is None
        if short and not drafts.complete:
            # drafted to a shorter k than asked now (k changed between rounds): drafting
            # afresh would give more; drafted on from its last, as a cut branch is. (A
            # complete branch went to the core ahead of the message, which serves it.)
            drafts.cut = True
        return drafts.trimmed(k)

    def speculate(
        self,
        seq_ids: Sequence[Hashable],
        budget: int,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> list[Branch] | None:
        """Prepare next-round drafts for the ``budget`` likeliest outcomes of this round.

        Call after :meth:`propose` for the same sequences. ``should_stop`` is checked
        between draft steps: once the real outcome is known, drafting stops. The greedy
        branches keep the drafts made by then (``Drafts.complete`` False; ``cut`` where a row
        had not reached its own end): the one that guessed the outcome serves them with the
        rest drafted on from its last (:meth:`propose`), the drafts drafting afresh would
        give (argmax of the same prefix) for the missing steps only. Why not serve them as
        they are: a verification costs the same with fewer drafts, and commits fewer
        tokens. A sampled branch is not
        kept: serving fewer drafts than its request's k would move its later rounds'
        boundaries, and with them the random numbers a seeded request's rounds draw.
        None: stopped with nothing kept.
        """
        look = [sid for sid in seq_ids if self._last.get(sid) is not None]
        look = [sid for sid in look if self._last[sid].tokens]
        if not look or budget <= 0:
            return []
        candidates = self._outcomes(look)
        candidates.sort(key=lambda c: -c[0])
        # Each branch takes a KV slot of the draft's runner: only slots that are free and
        # not kept for sequences still to come (main_slots).
        chosen = candidates[: max(0, min(budget, self.branch_slots()))]
        states, parents, guesses, ks = self._fork_branches(chosen)
        if not states:
            return []
        try:  # all or nothing: a failed pass keeps no branch
            prop = self.proposer.propose(
                states, max(ks), self.top_m, should_stop=should_stop, keep_partial=True
            )
        except Exception:
            self._free_states(states)
            raise
        if prop is None:
            self._free_states(states)
            return None
        branches = []
        every = _drafts_of(prop, ks, [state.params for state in states])
        rows = zip(states, parents, guesses, ks, every, strict=True)
        for row, (state, sid, guess, k, drafts) in enumerate(rows):
            if not prop.complete and not (state.params.is_greedy and drafts.tokens):
                self.proposer.free(state.seq_id)
                continue
            drafts.speculative, drafts.complete = True, prop.complete
            drafts.cut = not prop.complete and prop.cut[row] and len(drafts.tokens) < k
            br = Branch(sid, guess, state, drafts, k)
            self._branches.setdefault(sid, []).append(br)
            branches.append(br)
        return branches if branches or prop.complete else None

    def _outcomes(self, look: list[Hashable]) -> list[tuple[float, Hashable, tuple[int, ...]]]:
        """``(probability, sequence, guessed committed tokens)`` of every outcome worth
        a branch for the sequences in ``look`` (each with drafts being verified): all
        drafts accepted with each of the draft's likeliest bonus tokens, and a rejection at
        each position with each of its likeliest other tokens recovered (module docstring)."""
        heads = [
            SequenceState(
                sid,
                self.seqs[sid].prompt_token_ids,
                self.seqs[sid].params,
                output_token_ids=self.seqs[sid].output_token_ids + list(self._last[sid].tokens),
                device=self._device,
            )
            for sid in look
        ]
        bonus_ids, bonus_probs = self.proposer.extend(heads, self.top_m)  # [batch, m]
        candidates: list[tuple[float, Hashable, tuple[int, ...]]] = []
        for row, sid in enumerate(look):
            last = self._last[sid]
            n = len(last.tokens)
            alphas = self.position_acceptance(n)
            reach = [1.0]  # reach[j]: probability that verification gets to position j
            for alpha in alphas:
                reach.append(reach[-1] * alpha)
            all_accept = reach[n]
            for b, pb in zip(bonus_ids[row].tolist(), bonus_probs[row].tolist(), strict=True):
                candidates.append((all_accept * pb, sid, (*last.tokens, b)))
            for j in range(n):
                candidates.extend(_rejections_at(last, j, sid, reach[j] * (1 - alphas[j])))
        return candidates

    def _fork_branches(
        self, chosen: list[tuple[float, Hashable, tuple[int, ...]]]
    ) -> tuple[list[SequenceState], list[Hashable], list[tuple[int, ...]], list[int]]:
        """Fork the draft's cache of each chosen outcome's sequence into a branch whose
        committed tokens end with the guess; returns the branches' states, their parent
        sequences, guesses and draft lengths (an outcome with no room left to draft in
        max_model_len is skipped). On failure no fork is kept."""
        states, parents, guesses, ks = [], [], [], []
        for g, (_score, sid, guess) in enumerate(chosen):
            seq = self.seqs[sid]
            prefix = seq.token_ids + list(guess)
            k = min(self._k[sid], self.max_model_len - len(prefix))
            if k <= 0:
                continue
            bid = (sid, "branch", g)
            try:
                self.proposer.fork(sid, bid)
            except Exception:
                self._free_states(states)
                raise
            states.append(
                SequenceState(
                    bid,
                    seq.prompt_token_ids,
                    seq.params,
                    output_token_ids=seq.output_token_ids + list(guess),
                    device=self._device,
                )
            )
            parents.append(sid)
            guesses.append(guess)
            ks.append(k)
        return states, parents, guesses, ks

    def _free_states(self, states: list[SequenceState]) -> None:
        for st in states:
            self.proposer.free(st.seq_id)


def _drafts_of(prop, ks: list[int], params: list[SamplingParams]) -> list[Drafts]:
    """Each proposal row's first ``ks[row]`` drafts (fewer where it stopped early), as the
    proposer read them to the host (once for the whole proposal), or read here."""
    counts, ids = prop.host_num_draft_tokens, prop.host_draft_token_ids
    if counts is None or ids is None:
        counts = prop.num_draft_tokens.tolist()  # [rows]
        ids = prop.draft_token_ids.tolist()  # [rows, k]
    out = []
    for row, (k, p) in enumerate(zip(ks, params, strict=True)):
        n = min(k, counts[row])
        q = None if p.is_greedy else prop.q(row)[:n].clone()
        out.append(Drafts(ids[row][:n], q, prop.top_token_ids[row, :n], prop.top_probs[row, :n]))
    return out


def _rejections_at(
    last: Drafts, j: int, sid: Hashable, reject_here: float
) -> list[tuple[float, Hashable, tuple[int, ...]]]:
    """The outcomes "rejected at draft position ``j``, token ``t`` recovered" for each of
    the draft's likeliest tokens ``t`` there other than the draft itself, scored
    ``reject_here * pi_j(t) / (1 - pi_j(d_j))`` (``reject_here``: the probability that
    verification reaches ``j`` and rejects there)."""
    p_draft = 0.0
    alts = []
    for t, pt in zip(last.top_ids[j].tolist(), last.top_probs[j].tolist(), strict=True):
        if t == last.tokens[j]:
            p_draft = pt
        else:
            alts.append((t, pt))
    return [
        (reject_here * pt / max(1e-6, 1 - p_draft), sid, (*last.tokens[:j], t)) for t, pt in alts
    ]
