"""The engine core: a loop next to the target model that runs rounds back to back.

As in vLLM v1 (a busy engine-core loop, a separate frontend), scheduling of the running
sequences lives here, in the target's process, not in the Serve replica. A round:

1. take the drafts for every running sequence from what the draft actor *pushed*: on a
   speculation-cache hit they arrived while the previous round was being verified, so
   the round starts at once, with no actor call and no engine code in between; on a miss
   the loop waits for the fresh drafts the draft actor sends when it learns the outcome;
2. verify them all in one target pass and commit;
3. tell the draft actor the outcomes (one fire-and-forget message per round, sent by a
   sender thread so the loop never pays for Ray's call path) and publish the committed
   tokens to the frontend, which long-polls :meth:`EngineCore.get_outputs`.

Admissions and aborts arrive as messages between rounds. Every call into this actor runs
in a concurrency group of its own (control, push, poll), so a long-poll never blocks a
push, and all of them run while the loop thread is inside torch (which releases the GIL).

Message to the draft (``DraftWorker.on_round``): ``(msg_no, first, round_for, items,
freed, (verify_s, round_s, tokens))``: the mean verify time, and the wall time and the
committed tokens of the round that just ended (None, 0 after an admission). An item is
``(seq_id, base_len, new_tokens, k, full_tokens, params)``: the sequence had ``base_len``
committed tokens, now also ``new_tokens``; drafts of length ``k`` are wanted for round
``round_for``. ``full_tokens``/``params`` are set when the draft
must (re)start the sequence from scratch (new sequence, new draft, lost track).
Pushes back (``push_drafts``): ``(round_for, [(seq_id, guess, tokens, q, speculative)])``:
drafts for the round in which ``seq_id``'s previous round committed exactly ``guess``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import ray
import torch

from deployments.config import ModelSpec
from deployments.workers import GIVE_UP, configure_thread, load_runner, worker_info
from specdec.policy import SpeculationLength
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState
from specdec.verify import VerifyRow, sample_next, verify_rows

logger = logging.getLogger("specserve.core")
POLICY_STATE_EVERY_S = 0.05  # how fresh the policy snapshot drain_telemetry returns is
# A row the length policy keeps at k = 0 this many rounds in a row leaves the draft (no
# per-round messages, no branches); fewer, and it stays: resuming costs a full prefill.
PAUSE_AFTER_ROUNDS = 8


@dataclass
class RoundTimings:
    """Accumulated time per round phase, measured in the loop (for benchmarks and metrics).

    ``total_s`` runs from the moment a round starts gathering its drafts to the moment its
    outcomes are published; ``draft_wait_s`` is the part spent waiting for drafts (misses);
    ``verify_s`` the target's forward pass plus verification. Overhead is the rest: every
    bit of the critical path that is neither model work nor waiting for the draft.
    """

    rounds: int = 0
    total_s: float = 0.0
    draft_wait_s: float = 0.0
    verify_s: float = 0.0
    rows: int = 0  # sequence-rounds
    drafted_rows: int = 0  # sequence-rounds that carried drafts
    hits: int = 0  # ... whose drafts were prepared ahead (speculation-cache hits)
    draft_timeouts: int = 0
    paused: int = 0  # rows the length policy took out of the draft (k = 0)
    resumed: int = 0  # ... and sent to it again in full (drafting resumed)

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.draft_wait_s - self.verify_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "overhead_s": self.overhead_s}


class Telemetry:
    """Round outcomes kept for the monitor until the frontend drains them (bounded: past
    ``max_rounds`` sequence-rounds the oldest are dropped and counted, so a monitor that
    stops draining cannot grow the core's memory)."""

    def __init__(self, max_rounds: int = 100_000):
        self.max_rounds = max_rounds
        self.drain()

    def add(self, outcomes, committed, verify_s: float, wait_s: float, total_s: float) -> None:
        """``outcomes``: (domain, drafted, accepted, cache hit) per drafted row;
        ``committed``: (domain, tokens) per row."""
        self.rounds.extend(outcomes)
        if len(self.rounds) > self.max_rounds:
            cut = len(self.rounds) - self.max_rounds
            del self.rounds[:cut]
            self.dropped += cut
        for domain, n in committed:
            self.committed[domain] = self.committed.get(domain, 0) + n
        if len(self.verify_s) < self.max_rounds:
            self.verify_s.append(verify_s)
            self.draft_wait_s.append(wait_s)
            self.overhead_s.append(max(0.0, total_s - verify_s - wait_s))

    def drain(self) -> dict[str, Any]:
        out = {
            k: getattr(self, k, None)
            for k in ("rounds", "committed", "verify_s", "draft_wait_s", "overhead_s", "dropped")
        }
        self.rounds, self.committed, self.dropped = [], {}, 0
        self.verify_s, self.draft_wait_s, self.overhead_s = [], [], []
        return out


@dataclass
class _Seq:
    state: SequenceState
    k: int  # requested draft length
    k_next: int = 0  # draft length asked of the draft for the next round
    guess: tuple[int, ...] = ()  # what the last round committed: the key of the next drafts
    synced: bool = False  # the draft has this sequence's tokens
    base_len: int = 0  # committed tokens before the last round's
    domain: str = "default"  # the traffic domain (policy and telemetry key)
    auto: bool = False  # k comes from the length policy, capped at ``k``
    zero_rounds: int = 0  # consecutive rounds the policy chose k = 0 for it
    paused: bool = False  # ... PAUSE_AFTER_ROUNDS of them: the draft was told to free it
    resuming: bool = False  # sent in full after a pause: its next drafts start with a prefill
    # drafted, accepted, rounds with drafts, cache hits
    stats: list[int] = field(default_factory=lambda: [0, 0, 0, 0])


class _Sender:
    """Issues fire-and-forget actor calls from its own thread, off the loop's path."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="specserve-sender", daemon=True).start()

    def send(self, method, *args) -> None:
        self._queue.put((method, args))

    def _run(self) -> None:
        while True:
            method, args = self._queue.get()
            try:
                method.remote(*args)
            except Exception:  # a dead actor: the frontend replaces it
                logger.exception("could not send to the draft")


class _DraftGraph:
    """The ``compiled_graph`` transport: one Compiled Graph execution per round message.

    The loop thread compiles ``draft.step`` into a graph the first time it messages a
    draft (the core is the graph's driver) and executes it for each message; the reply,
    the drafts for the round the message was about, is collected by :meth:`collect`
    before that round is verified. Replies must be read in order and only once, so a
    reply that does not come in time breaks the graph: it is torn down and the draft is
    given up (the frontend replaces a draft that died).
    """

    MAX_PENDING = 4  # messages without a round in between (admissions, aborts)

    def __init__(self):
        self.draft = None  # the draft actor the graph runs on
        self._dag = None
        self._refs: list = []  # CompiledDAGRefs of messages whose reply is not read yet
        self._early: list[tuple] = []  # replies read before their round needed them

    def execute(self, draft, msg: tuple) -> bool:
        """Send ``msg`` to ``draft``; False if the graph could not be built or used."""
        try:
            if draft is not self.draft:
                self.teardown()
                from ray.dag import InputNode

                with InputNode() as inp:
                    dag = draft.step.bind(inp)
                self._dag = dag.experimental_compile()
                self.draft = draft
            if len(self._refs) >= self.MAX_PENDING:  # bound the replies in flight
                early = self.collect(time.perf_counter() + 10.0)
                if early is None:
                    return False
                self._early = early
            self._refs.append(self._dag.execute(msg))
            return True
        except Exception:
            logger.exception("compiled graph to the draft failed")
            self.teardown()
            return False

    def collect(self, deadline: float) -> list[tuple] | None:
        """Every pending reply ``(round_for, items)``, oldest first; None if the graph broke."""
        replies, self._early = self._early, []
        try:
            while self._refs:
                ref = self._refs.pop(0)
                replies.append(ref.get(timeout=max(0.0, deadline - time.perf_counter())))
        except Exception as exc:
            logger.warning("no reply from the draft through the compiled graph: %r", exc)
            self.teardown()
            return None
        return replies

    def teardown(self) -> None:
        self._refs.clear()
        self._early.clear()
        dag, self._dag, self.draft = self._dag, None, None
        if dag is not None:  # off the loop: a dead draft's graph may take long to go
            threading.Thread(target=_teardown, args=(dag,), daemon=True).start()


def _generation_eos(runner) -> frozenset[int]:
    """The EOS ids of the model's ``generation_config`` (an int or a list of them)."""
    eos = getattr(getattr(runner.model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def token_logprobs(logits, tokens: list[int], top: int | None) -> list[tuple] | None:
    """Log-probabilities of ``tokens`` under the target's raw distribution (before the
    request's temperature and filters, as vLLM reports them), with the ``top`` likeliest.

    logits: [n, vocab], row j the target's logits for ``tokens[j]``.
    Returns per token ``(logprob, [(token_id, logprob), ...])``; None when not asked for.
    """
    if top is None or not tokens:
        return None
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [n, vocab]
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if top:
        values, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)  # [n, top]
        tops = [
            list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        ]
    else:
        tops = [[] for _ in tokens]
    return list(zip(chosen, tops, strict=True))


def _teardown(dag) -> None:
    try:
        dag.teardown()
    except Exception:
        logger.exception("compiled graph teardown failed")


class EngineCore:
    """Target model + the scheduling loop of one replica (a threaded Ray actor)."""

    CONCURRENCY_GROUPS: ClassVar[dict[str, int]] = {"control": 2, "push": 1, "poll": 1}
    MAX_FAILURES_IN_A_ROW = 16

    def __init__(
        self,
        spec: dict,
        max_num_seqs: int,
        eos_token_ids: list[int],
        draft_timeout_s: float,
        draft_max_model_len: int | None = None,
        transport: str = "actor",
        length_policy: dict | None = None,
        telemetry: bool = False,
    ):
        self.spec = ModelSpec.model_validate(spec)
        self.runner = load_runner(self.spec, max_num_seqs)
        # k per domain and batch size for requests that do not set their own (None: fixed).
        self.policy = SpeculationLength(**length_policy) if length_policy else None
        self._forced: int | None = None  # this round's cost-measurement k, if any
        self._policy_state: dict[str, dict] = {}  # the policy's choices, for drain_telemetry
        self._policy_state_at = float("-inf")  # when the loop last published them
        self._drift: list[tuple[str, float]] = []  # drift alerts for the policy, from calls
        # Round outcomes for the monitor, drained by the frontend (off the loop's path).
        self._telemetry = Telemetry() if telemetry else None
        self.max_num_seqs = max_num_seqs
        # Every id that ends a sequence: the tokenizer's and generation_config's (models
        # list several there, e.g. end-of-text and end-of-turn).
        self.eos_token_ids = frozenset(eos_token_ids) | _generation_eos(self.runner)
        self.draft_timeout_s = draft_timeout_s
        self.draft_max_model_len = draft_max_model_len or self.runner.max_model_len
        self._cv = threading.Condition()  # guards everything the calls hand to the loop
        self._new: list[tuple] = []
        self._aborts: set[Hashable] = set()
        self._seq_ids: set[Hashable] = set()  # every request added and not yet ended
        self._pushes: dict[Hashable, dict[tuple, tuple]] = {}
        self._resync: set[Hashable] = set()
        self._give_up: set[Hashable] = set()  # the draft failed on these: target-only
        # Given up, or paused by the length policy (k = 0): the draft must free them.
        self._dropped: list[Hashable] = []
        self._draft = None
        self._draft_first = True  # the next message starts a new draft
        self._out_cv = threading.Condition()
        self._outbox: list[tuple] = []
        self._out_base = 0
        self._waiting: list[tuple] = []  # admitted to the core, not yet running
        self._running: dict[Hashable, _Seq] = {}
        self._round = 0
        # Message numbers grow with time, so a replacement core's numbers are all larger
        # than those of the core it replaces (the draft drops stragglers from that one).
        self._msg_no = time.time_ns() // 1000
        self._verify_avg: float | None = None
        self.timings = RoundTimings()
        self.error: str | None = None
        self.failed_requests = 0  # failed alone, each with its own error (see _fail)
        self._failures_in_a_row = 0
        self._stopped = False
        self._sender = _Sender()
        self._graph = _DraftGraph() if transport == "compiled_graph" else None
        self._thread = threading.Thread(target=self._loop_guarded, name="specserve-core")
        self._thread.daemon = True
        self._thread.start()

    # ----- calls (each in its concurrency group) ------------------------------------------

    @ray.method(concurrency_group="control")
    def ready(self) -> dict[str, Any]:
        return {**worker_info(self.runner), "eos_token_ids": sorted(self.eos_token_ids)}

    @ray.method(concurrency_group="control")
    def add_requests(self, items: list[tuple]) -> None:
        """``(seq_id, prompt_ids, output_ids, params dict, k)``; ``output_ids`` non-empty
        resumes a request that already committed those tokens (after a target failure)."""
        with self._cv:
            if self.error:
                raise RuntimeError(self.error)
            ids = [item[0] for item in items]
            taken = [sid for sid in ids if sid in self._seq_ids]
            if taken or len(set(ids)) != len(ids):
                raise ValueError(f"request ids already in use: {taken or ids}")
            self._seq_ids.update(ids)
            self._aborts.difference_update(ids)  # left from an earlier request of that id
            self._new.extend(items)
            self._cv.notify_all()

    @ray.method(concurrency_group="control")
    def abort(self, seq_ids: list[Hashable]) -> None:
        with self._cv:
            self._aborts.update(seq_ids)
            self._cv.notify_all()

    @ray.method(concurrency_group="control")
    def set_draft(self, draft, max_model_len: int | None = None) -> None:
        """Use this draft actor from now on (None: serve target-only until one comes);
        ``max_model_len``: the draft's context limit (no drafts past it)."""
        with self._cv:
            if max_model_len:
                self.draft_max_model_len = max_model_len
            self._draft = draft
            self._draft_first = True
            self._cv.notify_all()

    @ray.method(concurrency_group="control")
    def get_timings(self, reset: bool = False) -> dict[str, Any]:
        out = self.timings.as_dict()
        if reset:
            self.timings = RoundTimings()
        return out

    @ray.method(concurrency_group="control")
    def drain_telemetry(self) -> dict[str, Any] | None:
        """Round records since the last call, the batch state and the policy's choices."""
        if self._telemetry is None:
            return None
        with self._cv:
            out = self._telemetry.drain()
            out["running"] = len(self._running)
            out["waiting"] = len(self._waiting) + len(self._new)
            out["kv_cache"] = self.runner.kv_usage()
            out["policy"] = self._policy_state  # published by the loop thread
        return out

    @ray.method(concurrency_group="control")
    def on_drift(self, alerts: list[tuple[str, float]]) -> None:
        """Drift alerts ``(domain, current alpha)``: the policy takes them next round."""
        if self.policy is None:  # fixed k: nothing to adjust
            return
        with self._cv:
            self._drift.extend(alerts)

    @ray.method(concurrency_group="control")
    def seq_ids(self) -> dict[str, list]:
        """Sequences the loop runs and those whose KV the target holds (equal unless a
        path leaks a slot; checked by the fault tests)."""
        with self._cv:
            return {
                "running": list(self._running),
                "runner": list(self.runner.seq_ids),
                # per-sequence state kept beside the batch: empty once nothing runs
                "kept": sorted(
                    map(str, set(self._pushes) | self._resync | self._give_up | self._seq_ids)
                ),
            }

    @ray.method(concurrency_group="control")
    def health(self) -> dict[str, Any]:
        return {
            "running": len(self._running),
            "waiting": len(self._waiting) + len(self._new),
            "error": self.error,
            "failed_requests": self.failed_requests,
            "loop_alive": self._thread.is_alive(),
            "kv_cache": self.runner.kv_usage(),
        }

    @ray.method(concurrency_group="push")
    def push_drafts(self, round_for: int, items: list[tuple]) -> None:
        """Drafts from the draft actor; see the module docstring for the format."""
        self._store_drafts(round_for, items)

    def _store_drafts(self, round_for: int, items: list[tuple]) -> None:
        with self._cv:
            for seq_id, guess, tokens, q, speculative in items:
                if seq_id not in self._seq_ids:  # ended meanwhile: keep nothing for it
                    continue
                if guess is None:  # the draft lost track of this sequence
                    self._resync.add(seq_id)
                    continue
                if guess == GIVE_UP:  # drafting failed for it alone: target-only
                    self._give_up.add(seq_id)
                    self._resync.add(seq_id)
                    continue
                if round_for < self._round:  # a round already past: nobody will use it
                    continue
                self._pushes.setdefault(seq_id, {})[(round_for, guess)] = (tokens, q, speculative)
            self._cv.notify_all()

    @ray.method(concurrency_group="poll")
    def get_outputs(self, cursor: int, timeout_s: float) -> tuple[int, list[tuple], str | None]:
        """Long-poll: outputs after ``cursor`` (those before it are acknowledged and dropped).

        An output is ``(seq_id, new_tokens, finished, finish_reason, num_output_tokens,
        (drafted, accepted, rounds, cache_hits), error, logprobs)``; ``logprobs`` is None
        unless the request asked for them (see :func:`token_logprobs`).
        """
        with self._out_cv:
            drop = max(0, min(cursor - self._out_base, len(self._outbox)))
            del self._outbox[:drop]
            self._out_base += drop
            if not self._outbox and not self.error:
                self._out_cv.wait(timeout_s)
            return self._out_base + len(self._outbox), list(self._outbox), self.error

    # ----- the loop -------------------------------------------------------------------------

    def _loop_guarded(self) -> None:
        configure_thread(self.spec)
        try:
            self._loop()
        except Exception as exc:  # Ray does not see this thread: surface the error
            logger.exception("engine core loop failed")
            self.error = f"engine core failure: {exc!r}"
            with self._out_cv:
                for sid in list(self._running) + [it[0] for it in self._waiting]:
                    self._outbox.append((sid, [], True, "error", 0, (0, 0, 0, 0), self.error, None))
                self._out_cv.notify_all()

    def _loop(self) -> None:
        while not self._stopped:
            with self._cv:
                while not (self._running or self._new or self._aborts or self._waiting):
                    self._cv.wait()
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, set()
            self._waiting.extend(new)
            freed = self._apply_aborts(aborts)
            self._admit(freed)
            if self._running:
                self._run_round()

    def _apply_aborts(self, aborts: set[Hashable]) -> list[Hashable]:
        freed = []
        if aborts:
            self._waiting = [it for it in self._waiting if it[0] not in aborts]
            with self._cv:
                self._seq_ids -= aborts - self._running.keys()
            for sid in aborts:
                seq = self._running.get(sid)
                if seq is not None:
                    self._free(sid)
                    if seq.k > 0:
                        freed.append(sid)
        return freed

    def _free(self, sid: Hashable) -> None:
        self._running.pop(sid, None)
        self.runner.free(sid)
        with self._cv:
            self._pushes.pop(sid, None)
            self._resync.discard(sid)
            self._give_up.discard(sid)
            self._seq_ids.discard(sid)

    def _admit(self, freed: list[Hashable]) -> None:
        """Prefill waiting requests while KV slots are free (at most max_num_seqs run) and
        publish their first tokens; the rest wait, in order, for slots to free."""
        room = min(self.max_num_seqs - len(self._running), self.runner.num_free_slots)
        batch, self._waiting = self._waiting[:room], self._waiting[room:]
        if batch:
            self._take_drift_alerts()
        items: list[tuple] = []
        for sid in self._isolated(batch, self._prefill):
            seq = self._running[sid]
            if seq.state.finished:
                self._free(sid)
            elif seq.k > 0 and (item := self._draft_item(seq)) is not None:
                items.append(item)
        if items or freed:
            self._message(self._round, items, freed)

    def _isolated(self, batch: list, step) -> list:
        """``step(batch)``; if it fails, each item alone, failing only those that fail alone.

        ``step`` is all-or-nothing (it leaves no state behind when it raises) and returns
        what succeeded; an item of ``batch`` starts with its sequence id.
        """
        if not batch:
            return []
        try:
            done = step(batch)
        except Exception:
            done = []
            for item in batch:
                try:
                    done += step([item])
                except Exception as exc:
                    self._fail(item[0], exc)
        # A device that fails every request (a sticky CUDA error) is not one bad request:
        # after enough failures in a row, end the loop so that the replica is replaced.
        self._failures_in_a_row = 0 if done else self._failures_in_a_row + len(batch)
        if self._failures_in_a_row >= self.MAX_FAILURES_IN_A_ROW:
            raise RuntimeError(f"{self._failures_in_a_row} requests in a row failed")
        return done

    def _prefill(self, batch: list[tuple]) -> list[Hashable]:
        """Start ``batch``'s sequences (all or none) and publish their first tokens."""
        seqs, feeds = [], []
        try:
            for sid, prompt, output, params, k, domain, auto in batch:
                state = SequenceState(
                    sid, list(prompt), SamplingParams(**params), device=self.runner.device
                )
                state.output_token_ids = list(output)
                self.runner.add(sid)
                seqs.append(_Seq(state, k, domain=domain, auto=auto and self.policy is not None))
                # A resumed request already has its newest token: it is fed next round.
                feeds.append(state.token_ids if not output else state.token_ids[:-1])
            ids = [seq.state.seq_id for seq in seqs]
            logits = self.runner.forward_padded(ids, feeds, last_only=True)  # [batch, vocab]
            fresh = [i for i, seq in enumerate(seqs) if not seq.state.output_token_ids]
            firsts = (
                sample_next(
                    logits[fresh],
                    [seqs[i].state.params for i in fresh],
                    [
                        seqs[i].state.verify_generator_at(len(seqs[i].state.prompt_token_ids))
                        for i in fresh
                    ],
                )
                if fresh
                else []
            )
            first_lps = [
                token_logprobs(logits[i : i + 1], [tok], seqs[i].state.params.logprobs)
                for i, tok in zip(fresh, firsts, strict=True)
            ]
        except Exception:
            for seq in seqs:
                self.runner.free(seq.state.seq_id)
            raise
        outputs = []
        for seq in seqs:
            self._running[seq.state.seq_id] = seq
            seq.guess = (seq.state.last_token_id,) if seq.state.output_token_ids else ()
        for i, tok, lps in zip(fresh, firsts, first_lps, strict=True):
            seqs[i].state.append([tok], self.eos_token_ids)
            seqs[i].guess = (tok,)
            outputs.append(self._output(seqs[i], [tok], lps))
        self._publish(outputs)
        return ids

    def _fail(self, sid: Hashable, exc: BaseException) -> None:
        """Fail one request alone: free its state here, tell the draft, tell its client."""
        logger.warning("request %r failed: %r", sid, exc)
        self.failed_requests += 1
        seq = self._running.get(sid)
        if seq is not None:
            self._free(sid)
            if seq.k > 0:
                self._message(self._round, [], [sid])
        else:
            with self._cv:
                self._seq_ids.discard(sid)
        stats = tuple(seq.stats) if seq is not None else (0, 0, 0, 0)
        n_out = len(seq.state.output_token_ids) if seq is not None else 0
        error = f"request failed in the engine core: {type(exc).__name__}: {exc}"
        self._publish([(sid, [], True, "error", n_out, stats, error, None)])

    def _k_for(self, seq: _Seq) -> int:
        """Draft length for the next round: the request's k or the policy's choice, never
        past max_tokens or either model's context."""
        if self._draft is None or seq.k <= 0:
            return 0
        k = seq.k
        if seq.auto:
            k = min(k, self.policy.choose(seq.domain, len(self._running), forced=self._forced))
        st = seq.state
        length = len(st.prompt_token_ids) + len(st.output_token_ids)
        return max(
            0,
            min(
                k,
                st.params.max_tokens - len(st.output_token_ids) - 1,
                self.runner.max_model_len - length,
                self.draft_max_model_len - length - 1,
            ),
        )

    def _draft_item(self, seq: _Seq) -> tuple | None:
        """What the draft needs for the sequence's next round, or None once the length
        policy has kept it at k = 0 for PAUSE_AFTER_ROUNDS rounds: then the draft forgets
        the sequence (no message per round, no branches held: idle drafting only competes
        with verification for the cores) and gets it back in full when the policy drafts
        for it again. Cost measurements at k = 0 (forced) do not count towards a pause."""
        seq.k_next = self._k_for(seq)
        st = seq.state
        if seq.k_next > 0 or not seq.auto:
            seq.zero_rounds = 0
        elif self._forced is None:
            seq.zero_rounds += 1
        if seq.k_next == 0 and seq.auto and (seq.paused or seq.zero_rounds >= PAUSE_AFTER_ROUNDS):
            if not seq.paused:  # (freeing is idempotent: also when synced was lost)
                seq.paused, seq.synced = True, False
                self._dropped.append(st.seq_id)
                self.timings.paused += 1
                with self._cv:  # drafts prepared for it are worthless now
                    self._pushes.pop(st.seq_id, None)
            return None
        if seq.paused:
            seq.paused, seq.resuming = False, True
            self.timings.resumed += 1
        if seq.synced:
            return (st.seq_id, seq.base_len, list(seq.guess), seq.k_next, None, None)
        seq.synced = True
        return (st.seq_id, 0, list(seq.guess), seq.k_next, st.token_ids, asdict(st.params))

    def _message(
        self,
        round_for: int,
        items: list[tuple],
        freed: list[Hashable],
        round_s: float | None = None,
        tokens: int = 0,
    ) -> None:
        with self._cv:
            draft, first = self._draft, self._draft_first
        if draft is None:
            return
        if first:  # a new draft knows nothing: everything is sent in full
            for seq in self._running.values():
                seq.synced = False
            items = [self._draft_item(seq) for seq in self._running.values() if seq.k > 0]
            items = [item for item in items if item is not None]
        if not items and not freed:
            return  # (a first message stays first until one is sent: target-only rounds)
        with self._cv:
            if self._draft is draft:
                self._draft_first = False
        self._msg_no += 1
        stats = (self._verify_avg, round_s, tokens)
        msg = (self._msg_no, first, round_for, items, freed, stats)
        if self._graph is None:
            self._sender.send(draft.on_round, *msg)
        elif not self._graph.execute(draft, msg):
            self._lose_draft(draft)

    def _gather(self) -> tuple[dict[Hashable, tuple], float]:
        """Take each running sequence's drafts for this round, waiting for missing ones."""
        need = {sid: seq for sid, seq in self._running.items() if seq.k_next > 0}
        found: dict[Hashable, tuple] = {}
        t0 = time.perf_counter()
        deadline = t0 + self.draft_timeout_s
        if self._graph is not None and need:
            # Every reply this round needs is in flight: collect them, then wait no more.
            draft = self._graph.draft
            replies = self._graph.collect(deadline)
            if replies is None:
                self._lose_draft(draft)
            for round_for, items in replies or []:
                self._store_drafts(round_for, items)
            deadline = t0
        with self._cv:
            while True:
                for sid in list(need):
                    seq = need[sid]
                    got = self._pushes.get(sid, {}).pop((self._round, seq.guess), None)
                    if got is not None:
                        found[sid] = got
                        del need[sid]
                    elif sid in self._resync:
                        self._resync.discard(sid)
                        seq.synced = False
                        if sid in self._give_up:
                            self._give_up.discard(sid)
                            seq.k = seq.k_next = 0  # no drafts wanted from now on
                            # The marker may be older than a resync the draft has taken
                            # since: have it free the sequence (freeing is idempotent).
                            self._dropped.append(sid)
                        del need[sid]
                remaining = deadline - time.perf_counter()
                if not need or self._draft is None or remaining <= 0:
                    break
                self._cv.wait(remaining)
            for sid in need:  # timed out or no draft: plain decode this round
                self._running[sid].synced = False
                self.timings.draft_timeouts += int(self._draft is not None)
            for sid in found:  # drafts for rounds already past are worthless
                pushes = self._pushes.get(sid)
                if pushes:
                    for key in [key for key in pushes if key[0] <= self._round]:
                        del pushes[key]
        return found, time.perf_counter() - t0

    def _run_round(self) -> None:
        t_round = time.perf_counter()
        found, waited = self._gather()
        seqs = list(self._running.values())
        planned = max((seq.k_next for seq in seqs), default=0)  # the k this round costs
        # Rows back from a pause made the draft prefill their whole context first: this
        # round's time says what resuming costs, not what a round at ``planned`` does.
        resuming = any(seq.resuming and seq.k_next > 0 for seq in seqs)
        for seq in seqs:
            seq.resuming = False
        rows, feeds = [], []
        for seq in seqs:
            tokens, q, speculative = found.get(seq.state.seq_id, ([], None, False))
            k = min(len(tokens), seq.k_next)
            tokens, q = tokens[:k], (None if q is None else q.head(k))
            gen = seq.state.verify_generator_at(
                len(seq.state.prompt_token_ids) + len(seq.state.output_token_ids)
            )
            rows.append(VerifyRow(seq.state.params, tokens, q, gen))
            feeds.append([seq.state.last_token_id, *tokens])
            if k:
                seq.stats[0] += k
                seq.stats[2] += 1
                seq.stats[3] += int(speculative)
        t_verify = time.perf_counter()
        batch = [
            (seq.state.seq_id, feed, row) for seq, feed, row in zip(seqs, feeds, rows, strict=True)
        ]
        results = dict(self._isolated(batch, self._verify))
        verify_s = time.perf_counter() - t_verify
        self._verify_avg = (
            verify_s if self._verify_avg is None else (0.8 * self._verify_avg + 0.2 * verify_s)
        )
        self._round += 1
        self._plan_next_round(len(seqs))
        items, freed, outputs = [], [], []
        outcomes: list[tuple] = []  # (domain, drafted, accepted, cache hit) per drafted row
        committed: list[tuple[str, int]] = []  # (domain, tokens) per row
        for seq, row in zip(seqs, rows, strict=True):
            st = seq.state
            if st.seq_id not in results:  # failed alone (and freed)
                continue
            tokens, a, lps = results[st.seq_id]
            seq.base_len = len(st.prompt_token_ids) + len(st.output_token_ids)
            kept = st.append(tokens, self.eos_token_ids)
            seq.guess = tuple(tokens[:kept])
            if row.draft_token_ids:
                seq.stats[1] += a
                hit = found[st.seq_id][2]
                outcomes.append((seq.domain, len(row.draft_token_ids), a, hit))
            committed.append((seq.domain, kept))
            outputs.append(self._output(seq, tokens[:kept], lps and lps[:kept]))
            if st.finished:
                self._free(st.seq_id)
                if seq.k > 0:
                    freed.append(st.seq_id)
            elif seq.k > 0 and (item := self._draft_item(seq)) is not None:
                items.append(item)  # target-only requests never concern the draft
        freed += self._dropped
        self._dropped = []
        # First: the draft starts on it at once.
        tokens = sum(len(out[1]) for out in outputs)
        self._message(self._round, items, freed, time.perf_counter() - t_round, tokens)
        self._publish(outputs)
        total_s = time.perf_counter() - t_round
        t = self.timings
        t.rounds += 1
        t.rows += len(seqs)
        t.drafted_rows += sum(1 for r in rows if r.draft_token_ids)
        t.hits += sum(1 for sid in found if found[sid][2])
        t.draft_wait_s += waited
        t.verify_s += verify_s
        t.total_s += total_s
        if self.policy is not None:
            for domain, drafted, a, _hit in outcomes:
                self.policy.observe_round(domain, drafted, a)
            if not resuming:
                self.policy.observe_round_time(len(seqs), planned, total_s)
        if self._telemetry is not None:
            # The policy's snapshot costs ~10 us per domain: published at most every
            # POLICY_STATE_EVERY_S, and when the batch empties (its last word before idling).
            state = None
            now = time.monotonic()
            if self.policy is not None and (
                now - self._policy_state_at >= POLICY_STATE_EVERY_S or not self._running
            ):
                state, self._policy_state_at = self.policy.state(), now
            with self._cv:
                self._telemetry.add(outcomes, committed, verify_s, waited, total_s)
                if state is not None:
                    self._policy_state = state

    def _plan_next_round(self, batch_size: int) -> None:
        """Before the next round's draft lengths are chosen: drift alerts that came in,
        and whether the next round measures the cost of one k (see SpeculationLength)."""
        if self.policy is None:
            return
        self._take_drift_alerts()
        self._forced = self.policy.plan_round(batch_size)

    def _take_drift_alerts(self) -> None:
        """Hand alerts that came in to the policy (before any k is chosen: a sequence
        admitted right after an alert already drafts at the k the alert implies)."""
        if self.policy is None:
            return
        with self._cv:
            alerts, self._drift = self._drift, []
        for domain, alpha in alerts:
            self.policy.on_drift(domain, alpha)

    def _lose_draft(self, draft) -> None:
        """The compiled graph to this draft failed or its reply came too late: decode
        target-only and end the draft, so that the frontend's watch on it sees a death and
        replaces it (a live draft nobody messages would hold its sequences forever)."""
        with self._cv:
            if self._draft is draft:
                self._draft = None
        for seq in self._running.values():
            seq.synced = False
        if draft is not None:
            ray.kill(draft, no_restart=True)

    def _verify(self, batch: list[tuple]) -> list[tuple[Hashable, tuple]]:
        """One target pass over ``(seq_id, feed, VerifyRow)`` items; all or nothing.

        Returns per item ``(seq_id, (tokens, accepted, logprobs or None))``.
        """
        ids = [sid for sid, _, _ in batch]
        cached = [self.runner.length(sid) for sid in ids]
        # A seeded row retried alone must draw the same numbers as it would have.
        gens = [row.generator for _, _, row in batch if row.generator is not None]
        states = [gen.get_state() for gen in gens]
        try:
            # [batch, k + 1, vocab]
            logits = self.runner.forward_padded(ids, [feed for _, feed, _ in batch])
            results = [
                (tokens, a, token_logprobs(logits[i, : len(tokens)], tokens, row.params.logprobs))
                for i, ((tokens, a), (_, _, row)) in enumerate(
                    zip(verify_rows(logits, [row for _, _, row in batch]), batch, strict=True)
                )
            ]
        except Exception:
            for sid, c in zip(ids, cached, strict=True):  # the pass may have advanced them
                self.runner.rollback(sid, c)
            for gen, state in zip(gens, states, strict=True):
                gen.set_state(state)
            raise
        for sid, c, (_tokens, a, _lps) in zip(ids, cached, results, strict=True):
            self.runner.rollback(sid, c + 1 + a)
        return list(zip(ids, results, strict=True))

    def _output(self, seq: _Seq, new_tokens: list[int], logprobs: list | None = None) -> tuple:
        st = seq.state
        return (
            st.seq_id,
            list(new_tokens),
            st.finished,
            st.finish_reason,
            len(st.output_token_ids),
            tuple(seq.stats),
            None,
            logprobs,
        )

    def _publish(self, outputs: list[tuple]) -> None:
        if outputs:
            with self._out_cv:
                self._outbox.extend(outputs)
                self._out_cv.notify_all()
