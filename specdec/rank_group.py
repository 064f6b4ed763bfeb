"""A tensor-parallel group: one model runner per rank, run in lockstep from rank 0.

Rank 0 is the process that uses the runner (the engine core, or a one-process loop). Every
call that runs a pass or changes the cache's bookkeeping is mirrored on the other ranks as
a :class:`RankCall` (the call's own arguments, token ids and sequence ids, never logits).
Bookkeeping calls (a sequence added, freed, forked, renamed, rolled back) run on rank 0 at
once and travel with its next pass, so that a pass and everything since the previous one
reach the other ranks in one broadcast: one per engine round. The others run the calls in
order on their shards (:func:`follow`); the layers' sums (:mod:`specdec.tensor_parallel`)
keep them in step inside each pass. Every rank computes the same logits; rank 0's are
used. Calls that only read (lengths, slots free, the KV usage) run on rank 0 alone.

A rank that dies or hangs stalls the others in their next collective until the group's
timeout (``timeout_s``), where ``torch.distributed`` raises: the group fails together, and
whoever owns it replaces it whole. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from specdec.tensor_parallel import ModelShard

logger = logging.getLogger("specserve.tensor_parallel")

# The runner's calls that run a pass or change what the cache holds: run on every rank.
MIRRORED = frozenset(
    {
        "add",
        "free",
        "fork",
        "rename",
        "rollback",
        "forward",
        "forward_padded",
        "prefill",
        "warm_up",
        "advance",
        "end_steps",
        "step_logits",
    }
)


# Of MIRRORED, the calls that change only the cache's bookkeeping (no pass, no sum): sent
# with rank 0's next pass. Each validates before it changes anything (SlotTable), so one
# that raises on rank 0 changed nothing and is not sent.
DEFERRED = frozenset({"add", "free", "fork", "rename", "rollback", "advance", "end_steps"})


def _as_is(value: Any) -> Any:
    return value


class _HostPickler(pickle.Pickler):
    """Pickles a call's device tensors (a draft step's token ids) as host tensors: another
    rank's device is not this one's, and the runner's calls take host tensors (each rank
    moves them to its own device). Only tensors are touched, nothing else is walked."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return _as_is, (obj.cpu(),)
        return NotImplemented


@dataclass(frozen=True)
class RankCall:
    """One runner call, as rank 0 broadcasts it before running it itself."""

    method: str  # one of MIRRORED; "" ends the followers' loop
    args: tuple = ()  # positional arguments: seq ids, token ids ([rows][tokens] or [rows, n])
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments (last_only, ...)


STOP = RankCall("")
# After a mirrored call raised on rank 0: whether every rank raised at the same call (see
# MirroredRunner._in_step), answered by each rank's "raised" flag and call count.
CHECK = RankCall("check")
# Calls that cannot be mirrored: new weights come whole (one rank's cut each would be needed).
REFUSED = frozenset({"load_weights", "add_low_rank", "allocate_kv"})
# How long an idle rank waits for rank 0's next call: for good (see RankGroup.receive).
IDLE_WAIT = timedelta(days=365)
# How long ranks wait for each other to join: a rank is an actor that Ray may still be
# starting (a process, torch's import) when the core joins.
JOIN_TIMEOUT_S = 600.0


