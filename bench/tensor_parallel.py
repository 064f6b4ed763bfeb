"""The demo target whole and split over two ranks, side by side (one process per rank, gloo).

    python -m bench.tensor_parallel            # writes bench/results/tensor_parallel.{json,png}

Greedy decoding of the demo target (float32, eager, one thread per rank) at batch 1 and 8,
whole (TP = 1) and split over two ranks (TP = 2: rank 0 here, rank 1 a spawned process,
the sums over gloo), interleaved rep by rep so that both see the same minutes. Records
tokens/s and their ratio, and what travels between the ranks per pass: the broadcast of
rank 0's runner calls (one per pass, the frees of the previous rep riding on its first;
pickled bytes, measured) and the sums of the row-wise layers (two per
layer: rows x positions x hidden x 4 bytes, computed from the shapes). On a 2-core host
the two ranks share the cores the whole model had: this shows the cost of the group, not
a speedup, which needs a device per rank.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from functools import partial
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from bench.common import median, write_result
from specdec.rank_group import free_port, lead, run_rank
from specdec.runner import ModelRunner

TARGET = str(Path(__file__).resolve().parents[1] / "models" / "demo-target")


def decode(runner, batch: int, prompt_len: int, tokens: int) -> float:
    """Seconds for ``tokens`` one-token passes of ``batch`` rows after a prefill."""
    ids = [f"b{i}" for i in range(batch)]
    runner.prefill(ids, [[1 + (i + j) % 50 for j in range(prompt_len)] for i in range(batch)])
    try:
        t0 = time.perf_counter()
        for _ in range(tokens):
            runner.forward_padded(ids, [[7]] * batch, last_only=True)
        return time.perf_counter() - t0
    finally:
        for sid in ids:
            runner.free(sid)


def sum_bytes(runner, batch: int) -> int:
    """Bytes one rank sends into the sums of a one-token pass of ``batch`` rows."""
    config = runner.config
    return 2 * config.num_hidden_layers * batch * config.hidden_size * 4


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tensor_parallel", description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--name", default="tensor_parallel")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    kwargs = {"max_model_len": 512, "max_num_seqs": max(args.batches), "execution_mode": "eager"}
    make = partial(ModelRunner, TARGET, **kwargs)
    init = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    child = multiprocessing.get_context("spawn").Process(
        target=run_rank, args=(make, 1, 2, init), daemon=True
    )
    child.start()
    split = lead(make, 2, init)
    whole = make()
    results = {}
    try:
        for batch in args.batches:
            times = {"tp1": [], "tp2": []}
            group = split.group
            before = (group.messages, group.call_bytes)
            for _ in range(args.reps):  # interleaved: whole, split, whole, split ...
                times["tp1"].append(decode(whole, batch, args.prompt_len, args.tokens))
                times["tp2"].append(decode(split, batch, args.prompt_len, args.tokens))
            messages = group.messages - before[0]
            passes = args.reps * (1 + args.tokens)  # a prefill and the one-token passes
            rate = {k: batch * args.tokens / median(v) for k, v in times.items()}
            results[str(batch)] = {
                "tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
                "tp2_over_tp1": round(rate["tp2"] / rate["tp1"], 3),
                "broadcasts_per_pass": round(messages / passes, 3),
                "bytes_per_broadcast": round((group.call_bytes - before[1]) / messages, 1),
                "sum_bytes_per_pass": sum_bytes(whole, batch),
            }
            print(batch, results[str(batch)], flush=True)
        split.stop_followers()
        child.join(30)
    finally:
        split.close()
        if child.is_alive():
            child.kill()
    settings = {**vars(args), "model": "models/demo-target", "dtype": "float32"}
    path = write_result(args.name, settings, results)
    plot(results, path.with_suffix(".png"))
    print(path)


def plot(results: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    batches = list(results)
    for i, key in enumerate(("tp1", "tp2")):
        values = [results[b]["tokens_per_s"][key] for b in batches]
        ax.bar([j + 0.4 * i for j in range(len(batches))], values, 0.4, label=key.upper())
    ax.set_xticks([j + 0.2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("tokens/s (greedy decode, demo target)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
