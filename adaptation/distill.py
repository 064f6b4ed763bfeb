"""Sequence-level distillation of a draft on retained requests.

Why this needs no target pass: a retained request's output tokens are what the target
committed, i.e. samples of the target's own distribution (its argmax where the request was
greedy). Training the draft to predict them, given the request's prompt and the output so
far, is sequence-level knowledge distillation: the draft learns to say what the target
says on this traffic. Only output positions carry a loss: the prompt is the client's text,
which the draft never has to guess.

Why replay: a draft tuned on one domain alone forgets the others (the drift scenario is a
draft that learnt Python and lost prose; tuning it on prose alone would lose Python).
Each batch mixes rows of the drifted domain with rows retained from the other domains.

Token-level distillation (``teacher``, ``DistillSettings.teacher_top_k``): the target's
own next-token distribution at each output position, cut to its ``top_k`` likeliest
tokens and renormalised, replaces the one committed token as the label (the loss is the
cross-entropy of the draft against it). It carries what the target thought of the tokens
it did not commit, which a draft's acceptance depends on at temperature > 0, at the cost
of a target pass per training row. ``bench.distill --token-level`` measures it against
sequence-level on the demo pair.

Pure torch (no Ray): the trainer deployment runs it on a copy of the draft's weights.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from adaptation.retention import RetainedRequest

IGNORE = -100  # a label cross-entropy skips


@dataclass(frozen=True, slots=True)
class DistillSettings:
    """How long and how hard one adaptation run trains."""

    steps: int = 300  # optimizer steps at most
    max_seconds: float = 300.0  # wall seconds at most (the run stops early, and says so)
    batch_size: int = 16  # rows per step
    max_len: int = 256  # tokens per row: the prompt's tail, then the output
    lr: float = 5e-4  # peak learning rate (AdamW), after a 10 % warm-up, cosine to 10 %
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    replay_fraction: float = 0.5  # of each batch from the other domains, when there are any
    seed: int = 0
    log_every: int = 25  # steps between progress reports
    teacher_top_k: int = 16  # token-level: the teacher's likeliest tokens kept per position


@dataclass(frozen=True, slots=True)
class TrainingRow:
    """One request as a training row: ``token_ids`` [n] with a loss on positions
    ``[output_start, n)`` (each predicted from the tokens before it)."""

    token_ids: tuple[int, ...]
    output_start: int  # index of the first output token in token_ids (>= 1)


@dataclass(frozen=True, slots=True)
class DistillReport:
    steps: int
    seconds: float
    tokens: int  # output tokens trained on (with repeats)
    first_loss: float  # mean cross-entropy of the first log_every steps [nats/token]
    last_loss: float  # of the last log_every steps
    stopped_by_time: bool


def training_rows(records: Sequence[RetainedRequest], max_len: int) -> list[TrainingRow]:
    """Each record with an output, cut to ``max_len`` tokens: as much of the output as fits
    (at most ``max_len - 1`` tokens), after as much of the prompt's tail as is left."""
    rows = []
    for r in records:
        if not r.output_token_ids or not r.prompt_token_ids:
            continue
        output = r.output_token_ids[: max_len - 1]
        prompt = r.prompt_token_ids[-(max_len - len(output)) :]
        rows.append(TrainingRow(prompt + output, len(prompt)))
    return rows


