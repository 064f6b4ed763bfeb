"""One benchmark, two checkouts, interleaved in one run: what a change did, as ratios.

A benchmark run alone before a change and alone after it compares two machine states as
much as two codes. This runs ``python -m <module>`` from the ``--before`` checkout and from
this one by turns (the order alternating every repetition), each in a process of its own
with its checkout first on ``PYTHONPATH`` (Ray's worker processes inherit it), reads the
JSON each run writes (``<checkout>/bench/results/<name>.json``), and reports every numeric
result's median per checkout and the ratio after / before.

    git worktree add /tmp/before <commit>
    python -m bench.ab --before /tmp/before --module bench.pipeline --reps 3 \\
        --plot per_round_ms.overhead_ms -- --no-compiled-graph

Writes ``bench/results/ab_<name>.json`` and ``.png`` (the ratios of the results whose
path contains a ``--plot`` substring).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from bench.common import RESULTS, commit, median, write_result

ROOT = Path(__file__).resolve().parents[1]


def numeric_leaves(tree, prefix: str = "") -> dict[str, float]:
    """Every number in a JSON tree by its dotted path (booleans are not numbers)."""
    out: dict[str, float] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(numeric_leaves(value, f"{prefix}{key}."))
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        out[prefix[:-1]] = float(tree)
    return out


def run_once(checkout: Path, module: str, name: str, args: list[str]) -> dict[str, float]:
    """One run of the benchmark from ``checkout``; its numeric results by path."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    subprocess.run([sys.executable, "-m", module, *args], cwd=checkout, env=env, check=True)
    written = json.loads((checkout / "bench" / "results" / f"{name}.json").read_text())
    return numeric_leaves(written["results"])


def compare(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per result path: the median of each checkout's runs and after / before."""
    out = {}
    for path in sorted(set(runs["before"][0]) & set(runs["after"][0])):
        before = median([r[path] for r in runs["before"] if path in r])
        after = median([r[path] for r in runs["after"] if path in r])
        out[path] = {
            "before": before,
            "after": after,
            "after_over_before": round(after / before, 4) if before else None,
        }
    return out


def plot(table: dict, patterns: list[str], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        (k, v["after_over_before"])
        for k, v in table.items()
        if v["after_over_before"] is not None and any(p in k for p in patterns)
    ]
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows) + 2), 4.5))
    ax.bar([k for k, _ in rows], [r for _, r in rows])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set(title=title, ylabel="after / before (median)")
    ax.tick_params(axis="x", rotation=60, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the checkout to compare with")
    ap.add_argument("--module", required=True, help="e.g. bench.pipeline")
    ap.add_argument("--name", help="its result name (default: the module's last part)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--plot", nargs="*", default=[], help="substrings of result paths to plot")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="after --: the benchmark's own")
    args = ap.parse_args()
    name = args.name or args.module.rsplit(".", 1)[-1]
    bench_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    trees = {"before": args.before.resolve(), "after": ROOT}
    runs: dict[str, list] = {"before": [], "after": []}
    for rep in tqdm(range(args.reps), desc=f"{args.module} before/after"):
        for side in ("before", "after") if rep % 2 == 0 else ("after", "before"):
            runs[side].append(run_once(trees[side], args.module, name, bench_args))
    table = compare(runs)
    before_commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"],
        cwd=trees["before"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    settings = {
        "module": args.module,
        "args": bench_args,
        "reps": args.reps,
        "before_commit": before_commit,
        "after_commit": commit(),
    }
    out = write_result(f"ab_{name}", settings, table)
    if args.plot:
        title = f"{args.module}: {settings['after_commit']} over {before_commit}"
        plot(table, args.plot, title, RESULTS / f"ab_{name}.png")
    for path, row in table.items():
        if any(p in path for p in args.plot):
            print(f"{path}: {row['before']:.4g} -> {row['after']:.4g} ({row['after_over_before']})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
