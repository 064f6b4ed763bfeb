"""How a runner executes its model's forward: eager, or as compiled graphs.

Why compile: on the demo pair (and on any model on a GPU) an eager forward is one
Python-dispatched kernel at a time, so a small draft's step costs nearly what its
arithmetic does not. ``torch.compile`` (Inductor) traces the whole forward, transformers'
code and the slot cache included, into one graph of fused kernels.

Why graphs per :class:`PassShape` and not one per pass: a graph is traced for the sizes of
its first pass; sizes of 1 are always specialised (a one-row or one-query pass gets graphs
of its own), every other size is marked dynamic before the call (rows, queries, keys), so
one graph serves every batch of 2..max_num_seqs rows, every draft length and every context
length. The runner canonicalises compiled passes (every row's writes scattered by
position, keys gathered by slot, masks per row), so nothing else a pass carries (which
slots, where rows start) changes which graph runs. :meth:`ModelRunner.warm_up
<specdec.runner.ModelRunner.warm_up>` compiles all of them at startup; after it, no pass
recompiles (``tests/specdec/test_compiled.py`` runs rounds under
``torch._dynamo.config.error_on_recompile``).

A graph that fails to compile leaves that shape eager (logged), the rest compiled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch.fx.experimental import _config as fx_config

logger = logging.getLogger("specserve.execution")

EAGER = "eager"
TORCH_COMPILE = "torch_compile"
# The eager modules' kernels recorded as CUDA graphs, one per static pass shape
# (specdec.cuda_graphs): on CUDA. Elsewhere the same padded passes run eagerly (tests).
CUDA_GRAPH = "cuda_graph"
EXECUTION_MODES = (EAGER, TORCH_COMPILE, CUDA_GRAPH)

# What each device type runs when a model spec leaves execution_mode unset: what the
# benchmarks measured faster there (docs/benchmarks.md): on CPU Inductor's graphs
# (bench.costs); on CUDA the eager kernels recorded as CUDA graphs (bench.gpu on an H200:
# an 8B verification 9.5 against 26-34 ms eager, as fast as Inductor's kernels recorded
# the same way, which took 101 + 71 s to compile where recording took 5 s).
_DEFAULT_MODE = {"cpu": TORCH_COMPILE, "cuda": CUDA_GRAPH}

# Graphs one CompiledForward may hold (torch counts them per code object, and each
# CompiledForward has a code object of its own: :func:`_own_code`): the shapes of
# :class:`PassShape` (4) or of a draft's fused steps (5), with room to spare.
_GRAPHS_PER_SET = 16


def default_execution_mode(device_type: str) -> str:
    """The execution mode a model on ``device_type`` ("cpu", "cuda") gets by default."""
    return _DEFAULT_MODE.get(device_type, EAGER)


def check_execution_mode(mode: str) -> str:
    if mode not in EXECUTION_MODES:
        raise ValueError(f"execution_mode must be one of {EXECUTION_MODES}, got {mode!r}")
    return mode


def compile_cache_dir(base: str | os.PathLike) -> Path:
    """Where Inductor keeps its compiled artifacts, under ``base``: one directory per
    torch and transformers version (a new version traces different code). Inductor keys
    each artifact by its graph, which holds the model's shapes and config, so models and
    settings share the directory without colliding."""
    tag = f"torch-{torch.__version__}-transformers-{transformers.__version__}"
    return Path(base).expanduser() / tag.replace("+", "_")


def use_compile_cache(base: str | os.PathLike) -> Path:
    """Point this process's Inductor caches at :func:`compile_cache_dir` (before the first
    compile: Inductor reads the variable when it first needs the directory), so a restart
    loads graphs instead of compiling them again."""
    path = compile_cache_dir(base)
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def seconds_by_name(seconds: dict) -> dict[str, float]:
    """Compile seconds per shape (a warm-up's result) keyed by the shapes' names, rounded
    to 10 ms: what workers report in their info and logs."""
    return {str(shape): round(s, 2) for shape, s in seconds.items()}


@dataclass(frozen=True, slots=True)
class PassShape:
    """Which compiled graph a forward pass runs: the sizes the graph is specialised on."""

    single_row: bool  # batch == 1
    single_query: bool  # n == 1 (decode, a draft step)

    def __str__(self) -> str:
        rows = "1 row" if self.single_row else "rows"
        queries = "1 query" if self.single_query else "queries"
        return f"{rows} x {queries}"


class CompiledForward:
    """A function compiled once per shape, eager where that failed: a model's forward per
    :class:`PassShape`, or a round's fused draft steps (:mod:`specdec.draft_steps`) per
    :class:`~specdec.draft_steps.StepsShape`.

    Call it with the shape, the tensors whose sizes vary between calls of that shape
    (``dynamic``: tensor and dims, marked dynamic on the way in: rows, queries, keys) and
    the function's keyword arguments."""

    def __init__(self, fn, name: str):
        self.name = name
        self._eager = fn
        # fullgraph: a graph break is a failure (then eager for that shape), not a silent
        # split into pieces with Python between them.
        own = _own_code(fn, name)
        self.code = own.__code__  # where torch keeps this set's graphs (no one else's)
        self._compiled = torch.compile(own, fullgraph=True)
        self.compile_seconds: dict = {}  # shape -> first call's time [s]
        self.eager_shapes: set = set()  # shapes whose graph failed or went stale
        # Once warm (freeze), a pass whose graph's guards fail never compiles in a request
        # (seconds that would stall every row of the batch): its shape goes eager, logged.
        self.frozen = False
        # Once frozen, warm graphs check their input tensors' guards alone
        # (:meth:`_guard_stance`); False: every guard (tests of recompiles set it).
        self.trust_warm_guards = True
        self._every_guard = 0  # calls inside every_guard() in flight
        self._settings = {state: _CompileSettings(state) for state in (False, True)}

    def freeze(self) -> None:
        """No more compiling: called after the warm-up has built every shape's graph."""
        self.frozen = True

    @contextlib.contextmanager
    def every_guard(self):
        """Calls inside check every guard of their graph: for a call whose Python-level
        settings may differ from those the warm-up traced under one shape (a pass recorded
        once into a CUDA graph: ``ModelRunner._static_pass``), which only guards the
        skipped ones can tell apart, and whose guards are paid once anyway."""
        self._every_guard += 1
        try:
            yield
        finally:
            self._every_guard -= 1

    def __call__(self, shape, dynamic: list[tuple[torch.Tensor, tuple[int, ...]]], **kwargs):
        if shape in self.eager_shapes:
            return self._eager(**kwargs)
        for tensor, dims in dynamic:
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        start = time.perf_counter()
        try:
            with self._settings[self.frozen], self._guard_stance(shape):
                out = self._compiled(**kwargs)
        except _COMPILE_ERRORS as exc:
            # A graph that could not be made (or, once frozen, would have to be made again):
            # this shape runs eager from now on. Errors of running a graph (out of memory,
            # a bad input) are not caught: the caller sees them as the eager path raises them.
            self.eager_shapes.add(shape)
            logger.warning("%s: %s runs eager, its graph failed: %r", self.name, shape, exc)
            return self._eager(**kwargs)
        if shape not in self.compile_seconds:
            seconds = time.perf_counter() - start
            self.compile_seconds[shape] = seconds
            logger.info("%s: compiled %s in %.1f s", self.name, shape, seconds)
        return out

    def _guard_stance(self, shape) -> contextlib.AbstractContextManager:
        """How much of a graph's guards a call evaluates: once frozen, for a shape whose
        graph the warm-up built, outside any function mode, only the checks of the input
        tensors (torch's ``skip_guard_eval_unsafe`` stance: the guards on tensors that are
        not parameters, and any guard that ever failed), else all of them.

        Why: the rest are checks on parameters and on hundreds of module attributes
        (config values, flags), about 0.2 ms of every target pass and of every draft graph
        on this repository's CPU machines (measured interleaved, demo pair), on the
        critical path of every round. None of it can change once warm: weights change in
        place (:meth:`ModelRunner.load_weights <specdec.runner.ModelRunner.load_weights>`),
        modules are never rebuilt, and the sizes and dtypes of every input, the KV cache
        included, are still checked. A shape the warm-up did not build, or a call under a
        function mode (a profiler, a counter), gets every guard, so it misses and runs
        eager as before.

        What picks a graph must therefore be in its shape key or a tensor's size: a
        Python value the graph was specialised on is not checked once warm (see
        :meth:`every_guard`). torch's stance is the process's, not the thread's: it is
        taken only while no other thread's call holds it (else every guard runs), and
        graphs are called from one thread per process (the engine core's loop, the draft
        worker's)."""
        if (
            self.frozen
            and self.trust_warm_guards
            and not self._every_guard
            and shape in self.compile_seconds
            and not _function_modes()
        ):
            return _SkippedGuards()
        return contextlib.nullcontext()


def _function_modes() -> int:
    """How many ``TorchFunctionMode`` s are active (their stack is one of a graph's guards)."""
    return torch._C._len_torch_function_stack()


# Held by the one call under torch's skip_guard_eval_unsafe stance (a process-wide setting):
# a call on another thread meanwhile evaluates every guard instead of sharing or undoing it.
_SKIP_GUARDS_LOCK = threading.Lock()


class _SkippedGuards:
    """torch's ``skip_guard_eval_unsafe`` stance around one call, when no other thread's
    call holds it (else nothing: that call checks every guard)."""

    def __enter__(self) -> None:
        self._stance = None
        if _SKIP_GUARDS_LOCK.acquire(blocking=False):
            try:
                stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
                stance.__enter__()
            except BaseException:
                _SKIP_GUARDS_LOCK.release()
                raise
            self._stance = stance

    def __exit__(self, *exc) -> None:
        if self._stance is not None:
            try:
                self._stance.__exit__(*exc)
            finally:
                _SKIP_GUARDS_LOCK.release()


# What a graph that cannot be made (or, once frozen, made again) raises.
_COMPILE_ERRORS = (
    torch._dynamo.exc.TorchDynamoException,
    torch._dynamo.exc.FailOnRecompileLimitHit,
)


def _own_code(fn, name: str):
    """``fn`` behind a function whose code object no other caller shares.

    Why: torch keeps compiled graphs, and their guards, on the code object of the function
    it compiles. A model's ``forward`` (transformers wraps it) is one code object for every
    model in the process, and a method is one for every instance: without this, a target's
    and a colocated draft's graphs sit in one list that every pass searches in order, and
    a process that builds many runners (the tests) fills torch's per-code limit, after
    which new shapes go eager."""

    def call(**kwargs):
        return fn(**kwargs)

    label = "".join(c if c.isalnum() else "_" for c in name)
    call.__code__ = call.__code__.replace(
        co_name=f"compiled_{label}", co_qualname=f"compiled_{label}"
    )
    call.__name__ = call.__qualname__ = call.__code__.co_name
    return call


class _CompileSettings:
    """torch's tracing settings for these graphs, applied around each call (they take
    effect when a call compiles; nothing else in the process sees them):

    - no automatic dynamic sizes: the sizes that vary are marked, and a size that is not
      (a model's widths, a 1 of :class:`PassShape`) must never turn into a symbol because
      a second call saw another;
    - no duck shaping: sizes equal when a graph is traced (a prefill from position 0 has
      as many queries as keys) stay separate symbols, so the graph does not assume they
      always are;
    - room for all the shapes' graphs;
    - once ``frozen``, a recompile is an error (:class:`CompiledForward` then runs the
      shape eager).

    torch keeps these patches per thread, so a thread compiling here changes nothing for
    another.

    Built once per graph set and state (frozen or not) and entered around each call:
    entering prebuilt patches costs about a quarter of building them (13 against 48 us a
    pass, measured), on every pass of every round.
    """

    def __init__(self, frozen: bool):
        self._patches = (
            torch._dynamo.config.patch(
                automatic_dynamic_shapes=False,
                recompile_limit=_GRAPHS_PER_SET,
                error_on_recompile=frozen,
            ),
            fx_config.patch(use_duck_shape=False),
        )

    def __enter__(self) -> None:
        for patch in self._patches:
            patch.__enter__()

    def __exit__(self, *exc) -> None:
        for patch in reversed(self._patches):
            patch.__exit__(*exc)
