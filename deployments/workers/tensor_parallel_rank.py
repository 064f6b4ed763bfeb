"""A split model's rank other than 0: its share of the model, following rank 0.

For a split target the engine core is rank 0, for a split draft the draft worker: it holds
its own share and runs its loop, and every call of its runner that runs a pass reaches the
other ranks as one broadcast (:mod:`specdec.rank_group`). Each other rank is one of these
actors, on a device of its own in the replica's placement group, named for what it is so
that operators find the ranks in Ray's dashboard and state API (``health`` says whose).
It decides nothing: it loads its share as rank 0 loads its own and runs what rank 0
broadcasts, until rank 0 stops it or the group fails. A failed group is not repaired here:
the actor exits, rank 0 exits with it, and the replica replaces that worker (which starts a
fresh group).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from functools import partial
from typing import Any

import ray

from deployments.config import ModelSpec
from deployments.messages import RankConfig
from deployments.workers.model_loader import (
    configure_thread,
    load_runner,
    pin_thread,
    worker_device,
)
from specdec.rank_group import RankCall, run_rank

logger = logging.getLogger("specserve.workers")


class TensorParallelRank:
    """One rank (1 .. N - 1) of a split target or draft (a threaded Ray actor)."""

    def __init__(self, config: RankConfig):
        self.config = config
        self.spec = ModelSpec.model_validate(config.spec)
        self.calls = 0  # runner calls run for the core
        self.last_call_at: float | None = None  # time.time() of the last one
        self.error: str | None = None
        self._loaded = threading.Event()
        self._thread: threading.Thread | None = None

    def join(self, init_method: str) -> None:
        """Join the core's group at ``init_method`` and follow it, in a thread of its own
        (the core joins at the same time: the group forms when all have)."""
        if self._thread is not None:
            raise RuntimeError(f"rank {self.config.rank} has joined its group already")
        self._thread = threading.Thread(
            target=self._run, args=(init_method,), name=f"specserve-rank-{self.config.rank}"
        )
        self._thread.daemon = True
        self._thread.start()

    def _run(self, init_method: str) -> None:
        configure_thread(self.spec)
        pin_thread(self.config.cpu_affinity)
        c = self.config
        try:
            run_rank(
                partial(self._load, c.max_num_seqs),
                c.rank,
                c.world_size,
                init_method,
                worker_device(self.spec),
                c.timeout_s,
                self._counted,
            )
            logger.info("rank %d of %s stopped by rank 0", c.rank, self.spec.model)
        except BaseException as exc:
            # The group is broken (the core or another rank died or hung) or this rank
            # failed: nothing here can be served again. Exit, as the core does.
            self.error = f"rank {c.rank} failed: {exc!r}"
            logger.exception("rank %d of %s failed; exiting", c.rank, self.spec.model)
            os._exit(1)

    def _load(self, max_num_seqs: int, shard):
        runner = load_runner(self.spec, max_num_seqs, shard=shard, verifies=self.config.verifies)
        self._loaded.set()
        return runner

    def _counted(self, _call: RankCall) -> None:
        self.calls += 1
        self.last_call_at = time.time()

    def ready(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Once this rank's share is loaded: where it runs (for the core's ``ready``)."""
        if not self._loaded.wait(timeout_s):
            raise TimeoutError(f"rank {self.config.rank} not loaded within {timeout_s:.0f} s")
        return self.health()

    def health(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "rank": self.config.rank,
            "role": self.config.role,
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "loaded": self._loaded.is_set(),
            "calls": self.calls,
            "last_call_at": self.last_call_at,
            "error": self.error,
        }
