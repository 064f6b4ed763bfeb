"""bench/ has no dead ends: every module imports, every name it imports (at the top or
inside a function) exists, and the benchmarks that run in one process without Ray run
their smallest setting, writing their JSON (and PNG) to a tmp_path, never bench/results/.

What runs, per module (each a few seconds on 2 cores):

* ``bench.costs``: ``main`` with one rep and an 8-token prompt (demo pair, one process,
  eager and compiled);
* ``bench.pair``: ``main`` with one prompt per domain, 4 tokens, 2 timing reps;
* ``bench.heldout``: its prompt sources (pure);
* ``bench.ttft``: its in-process part, the target's prefill time (``prefill_ms``);
* ``bench.gpu``: ``--device cpu --smoke`` at batch 1 and 8 (tiny configs, ~25 s);
* ``bench.syncs``: the engine core in process at batch 1 (demo pair, ~10 s);
* ``bench.distill``: 4 served requests, 3 training steps, 2 probes per domain (~10 s);
* ``bench.tensor_parallel``: batch 1, 4 tokens, 1 rep (the demo target whole and over two
  ranks, rank 1 a spawned process; ~15 s).

Imported (and their config builders validated against ``deployments.config``) but not
run: ``bench.pipeline`` and ``bench.telemetry`` start Ray actors; ``bench.http`` needs a
running server; ``bench.peers``, ``bench.policy``, ``bench.soak``, ``bench.ttft`` (its
measurement) and ``bench.serving`` (GuideLLM too) deploy Serve applications;
``bench.transport`` starts Ray actors of its own (``ray.init``); ``bench.rank_kill``
deploys ``demo-tp.yaml`` and kills a rank. ``bench.adaptation`` deploys
one too; its ``--smoke`` run is tests/adaptation/test_bench_adaptation.py, in a process of
its own. ``bench.common`` is exercised by every run above.
"""

from __future__ import annotations

import ast
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
MODULES = sorted(f"bench.{p.stem}" for p in BENCH.glob("*.py") if p.stem != "__init__")


def imported_names(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for every absolute import in the file, function-local ones too."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.module, alias.name) for alias in node.names]
    return out


@pytest.mark.parametrize("name", MODULES, ids=MODULES)
def test_module_and_everything_it_imports_exist(name):
    importlib.import_module(name)
    path = BENCH / f"{name.split('.', 1)[1]}.py"
    for module, attr in imported_names(path):
        if module == "__future__":
            continue
        mod = importlib.import_module(module)
        if attr is not None and not hasattr(mod, attr):
            importlib.import_module(f"{module}.{attr}")  # a submodule, or ImportError


def test_every_bench_module_is_listed():
    assert "bench.common" in MODULES and "bench.transport" in MODULES and len(MODULES) >= 13


@pytest.fixture
def results(tmp_path, monkeypatch):
    """write_result's folder -> tmp_path; torch's global settings restored afterwards."""
    import bench.common

    def committed() -> dict:
        return {p.name: p.stat().st_mtime_ns for p in (BENCH / "results").glob("*")}

    before = committed()
    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    yield tmp_path
    torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)
    assert committed() == before, "a benchmark wrote into bench/results/"


def run_main(monkeypatch, module: str, argv: list[str], results: Path, name: str) -> dict:
    mod = importlib.import_module(module)
    monkeypatch.setattr(sys, "argv", [f"python -m {module}", *argv])
    mod.main()
    payload = json.loads((results / f"{name}.json").read_text())
    assert payload["benchmark"] == name
    assert {"date", "commit", "machine", "settings", "results"} <= payload.keys()
    assert (results / f"{name}.png").stat().st_size > 0
    return payload


def numbers(tree) -> list[float]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in numbers(v)]
    if isinstance(tree, list):
        return [x for v in tree for x in numbers(v)]
    return [tree] if isinstance(tree, (int, float)) and not isinstance(tree, bool) else []


