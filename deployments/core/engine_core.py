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

The loop is the one that executes; it asks the :class:`~deployments.core.scheduler.Scheduler`
what to run (admission on free KV slots, draft lengths) and talks to the draft through
the :class:`~deployments.core.draft_link.DraftLink`. Admissions and aborts arrive as messages
between rounds. Every call into this actor runs
in a concurrency group of its own (control, push, poll), so a long-poll never blocks a
push, and all of them run while the loop thread is inside torch (which releases the GIL).

Message to the draft (``DraftWorker.on_round``): ``(msg_no, first, round_for, items,
freed, (verify_s, round_s, tokens))``: the mean verify time, and the wall time and the
committed tokens of the round that just ended (None, 0 after an admission). An item is
``(seq_id, base_len, new_tokens, k, full_tokens, params)``: the sequence had ``base_len``
committed tokens, now also ``new_tokens``; drafts of length ``k`` are wanted for round
``round_for``. ``full_tokens`` (``(prompt ids, output ids)``: penalties count the
output apart from the prompt) and ``params`` are set when the draft
must (re)start the sequence from scratch (new sequence, new draft, lost track).
Pushes back (``push_drafts``): ``(round_for, [(seq_id, guess, tokens, q, speculative)])``:
drafts for the round in which ``seq_id``'s previous round committed exactly ``guess``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable
from typing import Any, ClassVar

import ray
import torch

from deployments.config import ModelSpec
from deployments.core.colocated import ColocatedDraftLink
from deployments.core.draft_link import DraftLink
from deployments.core.round_stats import RoundTimings, Telemetry
from deployments.core.scheduler import RunningSeq, Scheduler
from deployments.workers.drafting import DraftRounds
from deployments.workers.model_loader import configure_thread, load_runner, worker_info
from specdec.policy import SpeculationLength
from specdec.proposers import DraftModelProposer
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState
from specdec.speculation_cache import SpeculativeDrafter
from specdec.verify import VerifyRow, sample_next, verify_rows

__all__ = ["EngineCore", "RoundTimings", "Telemetry", "token_logprobs"]

