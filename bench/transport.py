"""Bytes per round and their cost between actors: the draft's push to the engine core.

For vocabulary 128256 and k = 5, at batch 1 and 32, greedy, T = 1 and top-p 0.9, this
builds the round's push exactly as the draft worker does (a
:class:`deployments.messages.DraftPush` of ``pushed_drafts`` rows: token ids, and for sampled
rows ``q``) in the old form (float32 ``[k, vocab]`` numpy per sampled row)
and the new one (:class:`specdec.qcodec.CompactQ`, encoded as the worker sends it:
:func:`deployments.messages.encode`), measures its size on the wire, and times
a push of it from one Ray actor to another and back (the round's overhead between
actors), the two forms interleaved. Draft distributions come from random logits through
the real sampling transform (no model: only the message is measured).

    python -m bench.transport [--reps 30]

Writes ``bench/results/transport.{json,png}``.
"""

from __future__ import annotations

import argparse
import pickle
import time

import matplotlib
import numpy as np
import ray
import torch
from tqdm import tqdm

from bench.common import RESULTS, median, write_result
from deployments.messages import DraftPush, decode, encode
from deployments.workers.drafting import pushed_drafts
from specdec.qcodec import quantize_q
from specdec.sampling import SamplingParams, probs_for
from specdec.speculation_cache import Drafts

matplotlib.use("Agg")
import matplotlib.pyplot as plt

VOCAB = 128256
K = 5
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "T=1": SamplingParams(temperature=1.0),
    "top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
}


def _drafts(params: SamplingParams, gen: torch.Generator) -> Drafts:
    tokens = torch.randint(0, VOCAB, (K,), generator=gen).tolist()
    empty = torch.zeros(K, 0)
    if params.is_greedy:
        return Drafts(tokens, None, empty, empty)
    # Draft logits of a small LM: roughly Zipf-shaped, a few dominant tokens.
    logits = torch.randn(K, VOCAB, generator=gen) * 2.5
    return Drafts(tokens, quantize_q(probs_for([params] * K, logits)), empty, empty)


def _old_item(seq_id, drafts: Drafts) -> tuple:
    """The previous wire form: float32 [k, vocab] numpy for sampled rows."""
    q = None if drafts.probs is None else drafts.probs.float().cpu().numpy()
    return (seq_id, (), drafts.tokens, q, drafts.speculative)


@ray.remote
class Core:
    def push(self, push, encoded: bool) -> int:
        if encoded:  # the new form is read back as the core does
            decode(DraftPush, push)
        return 0


@ray.remote
class Draft:
    def __init__(self, core):
        self.core = core

    def push_and_wait(self, push, encoded: bool) -> float:
        start = time.perf_counter()
        ray.get(self.core.push.remote(push, encoded))
        return time.perf_counter() - start


def wire_bytes(payload) -> int:
    """Bytes a payload travels as: the encoded message and its arrays, or a pickle."""
    if isinstance(payload, bytes):
        return len(payload)
    if isinstance(payload, tuple) and isinstance(payload[0], bytes):
        return len(payload[0]) + sum(a.nbytes for a in payload[1])
    return len(pickle.dumps(payload, protocol=5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    core = Core.remote()
    draft = Draft.remote(core)
    gen = torch.Generator().manual_seed(0)
    results = {}
    cases = [(b, name) for b in args.batches for name in SETTINGS]
    for batch, name in tqdm(cases, desc="transport"):
        drafts = [_drafts(SETTINGS[name], gen) for _ in range(batch)]
        payload = {
            "old": (0, [_old_item(f"req-{i}", d) for i, d in enumerate(drafts)]),
            "new": encode(
                DraftPush(
                    0, pushed_drafts([(f"req-{i}", (), d) for i, d in enumerate(drafts)], version=0)
                )
            ),
        }
        row = {}
        for form, items in payload.items():
            row[form] = {"bytes_per_round": wire_bytes(items)}
            row[form]["bytes_per_row_round"] = row[form]["bytes_per_round"] / batch
        times = {"old": [], "new": []}
        refs = {form: ray.put(items) for form, items in payload.items()}
        for rep in range(args.reps + 2):  # two warm-ups; forms interleaved, order rotated
            for form in ("old", "new") if rep % 2 else ("new", "old"):
                t = ray.get(draft.push_and_wait.remote(refs[form], form == "new"))
                if rep >= 2:
                    times[form].append(t)
        for form in times:
            row[form]["push_ms_median"] = 1e3 * median(times[form])
        if not SETTINGS[name].is_greedy:
            support = [float((d.probs != 0).sum(-1).float().mean()) for d in drafts]
            row["mean_support"] = float(np.mean(support))
            row["new"]["bytes_per_draft_token_per_row"] = row["new"]["bytes_per_row_round"] / K
            row["new"]["bytes_per_support_entry"] = (
                row["new"]["bytes_per_draft_token_per_row"] / (row["mean_support"])
            )
        results[f"batch {batch}, {name}"] = row
        old, new = row["old"], row["new"]
        tqdm.write(
            f"batch {batch:>2} {name:>9}: "
            f"old {old['bytes_per_round'] / 1024:9.1f} KiB {old['push_ms_median']:6.2f} ms"
            f" | new {new['bytes_per_round'] / 1024:8.1f} KiB {new['push_ms_median']:6.2f} ms"
        )
    ray.shutdown()
    settings = {"vocab": VOCAB, "k": K, "batches": args.batches, "reps": args.reps}
    path = write_result("transport", settings, results)
    _plot(results)
    print(f"wrote {path}")


def _plot(results: dict) -> None:
    labels = list(results)
    x = np.arange(len(labels))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for off, form in ((-0.2, "old"), (0.2, "new")):
        a1.bar(
            x + off, [results[k][form]["bytes_per_round"] / 1024 for k in labels], 0.4, label=form
        )
        a2.bar(x + off, [results[k][form]["push_ms_median"] for k in labels], 0.4, label=form)
    a1.set_yscale("log")
    a1.set_ylabel("KiB per round (draft -> core)")
    a2.set_ylabel("push round trip between actors, ms (median)")
    for a in (a1, a2):
        a.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
        a.legend()
    fig.suptitle(f"Draft push per round, vocab {VOCAB}, k = {K}: float32 q vs 16-bit compact q")
    fig.tight_layout()
    fig.savefig(RESULTS / "transport.png", dpi=110)


if __name__ == "__main__":
    main()