def numbered(device: torch.device, current: Callable[[], int] | None = None) -> torch.device:
    """``device`` with its index: a bare ``cuda`` (what a worker whose GPU Ray assigned
    asks for) is the process's current CUDA device (``current``, torch's by default), the
    rank's own GPU under the ``CUDA_VISIBLE_DEVICES`` Ray sets. ``torch.cuda.set_device``
    refuses a CUDA device without an index, so a split model on a GPU could not start."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", (current or torch.cuda.current_device)())


class RankGroup:
    """This process's place in a group of ``world_size`` ranks (one per device), joined
    through ``init_method`` (``tcp://host:port`` of rank 0) within ``join_timeout_s``.
    ``timeout_s``: how long a collective waits for a rank before it raises (the group's
    watchdog), but for an idle rank's wait for the next call (:meth:`receive`)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        init_method: str,
        device: str = "cpu",
        timeout_s: float = 60.0,
        join_timeout_s: float = JOIN_TIMEOUT_S,
    ):
        self.rank, self.world_size = rank, world_size
        self.device = numbered(torch.device(device))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":  # NCCL works on the current device: this rank's
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=join_timeout_s),  # the wait for every rank to join
        )
        self._pg = dist.distributed_c10d._get_default_group()
        self._timeout = timedelta(seconds=timeout_s)  # every collective's, after
        self.calls = 0  # runner calls broadcast (rank 0) or received (the others)
        self.messages = 0  # broadcasts that carried them: one per pass
        self.call_bytes = 0  # their pickled bytes (the sums inside passes not counted)

    def shard(self) -> ModelShard:
        """What a runner needs of the group to load its share of a model."""
        return ModelShard(
            self.world_size, self.rank, self.all_reduce, self.min_over_ranks, self.barrier
        )

    def all_reduce(
        self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, timeout: timedelta | None = None
    ) -> None:
        """Sum ``tensor`` over the ranks, in place, within the timeout (the group's, unless
        given)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp, opts.timeout = op, timeout or self._timeout
        self._pg.allreduce([tensor], opts).wait()

    def agree(self, raised: bool) -> bool:
        """Whether every rank's last call ``raised`` alike, at the same call count."""
        high = torch.tensor([int(raised), self.calls], device=self.device)
        low = high.clone()
        self.all_reduce(high, dist.ReduceOp.MAX)
        self.all_reduce(low, dist.ReduceOp.MIN)
        return bool(torch.equal(high, low))

    def barrier(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Wait until every rank is here, for up to ``timeout_s`` (ranks that load their
        share at different speeds meet before the first pass, whose sums time out sooner)."""
        self.all_reduce(torch.zeros(1, device=self.device), timeout=timedelta(seconds=timeout_s))

    def min_over_ranks(self, value: int) -> int:
        """The least of ``value`` over the ranks (the KV slots every rank can hold)."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        self.all_reduce(t, dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast(self, calls: tuple[RankCall, ...]) -> None:
        """Rank 0: send ``calls`` (to be run in order) to every other rank in one message:
        its size, then its pickled bytes (tensors in them as host tensors)."""
        buffer = io.BytesIO()
        _HostPickler(buffer).dump(calls)
        payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.long)
        self._broadcast(size, self._timeout)
        self._broadcast(payload, self._timeout)
        self._count(calls, payload.numel())

    def receive(self) -> tuple[RankCall, ...]:
        """Another rank: the next calls rank 0 broadcast. Waits for them without a limit: an
        idle rank 0 sends nothing, and one that died closes its connections, which ends
        the wait at once; the message's bytes, once announced, come within the timeout."""
        size = torch.zeros(1, dtype=torch.long)
        self._broadcast(size, IDLE_WAIT)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(payload, self._timeout)
        calls = pickle.loads(payload.numpy().tobytes())
        self._count(calls, payload.numel())
        return calls

    def _count(self, calls: tuple[RankCall, ...], nbytes: int) -> None:
        self.calls += sum(c.method in MIRRORED for c in calls)  # (not CHECK or STOP)
        self.messages += 1
        self.call_bytes += nbytes

    def _broadcast(self, tensor: torch.Tensor, timeout: timedelta) -> None:
        """Rank 0's ``tensor`` into every rank's, waiting at most ``timeout`` (on the
        group's device; host tensors in and out)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, timeout
        moved = tensor.to(self.device)
        self._pg.broadcast([moved], opts).wait()
        if moved is not tensor:
            tensor.copy_(moved)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port(host: str = "") -> int:
    """A TCP port free on this host now, for rank 0's ``init_method`` (the group's store
    listens on it once rank 0 joins)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MirroredRunner:
    """Rank 0's runner: a call in :data:`MIRRORED` is broadcast, then run here, with the
    :data:`DEFERRED` calls run here since the last broadcast ahead of it; anything else
    (attributes, reads) is the local runner's. Stands in for a ``ModelRunner``.

    A mirrored call that raises here (a request past the context, an unknown sequence)
    raised on every rank alike when it failed before its first sum: then the group is
    still in step and the caller may go on (failing that request alone). Anything else
    leaves the ranks out of step for good: :attr:`broken` says so, and the group must be
    replaced whole."""

    def __init__(self, runner, group: RankGroup):
        self._runner, self._group = runner, group
        self.broken = False
        self._pending: list[RankCall] = []  # DEFERRED calls run here, not yet sent

    def __getattr__(self, name: str):
        attr = getattr(self._runner, name)
        if name in REFUSED:
            raise AttributeError(f"{name}: not for a model split over ranks")
        if name not in MIRRORED:
            return attr

        def mirrored(*args, **kwargs):
            if self.broken:
                raise RuntimeError("the tensor-parallel group is out of step")
            if name in DEFERRED:  # here first: one that raises changed nothing, is not sent
                result = attr(*args, **kwargs)
                # (a copy: the caller may change a list it passed before the next pass)
                self._pending.append(RankCall(name, copy.deepcopy(args), copy.deepcopy(kwargs)))
                return result
            calls, self._pending = (*self._pending, RankCall(name, args, kwargs)), []
            try:
                self._group.broadcast(calls)
                return attr(*args, **kwargs)
            except Exception:
                self.broken = not self._in_step()
                raise

        return mirrored

    def _in_step(self) -> bool:
        """Whether every rank raised at the last call, at the same call count (a check of
        its own: two sums); False where the check itself fails."""
        try:
            self._group.broadcast((CHECK,))
            return self._group.agree(raised=True)
        except Exception:
            logger.exception("tensor-parallel group check failed")
            return False

    @property
    def group(self) -> RankGroup:
        return self._group

    def stop_followers(self) -> None:
        """End the other ranks' :func:`follow` loops (the group stays up)."""
        self._pending = []  # (nothing more runs on the others)
        self._group.broadcast((STOP,))

    def close(self) -> None:
        """Leave the group (the others' next collective fails: call after stopping them)."""
        self._group.close()


