"""What every benchmark records next to its numbers: machine, commit, settings, time."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "load_avg_at_start": os.getloadavg(),
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def commit() -> str:
    """``$BENCH_COMMIT`` where set, else ``git describe`` of the tree. The lent GPU machine
    gets a copy of the working tree whose ``.git`` can be older than its files (read there
    as the session's starting commit, "-dirty"), so its runs name the commit they ran."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(name: str, settings: dict, results: dict, directory: Path | None = None) -> Path:
    """Writes ``directory/name.json`` (default: :data:`RESULTS`, read at the call, so
    tests can point it elsewhere) and returns its path."""
    directory = RESULTS if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    payload = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "machine": machine(),
        "settings": settings,
        "results": results,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
