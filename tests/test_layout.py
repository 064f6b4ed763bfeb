"""The layout docs/architecture.md promises ("Layout", "Messages"), held by the code:
imports run one way between the layers, the leaves import no layer, the monitor imports
nothing of the serving side, and no function grows past what one can hold in one's head."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Left to right: a package may import only packages to its right (and the leaves).
LAYERS = ["deployments.openai", "deployments.frontend", "deployments.core", "deployments.workers"]
LEAVES = {"deployments.messages", "deployments.config"}
MAX_FUNCTION_LINES = 80  # the limit; the aim is 60 (docs/architecture.md, Layout)


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


def name_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    """Every module the file imports, function-local imports included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def layer(module: str) -> int | None:
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return None


def test_imports_run_one_way_between_the_layers():
    wrong = []
    for path in modules("deployments"):
        here = layer(name_of(path))
        for target in imports(path):
            there = layer(target)
            if here is not None and there is not None and there < here:
                wrong.append(f"{name_of(path)} imports {target}")
    assert wrong == []


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_the_leaves_import_no_layer(leaf):
    path = ROOT / (leaf.replace(".", "/") + ".py")
    project = [m for m in imports(path) if m.split(".")[0] in {"deployments", "bench", "tests"}]
    assert project == []
    if leaf == "deployments.messages":  # nothing of the project but specdec
        assert {m.split(".")[0] for m in imports(path)} & {"monitoring"} == set()


@pytest.mark.parametrize("package", ["monitoring", "adaptation"])
def test_the_monitor_and_adaptation_import_only_specdec_and_themselves(package):
    wrong = [
        f"{name_of(path)} imports {m}"
        for path in modules(package)
        for m in imports(path)
        if m.split(".")[0] in {"deployments", "bench", "tests", "monitoring", "adaptation"}
        and m.split(".")[0] != package
    ]
    assert wrong == []


def test_no_function_is_longer_than_the_limit():
    long = []
    for package in ("deployments", "specdec", "adaptation"):
        for path in modules(package):
            if "demo" in path.relative_to(ROOT).parts:  # the demo recipe aside
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{name_of(path)}.{node.name}: {lines} lines")
    assert long == []


def test_the_checks_above_see_a_violation():
    """The rules have power: an upward import and a long function are caught."""
    assert layer("deployments.core.engine_core") > layer("deployments.openai.server")
    source = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    (node,) = ast.parse(source).body
    assert node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES


def test_the_one_process_path_runs_without_ray():
    """specdec, its tests and ``bench.gpu`` import without Ray (and without msgspec or
    pydantic): the GPU machine lent to some sessions has torch and transformers only."""
    specdec_tests = [name_of(p) for p in modules("tests.specdec")]
    code = (
        "import sys\n"
        "for blocked in ('ray', 'msgspec', 'pydantic', 'deployments', 'monitoring'):\n"
        "    sys.modules[blocked] = None  # importing it now raises ImportError\n"
        "import importlib\n"
        f"for name in {[name_of(p) for p in modules('specdec')] + specdec_tests}:\n"
        "    importlib.import_module(name)\n"
        "import tests.conftest, tests.model_families, bench.gpu\n"
    )
    run_fresh(code)


def run_fresh(code: str) -> str:
    """``code`` in a fresh interpreter at the repository's root; its stdout (it must
    succeed)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


# What a model runs on and the Serve replica never needs at import: transformers'
# modeling (which pulls dynamo, DTensor and more) and specdec's runner. (Loading a
# tokenizer later brings dynamo in, through transformers: the replica saves ~1.5 CPU-s.)
MODEL_STACK = ("torch._dynamo", "transformers.modeling_utils", "specdec.runner")


def model_stack_after(statement: str) -> list[str]:
    """The MODEL_STACK modules a fresh interpreter has loaded after ``statement``."""
    code = f"import sys\n{statement}\nprint(*[m for m in {MODEL_STACK} if m in sys.modules])"
    return run_fresh(code).split()


def test_the_replica_imports_no_model_stack():
    """The replica imports the app and the workers' actor classes (to start them), and the
    OpenAI server; the workers import the model stack when they load, so each replica (one
    per app, restart and scale-up) starts sooner. The same check sees a module that does
    import it."""
    assert model_stack_after("import deployments.app") == []
    assert model_stack_after("import specdec.proposers") == list(MODEL_STACK)
