"""Sequence-level distillation data: the target's own continuations and its argmax labels.

Production teams fine-tune drafts on what the target actually says (its traffic); here the
target continues random windows of the training corpus, half greedily and half at T=0.7,
and every position (prompt and continuation) is labelled with the target's argmax. A draft
trained to predict those labels agrees with the target far more often than one trained on
raw text (measured: greedy acceptance 0.35-0.41 raw vs 0.77-0.84 distilled).
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams, probs_for, sample


def generate_distillation_set(
    runner: ModelRunner,
    prompts: torch.Tensor,
    new_tokens: int,
    batch: int,
    seed: int,
    desc: str = "distill",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Continue each prompt row; returns (inputs, labels), both [rows, prompt + new - 1].

    prompts: [rows, prompt_len] int. Row i is greedy when i is even, T=0.7 when odd.
    labels[:, j] is the target's argmax after inputs[:, : j + 1].
    """
    torch.manual_seed(seed)
    rows = prompts.shape[0]
    out_inputs, out_labels = [], []
    params = [
        SamplingParams(temperature=0.0 if i % 2 == 0 else 0.7, max_tokens=new_tokens)
        for i in range(batch)
    ]
    for start in tqdm(range(0, rows, batch), desc=desc, unit="batch"):
        chunk = prompts[start : start + batch].long()
        n = chunk.shape[0]
        ids = [f"d{start + i}" for i in range(n)]
        for sid in ids:
            runner.add(sid)
        logits = runner.forward(ids, chunk.tolist())  # n x [plen, vocab]
        labels = [lg.argmax(-1) for lg in logits]  # n x [plen]
        seqs = [row.tolist() for row in chunk]
        last = torch.stack([lg[-1] for lg in logits])  # [n, vocab]
        for step in range(new_tokens):
            tokens = sample(probs_for(params[:n], last), [None] * n)
            for i in range(n):
                seqs[i].append(int(tokens[i]))
            if step == new_tokens - 1:
                break
            step_logits = runner.forward(ids, [[int(t)] for t in tokens])
            last = torch.stack([lg[-1] for lg in step_logits])
            for i in range(n):
                labels[i] = torch.cat([labels[i], last[i].argmax(-1, keepdim=True)])
        for sid in ids:
            runner.free(sid)
        seq_t = torch.tensor(seqs, dtype=torch.int32)  # [n, plen + new]
        lab_t = torch.stack(labels).to(torch.int32)  # [n, plen + new - 1]
        out_inputs.append(seq_t[:, :-1])
        out_labels.append(lab_t)
    return torch.cat(out_inputs), torch.cat(out_labels)
