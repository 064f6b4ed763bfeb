"""Per-request state shared by the reference loops and the serving engine."""

from __future__ import annotations

from collections.abc import Collection, Hashable
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
    which is why proposers re-synchronise against :attr:`token_ids`. Generators live on
    ``device``, the device of the tensors they draw for (a CUDA tensor needs a CUDA
    generator).
    """

    seq_id: Hashable
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")

    def verify_generator_at(self, position: int, device=None) -> torch.Generator | None:
        """The generator of the round that starts with ``position`` committed tokens.

        Seeding each round by its position (instead of one stream per request) makes a
        seeded request resumable: a replacement engine that restarts the request from its
        committed tokens draws exactly the numbers the old one would have. Exactness holds
        because committed positions only grow, so no two rounds whose outcome anybody saw
        share a stream (a round lost with a dead engine was never seen).
        """
        if self.params.seed is None:
            return None
        return self.params.make_generator(
            device or self.device, offset=VERIFY_STREAM + 16 * (position + 1)
        )

    def draft_generator_at(self, position: int, device=None) -> torch.Generator | None:
        """The generator for drafting the token at absolute index ``position`` (None: global RNG).

        Seeding each drafted position separately makes a seeded request reproducible
        however its drafts were produced (fresh, or prepared ahead in a speculation-cache
        branch): a draft at a position is a function of its prefix and the seed only. It
        stays exact: a position is re-drafted only after the earlier draft there went
        unverified, so no verified draft ever reuses randomness that influenced anything.
        """
        if self.params.seed is None:
            return None
        return self.params.make_generator(
            device or self.device, offset=DRAFT_STREAM + 16 * (position + 1)
        )

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

    def append(self, tokens: list[int], eos_token_ids: int | Collection[int] | None) -> int:
        """Commit tokens one at a time until a stop condition; returns how many were kept.

        Stop strings need a tokenizer and are checked by the serving layer; here we stop
        on ``max_tokens``, any EOS id (unless ``ignore_eos``; models list several in
        ``generation_config``) and ``stop_token_ids``.
        """
        if eos_token_ids is None:
            eos_token_ids = ()
        elif isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        kept = 0
        for tok in tokens:
            if self.finished:
                break
            self.output_token_ids.append(int(tok))
            kept += 1
            if (tok in eos_token_ids and not self.params.ignore_eos) or (
                tok in self.params.stop_token_ids
            ):
                self.finish_reason = "stop"
            elif len(self.output_token_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
        return kept
