"""A small, resumable causal-LM training loop for the demo models (CPU, bf16 autocast or fp32).

Why our own loop instead of ``transformers.Trainer``: the recipe needs a hard CPU-time
budget per stage, checkpoints that resume mid-stage after a killed session, and two data
sources (raw text windows and distillation sequences with the target's labels); the
loop that does exactly that is short.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

# A batch source draws (input_ids [batch, seq], labels [batch, seq]) from a generator, and
# optionally a third tensor, negative [batch] bool: rows whose labels are to be *unlearned*.
BatchFn = Callable[[torch.Generator], tuple[torch.Tensor, ...]]


@dataclass
class TrainConfig:
    steps: int
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    cpu_budget_s: float = 600.0  # the stage stops early (and says so) past this
    checkpoint_every: int = 100
    seed: int = 0
    # bf16 autocast; off trains in fp32, which is ~12x faster on CPUs without native bf16
    # (no AVX512-BF16/AMX) and costs a model this small nothing
    bf16_autocast: bool = True
    # weight of the unlikelihood loss -log(1 - p(label)) on negative rows (see BatchFn)
    unlikelihood_weight: float = 1.0


def text_windows(tokens: torch.Tensor, batch: int, seq: int) -> BatchFn:
    """Random windows of a token stream; labels are the next tokens."""

    def draw(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=gen)
        idx = starts[:, None] + torch.arange(seq + 1)[None]
        chunk = tokens[idx].long()
        return chunk[:, :-1], chunk[:, 1:]

    return draw


def distill_rows(inputs: torch.Tensor, labels: torch.Tensor, batch: int) -> BatchFn:
    """Random rows of a distillation set: labels are the target's argmax at each position."""

    def draw(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randint(0, inputs.shape[0], (batch,), generator=gen)
        return inputs[rows].long(), labels[rows].long()

    return draw


def distill_rows_with_negatives(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    neg_inputs: torch.Tensor,
    neg_labels: torch.Tensor,
    batch: int,
    neg_rows: int,
) -> BatchFn:
    """Like ``distill_rows``, plus ``neg_rows`` rows per batch of a set to unlearn."""

    def draw(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos = torch.randint(0, inputs.shape[0], (batch - neg_rows,), generator=gen)
        neg = torch.randint(0, neg_inputs.shape[0], (neg_rows,), generator=gen)
        negative = torch.arange(batch) >= batch - neg_rows
        x = torch.cat([inputs[pos], neg_inputs[neg]]).long()
        y = torch.cat([labels[pos], neg_labels[neg]]).long()
        return x, y, negative

    return draw


def _loss(logits: torch.Tensor, labels: torch.Tensor, negative, weight: float):
    """(loss to minimise, cross-entropy of the positive rows to report)."""
    logits = logits.float()
    if negative is None:
        ce = torch.nn.functional.cross_entropy(
            logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
        )
        return ce, ce
    pos = ~negative
    ce = torch.nn.functional.cross_entropy(
        logits[pos].view(-1, logits.shape[-1]), labels[pos].reshape(-1), ignore_index=-100
    )
    neg_logits, neg_labels = logits[negative], labels[negative]
    keep = neg_labels != -100
    p = neg_logits.softmax(-1).gather(-1, neg_labels.clamp(min=0)[..., None])[..., 0]
    unlikely = -torch.log1p(-p.clamp(max=1 - 1e-6))[keep].mean()
    return ce + weight * unlikely, ce


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    )


def train(
    model: torch.nn.Module, batches: BatchFn, cfg: TrainConfig, checkpoint: Path, desc: str
) -> dict:
    """Train ``model`` in place; resumes from ``checkpoint`` if it exists. Returns stats."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    step, cpu_used, losses = 0, 0.0, []
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        step, cpu_used, losses = state["step"], state["cpu_used"], state["losses"]

    def save() -> None:
        tmp = checkpoint.with_suffix(".tmp")
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "generator": gen.get_state(),
                "step": step,
                "cpu_used": cpu_used,
                "losses": losses,
            },
            tmp,
        )
        tmp.replace(checkpoint)  # atomic: a kill mid-save keeps the previous checkpoint

    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, unit="step", mininterval=5)
    tokens_seen = 0
    wall0 = time.perf_counter()
    while step < cfg.steps and cpu_used < cfg.cpu_budget_s:
        t0 = time.process_time()
        inputs, labels, *rest = batches(gen)
        negative = rest[0] if rest else None
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            logits = model(input_ids=inputs).logits
        loss, ce = _loss(logits, labels, negative, cfg.unlikelihood_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        tokens_seen += inputs.numel()
        losses.append(round(ce.item(), 4))
        cpu_used += time.process_time() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}", cpu=f"{cpu_used:.0f}s")
        if step % cfg.checkpoint_every == 0:
            save()
    bar.close()
    save()
    model.eval()
    tail = losses[-100:] or [float("nan")]
    return {
        "steps": step,
        "planned_steps": cfg.steps,
        "stopped_by_budget": step < cfg.steps,
        "cpu_seconds": round(cpu_used, 1),
        "final_loss": round(sum(tail) / len(tail), 4),
        "tokens_per_wall_second_this_run": round(
            tokens_seen / max(1e-9, time.perf_counter() - wall0)
        ),
    }
