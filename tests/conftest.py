"""Shared fixtures: tiny random Llama and GPT-2 models saved to disk and loaded like hub
models (GPT-2 has learned absolute position embeddings and a small context limit), and a
local Ray instance for the tests that run actors.

Ray is imported only inside the fixtures that start it: ``tests/specdec`` (and
``python -m bench.gpu``) run on a machine that has torch and transformers but no Ray,
such as the GPU machine lent to some sessions."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest
import torch

# Where no GPU runs Triton, its interpreter runs specdec.slot_attention's kernels on the
# CPU (tests/specdec/test_slot_attention.py). Triton reads this when imported, so here;
# nothing else changes, since a runner uses the kernels on a CPU only when asked to.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

# What the model specs of tests about other things than compiled execution carry: eager
# forwards (the reference), so that a replica starts in seconds. The compiled path has its
# own tests (tests/specdec/test_compiled.py, tests/deployments/test_warm_up.py), and the
# shipped demo.yaml's engine runs it as users get it (tests/clients/).
EAGER = {"execution_mode": "eager"}
VOCAB = 96
ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = str(ROOT / "models" / "demo-target")
DEMO_DRAFT = str(ROOT / "models" / "demo-draft")
DEMO_DRAFT_PYTHON = str(ROOT / "models" / "demo-draft-python")
GPT2_POSITIONS = 64  # the tiny GPT-2's context limit (n_positions)

# ModelSpec's default compile_cache_dir (tests/deployments/test_config_placement.py checks it).
COMPILE_CACHE_DIR = "~/.cache/specserve/torch-compile"


@pytest.fixture(scope="session", autouse=True)
def shared_compile_cache():
    """In-process compiled runners keep their graphs where the workers keep theirs, as a
    user's workers do across restarts: a model's graphs built by one test (in a worker or in
    this process) are loaded by the next instead of compiled again."""
    from specdec.execution import use_compile_cache

    return use_compile_cache(COMPILE_CACHE_DIR)


def save_tiny_llama(path, *, seed: int, layers: int, hidden: int, vocab: int = VOCAB) -> str:
    """A random Llama with *untied* embeddings (tied random models trivially agree)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Sharpen the output layer so greedy/T=1 choices are not near-uniform noise.
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("target"), seed=0, layers=2, hidden=64)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory, tiny_target) -> str:
    """A draft that partly agrees with the target: the target's weights, perturbed."""
    model = LlamaForCausalLM.from_pretrained(tiny_target)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.3)
    path = tmp_path_factory.mktemp("draft")
    model.save_pretrained(path)
    return str(path)


def _perturb(model, seed: int, scale: float = 0.3):
    """Add noise to every weight: a draft that partly agrees with its target."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    return model


def save_tiny_gpt2(
    path, *, seed: int, layers: int = 2, hidden: int = 32, vocab: int = VOCAB
) -> str:
    """A random GPT-2: learned absolute positions (``wpe``) over ``GPT2_POSITIONS`` slots,
    untied embeddings, sharpened output layer (as :func:`save_tiny_llama`)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=GPT2_POSITIONS,
        n_embd=hidden,
        n_layer=layers,
        n_head=2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        # Strong position embeddings, so a wrong position id visibly changes the logits.
        model.transformer.wpe.weight.mul_(20.0)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_gpt2_target(tmp_path_factory) -> str:
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2-target"), seed=0)


@pytest.fixture(scope="session")
def tiny_gpt2_draft(tmp_path_factory, tiny_gpt2_target) -> str:
    """A draft that partly agrees with the GPT-2 target: its weights, perturbed."""
    model = _perturb(GPT2LMHeadModel.from_pretrained(tiny_gpt2_target), seed=1)
    path = tmp_path_factory.mktemp("gpt2-draft")
    model.save_pretrained(path)
    return str(path)