def collate(
    rows: Sequence[TrainingRow], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)``, each ``[batch, longest]`` int64, right-padded;
    ``labels[b, j]`` is the token after position j where that token is an output token,
    else IGNORE."""
    longest = max(len(r.token_ids) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    labels = torch.full((len(rows), longest), IGNORE, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r.token_ids)
        ids[b, :n] = torch.tensor(r.token_ids)
        mask[b, :n] = 1
        # position j predicts token j + 1: the outputs are predicted from output_start - 1
        labels[b, r.output_start - 1 : n - 1] = torch.tensor(r.token_ids[r.output_start :])
    return ids.to(device), mask.to(device), labels.to(device)


@torch.enable_grad()  # whatever the caller's setting (serving code turns gradients off)
def distill(
    model: torch.nn.Module,
    domain_rows: Sequence[TrainingRow],
    replay_rows: Sequence[TrainingRow],
    settings: DistillSettings,
    pad_id: int = 0,
    log: Callable[[str], None] | None = None,
    pace: Callable[[float], None] | None = None,
    teacher: torch.nn.Module | None = None,
) -> DistillReport:
    """Train ``model`` in place on ``domain_rows``, mixed with ``replay_rows``; returns
    what the run did. The model stays on its device and dtype (train a float32 copy).
    ``pace(step_seconds)`` is called after every step (it may pause the run there: the
    cost to serving, adaptation/pacing.py); ``max_seconds`` counts its pauses. With a
    ``teacher`` (the target, on the model's device) the labels are its top-k
    distributions (token-level), else the committed tokens (sequence-level)."""
    if not domain_rows:
        raise ValueError("no training rows for the domain")
    device = next(model.parameters()).device
    trained = [p for p in model.parameters() if p.requires_grad]  # (adapters: theirs only)
    opt = torch.optim.AdamW(
        trained, lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.95)
    )
    gen = random.Random(settings.seed)
    n_replay = round(settings.batch_size * settings.replay_fraction) if replay_rows else 0
    n_replay = min(n_replay, settings.batch_size - 1)  # every batch trains the domain
    losses: list[float] = []
    tokens, start = 0, time.monotonic()
    model.train()
    step = 0
    try:
        while step < settings.steps and time.monotonic() - start < settings.max_seconds:
            t_step = time.monotonic()
            batch = gen.choices(domain_rows, k=settings.batch_size - n_replay)
            batch += gen.choices(replay_rows, k=n_replay) if n_replay else []
            ids, mask, labels = collate(batch, pad_id, device)
            for group in opt.param_groups:
                group["lr"] = _lr(settings, step)
            logits = model(input_ids=ids, attention_mask=mask).logits  # [b, n, vocab]
            if teacher is None:
                loss = torch.nn.functional.cross_entropy(
                    logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE
                )
            else:
                loss = _token_level_loss(logits, teacher, ids, mask, labels, settings)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, settings.grad_clip)
            opt.step()
            step += 1
            tokens += int((labels != IGNORE).sum())
            losses.append(loss.item())
            if log is not None and step % settings.log_every == 0:
                recent = losses[-settings.log_every :]
                log(f"step {step}/{settings.steps}: loss {sum(recent) / len(recent):.3f}")
            if pace is not None:
                pace(time.monotonic() - t_step)
    finally:
        model.eval()
    window = max(1, min(settings.log_every, len(losses)))
    return DistillReport(
        steps=step,
        seconds=round(time.monotonic() - start, 2),
        tokens=tokens,
        first_loss=sum(losses[:window]) / window if losses else math.nan,
        last_loss=sum(losses[-window:]) / window if losses else math.nan,
        stopped_by_time=step < settings.steps,
    )


def _token_level_loss(logits, teacher, ids, mask, labels, settings) -> torch.Tensor:
    """Cross-entropy of the draft's ``logits`` [b, n, vocab] against the teacher's top-k
    distribution at each labelled (output) position [nats/position]."""
    keep = labels != IGNORE  # [b, n]
    with torch.no_grad():
        t_logits = teacher(input_ids=ids, attention_mask=mask).logits[keep].float()  # [m, V]
        width = min(settings.teacher_top_k, t_logits.shape[-1], logits.shape[-1])
        top, index = t_logits.topk(width, dim=-1)  # [m, width]
        weights = torch.softmax(top, dim=-1)  # renormalised over the kept tokens
        inside = index < logits.shape[-1]  # ids the draft's vocabulary has (padding differs)
        weights = weights * inside
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-12)
        index = torch.where(inside, index, 0)
    log_q = torch.log_softmax(logits[keep].float(), dim=-1)  # [m, vocab]
    return -(weights * log_q.gather(1, index)).sum(-1).mean()


def _lr(settings: DistillSettings, step: int) -> float:
    """Linear warm-up over the first 10 % of steps, then cosine down to 10 % of the peak."""
    warmup = max(1, settings.steps // 10)
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, settings.steps - warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
