"""Sampling parameters and the logits -> probabilities transform that is verified.

Speculative decoding is exact only if the target distribution ``p`` and the draft
distribution ``q`` go through the *same* transform (temperature, top-k, top-p) before
the rejection sampler compares them (docs/architecture.md, "Formulas"). Everything that
samples in SpecServe calls :func:`logits_to_probs` so the two sides cannot drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import torch

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows, and a
# distribution that sharp is a point mass at the argmax for every practical purpose.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (OpenAI's limit)
# Below this, dividing a logit by the repetition penalty can overflow float32 to inf.
MIN_REPETITION_PENALTY = 0.01


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated on construction.

    Mirrors the OpenAI / vLLM fields so the HTTP layer can pass them through unchanged.
    ``temperature == 0`` means greedy decoding; ``top_k <= 0`` and ``top_p == 1`` disable
    those filters. ``seed`` makes a request reproducible: every random draw of the request
    (draft sampling, acceptance tests, recovered and bonus tokens) comes from generators
    seeded from it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # report the sampled token's logprob and this many top ones
    # Log-probabilities of the prompt's tokens (each given those before it) with this many
    # top ones, returned with the first output (echo + logprobs: scoring, as lm-eval asks).
    prompt_logprobs: int | None = None
    # History-dependent processing (specdec.penalties), applied to raw logits before the
    # transform above, on the target and the draft alike.
    repetition_penalty: float = 1.0  # in [MIN_REPETITION_PENALTY, 2]; 1 disables
    frequency_penalty: float = 0.0  # in [-2, 2]
    presence_penalty: float = 0.0  # in [-2, 2]
    min_tokens: int = 0  # no stop token before this many output tokens
    # What min_tokens bans: EOS ids (unless ignore_eos) and stop_token_ids. Filled in by
    # the engine core, which knows the model's EOS ids, so every worker bans the same ids.
    all_stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        self._normalise_stops()
        errors = [
            *self._sampling_errors(),
            *self._output_errors(),
            *self._penalty_errors(),
            *self._stop_errors(),
        ]
        if errors:
            raise ValueError("; ".join(errors))

    def _normalise_stops(self) -> None:
        """Stops as tuples (hashable, as a frozen dataclass needs), ids as ints; a single
        string or any sequence is accepted for ``stop``, as the OpenAI API does."""
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(
            self, "all_stop_token_ids", tuple(int(t) for t in self.all_stop_token_ids)
        )

    def _sampling_errors(self) -> list[str]:
        """What is wrong with the transform's settings and the seed (all of it, at once)."""
        errors = []
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature):
            errors.append(f"temperature must be a finite number, got {self.temperature!r}")
        elif self.temperature < 0:
            errors.append(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k):
            errors.append(f"top_k must be an integer (-1 or 0 disables it), got {self.top_k!r}")
        elif self.top_k < -1:
            errors.append(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            errors.append(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}")
        return errors

    def _output_errors(self) -> list[str]:
        """What is wrong with the output's length and the logprobs asked for."""
        errors = []
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            errors.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            errors.append(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            errors.append(
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                f"got {self.prompt_logprobs!r}"
            )
        return errors

    def _penalty_errors(self) -> list[str]:
        """What is wrong with the history-dependent penalties (finite, within the ranges
        where dividing or subtracting logits cannot overflow)."""
        errors = []
        rp = self.repetition_penalty
        if not isinstance(rp, int | float) or not (
            math.isfinite(rp) and MIN_REPETITION_PENALTY <= rp <= 2
        ):
            errors.append(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 2], got {rp!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not (math.isfinite(v) and -2 <= v <= 2):
                errors.append(f"{name} must be in [-2, 2], got {v!r}")
        return errors

    def _stop_errors(self) -> list[str]:
        """What is wrong with min_tokens and the stop strings."""
        errors = []
        if not _is_int(self.min_tokens) or not self.min_tokens >= 0:
            errors.append(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        elif isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens:
            errors.append(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            errors.append("stop must be a non-empty string or a list of non-empty strings")
        return errors

    def with_stops(self, eos_token_ids: Collection[int] | int | None) -> SamplingParams:
        """These params with :attr:`all_stop_token_ids` filled from the model's EOS ids."""
        eos = () if eos_token_ids is None else eos_token_ids
        eos = (eos,) if isinstance(eos, int) else tuple(sorted(eos))
        ids = (() if self.ignore_eos else eos) + self.stop_token_ids
        return replace(self, all_stop_token_ids=tuple(dict.fromkeys(ids)))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def make_generator(self, device: torch.device | str = "cpu", offset: int = 0):
        """A generator for this request, or None (global RNG) when no seed was given.

        ``offset`` separates independent streams of one request (e.g. the draft's
        sampling and the verifier's acceptance tests) so that they do not share draws.
        """
        if self.seed is None:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed * 1_000_003 + offset) % (2**63 - 1))
        return gen


def _is_int(value: object) -> bool:
    """An int that is not a bool (True is an int to Python, not to an API client)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _as_column(values: Sequence[float] | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.float32, device=like.device)
    # [batch] -> [batch, 1, ..., 1] so it broadcasts over positions and vocab.
    return t.view(-1, *([1] * (like.dim() - 1)))


def logits_to_probs(
    logits: torch.Tensor,
    temperature: Sequence[float] | torch.Tensor,
    top_k: Sequence[int] | torch.Tensor | None = None,
    top_p: Sequence[float] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Turn raw logits into the distribution that is sampled and verified.

    logits:      [batch, ..., vocab] (any number of position dims)
    temperature: [batch]; rows with temperature 0 become a one-hot at the argmax
    top_k:       [batch] or None; <= 0 disables
    top_p:       [batch] or None; 1.0 disables
    returns:     [batch, ..., vocab] float32 probabilities

    Order follows vLLM and HF: temperature, then top-k, then top-p (nucleus over the
    temperature-scaled distribution). Ties at the k-th value are all kept, so the result
    does not depend on sort stability.
    """
    logits = logits.float()
    temp = _as_column(temperature, logits)
    greedy = temp < GREEDY_EPS
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)

    vocab = logits.shape[-1]
    # Each transform runs only when some row asks for it (decided on the host).
    if top_k is not None and _any(top_k, lambda v: 0 < v < vocab, lambda t: (t > 0) & (t < vocab)):
        k = torch.as_tensor(top_k, device=logits.device).view(-1, *([1] * (logits.dim() - 1)))
        k_eff = torch.where(k <= 0, torch.full_like(k, vocab), k.clamp(max=vocab))
        sorted_desc = scaled.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(-1, (k_eff - 1).expand(*scaled.shape[:-1], 1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))

    probs = torch.softmax(scaled, dim=-1)

    if top_p is not None and _any(top_p, lambda v: v < 1, lambda t: t < 1):
        p = _as_column(top_p, logits)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Mass strictly before each token; a token is kept while that mass is < top_p,
        # so the smallest set whose mass reaches top_p survives (always >= 1 token).
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = before >= p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)

    if _any(temperature, lambda v: v < GREEDY_EPS, lambda t: t < GREEDY_EPS):
        one_hot = torch.zeros_like(probs).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs


def _any(values: Sequence | torch.Tensor, test, tensor_test) -> bool:
    """Whether any row's setting passes ``test``: decided from the host's values when
    they are a sequence (the usual case: no read of the device), else from the tensor."""
    if isinstance(values, torch.Tensor):
        return bool(tensor_test(values).any())
    return any(test(v) for v in values)


def probs_for(params: Sequence[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
    """:func:`logits_to_probs` with per-row settings taken from ``params`` ([batch])."""
    return logits_to_probs(
        logits,
        [sp.temperature for sp in params],
        [sp.top_k for sp in params],
        [sp.top_p for sp in params],
    )


def sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row; each row uses its own generator (None: global RNG).

    probs: [batch, vocab] -> returns [batch] int64
    """
    seeded = [i for i, gen in enumerate(generators) if gen is not None]
    if len(seeded) < len(generators):  # the unseeded rows in one draw from the global RNG
        out = torch.multinomial(probs, 1)[:, 0]
    else:
        out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for i in seeded:
        out[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    return out
