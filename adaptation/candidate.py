"""One adaptation run, start to verdict: a candidate draft trained on a domain's retained
requests and judged on requests it never saw.

Pure torch and transformers (no Ray): the adaptation deployment runs :func:`run` as a Ray
task with the trainer's own resources, and the tests call it directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from adaptation.adapters import adapter_update, with_adapters
from adaptation.config import TrainerConfig
from adaptation.distill import DistillSettings, TrainingRow, distill, training_rows
from adaptation.retention import RetainedRequest
from adaptation.validation import Verdict, agreement, judge, split_held_back
from specdec.low_rank import LowRankUpdate

MAX_ROW_TOKENS = 256  # tokens per training row (the prompt's tail, then the output)


@dataclass(frozen=True, slots=True)
class DraftSource:
    """Where the draft's base weights come from (the engine's draft model spec)."""

    model: str  # Hugging Face directory or hub id
    dtype: str  # "float32" | "bfloat16" | "float16": what the draft serves in
    trust_remote_code: bool = False


@dataclass
class RunResult:
    """What one run did: the verdict, the scores it rests on, and (if deployed) the
    weights, in the draft's serving dtype."""

    domain: str
    verdict: Verdict
    before: dict[str, float]  # agreement per domain on held-back requests, current draft
    after: dict[str, float]  # the same for the candidate
    train: dict  # adaptation.distill.DistillReport as a dict
    train_requests: int
    held_back_requests: int
    seconds: float
    weights: dict[str, torch.Tensor] | None  # only when deployed
    # a run with adapters, deployed: the same weights as factors over base_version
    update: LowRankUpdate | None = None
    pacing: dict | None = None  # adaptation.pacing.ServingPace.report() (None: not paced)

    def summary(self) -> dict:
        """Everything but the weights (for logs, the handle and metrics)."""
        out = {k: v for k, v in vars(self).items() if k not in ("weights", "update")}
        out["verdict"] = asdict(self.verdict)
        out["adapters"] = (
            None
            if self.update is None
            else {
                "tensors": len(self.update.factors),
                "megabytes": round(self.update.nbytes() / 2**20, 3),
            }
        )
        return out


def load_draft(source: DraftSource, weights: Mapping[str, torch.Tensor] | None):
    """The draft model in float32 on the host (training precision), with ``weights`` (the
    version served now) over the base checkpoint when given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        source.model, dtype=torch.float32, trust_remote_code=source.trust_remote_code
    )
    if weights is not None:
        model.load_state_dict({k: v.float() for k, v in weights.items()})
    return model.eval()


def run(
    source: DraftSource,
    current: Mapping[str, torch.Tensor] | None,
    domain: str,
    records: Mapping[str, Sequence[RetainedRequest]],
    config: TrainerConfig,
    log: Callable[[str], None] | None = None,
    base_version: int = 0,
    pace: Callable[[float], None] | None = None,
) -> RunResult:
    """Train a candidate for ``domain`` from ``records`` (every domain's retained
    requests) and judge it; see the module docstring. ``current`` are the weights of
    draft version ``base_version`` (None: the checkpoint's); ``pace``: called after every
    optimizer step (see :func:`adaptation.distill.distill`)."""
    t0 = time.monotonic()
    train, held = _split(records, config.held_back_fraction)
    if len(train.get(domain, ())) < 1 or not held.get(domain):
        raise ValueError(f"not enough retained requests of domain {domain!r} to train")
    model = load_draft(source, current)
    before = {d: agreement(model, rows) for d, rows in held.items()}
    adapters = sum(p.numel() for p in model.parameters()) >= config.adapter_min_params
    if adapters:
        model = with_adapters(model, config.lora_rank, config.lora_alpha)
    replay = [row for d, rows in train.items() if d != domain for row in rows]
    settings = DistillSettings(
        steps=config.steps,
        max_seconds=config.max_seconds,
        batch_size=config.batch_size,
        lr=config.lr,
        replay_fraction=config.replay_fraction,
        max_len=MAX_ROW_TOKENS,
    )
    report = distill(model, train[domain], replay, settings, log=log, pace=pace)
    after = {d: agreement(model, rows) for d, rows in held.items()}
    verdict = judge(before, after, domain, config.min_gain, config.max_loss)
    dtype = getattr(torch, source.dtype)
    weights = update = None
    if verdict.deploy and adapters:
        update, weights = adapter_update(model, base_version, dtype)
    elif verdict.deploy:
        weights = {k: v.detach().to(dtype).clone() for k, v in model.state_dict().items()}
    return RunResult(
        domain=domain,
        verdict=verdict,
        before=before,
        after=after,
        train=asdict(report),
        train_requests=len(train[domain]),
        held_back_requests=len(held[domain]),
        seconds=round(time.monotonic() - t0, 2),
        weights=weights,
        update=update,
    )


def _split(
    records: Mapping[str, Sequence[RetainedRequest]], fraction: float
) -> tuple[dict[str, list[TrainingRow]], dict[str, list[TrainingRow]]]:
    """Per domain, ``(training rows, held-back rows)``; domains with one request only
    train (nothing to score them on)."""
    train, held = {}, {}
    for domain, recs in records.items():
        rows = training_rows(recs, MAX_ROW_TOKENS)
        train[domain], back = split_held_back(rows, fraction)
        if back:
            held[domain] = back
    return train, held
