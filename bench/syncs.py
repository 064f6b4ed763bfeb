"""Host syncs per round in the engine core's own loop (the demo pair, colocated draft).

    python -m bench.syncs        # writes bench/results/syncs.json and syncs.png

Every read of a device value by Python stops the host until the device has caught up
(:mod:`specdec.host_syncs`); on a GPU, a round that reads per row or per draft step leaves
the device idle that many times. This runs the real :class:`EngineCore` in this process,
its draft colocated (so the draft's reads are counted too, in the same loop thread), and
counts the reads of each round at batch 1 and 32, greedy and sampled (T = 1, top-p 0.9),
k = 4, with the calling lines that account for them. No Ray: the core is a plain object
here (its actor decorators are inert without a cluster).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from bench.common import median, write_result
from deployments.config import ModelSpec
from deployments.core.engine_core import EngineCore
from deployments.messages import (
    ColocatedDraftConfig,
    EngineCoreConfig,
    EngineCoreOutputs,
    EngineCoreRequest,
    decode,
)
from specdec.host_syncs import HostSyncCounter
from specdec.sampling import SamplingParams

MODELS = Path(__file__).resolve().parents[1] / "models"
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    "sampled": SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=1),
}


class CountingCore(EngineCore):
    """The engine core, counting the host reads of each round in its loop thread."""

    def __init__(self, config: EngineCoreConfig):
        self.rounds: list[tuple[int, HostSyncCounter]] = []  # (batch size, its counts)
        super().__init__(config)
        # Count an accelerator's round: there the draft runs its k steps on without
        # reading whether the confidence stop has ended every row (a CPU reads that after
        # each step, at no cost: specdec.proposers.DraftModelProposer's stop_early).
        self.link.rounds.drafter.proposer.stop_early = False

    def _run_round(self) -> None:
        batch = len(self.scheduler.running)
        with HostSyncCounter() as counter:
            super()._run_round()
        self.rounds.append((batch, counter))


def core_config(batch: int) -> EngineCoreConfig:
    def spec(name: str) -> dict:
        # Eager: the counter is a TorchFunctionMode, which a compiled graph would trace
        # into itself; the reads it counts are the Python code around the forward, the
        # same in both modes (a graph has none: it runs as one call).
        return ModelSpec(
            model=str(MODELS / name), num_threads=1, execution_mode="eager"
        ).model_dump()

    return EngineCoreConfig(
        spec=spec("demo-target"),
        max_num_seqs=batch,
        eos_token_ids=[],
        draft_timeout_s=1.0,
        colocated_draft=ColocatedDraftConfig(spec("demo-draft"), 0.0, None),
    )


def run(core: CountingCore, batch: int, params: SamplingParams, k: int, cursor: int) -> int:
    """``batch`` requests at once, until every one has finished; ``cursor``: the core's
    output cursor (the outputs before it were read by the previous run). Returns the new
    cursor."""
    prompts = [[5 + i, 40 + i, 7, 11 + (i % 5)] for i in range(batch)]
    core.add_requests(
        [
            EngineCoreRequest(f"req-{i}", p, [], asdict(params), k, "default", False)
            for i, p in enumerate(prompts)
        ]
    )
    done = 0
    deadline = time.monotonic() + 300
    while done < batch and time.monotonic() < deadline:
        polled = decode(EngineCoreOutputs, core.get_outputs(cursor, 1.0))
        cursor = polled.cursor
        done += sum(out.finished for out in polled.outputs)
        if polled.error:
            raise RuntimeError(polled.error)
    return cursor


def summary(rounds: list[tuple[int, HostSyncCounter]], batch: int) -> dict:
    """Per round at full batch: median reads, and the calling lines over all of them."""
    full = [c for b, c in rounds if b == batch]
    sites: dict[str, int] = {}
    kinds: dict[str, int] = {}
    for c in full:
        for site, n in c.by_site.items():
            sites[site] = sites.get(site, 0) + n
        for kind, n in c.by_kind.items():
            kinds[kind] = kinds.get(kind, 0) + n
    per = max(1, len(full))
    top = sorted(sites.items(), key=lambda kv: -kv[1])[:12]
    return {
        "rounds": len(full),
        "syncs_per_round_median": median([c.total for c in full]) if full else None,
        "by_kind_per_round": {kind: round(n / per, 2) for kind, n in kinds.items()},
        "top_sites_per_round": {site: round(n / per, 2) for site, n in top},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("-k", type=int, default=4)
    args = ap.parse_args()
    results = {}
    for batch in args.batches:
        core = CountingCore(core_config(batch))
        cursor = 0
        try:
            for name, params in SETTINGS.items():
                core.rounds.clear()
                cursor = run(core, batch, params, args.k, cursor)
                results[f"batch {batch}, {name}"] = summary(list(core.rounds), batch)
                row = results[f"batch {batch}, {name}"]
                print(f"batch {batch:>2} {name:>7}: {row['syncs_per_round_median']} per round")
        finally:
            core.stop()
    path = write_result("syncs", {"batches": args.batches, "k": args.k}, results)
    _plot(results, path.with_suffix(".png"))
    print(f"wrote {path}")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = list(results)
    ax.barh(labels, [row["syncs_per_round_median"] or 0 for row in results.values()])
    ax.set_xlabel("host reads per round (median)")
    ax.set_title("engine core, colocated draft: host syncs per round")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