def test_costs_smallest(results, monkeypatch, tiny_target, tiny_draft):
    # (the tiny pair: the bench's code, not the demo pair's compile time, is under test)
    argv = ["--reps", "1", "--prompt-len", "8", "--steps", "10", "--block", "5"]
    argv += ["--target", tiny_target, "--draft", tiny_draft]
    payload = run_main(monkeypatch, "bench.costs", argv, results, "costs")
    assert payload["settings"]["reps"] == 1 and payload["settings"]["draft"] == tiny_draft
    out = payload["results"]
    kinds = ("bare", "bare_compiled", "worker", "compiled")
    expected = {f"{m}_{k}" for m in ("target", "draft") for k in kinds}
    assert set(out["ms_per_token"]) == expected | {"draft_compiled_stepwise"}
    assert {
        "target_compiled_vs_worker",
        "draft_compiled_vs_bare_compiled",
        "draft_compiled_vs_compiled_stepwise",
    } <= set(out["ratios"])
    assert all(len(v) == 1 for v in out["samples_ms"].values())
    assert all(x > 0 for x in numbers(out))


def test_pair_smallest(results, monkeypatch):
    argv = ["--prompts", "1", "--max-tokens", "4", "--reps", "2"]
    out = run_main(monkeypatch, "bench.pair", argv, results, "pair")["results"]
    assert set(out["ms_per_token"]) == {"demo-target", "demo-draft", "demo-draft-python"}
    assert set(out["verify_ms"]) == {str(n) for n in range(1, 10)}
    assert set(out["tokens_per_s"]) == {"0"} | {str(k) for k in range(2, 9)}
    assert 2 <= out["best_k"] <= 8
    for per_domain in out["acceptance"].values():
        assert set(per_domain) == {"python", "prose"}
        for per_t in per_domain.values():
            assert set(per_t) == {"T=0", "T=1"}
            for row in (r for curve in per_t.values() for r in curve.values()):
                assert 0 <= row["alpha_hat"] <= 1 and row["tokens_per_round"] >= 1
    for key in ("ms_per_token", "verify_ms", "tokens_per_s", "speedup_vs_target_only"):
        assert all(x > 0 for x in numbers(out[key])), key


def test_tensor_parallel_smallest(results, monkeypatch):
    argv = ["--batches", "1", "--tokens", "4", "--reps", "1", "--prompt-len", "8"]
    out = run_main(monkeypatch, "bench.tensor_parallel", argv, results, "tensor_parallel")
    row = out["results"]["1"]
    assert set(row["tokens_per_s"]) == {"tp1", "tp2"} and row["tp2_over_tp1"] > 0
    assert row["bytes_per_broadcast"] > 0 and row["sum_bytes_per_pass"] > 0
    # Each pass reaches the other rank as one broadcast (bookkeeping rides along with it).
    assert 0 < row["broadcasts_per_pass"] <= 1.5


def test_heldout_prompts_are_deterministic_text():
    from bench.heldout import licence_prose, mixed, third_party_python

    prompts = mixed(4, seed=3)
    assert len(prompts) == 4 and all(p.strip() and p.endswith("\n") for p in prompts)
    assert prompts == mixed(4, seed=3)
    assert len(third_party_python(2)) == 2 and len(licence_prose(2)) == 2


def test_ttft_prefill_in_process(results):
    from bench.ttft import prefill_ms

    assert prefill_ms(1) > 0


def test_config_builders_validate():
    """The configs the Ray benchmarks would deploy still match deployments.config."""
    from bench import pipeline, policy, serving
    from deployments.config import AppConfig

    for mode, transport in (("sequential", "actor"), ("overlap", "compiled_graph")):
        cfg = pipeline.engine_config(mode, 4, 4, transport)
        assert cfg.transport == transport and cfg.speculation.num_speculative_tokens == 4
    for shape, name in pipeline.SHIPPED.items():  # --shipped: the configs as they ship
        cfg = pipeline.shipped_config(name, fixed_width=True)
        assert (cfg.draft_placement == "colocated") == (shape == "colocated")
        assert not cfg.speculation.adaptive_overlap and Path(cfg.target.model).is_dir()
    assert AppConfig.model_validate(policy.app_config("demo-draft", 4, 9464)).engine.draft
    shipped = pipeline.shipped_config("demo-colocated.yaml")
    fixed = pipeline.shipped_config("demo-colocated.yaml", speculation={"policy": "fixed"})
    assert (shipped.speculation.policy, fixed.speculation.policy) == ("goodput", "fixed")
    assert fixed.draft_placement == "colocated" and Path(fixed.draft.model).is_dir()
    pinned = pipeline.shipped_config(
        "demo.yaml",
        speculation={"speculation_width": 2},
        engine={"draft": {"model": "models/demo-draft"}, "draft_resources": {"num_cpus": 0.5}},
    )  # --engine-variant: keys replaced, model paths still made absolute
    assert Path(pinned.draft.model).is_absolute() and pinned.draft_resources.num_cpus == 0.5
    assert pinned.speculation.speculation_width == 2
    with pytest.raises(ValueError, match="speculation"):
        pipeline.shipped_config("demo.yaml", engine={"speculation": {}})
    for draft in (True, False):
        cfg = AppConfig.model_validate(serving.app_args(draft, 9464))
        assert (cfg.engine.draft is not None) == draft