logger = logging.getLogger("specserve.core")
POLICY_STATE_EVERY_S = 0.05  # how fresh the policy snapshot drain_telemetry returns is


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
        colocated_draft: dict | None = None,
    ):
        """``colocated_draft``: ``{"spec", "min_confidence", "tokenizer_size"}`` to run the
        draft in this process (:mod:`deployments.core.colocated`); None: a draft actor is
        connected with :meth:`set_draft`."""
        self.spec = ModelSpec.model_validate(spec)
        self.draft_runner = None
        if colocated_draft is None:
            self.runner = load_runner(self.spec, max_num_seqs)
        else:  # the draft first: the target plans one KV budget for both
            self.draft_runner = load_runner(
                ModelSpec.model_validate(colocated_draft["spec"]), max_num_seqs, defer_kv=True
            )
            self.runner = load_runner(self.spec, max_num_seqs, kv_shared_with=self.draft_runner)
            draft_max_model_len = self.draft_runner.max_model_len
        # k per domain and batch size for requests that do not set their own (None: fixed).
        policy = SpeculationLength(**length_policy) if length_policy else None
        self.scheduler = Scheduler(
            max_num_seqs,
            self.runner.max_model_len,
            draft_max_model_len or self.runner.max_model_len,
            policy,
        )
        self._policy_state: dict[str, dict] = {}  # the policy's choices, for drain_telemetry
        self._policy_state_at = float("-inf")  # when the loop last published them
        self._drift: list[tuple[str, float]] = []  # drift alerts for the policy, from calls
        # Round outcomes for the monitor, drained by the frontend (off the loop's path).
        self._telemetry = Telemetry() if telemetry else None
        # Every id that ends a sequence: the tokenizer's and generation_config's (models
        # list several there, e.g. end-of-text and end-of-turn).
        self.eos_token_ids = frozenset(eos_token_ids) | _generation_eos(self.runner)
        self.draft_timeout_s = draft_timeout_s
        self._cv = threading.Condition()  # guards what the calls hand to the loop
        self._new: list[tuple] = []
        self._aborts: set[Hashable] = set()
        self._seq_ids: set[Hashable] = set()  # every request added and not yet ended
        self.link = (
            DraftLink(transport, is_live=self._seq_ids.__contains__)
            if colocated_draft is None
            else self._colocated_link(colocated_draft)
        )
        self._out_cv = threading.Condition()
        self._outbox: list[tuple] = []
        self._out_base = 0
        self._verify_avg: float | None = None
        self.timings = RoundTimings()
        self._paused_base = self._resumed_base = 0  # scheduler counts at the last reset
        self.error: str | None = None
        self.failed_requests = 0  # failed alone, each with its own error (see _fail)
        self._failures_in_a_row = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._loop_guarded, name="specserve-core")
        self._thread.daemon = True
        self._thread.start()

    def _colocated_link(self, cfg: dict) -> ColocatedDraftLink:
        """The draft in this process, proposing the ids both models and the tokenizer
        share, keeping a slot for every target slot (the budget planned them together)."""
        limits = [self.runner.vocab_size, self.draft_runner.vocab_size]
        if cfg.get("tokenizer_size"):
            limits.append(cfg["tokenizer_size"])
        proposer = DraftModelProposer(self.draft_runner, cfg["min_confidence"], min(limits))
        drafter = SpeculativeDrafter(proposer, main_slots=self.draft_runner.max_num_seqs)
        return ColocatedDraftLink(DraftRounds(drafter))

    # ----- calls (each in its concurrency group) ------------------------------------------

    @ray.method(concurrency_group="control")
    def ready(self) -> dict[str, Any]:
        info = {**worker_info(self.runner), "eos_token_ids": sorted(self.eos_token_ids)}
        if self.draft_runner is not None:
            info["draft"] = worker_info(self.draft_runner)
        return info

    @ray.method(concurrency_group="control")
    def add_requests(self, items: list[tuple]) -> None:
        """``(seq_id, prompt_ids, output_ids, params dict, k, domain, auto)``;
        ``output_ids`` non-empty resumes a request that already committed those tokens
        (after a target failure)."""
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
                self.scheduler.draft_max_model_len = max_model_len
            self.link.set_draft(draft)
            self._cv.notify_all()

    @ray.method(concurrency_group="control")
    def get_timings(self, reset: bool = False) -> dict[str, Any]:
        t, s = self.timings, self.scheduler
        t.paused, t.resumed = s.paused - self._paused_base, s.resumed - self._resumed_base
        out = t.as_dict()
        if reset:
            self.timings = RoundTimings()
            self._paused_base, self._resumed_base = s.paused, s.resumed
        return out

    @ray.method(concurrency_group="control")
    def drain_telemetry(self) -> dict[str, Any] | None:
        """Round records since the last call, the batch state and the policy's choices."""
        if self._telemetry is None:
            return None
        with self._cv:
            out = self._telemetry.drain()
            out["running"] = len(self.scheduler.running)
            out["waiting"] = len(self.scheduler.waiting) + len(self._new)
            out["kv_cache"] = self.runner.kv_usage()
            out["policy"] = self._policy_state  # published by the loop thread
        return out

    @ray.method(concurrency_group="control")
    def on_drift(self, alerts: list[tuple[str, float]]) -> None:
        """Drift alerts ``(domain, current alpha)``: the policy takes them next round."""
        if self.scheduler.policy is None:  # fixed k: nothing to adjust
            return
        with self._cv:
            self._drift.extend(alerts)

    @ray.method(concurrency_group="control")
    def seq_ids(self) -> dict[str, list]:
        """Sequences the loop runs and those whose KV the target holds (equal unless a
        path leaks a slot; checked by the fault tests)."""
        with self._cv:
            out = {
                "running": list(self.scheduler.running),
                "runner": list(self.runner.seq_ids),
                # per-sequence state kept beside the batch: empty once nothing runs
                "kept": sorted(map(str, self.link.kept() | self._seq_ids)),
            }
            if self.draft_runner is not None:  # as the draft actor reports them
                drafter = self.link.rounds.drafter
                out["draft"] = {"drafter": list(drafter.seqs), "runner": self.draft_runner.seq_ids}
            return out

    @ray.method(concurrency_group="control")
    def health(self) -> dict[str, Any]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + len(self._new),
            "error": self.error,
            "failed_requests": self.failed_requests,
            "loop_alive": self._thread.is_alive(),
            "kv_cache": self.runner.kv_usage(),
            "draft_kv_cache": None if self.draft_runner is None else self.draft_runner.kv_usage(),
            "draft_failed_sequences": (
                self.link.rounds.failed_sequences if self.draft_runner is not None else None
            ),
        }

    @ray.method(concurrency_group="push")
    def push_drafts(self, round_for: int, items: list[tuple]) -> None:
        """Drafts from the draft actor; see the module docstring for the format."""
        self.link.store(round_for, items)

    @ray.method(concurrency_group="poll")
    def get_outputs(self, cursor: int, timeout_s: float) -> tuple[int, list[tuple], str | None]:
        """Long-poll: outputs after ``cursor`` (those before it are acknowledged and dropped).

        An output is ``(seq_id, new_tokens, finished, finish_reason, num_output_tokens,
        (drafted, accepted, rounds, cache_hits), error, logprobs, prompt_logprobs)``;
        ``logprobs`` is None unless the request asked for them (see :func:`token_logprobs`),
        ``prompt_logprobs`` too, and set on a request's first output only.
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
            sched = self.scheduler
            with self._out_cv:
                for sid in list(sched.running) + [it[0] for it in sched.waiting]:
                    self._outbox.append(
                        (sid, [], True, "error", 0, (0, 0, 0, 0), self.error, None, None)
                    )
                self._out_cv.notify_all()

    def _loop(self) -> None:
        sched = self.scheduler
        while not self._stopped:
            with self._cv:
                while not (sched.running or self._new or self._aborts or sched.waiting):
                    self._cv.wait()
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, set()
                sched.has_draft = self.link.draft is not None
            sched.enqueue(new)
            freed = self._apply_aborts(aborts)
            self._admit(freed)
            if sched.running:
                self._run_round()

    def _apply_aborts(self, aborts: set[Hashable]) -> list[Hashable]:
        """End aborted requests; returns those the draft must free."""
        running = self.scheduler.abort(aborts)
        with self._cv:
            self._seq_ids -= aborts - set(running)  # (waiting ones end here)
        freed = []
        for sid in running:
            if self._free(sid).k > 0:
                freed.append(sid)
        return freed

    def _free(self, sid: Hashable) -> RunningSeq | None:
        seq = self.scheduler.finish(sid)
        self.runner.free(sid)
        with self._cv:
            self._seq_ids.discard(sid)
        self.link.forget(sid)  # (after the id stopped being live: no push lands after it)
        return seq

    def _admit(self, freed: list[Hashable]) -> None:
        """Prefill what the scheduler admits (KV slots free) and publish first tokens."""
        batch = self.scheduler.admit(self.runner.num_free_slots)
        if batch:
            self._take_drift_alerts()
        items: list[tuple] = []
        for sid in self._isolated(batch, self._prefill):
            seq = self.scheduler.running[sid]
            if seq.state.finished:
                self._free(sid)
            elif seq.k > 0 and (item := self.scheduler.draft_item(seq)) is not None:
                items.append(item)
        if items or freed:
            self._message(items, freed)

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
                    sid,
                    list(prompt),
                    SamplingParams(**params).with_stops(self.eos_token_ids),
                    device=self.runner.device,
                )
                state.output_token_ids = list(output)
                self.runner.add(sid)
                seqs.append(RunningSeq(state, k, domain=domain, auto=auto))
                # A resumed request already has its newest token: it is fed next round.
                feeds.append(state.token_ids if not output else state.token_ids[:-1])
            ids = [seq.seq_id for seq in seqs]
            fresh = [i for i, seq in enumerate(seqs) if not seq.state.output_token_ids]
            # Rows that score their prompt need every position's logits (chunk by chunk,
            # _score_prompt); the others only the last, in one batched pass.
            scoring = [i for i in fresh if seqs[i].state.params.prompt_logprobs is not None]
            rest = [i for i in range(len(seqs)) if i not in scoring]
            prompt_lps: dict[int, list] = {}
            last: list = [None] * len(seqs)  # per row: [vocab] logits after its feed
            if rest:
                batched = self.runner.forward_padded(
                    [ids[i] for i in rest], [feeds[i] for i in rest], last_only=True
                )  # [len(rest), vocab]
                for r, i in enumerate(rest):
                    last[i] = batched[r]
            for i in scoring:
                last[i], prompt_lps[i] = self._score_prompt(
                    ids[i], feeds[i], seqs[i].state.params.prompt_logprobs
                )
            # [batch, vocab]: the batched pass itself unless scoring rows joined it
            logits = torch.stack(last) if scoring else batched
            firsts = (
                sample_next(
                    logits[fresh],
                    [seqs[i].state.params for i in fresh],
                    [
                        seqs[i].state.verify_generator_at(len(seqs[i].state.prompt_token_ids))
                        for i in fresh
                    ],
                    [(seqs[i].state.prompt_token_ids, ()) for i in fresh],
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
                self.runner.free(seq.seq_id)
            raise
        outputs = []
        for seq in seqs:
            self.scheduler.start(seq)
            seq.guess = (seq.state.last_token_id,) if seq.state.output_token_ids else ()
        for i, tok, lps in zip(fresh, firsts, first_lps, strict=True):
            seqs[i].state.append([tok], self.eos_token_ids)
            seqs[i].guess = (tok,)
            outputs.append(self._output(seqs[i], [tok], lps, prompt_lps.get(i)))
        self._publish(outputs)
        return ids

    def _score_prompt(
        self, sid: Hashable, prompt: list[int], top: int
    ) -> tuple[torch.Tensor, list]:
        """Prefill one prompt in chunks of ``prefill_chunk_size`` and score it: the logits
        after its last token ([vocab]) and the log-probability of each token after the
        first. One chunk's logits ([chunk, vocab]) at a time, so a long prompt never
        materialises [prompt, vocab]."""
        size = self.runner.prefill_chunk_size
        scored: list = []
        last = None
        for start in range(0, len(prompt), size):
            chunk = prompt[start : start + size]
            logits = self.runner.forward_padded([sid], [chunk])[0]  # [chunk, vocab]
            following = prompt[start + 1 : start + 1 + len(chunk)]  # what each position predicts
            scored += token_logprobs(logits[: len(following)], following, top) or []
            last = logits[len(chunk) - 1].clone()  # not a view that would keep the chunk
            del logits
        return last, scored

    def _fail(self, sid: Hashable, exc: BaseException) -> None:
        """Fail one request alone: free its state here, tell the draft, tell its client."""
        logger.warning("request %r failed: %r", sid, exc)
        self.failed_requests += 1
        seq = self.scheduler.running.get(sid)
        if seq is not None:
            self._free(sid)
            if seq.k > 0:
                self._message([], [sid])
        else:
            with self._cv:
                self._seq_ids.discard(sid)
        stats = tuple(seq.stats) if seq is not None else (0, 0, 0, 0)
        n_out = len(seq.state.output_token_ids) if seq is not None else 0
        error = f"request failed in the engine core: {type(exc).__name__}: {exc}"
        self._publish([(sid, [], True, "error", n_out, stats, error, None, None)])

    def _message(
        self,
        items: list[tuple],
        freed: list[Hashable],
        round_s: float | None = None,
        tokens: int = 0,
    ) -> None:
        """Tell the draft about the round just ended (or admissions/frees between rounds)."""
        stats = (self._verify_avg, round_s, tokens)
        sent = self.link.send(self.link.round, items, freed, stats, self.scheduler.full_items)
        if not sent:  # the compiled graph broke and the draft was ended
            self.scheduler.unsync_all()

    def _gather(self) -> tuple[dict[Hashable, tuple], float]:
        """Each running sequence's drafts for this round (target-only for those without)."""
        sched = self.scheduler
        need = {sid: seq.guess for sid, seq in sched.running.items() if seq.k_next > 0}
        got = self.link.gather(need, self.draft_timeout_s)
        if got.lost_draft:
            sched.unsync_all()
        for sid in got.resync:
            sched.running[sid].synced = False
        for sid in got.gave_up:
            sched.give_up(sched.running[sid])
        for sid in got.timed_out:  # timed out or no draft: plain decode this round
            sched.running[sid].synced = False
        self.timings.draft_timeouts += len(got.timed_out) if got.had_draft else 0
        return got.found, got.waited_s

    def _run_round(self) -> None:
        sched = self.scheduler
        t_round = time.perf_counter()
        found, waited = self._gather()
        seqs = list(sched.running.values())
        planned = max((seq.k_next for seq in seqs), default=0)  # the k this round costs
        asked = [seq.k_next for seq in seqs]  # (draft_item overwrites k_next below)
        # Rows back from a pause made the draft prefill their whole context first: this
        # round's time says what resuming costs, not what a round at ``planned`` does.
        resuming = any(seq.resuming and seq.k_next > 0 for seq in seqs)
        for seq in seqs:
            seq.resuming = False
        rows, feeds = [], []
        for seq in seqs:
            tokens, q, speculative = found.get(seq.seq_id, ([], None, False))
            k = min(len(tokens), seq.k_next)
            tokens, q = tokens[:k], (None if q is None else q.head(k))
            gen = seq.state.verify_generator_at(
                len(seq.state.prompt_token_ids) + len(seq.state.output_token_ids)
            )
            rows.append(
                VerifyRow(
                    seq.state.params,
                    tokens,
                    q,
                    gen,
                    seq.state.prompt_token_ids,
                    seq.state.output_token_ids,
                )
            )
            feeds.append([seq.state.last_token_id, *tokens])
            if k:
                seq.stats[0] += k
                seq.stats[2] += 1
                seq.stats[3] += int(speculative)
        t_verify = time.perf_counter()
        batch = [(seq.seq_id, feed, row) for seq, feed, row in zip(seqs, feeds, rows, strict=True)]
        results = dict(self._isolated(batch, self._verify))
        verify_s = time.perf_counter() - t_verify
        self._verify_avg = (
            verify_s if self._verify_avg is None else (0.8 * self._verify_avg + 0.2 * verify_s)
        )
        self.link.round += 1
        with self._cv:
            alerts, self._drift = self._drift, []
        sched.plan_round(len(seqs), alerts)
        items, freed, outputs = [], [], []
        outcomes: list[tuple] = []  # (domain, drafted, accepted, cache hit) per drafted row
        at_planned: list[tuple] = []  # (domain, drafted, accepted) per row asking ``planned``
        committed: list[tuple[str, int]] = []  # (domain, tokens) per row
        for seq, row, k_asked in zip(seqs, rows, asked, strict=True):
            st = seq.state
            if st.seq_id not in results:  # failed alone (and freed)
                continue
            tokens, a, lps = results[st.seq_id]
            if planned and k_asked == planned:
                at_planned.append((seq.domain, len(row.draft_token_ids), a))
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
            elif seq.k > 0 and (item := sched.draft_item(seq)) is not None:
                items.append(item)  # target-only requests never concern the draft
        dropped = sched.take_dropped()
        for sid in dropped:  # drafts prepared for rows that left the draft are worthless
            self.link.drop_pushes(sid)
        freed += dropped
        # First: the draft starts on it at once.
        tokens = sum(len(out[1]) for out in outputs)
        self._message(items, freed, time.perf_counter() - t_round, tokens)
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
        sched.observe_round(outcomes, len(seqs), planned, total_s, resuming, at_planned)
        if self._telemetry is not None:
            # The policy's snapshot costs ~10 us per domain: published at most every
            # POLICY_STATE_EVERY_S, and when the batch empties (its last word before idling).
            state = None
            now = time.monotonic()
            if sched.policy is not None and (
                now - self._policy_state_at >= POLICY_STATE_EVERY_S or not sched.running
            ):
                state, self._policy_state_at = sched.policy.state(), now
            with self._cv:
                self._telemetry.add(outcomes, committed, verify_s, waited, total_s)
                if state is not None:
                    self._policy_state = state

    def _take_drift_alerts(self) -> None:
        with self._cv:
            alerts, self._drift = self._drift, []
        self.scheduler.take_drift_alerts(alerts)

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

    def _output(
        self,
        seq: RunningSeq,
        new_tokens: list[int],
        logprobs: list | None = None,
        prompt_logprobs: list | None = None,
    ) -> tuple:
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
            prompt_logprobs,
        )

    def _publish(self, outputs: list[tuple]) -> None:
        if outputs:
            with self._out_cv:
                self._outbox.extend(outputs)
                self._out_cv.notify_all()
