"""Per-request state shared by the reference loops and the serving engine."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from specdec.sampling import SamplingParams

# Generator stream offsets: the draft's sampling and the verifier's draws of one seeded
# request must not share random numbers (that would correlate q-samples with u).
DRAFT_STREAM = 1
VERIFY_STREAM = 2


@dataclass
class SequenceState:
    """A request being generated: its committed tokens and its random streams.

    Committed tokens are final (already verified); the draft may hold more in its cache,
    which is why proposers re-synchronise against :attr:`token_ids`.
    """

    seq_id: Hashable
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    verify_generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if self.verify_generator is None:
            self.verify_generator = self.params.make_generator(offset=VERIFY_STREAM)

    def draft_generator_at(self, position: int) -> torch.Generator | None:
        """The generator for drafting the token at absolute index ``position`` (None: global RNG).

        Seeding each drafted position separately makes a seeded request reproducible
        however its drafts were produced (fresh, or prepared ahead in a speculation-cache
        branch): a draft at a position is a function of its prefix and the seed only. It
        stays exact: a position is re-drafted only after the earlier draft there went
        unverified, so no verified draft ever reuses randomness that influenced anything.
        """
        if self.params.seed is None:
            return None
        return self.params.make_generator(offset=DRAFT_STREAM + 16 * (position + 1))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The newest committed token, without building the whole token list."""
        return (self.output_token_ids or self.prompt_token_ids)[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, tokens: list[int], eos_token_id: int | None) -> int:
        """Commit tokens one at a time until a stop condition; returns how many were kept.

        Stop strings need a tokenizer and are checked by the serving layer; here we stop
        on ``max_tokens``, EOS (unless ``ignore_eos``) and ``stop_token_ids``.
        """
        kept = 0
        for tok in tokens:
            if self.finished:
                break
            self.output_token_ids.append(int(tok))
            kept += 1
            if (
                eos_token_id is not None and tok == eos_token_id and not self.params.ignore_eos
            ) or (tok in self.params.stop_token_ids):
                self.finish_reason = "stop"
            elif len(self.output_token_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
        return kept
