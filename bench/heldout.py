"""Prompts the demo pair's recipe never saw: what a user of the shipped config sends.

The demo pair was trained on the standard library and the Python documentation
(:mod:`specdec.demo.corpus`; ``models/prompts`` holds its held-out *files*, same sources).
Here the sources are different altogether: third-party Python (the packages installed
next to SpecServe, ``site-packages``) and English licence texts from
``/usr/share/common-licenses`` (Debian). Both exist on every machine that runs the
project; the choice is deterministic (sorted files, fixed seed), so runs compare.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

LICENSES = Path("/usr/share/common-licenses")
PACKAGES = ("httpx", "pydantic", "yaml", "click", "starlette", "fastapi", "jinja2", "rich")


def _windows(text: str, rng: random.Random, n: int, lines: int) -> list[str]:
    rows = [r for r in text.splitlines() if r.strip()]
    if len(rows) <= lines:
        return []
    out = []
    for _ in range(n):
        i = rng.randrange(0, len(rows) - lines)
        out.append("\n".join(rows[i : i + lines]) + "\n")
    return out


def third_party_python(count: int, seed: int = 0, lines: int = 6) -> list[str]:
    """``count`` windows of ``lines`` non-empty lines from installed third-party packages."""
    root = Path(sysconfig.get_paths()["purelib"])
    files = sorted(
        p for pkg in PACKAGES if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py")
    )
    files = [p for p in files if "test" not in p.parts and p.stat().st_size > 2000]
    if not files:
        raise FileNotFoundError(f"no third-party Python under {root} ({', '.join(PACKAGES)})")
    return _sample(files, count, seed, lines)


def licence_prose(count: int, seed: int = 0, lines: int = 4) -> list[str]:
    """``count`` windows of ``lines`` non-empty lines of Debian's licence texts."""
    files = sorted(p for p in LICENSES.glob("*") if p.is_file() and not p.is_symlink())
    if not files:
        raise FileNotFoundError(f"no licence texts under {LICENSES} (Debian's base-files)")
    return _sample(files, count, seed, lines)


def _sample(files: list[Path], count: int, seed: int, lines: int) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < count:
        path = files[rng.randrange(len(files))]
        out += _windows(path.read_text(errors="replace"), rng, 1, lines)
    return out


def mixed(count: int, seed: int = 0) -> list[str]:
    """Half third-party Python, half licence prose, interleaved."""
    py, prose = third_party_python(count, seed), licence_prose(count, seed)
    return [p for pair in zip(py, prose, strict=True) for p in pair][:count]
