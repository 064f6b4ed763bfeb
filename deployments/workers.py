"""Worker actors: the target (verification) and the draft (proposals + speculation cache).

Workers own models and KV caches; the engine owns scheduling. Calls carry token ids as
Python lists and draft probabilities as float32 numpy arrays (only for sampled requests;
greedy verification needs no ``q``), never logits of the target.
"""

from __future__ import annotations

import os
import time
from collections.abc import Hashable
from typing import Any

import numpy as np
import ray
import torch

from deployments.config import ModelSpec
from specdec.proposers import DraftModelProposer
from specdec.rejection import rejection_sample
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams, probs_for, sample
from specdec.sequence import SequenceState
from specdec.speculation_cache import SpeculativeDrafter


def _device(spec: ModelSpec) -> str:
    if spec.device != "auto":
        return spec.device
    return "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"


def _load(spec: ModelSpec, max_num_seqs: int) -> ModelRunner:
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    return ModelRunner(
        spec.model,
        dtype=spec.dtype,
        device=_device(spec),
        max_num_seqs=max_num_seqs,
        max_model_len=spec.max_model_len,
        trust_remote_code=spec.trust_remote_code,
    )


def _info(runner: ModelRunner) -> dict[str, Any]:
    ctx = ray.get_runtime_context()
    pg = ctx.get_placement_group_id()
    return {
        "node_id": ctx.get_node_id(),
        "placement_group_id": pg,
        "pid": os.getpid(),
        "vocab_size": runner.vocab_size,
        "max_model_len": runner.max_model_len,
        "device": str(runner.device),
    }


class TargetWorker:
    """Prefills requests and verifies drafts with the target model.

    Its KV cache holds every committed token of a sequence except the newest, which is
    the first input of the next verify pass; so plain decoding is verify with no drafts.
    """

    def __init__(self, spec: dict, max_num_seqs: int):
        self.spec = ModelSpec.model_validate(spec)
        self.runner = _load(self.spec, max_num_seqs)
        self.seqs: dict[Hashable, SequenceState] = {}

    def ready(self) -> dict[str, Any]:
        return _info(self.runner)

    def prefill(self, items: list[tuple[Hashable, list[int], dict, bool]]) -> list[int | None]:
        """Start sequences: ``(seq_id, token_ids, sampling params, sample_first)``.

        A new request passes its prompt and ``sample_first=True`` and gets its first token.
        A request resumed after a failure passes all committed tokens and
        ``sample_first=False``: everything but the newest token is cached, nothing sampled.
        """
        ids, feeds, out = [], [], []
        for seq_id, tokens, params, sample_first in items:
            if seq_id in self.seqs:
                self.free([seq_id])
            state = SequenceState(seq_id, list(tokens), SamplingParams(**params))
            self.seqs[seq_id] = state
            self.runner.add(seq_id)
            ids.append(seq_id)
            feeds.append(tokens if sample_first else tokens[:-1])
        to_run = [(i, f) for i, f in zip(ids, feeds, strict=True) if f]
        logits = self.runner.forward([i for i, _ in to_run], [f for _, f in to_run])
        last = {i: lg[-1] for (i, _), lg in zip(to_run, logits, strict=True)}
        for seq_id, _tokens, _params, sample_first in items:
            if not sample_first:
                out.append(None)
                continue
            state = self.seqs[seq_id]
            probs = probs_for([state.params], last[seq_id][None])
            out.append(int(sample(probs, [state.verify_generator])[0]))
        return out

    def verify(
        self, items: list[tuple[Hashable, int, list[int], np.ndarray | None]]
    ) -> tuple[list[tuple[list[int], int]], float]:
        """Verify ``(seq_id, newest committed token, draft tokens, draft q or None)``.

        Returns per sequence the tokens it commits this round and how many drafts were
        accepted (rows with no drafts are plain decode steps in the same batched pass),
        and the seconds this worker computed, so the engine can tell transport from work.
        """
        t0 = time.perf_counter()
        ids = [it[0] for it in items]
        cached = [self.runner.length(i) for i in ids]
        logits = self.runner.forward(ids, [[it[1], *it[2]] for it in items])
        batch, k = len(items), max(len(it[2]) for it in items)
        vocab = self.runner.vocab_size
        target_logits = torch.zeros(batch, k + 1, vocab)
        draft_ids = torch.zeros(batch, k, dtype=torch.long)
        draft_probs = torch.zeros(batch, k, vocab)
        counts = torch.zeros(batch, dtype=torch.long)
        for row, (_sid, _last, drafts, q) in enumerate(items):
            n = len(drafts)
            target_logits[row, : n + 1] = logits[row]
            counts[row] = n
            if n:
                draft_ids[row, :n] = torch.tensor(drafts)
                if q is not None:
                    draft_probs[row, :n] = torch.from_numpy(q)
                else:  # greedy: q is the point mass at the draft's choice
                    draft_probs[row, :n] = torch.nn.functional.one_hot(draft_ids[row, :n], vocab)
        states = [self.seqs[i] for i in ids]
        p = probs_for([s.params for s in states], target_logits)  # [batch, k + 1, vocab]
        out = rejection_sample(
            draft_ids,
            counts,
            p,
            draft_probs,
            torch.tensor([s.params.is_greedy for s in states]),
            [s.verify_generator for s in states],
        )
        results = []
        for row, sid in enumerate(ids):
            a = int(out.num_accepted[row])
            self.runner.rollback(sid, cached[row] + 1 + a)
            results.append((out.tokens(row), a))
        return results, time.perf_counter() - t0

    def free(self, seq_ids: list[Hashable]) -> None:
        for sid in seq_ids:
            if self.seqs.pop(sid, None) is not None:
                self.runner.free(sid)

    def num_seqs(self) -> int:
        return self.runner.num_seqs


