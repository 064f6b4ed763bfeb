"""Gather the two text domains and split them into training and held-out files.

Python: the standard library of the running interpreter, without its test suites.
Prose: the reStructuredText sources of the Python documentation shipped by Debian's
``python3.11-doc`` package. A file is held out when a stable hash of its relative path
falls in the held-out bucket, so the split is the same on every machine.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import random
import sysconfig
import tokenize
from dataclasses import dataclass
from pathlib import Path

PROSE_DIRS = [
    Path("/usr/share/doc/python3.11/html/_sources"),
    Path("/usr/share/doc/python3-doc/html/_sources"),
]
EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}
HELD_OUT_PERCENT = 5


@dataclass(frozen=True)
class Document:
    domain: str  # "python" | "prose"
    path: str  # relative to the domain root
    text: str


def _held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def python_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_PARTS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        files.append((str(rel), path))
    return files


def prose_files() -> list[tuple[str, Path]]:
    for root in PROSE_DIRS:
        if root.is_dir():
            return [(str(p.relative_to(root)), p) for p in sorted(root.rglob("*.rst.txt"))]
    raise FileNotFoundError(
        "English prose corpus not found: install Debian's python3.11-doc package "
        "(apt-get install python3.11-doc) or place the docs under one of "
        + ", ".join(map(str, PROSE_DIRS))
    )


def load_documents() -> tuple[list[Document], list[Document]]:
    """Returns (training documents, held-out documents), in a deterministic order."""
    train, held = [], []
    for domain, files in (("python", python_files()), ("prose", prose_files())):
        for rel, path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            if len(text) < 200:
                continue
            (held if _held_out(f"{domain}/{rel}") else train).append(Document(domain, rel, text))
    return train, held


def make_prompts(held: list[Document], domain: str, count: int, seed: int) -> list[dict]:
    """Short prompts cut from held-out files: a few consecutive non-empty lines."""
    rng = random.Random(seed)
    docs = [d for d in held if d.domain == domain]
    prompts: list[dict] = []
    while len(prompts) < count:
        doc = rng.choice(docs)
        lines = doc.text.splitlines()
        start = rng.randrange(len(lines))
        chunk = []
        for line in lines[start:]:
            chunk.append(line)
            if sum(len(c) for c in chunk) >= rng.randint(80, 240):
                break
        text = "\n".join(chunk)
        if len(text.strip()) < 40:
            continue
        prompts.append({"prompt": text + "\n", "domain": domain, "source": doc.path})
    return prompts


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def strip_python(text: str) -> str | None:
    """Python source without its English: comments, docstrings and bare string statements.

    Lines left empty by a removal go; a string statement that is the whole body of a block
    becomes ``pass`` so the code still parses; runs of blank lines shrink to two. Returns
    None when the source does not parse (before or after), so callers can skip the file.
    """
    try:
        tree = ast.parse(text)
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (SyntaxError, ValueError, tokenize.TokenError):
        return None
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def at(row: int, col: int, in_bytes: bool) -> int:
        """Character offset of (1-based row, column); ast counts columns in UTF-8 bytes."""
        if in_bytes:
            col = len(lines[row - 1].encode("utf-8")[:col].decode("utf-8", errors="ignore"))
        return starts[row - 1] + col

    cuts: list[tuple[int, int, str]] = []  # (start, end, replacement), character offsets
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            cuts.append((at(*tok.start, False), at(*tok.end, False), ""))
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            body = getattr(node, name, None)
            if not isinstance(body, list):
                continue
            for stmt in body:
                if (
                    isinstance(stmt, ast.Expr)
                    and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)
                ):
                    start = at(stmt.lineno, stmt.col_offset, True)
                    end = at(stmt.end_lineno, stmt.end_col_offset, True)
                    cuts.append((start, end, "pass" if len(body) == 1 else ""))
    mark = "\x00"  # stands where something was cut, so emptied lines can be told apart
    out, pos = [], 0
    for start, end, repl in sorted(cuts):
        if start < pos:
            continue
        out.append(text[pos:start] + (repl or mark))
        pos = end
    out.append(text[pos:])
    kept, blank = [], 0
    for line in "".join(out).splitlines():
        if line.strip() == mark or (mark in line and not line.replace(mark, "").strip()):
            continue
        line = line.replace(mark, "").rstrip()
        blank = blank + 1 if not line else 0
        if blank <= 2:
            kept.append(line)
    result = "\n".join(kept).strip("\n") + "\n"
    try:
        ast.parse(result)
    except SyntaxError:
        return None
    return result