# `make test` runs the suite on two pytest-xdist workers (`-n 2`). The files that run on
# a Ray instance (RAY_FILES: ray_local / serve_http, each worker starting its own) or on
# the local cluster of cluster/local_cluster.sh (TWO_NODE_FILES) are the bulk of the
# suite's time; they are cut into two groups of about equal measured time (durations of a
# full run on a 2-core machine with a warm compile cache, in the comments), one per worker
# from the start, each group's files one after another so that one Serve app at a time
# per worker shares the cores. Every other file (models in process: specdec, policies,
# detectors) goes whole to the first worker free once its group is done, so that its
# module-scoped fixtures (compiled runners among them) are built once.
RAY_FIXTURES = frozenset({"ray_local", "serve_http"})
TWO_NODE_FILES = frozenset(
    "tests/deployments/" + name
    for name in (
        "test_deploy_shapes.py",  # ~510 s
        "test_node_loss.py",  # ~280 s
        "test_two_node.py",  # ~30 s
    )
)
RAY_GROUPS = {
    "ray-a": frozenset(
        "tests/" + name
        for name in (
            "deployments/test_channel.py",  # ~20 s
            "deployments/test_engine.py",  # ~630 s
            "deployments/test_engine_law.py",  # ~110 s
            "deployments/test_families_http.py",  # ~340 s
            "deployments/test_http.py",  # ~190 s
            "deployments/test_serve_engine.py",  # ~100 s
        )
    ),
    # with the local cluster's files, first
    "ray-b": frozenset(
        "tests/" + name
        for name in (
            "adaptation/test_bench_adaptation.py",  # ~220-300 s; bench.adaptation, a process
            "clients/test_aiperf.py",  # ~140 s; a client against its fixture's server
            "clients/test_guidellm.py",  # ~40 s
            "clients/test_lm_eval.py",  # ~35 s
            "clients/test_vllm_bench_replay.py",  # ~10 s (the client tests' server: here)
            "deployments/test_tensor_parallel_serve.py",  # ~350 s
            "monitoring/test_drift_e2e.py",  # ~75 s; Prometheus and Alertmanager
        )
    ),
}
RAY_FILES = RAY_GROUPS["ray-a"] | RAY_GROUPS["ray-b"]


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def scope_of(path: str) -> str:
    """The xdist scope of a test file: its Ray group (RAY_GROUPS; the local cluster's files
    are in "ray-b") or the file itself."""
    if path in TWO_NODE_FILES:
        return "ray-b"
    for group, files in RAY_GROUPS.items():
        if path in files:
            return group
    return path


# Files without Ray that take longest (compiles: with a warm cache, and with a cold one in
# parentheses; durations of a loaded run), first among
# the files that fill the workers once their Ray groups are done: a long file handed out
# last would keep one worker busy while the other has nothing left.
LONG_FILES = tuple(
    "tests/" + name
    for name in (
        "specdec/test_compiled.py",  # ~85 s (~270 s)
        "deployments/test_warm_up.py",  # ~25 s (~100 s)
        "specdec/test_draft_steps.py",  # ~60 s (~290 s)
    )
)

# Ray files whose tests run many processes of their own (a client's workers, Prometheus,
# a second Serve app): late in their group.
RAY_FILES_LATE = ("tests/clients/", "test_bench_adaptation.py", "test_drift_e2e.py")


def run_order(item) -> tuple[int, int]:
    """(group, order in it): the two Ray groups first, in that order (each worker starts
    with one of them), then every other file, LONG_FILES first. In a Ray group: the tests
    of the local cluster first (its nodes start while the other worker's group is still
    starting up: `ray start` gives up on a raylet that takes 30 s to register, which a
    2-core host under two groups' load can exceed), then the rest, RAY_FILES_LATE last."""
    path = file_of(item.nodeid)
    scope = scope_of(path)
    if scope not in RAY_GROUPS:  # LONG_FILES first, in their order, then the rest
        rank = LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES)
        return len(RAY_GROUPS), rank
    group = list(RAY_GROUPS).index(scope)
    if "two_node_cluster" in item.fixturenames:
        return group, 0
    return group, 1 + any(f in path for f in RAY_FILES_LATE)