def test_distill_smallest(results, monkeypatch):
    """``bench.distill`` end to end on a handful of requests: scores per draft and probe
    domain, the trained drafts with their training time and loss."""
    argv = ["--traffic", "4", "--replay", "2", "--probes", "2", "--new-tokens", "8"]
    payload = run_main(monkeypatch, "bench.distill", [*argv, "--steps", "3"], results, "distill")
    drafts = payload["results"]["drafts"]
    assert list(drafts) == ["drift (before)", "general (reference)", "drift + 3 steps"]
    for scores in drafts.values():
        for domain in ("prose", "python"):
            assert 0 <= scores[domain]["agreement"] <= 1 and 0 <= scores[domain]["alpha_k"] <= 1
    assert drafts["drift + 3 steps"]["train_s"] > 0 and drafts["drift + 3 steps"]["loss"] > 0


def test_gpu_smoke_on_cpu(results, monkeypatch):
    """``bench.gpu`` as a GPU session runs it, on tiny configs here: every section written,
    each pass against its floor, oracle speculation at both α, transformers' three modes
    (torch.compile included)."""
    argv = ["--device", "cpu", "--smoke", "--batches", "1", "8", "--reps", "1"]
    # the runners' padded static passes (CUDA graphs on a GPU; here the same passes eager)
    argv += ["--execution-mode", "cuda_graph"]
    payload = run_main(monkeypatch, "bench.gpu", argv, results, "gpu_smoke")
    assert payload["settings"]["execution_mode"] == "cuda_graph"
    out = payload["results"]
    assert payload["settings"]["smoke"] and payload["settings"]["target"] == "llama-3.1-8b"
    assert set(out["passes"]["verify"]) == {
        f"batch {b}, {n} positions" for b in (1, 8) for n in (1, 2, 4, 6)
    }
    # the draft on graphs drafts a round (k = 5) as one graph, timed beside single steps
    assert set(out["passes"]["draft_round"]) == {"batch 1, 5 steps", "batch 8, 5 steps"}
    for row in [*out["passes"]["verify"].values(), *out["passes"]["draft_step"].values()]:
        assert 0 < row["floor_ms"] < row["ms"] and 0 < row["floor_fraction"] < 1
    for batch in ("batch 1", "batch 8"):
        row = out["decoding"][batch]
        assert row["plain"] > 0
        for alpha in (0.6, 0.8):  # at most k + 1 tokens a round, at least the bonus
            assert 1 <= row[f"alpha {alpha}"]["tokens_per_round_per_row"] <= 6
    assert set(out["transformers_batch1"]) == {
        "plain_eager",
        "assisted",
        "static_compile",
        "static_compile_warmup_s",
    }
    assert all(x > 0 for x in numbers(out))


def test_syncs_smallest(results, monkeypatch):
    """The core's own loop at batch 1 counts host reads in every round, greedy and sampled,
    with the lines responsible (the bounds are tests/deployments/test_round_host_syncs.py's)."""
    out = run_main(monkeypatch, "bench.syncs", ["--batches", "1"], results, "syncs")["results"]
    greedy, sampled = out["batch 1, greedy"], out["batch 1, sampled"]
    for row in (greedy, sampled):
        assert row["rounds"] > 0 and row["syncs_per_round_median"] > 0
        assert all(site.split(":")[0].endswith(".py") for site in row["top_sites_per_round"])
        assert sum(row["top_sites_per_round"].values()) == pytest.approx(
            row["syncs_per_round_median"], abs=1.0
        )