def follow(runner, group: RankGroup, on_call: Callable[[RankCall], None] | None = None) -> int:
    """Another rank's loop: run the calls rank 0 broadcasts, in order, on this rank's
    ``runner`` until :data:`STOP`; returns the calls run. A call that raises here is logged
    and the loop goes on: rank 0's next message is then its :data:`CHECK` (whether every
    rank raised alike) if it raised too, or its next pass stalls on this rank's missing
    sums until the timeout if this rank raised alone mid-pass (the group fails together).
    A call that raised here alone after its last sum (rank 0 went on without a CHECK)
    raises here: this rank's cache no longer matches rank 0's, and every later pass would
    sum wrong shares in silence, so the group must fail together instead."""
    done, raised = 0, None  # raised: the method of the last call, when it raised here
    while True:
        for call in group.receive():
            if not call.method:
                return done
            if call.method == CHECK.method:
                group.agree(raised is not None)
                raised = None  # (rank 0 goes on only where every rank raised alike)
                continue
            if raised is not None:
                raise RuntimeError(
                    f"rank {group.rank}: {raised} raised here but not on rank 0, which went "
                    f"on to {call.method}: the ranks are out of step"
                )
            if call.method not in MIRRORED:
                raise ValueError(f"rank {group.rank}: {call.method!r} is not a mirrored call")
            try:
                getattr(runner, call.method)(*call.args, **call.kwargs)
            except Exception:
                logger.exception("rank %d: %s raised", group.rank, call.method)
                raised = call.method
            done += 1
            if on_call is not None:
                on_call(call)


def run_rank(
    make_runner: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    device: str = "cpu",
    timeout_s: float = 60.0,
    on_call: Callable[[RankCall], None] | None = None,
) -> int:
    """A rank other than 0, for its whole life: join the group, load this rank's share
    (``make_runner(shard=...)``, built as rank 0 builds its own), follow rank 0's calls
    until it stops them, leave. Returns the calls run."""
    group = RankGroup(rank, world_size, init_method, device, timeout_s)
    try:
        torch.set_grad_enabled(False)
        return follow(make_runner(shard=group.shard()), group, on_call)
    finally:
        group.close()


def lead(
    make_runner: Callable[..., Any],
    world_size: int,
    init_method: str,
    device: str = "cpu",
    timeout_s: float = 60.0,
) -> MirroredRunner:
    """Rank 0: join the group (the other ranks join at the same ``init_method``) and
    load rank 0's share; every call of the runner returned reaches the group."""
    group = RankGroup(0, world_size, init_method, device, timeout_s)
    try:
        return MirroredRunner(make_runner(shard=group.shard()), group)
    except BaseException:
        group.close()
        raise