def pytest_collection_modifyitems(config, items):
    """Tests in :func:`run_order` (stable: each file's order kept). A test of a worker's
    Ray or of the local cluster from a file not in a Ray group would run beside another
    worker's instance on whichever worker is free: refused, naming the file."""
    stray = set()
    for item in items:
        path = file_of(item.nodeid)
        if (RAY_FIXTURES & set(item.fixturenames) and path not in RAY_FILES) or (
            "two_node_cluster" in item.fixturenames and path not in TWO_NODE_FILES
        ):
            stray.add(file_of(item.nodeid))
    if stray:
        lists = "tests/conftest.py RAY_FILES / TWO_NODE_FILES"
        raise pytest.UsageError(f"{lists} lack {sorted(stray)}")
    items.sort(key=run_order)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """The local cluster stops once the last of its tests (they run in a row) is done,
    after that test's fixtures are torn down (they may still use the cluster). The same
    for the worker's own Ray instance (and Serve on it) once its Ray group is done: its
    idle controller, proxy and agents took about a tenth of a core while the worker went
    on with the files that need no Ray."""
    if "two_node_cluster" in item.fixturenames and (
        nextitem is None or "two_node_cluster" not in nextitem.fixturenames
    ):
        from tests.deployments.conftest import LOCAL_CLUSTER_STOP

        if stop := item.config.stash.get(LOCAL_CLUSTER_STOP, None):
            stop()
    if scope_of(file_of(item.nodeid)) in RAY_GROUPS and (
        nextitem is None or scope_of(file_of(nextitem.nodeid)) not in RAY_GROUPS
    ):
        release_ray()


def release_ray() -> None:
    """Serve, then this process's Ray instance, shut down (nothing when it runs none).
    Only once the worker's Ray groups are done: each is handed out whole and the groups
    come first (:func:`run_order`), so no later test of this worker needs them."""
    import ray

    if ray.is_initialized():
        from ray import serve

        serve.shutdown()
        ray.shutdown()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduling by :func:`scope_of` each test's file, for ``--dist load`` (what
    ``-n`` alone means) only: another ``--dist`` is kept. Scopes are handed out in the
    order of the collection (:func:`run_order`), not by their number of tests, so that
    each worker starts with a Ray group of its own."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class RayFilesApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(file_of(nodeid))

    return RayFilesApart(config, log)


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker (not the processes it starts)
        # Two workers on two cores: one intra-op thread each, instead of two threads per
        # process spinning against each other and against the Ray worker's actors.
        torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cpu",
        help="torch device the model-running specdec tests use (cpu, cuda): "
        "`pytest tests/specdec --device cuda` on a GPU machine (no Ray needed)",
    )


@pytest.fixture(scope="session")
def device(pytestconfig) -> str:
    """The ``--device`` the specdec tests put their runners and references on."""
    name = pytestconfig.getoption("--device")
    if torch.device(name).type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {name}: this machine has no CUDA device")
    return name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float, what: str, every_s: float = 0.5):
    """``predicate()``'s first truthy value, polled every ``every_s`` for up to
    ``timeout_s`` (then an AssertionError naming ``what``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.fixture(scope="session")
def ray_local():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    # Logical CPUs: the workers reserve resources; the machine's 2 cores are shared.
    # "local": a new instance of this worker's own, never another worker's or the local
    # cluster's (which ray.init would otherwise find and join).
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    # Nothing reads the log monitor's output without log_to_driver, and it rescans every
    # worker's log file ten times a second: 2.5 % of a core by the run's tenth minute
    # (16 CPU-s, measured), growing with the hundreds of workers a run starts. (ray.init
    # has no switch for it, as `ray start --include-log-monitor` has.)
    ray._private.worker._global_node.kill_log_monitor()
    yield
    ray.shutdown()


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def serve_http(ray_local):
    """Ray Serve's HTTP proxy on a free loopback port; yields the base URL."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    import ray

    if ray.is_initialized():  # (else released with the worker's Ray groups: release_ray)
        serve.shutdown()


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """Every family of :mod:`tests.model_families`, built once: name -> (target, draft,
    tokenizer) directories."""
    from tests.model_families import FAMILIES, build_family

    root = tmp_path_factory.mktemp("families")
    return {name: build_family(f, root / name) for name, f in FAMILIES.items()}
