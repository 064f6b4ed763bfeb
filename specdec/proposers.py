"""Proposers: where draft tokens come from.

A two-method interface, as in transformers' assisted generation: :meth:`Proposer.propose`
returns up to ``k`` draft tokens per sequence together with their proposal distribution,
and :meth:`Proposer.observe` tells the proposer how many were accepted. Proposals are
batched over sequences so one draft forward pass serves the whole batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from specdec.draft_steps import (
    FusedDraftSteps,
    GraphedDraftSteps,
    chunk_sizes,
    confidence_stop,
    top_candidates,
)
from specdec.execution import CUDA_GRAPH, TORCH_COMPILE, seconds_by_name
from specdec.low_rank import LowRankUpdate
from specdec.ngram import ngram_propose
from specdec.penalties import apply_history, needs_history
from specdec.qcodec import dequantize_q, quantize_q
from specdec.rejection import ProposalKind
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams, probs_for, sample
from specdec.sequence import SequenceState


@dataclass
class Proposal:
    """Draft tokens for a batch. A row's drafts are its first ``num_draft_tokens``:
    past them (a confidence stop) the tensors hold what the draft went on to draft, which
    is never proposed; every consumer cuts each row at its count."""

    draft_token_ids: torch.Tensor  # [batch, k] int64
    num_draft_tokens: torch.Tensor  # [batch] int64
    # [len(probs_rows), k, vocab] q as float16 weights (specdec.qcodec.dequantize_q gives
    # the float32 distribution) of the sampled rows only, or None (point mass, all greedy)
    draft_probs: torch.Tensor | None
    kind: ProposalKind
    # The draft's likeliest tokens at each position and their probabilities under its raw
    # (untransformed) distribution: the speculation cache guesses outcomes from them.
    top_token_ids: torch.Tensor | None = None  # [batch, k, m] int64
    top_probs: torch.Tensor | None = None  # [batch, k, m] float32
    probs_rows: tuple[int, ...] = ()  # the batch row of each draft_probs row
    # The same drafts already read to the host (one read for the batch), when the
    # proposer made them: consumers take these instead of reading the tensors again.
    host_num_draft_tokens: list[int] | None = None  # [batch]
    host_draft_token_ids: list[list[int]] | None = None  # [batch][k]
    # False: ``should_stop`` ended the drafting early (``keep_partial``); each row's drafts
    # are those of the steps run (at most that many).
    complete: bool = True
    # With complete False: per row, whether it was stopped before its own end (its k or its
    # confidence stop), so that drafting on would give more drafts
    cut: tuple[bool, ...] = ()

    def q(self, row: int) -> torch.Tensor | None:
        """Batch row ``row``'s q (``[k, vocab]`` float16 weights), None for a greedy row."""
        if self.draft_probs is None or row not in self.probs_rows:
            return None
        return self.draft_probs[self.probs_rows.index(row)]


class Proposer(ABC):
    @abstractmethod
    def propose(self, seqs: Sequence[SequenceState], k: int) -> Proposal:
        """Propose up to ``k`` tokens continuing each sequence's committed tokens."""

    def observe(self, seqs: Sequence[SequenceState], num_accepted: Sequence[int]) -> None:  # noqa: B027
        """Learn from verification (optional: adaptive proposers override it)."""

    def free(self, seq_id: Hashable) -> None:  # noqa: B027
        """Release per-sequence state when a request ends."""


