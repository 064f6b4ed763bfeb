"""Reference decode loops: target-only and speculative, one request, one process.

These are deliberately short (gpt-fast style) because every other path in SpecServe,
including the distributed engine, is checked against them. Both loops keep the target's
KV cache one token behind the committed tokens: the newest token is fed as the first
input of the next pass, so a plain decode step is a verify step with zero drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.penalties import apply_history
from specdec.proposers import Proposer
from specdec.qcodec import dequantize_q
from specdec.rejection import rejection_sample
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams, probs_for, sample
from specdec.sequence import SequenceState


@dataclass
class RoundStats:
    """One verification round of one sequence."""

    num_draft_tokens: int
    num_accepted: int
    bonus: bool  # all drafts accepted; the extra token came from p_{k+1}

    @property
    def accepted_per_position(self) -> list[int]:
        """1 for each draft position that was accepted, 0 after the first rejection."""
        return [1] * self.num_accepted + [0] * (self.num_draft_tokens - self.num_accepted)


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    rounds: list[RoundStats] = field(default_factory=list)

    @property
    def num_drafted(self) -> int:
        return sum(r.num_draft_tokens for r in self.rounds)

    @property
    def num_accepted(self) -> int:
        return sum(r.num_accepted for r in self.rounds)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (biased low as an α estimate; see speedup.estimate_alpha)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verification round, counting the recovered/bonus token."""
        return (self.num_accepted + len(self.rounds)) / len(self.rounds) if self.rounds else 0.0


def _start(runner: ModelRunner, seq: SequenceState, eos: int | None) -> None:
    """Prefill the prompt and commit the first token, sampled from the target alone."""
    logits = runner.prefill([seq.seq_id], [seq.prompt_token_ids])  # [1, vocab]
    logits = apply_history(logits, seq.params, seq.prompt_token_ids, ())
    first = sample(probs_for([seq.params], logits), [seq.verify_generator_at(len(seq.token_ids))])
    seq.append([int(first[0])], eos)


def _free(runner: ModelRunner, seq_id: str) -> None:
    if seq_id in runner.seq_ids:
        runner.free(seq_id)


def generate_autoregressive(
    target: ModelRunner,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    eos_token_id: int | None = None,
    seq_id: str = "ar",
) -> GenerationResult:
    """Plain decoding with the target: one forward pass per token."""
    params = params.with_stops(eos_token_id)
    seq = SequenceState(seq_id, list(prompt_token_ids), params, device=target.device)
    try:
        _start(target, seq, eos_token_id)
        while not seq.finished:
            logits = target.forward([seq_id], [[seq.last_token_id]])[0]  # [1, vocab]
            logits = apply_history(logits, params, seq.prompt_token_ids, seq.output_token_ids)
            gen = seq.verify_generator_at(len(seq.token_ids))
            token = sample(probs_for([params], logits), [gen])
            seq.append([int(token[0])], eos_token_id)
    finally:  # a failed call leaves nothing behind: the same seq_id works next time
        _free(target, seq_id)
    return GenerationResult(seq.output_token_ids, seq.finish_reason or "length")


def generate_speculative(
    target: ModelRunner,
    proposer: Proposer,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    num_speculative_tokens: int,
    eos_token_id: int | None = None,
    seq_id: str = "sd",
) -> GenerationResult:
    """Speculative decoding: propose k, verify k + 1 positions in one pass, keep a prefix."""
    params = params.with_stops(eos_token_id)
    seq = SequenceState(seq_id, list(prompt_token_ids), params, device=target.device)
    rounds: list[RoundStats] = []
    try:
        _start(target, seq, eos_token_id)
        while not seq.finished:
            # Never draft past max_tokens: those tokens could not be committed anyway.
            k = max(
                0, min(num_speculative_tokens, params.max_tokens - len(seq.output_token_ids) - 1)
            )
            proposal = proposer.propose([seq], k)
            n = int(proposal.num_draft_tokens[0])
            drafts = proposal.draft_token_ids[0, :n].tolist()
            cached = target.length(seq_id)
            logits = target.forward([seq_id], [[seq.last_token_id, *drafts]])[0]  # [n + 1, vocab]
            # Position j given the output and drafts 0..j-1 (specdec.penalties).
            logits = apply_history(
                logits, params, seq.prompt_token_ids, seq.output_token_ids, drafts
            )
            p = probs_for([params], logits[None])  # [1, n + 1, vocab]
            q = proposal.q(0) if proposal.kind == "probs" else None  # [k, draft vocab] or None
            q = None if q is None else dequantize_q(q[None, :n])  # [1, n, draft vocab] float32
            if q is not None and q.shape[-1] < logits.shape[-1]:  # a draft over fewer ids
                q = torch.nn.functional.pad(q, (0, logits.shape[-1] - q.shape[-1]))
            if q is None and proposal.kind == "probs":  # greedy: q is the point mass at each draft
                q = torch.nn.functional.one_hot(proposal.draft_token_ids[:, :n], logits.shape[-1])
                q = q.float()
            out = rejection_sample(
                proposal.draft_token_ids[:, :n],
                proposal.num_draft_tokens,
                p,
                q,
                torch.tensor([params.is_greedy], device=logits.device),
                [seq.verify_generator_at(len(seq.token_ids))],
                proposal.kind,
            )
            a = int(out.num_accepted[0])
            rounds.append(RoundStats(n, a, bool(out.bonus[0])))
            proposer.observe([seq], [a])
            seq.append(out.tokens(0), eos_token_id)
            # Keep KV of the fed token plus the accepted drafts; drop the rejected suffix.
            target.rollback(seq_id, cached + 1 + a)
    finally:
        _free(target, seq_id)
        proposer.free(seq_id)
    return GenerationResult(seq.output_token_ids, seq.finish_reason or "length", rounds)
