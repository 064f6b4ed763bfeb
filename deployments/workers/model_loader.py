"""Loading a model runner for a worker: the spec's model on its device with its KV cache
(whole, or rank 0's share with the other ranks joining), and the per-thread torch settings a
loop thread needs. Used by the draft worker and by the engine core (which loads the target,
and a colocated draft)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray
import torch

from deployments.config import ModelSpec
from specdec.rank_group import MirroredRunner, free_port, lead
from specdec.tensor_parallel import ModelShard

if TYPE_CHECKING:
    from specdec.runner import ModelRunner

logger = logging.getLogger("specserve.workers")


def worker_device(spec: ModelSpec) -> str:
    """The torch device a worker loads its model on: the spec's, or by what Ray gave it."""
    if spec.device != "auto":
        return spec.device
    return "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"


def pin_thread(cores: list[int] | None) -> list[int]:
    """Run the calling thread (and the threads it starts, torch's included) on ``cores``
    (Linux: ``sched_setaffinity`` of thread id 0 is the calling thread). Cores this process
    may not use are left out, logged; returns the cores the thread now runs on (empty:
    unchanged, when ``cores`` is None, none is usable, or the OS cannot pin)."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return []
    allowed = os.sched_getaffinity(0)
    usable = sorted(set(cores) & allowed)
    if usable != sorted(cores):
        logger.warning(
            "cpu_affinity %s: cores %s are not this worker's (it may use %s); %s",
            cores,
            sorted(set(cores) - allowed),
            sorted(allowed),
            f"pinned to {usable}" if usable else "left unpinned",
        )
    if usable:
        os.sched_setaffinity(0, usable)
    return usable


def configure_thread(spec: ModelSpec) -> None:
    """Per-thread torch settings: OpenMP's thread count and grad mode are per thread, so a
    loop thread must set them itself (else it runs with one OpenMP thread per core)."""
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    torch.set_grad_enabled(False)
    if spec.default_device:
        torch.set_default_device(spec.default_device)  # per thread, as grad mode


def show_info_logs() -> None:
    """SpecServe's INFO records (model loading, the KV arithmetic, each compiled graph's
    time) on this process's stderr, which Ray keeps in the worker's log: a Ray worker's root
    logger has no handler, so only warnings would reach it (through logging's last resort).
    Nothing changes in a process whose root logger has handlers (a driver that configured
    logging, pytest): the records reach those."""
    log = logging.getLogger("specserve")
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def load_runner(
    spec: ModelSpec,
    max_num_seqs: int,
    defer_kv: bool = False,
    kv_shared_with=None,
    verifies: bool = True,
    shard: ModelShard | None = None,
) -> ModelRunner:
    """The spec's model on its device with its KV cache (see ModelRunner for the
    keyword arguments: a colocated draft's cache comes out of the target's budget; a
    draft, ``verifies`` False, keeps no every-position logits in its reserve). The
    calling thread is configured for the spec once loaded, except for a deferred
    (colocated) draft: the target loads after it, with torch's defaults. ``shard``: this
    rank's place in a tensor-parallel group (its share of the model is loaded, eager).

    The model's stack (transformers' modeling, dynamo: seconds of CPU per process) is
    imported here, in the worker that loads, not when this module is: the Serve replica
    imports the workers' actor classes to start them and never runs a model."""
    from specdec.execution import EAGER, default_execution_mode, use_compile_cache
    from specdec.runner import ModelRunner

    show_info_logs()
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    device = worker_device(spec)
    mode = spec.execution_mode or default_execution_mode(torch.device(device).type)
    if spec.tensor_parallel_size > 1:
        mode = EAGER  # (ModelSpec refuses any other mode set with it)
    if mode != EAGER:
        use_compile_cache(spec.compile_cache_dir)
    logger.info("loading %s (%s) on %s, %s", spec.model, spec.dtype, device, mode)
    started = time.monotonic()
    runner = ModelRunner(
        spec.model,
        dtype=spec.dtype,
        device=device,
        max_num_seqs=max_num_seqs,
        max_model_len=spec.max_model_len,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        trust_remote_code=spec.trust_remote_code,
        kv_cache_memory_bytes=spec.kv_cache_memory_bytes,
        kv_cache_memory_fraction=spec.kv_cache_memory_fraction,
        defer_kv=defer_kv,
        kv_shared_with=kv_shared_with,
        execution_mode=mode,
        # The largest passes run once first: their peak memory stays out of the budget.
        reserve_activations=True,
        verifies=verifies,
        shard=shard,
    )
    if not defer_kv:
        configure_thread(spec)  # after loading: from_pretrained may use the default device
    _log_loaded(spec, runner, time.monotonic() - started)
    for r in (runner, kv_shared_with):
        if r is not None and r.kv_plan is not None:
            _log_kv(r)
    return runner