class DraftModelProposer(Proposer):
    """Samples ``k`` tokens autoregressively from a small draft model.

    The draft's KV cache is re-synchronised at every call: the cached tokens are compared
    with the committed ones and rolled back to their common prefix, so rejected drafts
    (and anything a failed round left behind) never leak into the next proposal.
    """

    kind: ProposalKind = "probs"

    def __init__(
        self,
        runner: ModelRunner,
        min_confidence: float = 0.0,
        vocab_limit: int | None = None,
        stop_early: bool | None = None,
    ):
        """``vocab_limit``: the draft proposes only ids below it, the ids it shares with
        the target (the target tokenizer's size; embedding rows past it are padding,
        Qwen 2.5: 151936 or 152064 rows over 151665 tokens). ``q`` is then
        ``[..., vocab_limit]`` wide: zero on every other target id, which is exact. A
        committed id the draft's embedding has no row for (the target may sample one of
        its padding rows) is fed as id 0: what the draft conditions on only shapes ``q``,
        never the law of the output.

        ``min_confidence`` > 0 ends a row's drafts at the first token the draft itself
        gives less than this probability (that token is still proposed), as transformers'
        assisted generation does: a confident draft proposes long runs, a doubtful one
        stops early. The rule looks only at the draft's own randomness, never at the
        target's, so verification stays exact with a variable number of drafts per row.

        ``stop_early``: whether drafting ends once the confidence stop has ended every row
        (None: where the draft's device is the host's CPU). That takes a read of the rows'
        stop flags after each step: free where the device is the host (no queue to drain,
        and a round at batch 1 skips the steps past its stop, often half of k); on an
        accelerator every step would wait for the device, so there the steps run on (what
        a row drafts past its count is never proposed)."""
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.runner = runner
        self.min_confidence = min_confidence
        self.stop_early = runner.device.type == "cpu" if stop_early is None else stop_early
        self.limit_vocab(vocab_limit)
        self._cached: dict[Hashable, list[int]] = {}  # seq_id -> tokens whose KV is cached
        self.weights_version = 0  # weights loaded since construction (load_weights)
        # A compiled draft runs a round's one-token steps in graphs of several (greedy
        # batches; specdec.draft_steps), else step by step.
        name = str(runner.config.name_or_path or "draft")
        self.fused = (
            FusedDraftSteps(runner, name)
            if runner.execution_mode == TORCH_COMPILE
            else GraphedDraftSteps(runner, name)
            if runner.execution_mode == CUDA_GRAPH
            else None
        )

    def warm_up(self, top_m: int) -> dict[str, float]:
        """Build the fused draft steps' graphs for proposals with ``top_m`` candidates
        (nothing when the runner is eager); seconds per graph, by name."""
        if self.fused is None:
            return {}
        return seconds_by_name(self.fused.warm_up(top_m))

    def limit_vocab(self, vocab_limit: int | None) -> None:
        """Propose only ids below ``vocab_limit`` (None: every row of the draft's head)."""
        self.vocab_limit = min(vocab_limit or self.runner.vocab_size, self.runner.vocab_size)

    def free(self, seq_id: Hashable) -> None:
        if seq_id in self._cached:
            del self._cached[seq_id]
            self.runner.free(seq_id)

    def load_weights(self, weights: Mapping[str, torch.Tensor] | LowRankUpdate) -> None:
        """New draft weights (:meth:`ModelRunner.load_weights`; a :class:`LowRankUpdate`:
        :meth:`ModelRunner.add_low_rank`, over the weights served now), between proposals. Every
        sequence's cached keys and values came from the old weights: each is emptied, and
        its next proposal feeds all its committed tokens again (a lazy rebuild, paid by
        the sequences that draft again). A proposal's drafts and its q therefore always
        come from one set of weights."""
        if isinstance(weights, LowRankUpdate):
            self.runner.add_low_rank(weights)
        else:
            self.runner.load_weights(weights)
        for seq_id, cached in self._cached.items():
            cached.clear()
            self.runner.rollback(seq_id, 0)
        self.weights_version += 1

    def fork(self, src: Hashable, dst: Hashable) -> None:
        """Branch ``dst`` off ``src`` sharing its cached prefix (copied, not recomputed)."""
        self.runner.fork(src, dst)
        self._cached[dst] = list(self._cached[src])

    def rename(self, old: Hashable, new: Hashable) -> None:
        self.runner.rename(old, new)
        self._cached[new] = self._cached.pop(old)

    def extend(self, seqs: Sequence[SequenceState], m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each sequence's unfed committed tokens; return its ``m`` likeliest next tokens.

        Used to look one token past the drafts (candidates for a bonus token) without
        sampling: returns ``([batch, m] token ids, [batch, m] probabilities)`` under the
        draft's raw distribution after the last committed token.
        """
        ids = [s.seq_id for s in seqs]
        feed = [self._sync(s) for s in seqs]
        logits = self._logits(ids, feed)  # [batch, vocab_limit]
        for sid, toks in zip(ids, feed, strict=True):
            self._cached[sid].extend(toks)
        return top_candidates(logits, m)

    def _logits(self, ids: list[Hashable], feed: list[list[int]]) -> torch.Tensor:
        """Last-position logits over the shared ids: ``[batch, vocab_limit]``."""
        feed = [self._embeddable(t) for t in feed]
        return self.runner.forward_padded(ids, feed, last_only=True)[:, : self.vocab_limit]

    def _embeddable(self, tokens: list[int]) -> list[int]:
        """``tokens`` with each id the draft's embedding has no row for as 0 (the target
        may commit one of its padding ids: what the draft conditions on only shapes q)."""
        rows = self.runner.input_vocab_size
        return tokens if max(tokens) < rows else [x if x < rows else 0 for x in tokens]

    def _sync(self, seq: SequenceState) -> list[int]:
        """Roll the draft cache back to the committed prefix; return the tokens to feed."""
        tokens = seq.token_ids
        cached = self._cached.get(seq.seq_id)
        if cached is None:
            self.runner.add(seq.seq_id)
            cached = self._cached[seq.seq_id] = []
        # Keep at least one token to feed: its logits give the first draft distribution.
        limit = min(len(cached), len(tokens) - 1)
        if cached[:limit] == tokens[:limit]:  # the usual case: one comparison in C
            common = limit
        else:
            common = 0
            while cached[common] == tokens[common]:
                common += 1
        del cached[common:]
        self.runner.rollback(seq.seq_id, common)
        return tokens[common:]

    def propose(
        self,
        seqs: Sequence[SequenceState],
        k: int,
        top_m: int = 0,
        should_stop: Callable[[], bool] | None = None,
        keep_partial: bool = False,
    ) -> Proposal | None:
        """``k`` drafts per sequence (fewer where ``min_confidence`` ends a row early:
        ``num_draft_tokens``); with ``top_m``, also the draft's ``top_m`` likeliest tokens
        at each position (for guessing verification outcomes).

        ``should_stop`` is checked before each draft step (or graph of fused steps, up to
        4); when it says so, drafting ends and None is returned (the caches keep what was
        fed and resynchronise next time), or with ``keep_partial`` and a step done, the
        drafts of the steps run (``complete`` False: a prefix of a row's drafts is a
        valid proposal).

        Greedy rows take the argmax and carry no ``q`` (argmax matching needs none):
        ``draft_probs`` holds the sampled rows only (``probs_rows``; :meth:`Proposal.q`).
        """
        run = self._start(seqs, k, top_m)
        i, complete = 0, True
        for size in self._plan(run):
            if should_stop is not None and should_stop():
                if run.steps and keep_partial:
                    complete = False
                    break
                if run.steps:
                    self._read_drafts(run)  # what was fed stays cached
                return None
            if size is None:
                self._step(run, i)
                i += 1
            else:
                i += self._fused_step(run, i, size)
            if self._all_stopped(run, i - 1):
                break
        counts, drafts = self._read_drafts(run)
        cut = ()
        if not complete:  # a row whose count is past the steps run had not reached its end
            cut = tuple(c > run.steps for c in counts)
            counts = [min(c, run.steps) for c in counts]
            run.counts.clamp_(max=run.steps)  # [batch] the drafts made so far
        return Proposal(
            run.draft,
            run.counts,
            run.probs,
            self.kind,
            run.top_ids,
            run.top_p,
            run.probs_rows,
            host_num_draft_tokens=counts,
            host_draft_token_ids=drafts,
            complete=complete,
            cut=cut,
        )

    def _plan(self, run: _Drafting) -> list[int | None]:
        """How this proposal's ``k`` steps run, in order: None for one ordinary pass, n
        for a graph of n fused steps. Fused steps need a compiled runner and greedy rows
        without penalties history (a sampled row draws from its request's generator; a
        penalty needs the drafts on the host). The first step is fused too where every row
        feeds one committed token (the usual round: the target's token after a rejection),
        else it is an ordinary pass (a new row's prompt, or a round that accepted every
        draft feeds two or more)."""
        if self.fused is None or run.probs_rows or run.history or run.k == 0:
            return [None] * run.k
        head = [] if all(len(feed) == 1 for feed in run.first_feed) else [None]
        ascending = self.stop_early and self.min_confidence > 0
        sizes = self.fused.sizes_for(len(run.ids))
        return head + chunk_sizes(run.k - len(head), ascending, sizes)

    def _fused_step(self, run: _Drafting, i: int, steps: int) -> int:
        """Draft positions ``i .. i + steps - 1`` of every row in one graph (fed the
        drafts of step ``i - 1`` on the device, or at ``i`` = 0 each row's one committed
        token), or step by step where the graph should not run
        (:meth:`FusedDraftSteps.can_run`); returns ``steps``."""
        if not self.fused.can_run(run.ids, steps, run.top_m):
            for j in range(i, i + steps):
                self._step(run, j)
            return steps
        if i > 0:
            tokens = run.draft[:, i - 1]  # [batch] the step before's drafts, on the device
        else:  # each row's one committed token
            first = self._embeddable([feed[0] for feed in run.first_feed])
            tokens = torch.tensor(first, dtype=torch.long, device=self.runner.device)
        out = self.fused.run(
            run.ids,
            tokens,
            steps=steps,
            first_step=i,
            num_draft_tokens=run.counts,
            k=run.k,
            vocab_limit=self.vocab_limit,
            min_confidence=self.min_confidence,
            top_m=run.top_m,
        )
        run.draft[:, i : i + steps] = out.draft_token_ids
        if run.top_m:
            run.top_ids[:, i : i + steps] = out.top_token_ids
            run.top_p[:, i : i + steps] = out.top_probs
        run.counts = out.num_draft_tokens
        run.steps = i + steps
        return steps

    def _all_stopped(self, run: _Drafting, i: int) -> bool:
        """With ``stop_early``: whether the confidence stop has ended every row by step
        ``i`` (one read of ``[batch]`` flags)."""
        if not (self.stop_early and self.min_confidence) or i + 1 >= run.k:
            return False
        return bool((run.counts < run.k).all())

    def _read_drafts(self, run: _Drafting) -> tuple[list[int], list[list[int]]]:
        """The drafts and their counts on the host, in one read for the whole batch (the
        steps fed each other on the device); records what the draft's cache now holds:
        each row's first feed, then the drafts of every step but the last (every row
        runs every step, a stopped one too)."""
        host = torch.cat([run.counts[:, None], run.draft], dim=1).tolist()  # [batch, 1 + k]
        counts = [row[0] for row in host]
        drafts = [row[1:] for row in host]
        if run.steps:
            for r, sid in enumerate(run.ids):
                self._cached[sid].extend(run.first_feed[r])
                self._cached[sid].extend(drafts[r][: run.steps - 1])
        return counts, drafts

    def _start(self, seqs: Sequence[SequenceState], k: int, top_m: int) -> _Drafting:
        """A proposal's buffers, on the draft model's device, and each row's first feed
        (the cache resynchronised to its committed tokens)."""
        batch = len(seqs)
        params = [s.params for s in seqs]
        dev = self.runner.device  # every tensor of the proposal lives with the draft model
        probs_rows = tuple(r for r in range(batch) if not params[r].is_greedy)
        return _Drafting(
            seqs=seqs,
            k=k,
            top_m=top_m,
            ids=[s.seq_id for s in seqs],
            params=params,
            start=[len(s.token_ids) for s in seqs],
            draft=torch.zeros(batch, k, dtype=torch.long, device=dev),
            counts=torch.full((batch,), k, dtype=torch.long, device=dev),
            # q as the float16 weights the draft samples from (specdec.qcodec): half the
            # bytes, and what travels to the verifier as it is; sampled sequences only.
            probs=(
                torch.zeros(len(probs_rows), k, self.vocab_limit, dtype=torch.float16, device=dev)
                if probs_rows
                else None
            ),
            probs_rows=probs_rows,
            probs_at=torch.tensor(probs_rows, dtype=torch.long, device=dev),
            top_ids=torch.zeros(batch, k, top_m, dtype=torch.long, device=dev) if top_m else None,
            top_p=torch.zeros(batch, k, top_m, device=dev) if top_m else None,
            first_feed=[self._sync(s) for s in seqs],
            history={r: [] for r in range(batch) if needs_history(params[r])},
        )

    def _step(self, run: _Drafting, i: int) -> bool:
        """Draft position ``i`` of every row (one forward pass of the draft). Step
        ``i`` > 0 feeds the tokens of step ``i - 1`` straight from the device: nothing is
        read back unless a row's penalties need it. Every row runs every step (rows the
        confidence stop ended are cut to their count when the drafts are read)."""
        if i == 0:
            logits = self._logits(run.ids, run.first_feed)
        else:
            logits = self._logits_after(run.ids, run.draft[:, i - 1])
        # logits: [batch, vocab_limit]
        if run.history:  # penalties / min_tokens given the output and the drafts so far
            logits = _with_draft_history(logits, run)
        top_m = run.top_m
        lse = logits.logsumexp(dim=-1, keepdim=True) if top_m or self.min_confidence else None
        if top_m:  # the likeliest token heads the top-m: no separate argmax
            run.top_ids[:, i], run.top_p[:, i] = top_candidates(logits, top_m, lse)  # [batch, m]
            tokens = run.top_ids[:, i, 0].clone()  # [batch]; replaced on sampled rows
        else:
            tokens = logits.argmax(dim=-1)
        self._sample_rows(run, i, logits, tokens)
        run.draft[:, i] = tokens
        run.steps = i + 1
        if run.history:  # the rows' penalties need this step's tokens on the host
            for r, t in enumerate(tokens.tolist()):
                if r in run.history:
                    run.history[r].append(t)
        if self.min_confidence and i + 1 < run.k:
            # (rows stay in the batch: reading which stopped would stop the host each step)
            run.counts, _ = confidence_stop(
                run.counts, run.counts == run.k, logits, lse, tokens, self.min_confidence, i + 1
            )
        return True

    def _logits_after(self, ids: list[Hashable], tokens: torch.Tensor) -> torch.Tensor:
        """:meth:`_logits` of one token per row, given as ``[rows]`` ids on the device."""
        rows = self.runner.input_vocab_size
        if self.vocab_limit > rows:  # an id the embedding has no row for is fed as 0
            tokens = torch.where(tokens < rows, tokens, torch.zeros_like(tokens))
        logits = self.runner.forward_padded(ids, tokens[:, None], last_only=True)
        return logits[:, : self.vocab_limit]

    def _sample_rows(
        self, run: _Drafting, i: int, logits: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """Sample position ``i`` of the rows that are not greedy from their q (the
        sampling transform of ``logits``, ``[batch, vocab_limit]``), each seeded row with
        its request's draft generator at that position; write the tokens into ``tokens``
        (``[batch]``) and q, as float16 weights, into ``run.probs``."""
        if not run.probs_rows:
            return
        w = quantize_q(probs_for([run.params[r] for r in run.probs_rows], logits[run.probs_at]))
        gens = [
            run.seqs[r].draft_generator_at(run.start[r] + i, logits.device) for r in run.probs_rows
        ]
        tokens[run.probs_at] = sample(dequantize_q(w), gens)  # w: [s, vocab] float16
        run.probs[:, i] = w


class NgramProposer(Proposer):
    """Deterministic prompt-lookup drafts, verified as a point mass ``q = δ_x``."""

    kind: ProposalKind = "point_mass"

    def __init__(self, n_max: int = 4, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seqs: Sequence[SequenceState], k: int) -> Proposal:
        host = torch.device("cpu")  # token lookups in Python lists: no model, no device
        draft = torch.zeros(len(seqs), k, dtype=torch.long, device=host)
        counts = torch.zeros(len(seqs), dtype=torch.long, device=host)
        for row, seq in enumerate(seqs):
            tokens = ngram_propose(seq.token_ids, k, self.n_max, self.n_min)
            draft[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=host)
            counts[row] = len(tokens)
        return Proposal(draft, counts, None, self.kind)


@dataclass
class _Drafting:
    """One :meth:`DraftModelProposer.propose` call: its buffers and its rows' progress
    (rows are the batch's)."""

    seqs: Sequence[SequenceState]
    k: int  # drafts asked per row
    top_m: int  # likeliest tokens recorded per position (0: none)
    ids: list[Hashable]  # per row: its sequence id
    params: list[SamplingParams]  # per row: its sampling params
    start: list[int]  # per row: absolute index of its first draft
    draft: torch.Tensor  # [batch, k] int64 drafts (0 past a row's end)
    counts: torch.Tensor  # [batch] int64 drafts per row (k unless it stopped early)
    probs: torch.Tensor | None  # [len(probs_rows), k, vocab_limit] float16 q weights
    probs_rows: tuple[int, ...]  # the batch row of each probs row (the sampled rows)
    probs_at: torch.Tensor  # [len(probs_rows)] int64 the same rows, on the draft's device
    top_ids: torch.Tensor | None  # [batch, k, top_m] int64
    top_p: torch.Tensor | None  # [batch, k, top_m] float32 raw probabilities
    first_feed: list[list[int]]  # per row: tokens fed at step 0 (the unfed committed ones)
    history: dict[int, list[int]]  # rows with history-dependent processing: drafts so far
    steps: int = 0  # draft steps run so far


def _with_draft_history(logits: torch.Tensor, run: _Drafting) -> torch.Tensor:
    """``logits`` (``[batch, vocab_limit]``) with penalties and min_tokens applied on the
    rows that have them, given each row's output and its drafts so far (a float32 copy;
    the other rows unchanged)."""
    logits = logits.float().clone()
    for r in run.history:
        s = run.seqs[r]
        logits[r] = apply_history(
            logits[r : r + 1],
            run.params[r],
            s.prompt_token_ids,
            [*s.output_token_ids, *run.history[r]],
        )[0]
    return logits