class DraftWorker:
    """Proposes drafts and, in overlap mode, drafts ahead while the target verifies.

    Calls are self-contained (each names the sequence's committed tokens and sampling
    params), so a replacement draft needs no state transfer: it rebuilds its cache lazily.
    """

    def __init__(self, spec: dict, max_num_seqs: int, fanout: int, rejections: bool, max_k: int):
        self.spec = ModelSpec.model_validate(spec)
        # Branches of the speculation cache are sequences too.
        capacity = max_num_seqs * (2 + fanout + (max_k if rejections else 0))
        self.runner = _load(self.spec, capacity)
        self.drafter = SpeculativeDrafter(DraftModelProposer(self.runner), fanout, rejections)
        self.seqs: dict[Hashable, SequenceState] = {}

    def ready(self) -> dict[str, Any]:
        return _info(self.runner)

    def _state(self, seq_id: Hashable, tokens: list[int], params: dict) -> SequenceState:
        state = self.seqs.get(seq_id)
        if state is None:
            state = self.seqs[seq_id] = SequenceState(
                seq_id, list(tokens), SamplingParams(**params)
            )
        else:
            state.prompt_token_ids = list(tokens)
        return state

    def propose(
        self, items: list[tuple[Hashable, list[int], dict, int]]
    ) -> tuple[list[tuple[list[int], np.ndarray | None, bool]], float]:
        """``(seq_id, committed tokens, params, k)`` -> ``(drafts, q or None, hit)``.

        ``q`` travels as float32: rounding it would make acceptance tests use a slightly
        different distribution than the one the drafts were sampled from.
        """
        t0 = time.perf_counter()
        states = [self._state(sid, toks, params) for sid, toks, params, _ in items]
        results = self.drafter.propose(states, [it[3] for it in items])
        out = [(r.tokens, None if r.probs is None else r.probs.numpy(), r.hit) for r in results]
        return out, time.perf_counter() - t0

    def speculate(
        self, items: list[tuple[Hashable, int]], fanout: int, rejections: bool
    ) -> tuple[int, float]:
        """Draft ahead for the outcomes of the last proposals; returns (branches, seconds)."""
        t0 = time.perf_counter()
        states = [self.seqs[sid] for sid, _ in items]
        branches = self.drafter.speculate(states, [k for _, k in items], fanout, rejections)
        return branches, time.perf_counter() - t0

    def free(self, seq_ids: list[Hashable]) -> None:
        for sid in seq_ids:
            if self.seqs.pop(sid, None) is not None:
                self.drafter.free(sid)

    def stats(self) -> dict[str, Any]:
        return {"hits": self.drafter.hits, "misses": self.drafter.misses, "seqs": len(self.seqs)}
