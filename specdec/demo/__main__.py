"""``python -m specdec.demo build``: build the demo pair into models/ (resumable).

``python -m specdec.demo drift``: the drafts' greedy acceptance on fresh held-out prompts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec.demo import drift
from specdec.demo.build import Recipe, build


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.demo")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build (or resume building) the demo pair")
    b.add_argument(
        "--workdir", type=Path, default=Path("data/demo-build"), help="checkpoints and caches"
    )
    b.add_argument("--out", type=Path, default=Path("models"), help="where the HF model dirs go")
    b.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    d = sub.add_parser("drift", help="greedy acceptance per domain on fresh held-out prompts")
    drift.add_arguments(d)
    args = parser.parse_args()
    if args.command == "drift":
        drift.run(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    stats = build(args.workdir, args.out, Recipe())
    print(json.dumps({k: v for k, v in stats.items() if k != "recipe"}, indent=2))


if __name__ == "__main__":
    main()