def load_split(
    make: Callable[..., Any], ranks: list[Any], spec: ModelSpec, timeout_s: float
) -> tuple[MirroredRunner, list[dict[str, Any]]]:
    """Rank 0's share of a model split over ``ranks`` (TensorParallelRank actors, 1 ..
    N - 1), loaded by ``make(shard=...)`` as the others load theirs while they join this
    process's group; returns the runner and each other rank's ``ready`` answer (where it
    runs). Ranks placed on another node are refused: the group's store is on loopback."""
    mine = ray.get_runtime_context().get_node_id()
    where = ray.get([rank.health.remote() for rank in ranks])  # (alive, placed)
    apart = [r["rank"] for r in where if r["node_id"] != mine]
    if apart:
        raise RuntimeError(
            f"tensor-parallel ranks {apart} of {spec.model} are not on rank 0's node: the "
            "placement group could not pack them together (placement_strategy PACK or "
            "STRICT_PACK, and resources that one node holds N times)"
        )
    init_method = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    for rank in ranks:
        rank.join.remote(init_method)
    world = len(ranks) + 1
    runner = lead(make, world, init_method, worker_device(spec), timeout_s)
    infos = ray.get([rank.ready.remote() for rank in ranks])
    logger.info("%s split over %d ranks (group at %s)", spec.model, world, init_method)
    return runner, infos


def group_health(runner, rank_actors: list[Any]) -> dict[str, Any] | None:
    """A split model's ranks as they answer now (None: the model is whole): rank 0's
    broadcast calls, and each other rank's calls run, or why it did not answer."""
    if not rank_actors:
        return None
    refs = [actor.health.remote() for actor in rank_actors]
    ray.wait(refs, num_returns=len(refs), timeout=5.0)  # one deadline for them all
    ranks = []
    for i, ref in enumerate(refs, start=1):
        try:
            ranks.append(ray.get(ref, timeout=0))
        except Exception as exc:  # dead or hung: the group fails at its next pass
            ranks.append({"rank": i, "error": repr(exc)})
    return {"size": len(ranks) + 1, "calls": runner.group.calls, "ranks": ranks}


def _log_loaded(spec: ModelSpec, runner: ModelRunner, seconds: float) -> None:
    size = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    logger.info(
        "loaded %s in %.1f s: %.2f GB of weights, %d logits rows, context %d",
        spec.model,
        seconds,
        size / 1e9,
        runner.vocab_size,
        runner.max_model_len,
    )


def _log_kv(runner: ModelRunner) -> None:
    """The KV arithmetic of a runner whose cache is allocated, with its activation reserve."""
    plan = runner.kv_plan
    logger.info(
        "KV cache of %s: %d slots x %d tokens (max_model_len) x %d bytes per token "
        "= %.2f GB; %.2f GB kept for activations and graphs (measured peaks: %s)",
        runner.model.name_or_path,
        runner.max_num_seqs,
        runner.max_model_len,
        plan.bytes_per_token,
        plan.total_bytes / 1e9,
        plan.reserved_bytes / 1e9,
        ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in runner.activation_peaks.items()),
    )


def warm_up(runner: ModelRunner) -> dict[str, float]:
    """Compile the runner's graphs now (nothing when eager); logs and returns the seconds
    each took, by pass shape, for the worker's info."""
    from specdec.execution import EAGER, seconds_by_name

    if runner.execution_mode == EAGER:
        return {}
    started = time.monotonic()
    seconds = seconds_by_name(runner.warm_up())
    logger.info(
        "%s: %d graphs ready in %.1f s (%s)",
        runner.model.name_or_path,
        len(seconds),
        time.monotonic() - started,
        ", ".join(f"{k}: {v} s" for k, v in seconds.items()),
    )
    return seconds


def worker_info(runner: ModelRunner) -> dict[str, Any]:
    ctx = ray.get_runtime_context()
    pg = ctx.get_placement_group_id()
    return {
        "node_id": ctx.get_node_id(),
        "placement_group_id": pg,
        "pid": os.getpid(),
        "vocab_size": runner.vocab_size,
        "max_model_len": runner.max_model_len,
        "device": str(runner.device),
        "execution_mode": runner.execution_mode,
        "kv_cache": runner.kv_plan.as_dict(),
    }
