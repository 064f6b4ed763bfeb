"""The core's scheduler and draft link, driven alone: no Ray, no model."""

import threading
from dataclasses import replace

import pytest

from deployments.core.draft_link import ActorDraftLink
from deployments.core.scheduler import PAUSE_AFTER_ROUNDS, RunningSeq, Scheduler
from deployments.messages import (
    DraftItem,
    DraftPush,
    DraftRestart,
    DraftStatus,
    EngineCoreRequest,
    PushedDraft,
)
from specdec.policy import LengthPolicyConfig, SpeculationLength, batch_bucket
from specdec.proposer_choice import ProposerChoice, ProposerChoiceConfig
from specdec.sampling import SamplingParams
from specdec.sequence import SequenceState
from specdec.speculation_gate import GateConfig
from specdec.stats import RoundStats, RowOutcome


def item(sid, k=4, prompt=(1, 2, 3), auto=False):
    params = {"temperature": 0.0, "max_tokens": 32, "ignore_eos": True}
    return EngineCoreRequest(sid, list(prompt), [], params, k, "default", auto)


def running(sched, req, output=(7,)):
    params = SamplingParams(**req.sampling_params)
    state = SequenceState(req.request_id, list(req.prompt_token_ids), params)
    state.output_token_ids = list(output)
    seq = RunningSeq(
        state, req.num_speculative_tokens, domain=req.domain, auto=req.auto_k, guess=tuple(output)
    )
    sched.start(seq)
    return seq


def test_admission_waits_for_kv_slots_in_arrival_order():
    sched = Scheduler(max_num_seqs=4, max_model_len=100, draft_max_model_len=100)
    sched.enqueue([item(f"r{i}") for i in range(6)])
    first = sched.admit(free_slots=2)  # the KV budget holds 2 though 4 may run
    assert [it.request_id for it in first] == ["r0", "r1"]
    for it in first:
        running(sched, it)
    assert sched.admit(free_slots=0) == []  # full: the rest wait, none fails
    assert [it.request_id for it in sched.waiting] == ["r2", "r3", "r4", "r5"]
    admitted = sched.admit(free_slots=10)
    assert [it.request_id for it in admitted] == ["r2", "r3"]  # max_num_seqs caps
    assert sched.abort({"r4", "r0"}) == ["r0"]  # a waiting one just leaves the queue
    assert [it.request_id for it in sched.waiting] == ["r5"]


def test_k_stays_within_max_tokens_and_both_contexts():
    sched = Scheduler(max_num_seqs=2, max_model_len=12, draft_max_model_len=10)
    seq = running(sched, item("a", k=8, prompt=(1, 2, 3, 4, 5)))  # 6 tokens so far
    assert sched.k_for(seq) == 0  # no draft connected
    sched.has_draft = True
    assert sched.k_for(seq) == 3  # the draft has room for 10 - 6 - 1 more
    sched.draft_max_model_len = 100
    assert sched.k_for(seq) == 6  # the target's 12
    seq.state.params = replace(seq.state.params, max_tokens=3)
    assert sched.k_for(seq) == 1  # one output token so far, the bonus token is the last


def test_draft_items_full_then_incremental_and_give_up():
    sched = Scheduler(max_num_seqs=2, max_model_len=100, draft_max_model_len=100)
    sched.has_draft = True
    seq = running(sched, item("a", k=3))
    full = sched.draft_item(seq)
    assert full.seq_id == "a" and full.restart.sampling_params["temperature"] == 0.0
    assert (full.restart.prompt_token_ids, full.restart.output_token_ids) == ([1, 2, 3], [7])
    seq.base_len = 4
    assert sched.draft_item(seq) == DraftItem("a", 4, [7], 3, None)
    again = sched.full_items()[0].restart  # a new draft gets it in full again
    assert again == DraftRestart([1, 2, 3], [7], full.restart.sampling_params)
    sched.give_up(seq)
    assert sched.k_for(seq) == 0 and sched.take_dropped() == ["a"] and sched.dropped == []


def test_a_row_the_policy_keeps_at_zero_leaves_the_draft_and_comes_back():
    policy = SpeculationLength(LengthPolicyConfig(max_k=4))
    policy.observe_round_time(1, 0, 0.01)
    for k in range(1, 5):  # measured: any draft costs 100x a plain round, so k = 0 wins
        policy.observe_round_time(1, k, 1.0)
    policy.on_drift("default", 0.5)  # an acceptance estimate, as after a drift alert
    sched = Scheduler(max_num_seqs=2, max_model_len=1000, draft_max_model_len=1000, policy=policy)
    sched.has_draft = True
    seq = running(sched, item("a", k=4, auto=True))
    assert seq.auto and sched.draft_item(seq).num_speculative_tokens == 0
    items = []
    for _ in range(PAUSE_AFTER_ROUNDS + 2):
        sched.forced = None
        items.append(sched.draft_item(seq))
    assert seq.paused and sched.paused == 1 and items[-1] is None
    assert sched.take_dropped() == ["a"]  # told to the draft once
    sched.forced = 2  # a cost measurement drafts again (as would a recovered domain)
    back = sched.draft_item(seq)
    assert back is not None and back.restart is not None  # resumed: sent in full
    assert seq.resuming and sched.resumed == 1


def test_a_gate_measuring_k_zero_keeps_rows_in_the_draft_and_a_closed_gate_does_not():
    """The gate's measurement of k = 0 outlasts PAUSE_AFTER_ROUNDS, and its rows stay
    with the draft (drafting resumes after it without a prefill); once the gate has
    closed, a row admitted meanwhile is never sent to the draft, and the rows it holds
    leave after PAUSE_AFTER_ROUNDS as before."""
    gate = GateConfig(compare_rounds=PAUSE_AFTER_ROUNDS + 4, min_rounds=2)
    policy = SpeculationLength(LengthPolicyConfig(max_k=4, gate=gate))
    sched = Scheduler(max_num_seqs=2, max_model_len=1000, draft_max_model_len=1000, policy=policy)
    sched.has_draft = True
    seq = running(sched, item("a", k=4, auto=True))
    for _ in range(2):  # drafting measured: 10 tokens/s
        policy.gate.observe(batch_bucket(1), True, 10, 1.0)
    sched.plan_round(1, [])
    while sched.forced is not None:  # the length policy's first cost measurements
        sched.plan_round(1, [])
    trial = []
    while policy.measuring_off:
        trial.append(sched.draft_item(seq))
        policy.observe_round_wall(1, False, 10, 0.01)  # not drafting: 1000 tokens/s
        sched.plan_round(1, [])
    assert len(trial) == gate.compare_rounds > PAUSE_AFTER_ROUNDS
    assert all(it is not None and it.num_speculative_tokens == 0 for it in trial)
    assert not seq.paused and sched.take_dropped() == []
    assert policy.gate_closed and sched.forced is None
    late = running(sched, item("b", k=4, auto=True))
    assert sched.draft_item(late) is None and late.paused and sched.take_dropped() == ["b"]
    closed = []
    for _ in range(PAUSE_AFTER_ROUNDS):
        assert policy.gate_closed and sched.forced is None
        closed.append(sched.draft_item(seq))
        sched.plan_round(1, [])
    assert None not in closed[:-1] and closed[-1] is None and seq.paused
    assert sched.take_dropped() == ["a"]


def test_the_gate_hears_only_rounds_whose_lengths_were_all_the_policys():
    """Wall-clock goodput reaches the gate from rounds planned without a cost
    measurement and with every row's k the policy's, filed by the k asked for; a forced
    round or a round with a request's own k says nothing (it would skew either figure)."""
    policy = SpeculationLength(LengthPolicyConfig(max_k=4))
    sched = Scheduler(max_num_seqs=4, max_model_len=1000, draft_max_model_len=1000, policy=policy)

    def round_(planned_k, policy_rows, forced_before):
        sched.forced = forced_before  # the plan the observed round's k were chosen under
        sched.plan_round(2, [])
        stats = RoundStats(2, planned_k, False, total_s=0.01, wall_s=0.02, policy_rows=policy_rows)
        stats.rows = [RowOutcome("d", planned_k, planned_k, False, planned_k + 1, True)] * 2
        sched.observe_round(stats)

    round_(4, True, None)  # heard: drafted
    round_(0, True, None)  # heard: not drafted
    round_(4, False, None)  # a request's own k in the round: not heard
    round_(4, True, 4)  # a cost measurement: not heard
    gate = policy.gate._gates[(batch_bucket(2), False)]
    assert gate.rounds == {True: 1, False: 1}
    assert gate.rate(True) == 10 / 0.02 and gate.rate(False) == 2 / 0.02


def test_rounds_with_requests_waiting_are_planned_and_heard_apart():
    """With requests waiting for a slot the gate is asked, and told, about its queued
    state, by the state each round's plan was made in."""
    policy = SpeculationLength(LengthPolicyConfig(max_k=4))
    sched = Scheduler(max_num_seqs=2, max_model_len=1000, draft_max_model_len=1000, policy=policy)
    bucket = batch_bucket(2)
    while policy.plan_round(2) is not None:  # past the first cost measurements (the gate
        pass  # is asked once, unqueued, when they end)

    def round_(queued):
        sched.waiting = [item("w")] if queued else []
        sched.forced = None
        sched.plan_round(2, [])
        stats = RoundStats(2, 4, False, total_s=0.01, wall_s=0.02, policy_rows=True)
        stats.rows = [RowOutcome("d", 4, 4, False, 5, True)] * 2
        sched.observe_round(stats)

    round_(True)  # planned queued; the round it observes was planned before: not queued
    round_(False)  # the round it observes was planned queued
    round_(True)  # ... planned not queued (a queue now: that round is not filed by it)
    gates = policy.gate._gates
    assert gates[(bucket, False)].rounds[True] == 2 and gates[(bucket, True)].rounds[True] == 1
    assert gates[(bucket, True)].planned == 2 and gates[(bucket, False)].planned == 2


# ----- the draft link (no draft actor: pushes are stored and gathered) -------------------------


def drafts(sid, guess, tokens, speculative=False):
    return PushedDraft(sid, DraftStatus.DRAFTS, guess, tokens, None, speculative)


def test_gather_takes_pushed_drafts_for_this_round_and_guess():
    live = {"a", "b", "c"}
    link = ActorDraftLink("actor", is_live=live.__contains__)
    link.set_draft(object())  # any handle: gather never calls it
    link.round = 5
    link.store(DraftPush(4, [drafts("a", (1,), [9])]))  # a round already past: dropped
    link.store(DraftPush(5, [drafts("a", (2,), [3, 4], True), drafts("b", (8,), [5])]))
    link.store(DraftPush(5, [PushedDraft("c", DraftStatus.GAVE_UP), drafts("gone", (1,), [1])]))
    got = link.gather({"a": (2,), "b": (7,), "c": (1,)}, timeout_s=0.05)
    assert got.found == {"a": drafts("a", (2,), [3, 4], True)}
    assert got.timed_out == ["b"] and got.had_draft  # pushed for another guess
    assert got.resync == ["c"] and got.gave_up == ["c"]
    assert link.kept() == {"b"}
    link.forget("b")
    assert link.kept() == set()


def test_gather_wakes_on_a_push_and_stops_waiting_when_the_draft_goes():
    live = {"a"}
    link = ActorDraftLink("actor", is_live=live.__contains__)
    link.set_draft(object())
    pusher = threading.Timer(0.05, link.store, args=(DraftPush(0, [drafts("a", (), [1, 2])]),))
    pusher.start()
    assert link.gather({"a": ()}, timeout_s=30).found == {"a": drafts("a", (), [1, 2])}
    threading.Timer(0.05, link.set_draft, args=(None,)).start()
    got = link.gather({"a": ()}, timeout_s=30)  # returns when the draft is gone, not at 30 s
    assert got.timed_out == ["a"] and not got.had_draft and got.waited_s < 10


@pytest.mark.parametrize("live", [True, False])
def test_a_push_for_an_ended_sequence_is_not_kept(live):
    ids = {"a"} if live else set()
    link = ActorDraftLink("actor", is_live=ids.__contains__)
    link.store(DraftPush(0, [drafts("a", (1,), [2])]))
    assert link.kept() == ({"a"} if live else set())


def test_a_cost_measurement_and_the_round_after_it_are_not_representative():
    """The draft's width policy must not judge speculating by a round whose k the length
    policy forced, nor by the next one (its drafts were prepared at the forced k)."""
    policy = SpeculationLength(LengthPolicyConfig(max_k=4))
    sched = Scheduler(max_num_seqs=2, max_model_len=1000, draft_max_model_len=1000, policy=policy)
    flags = []
    for _ in range(16):  # a new bucket measures k = 0, 1 and 4 first, 3 rounds each
        running_forced = sched.forced  # what the round now running was planned with
        sched.plan_round(1, [])
        flags.append((running_forced is not None, sched.measuring_running_round))
    forced_rounds = [i for i, (forced, _) in enumerate(flags) if forced]
    assert forced_rounds and all(flags[i][1] for i in forced_rounds)
    after = [i + 1 for i in forced_rounds if i + 1 < len(flags) and not flags[i + 1][0]]
    assert all(flags[i][1] for i in after)
    free = [m for i, (f, m) in enumerate(flags) if not f and i - 1 not in forced_rounds]
    assert free and not any(free), flags


def test_the_gate_compares_rounds_without_the_prefills_of_admissions():
    """A burst of admissions prefilled before a round is the same work whichever choice
    ran: the gate is told the round's wall time less it (the twin, the whole wall time,
    would rate the round 25 times slower)."""
    policy = SpeculationLength(LengthPolicyConfig(max_k=4))
    choice = ProposerChoice(ProposerChoiceConfig())
    sched = Scheduler(
        max_num_seqs=4, max_model_len=1000, draft_max_model_len=1000, policy=policy, choice=choice
    )
    sched.plan_round(2, [])
    stats = RoundStats(2, 0, False, total_s=0.01, wall_s=0.5, prefill_s=0.48, policy_rows=True)
    stats.rows = [RowOutcome("d", 0, 0, False, 1, True, auto_method=True)] * 2
    sched.observe_round(stats)
    gate = policy.gate._gates[(batch_bucket(2), False)]
    assert gate.rate(False) == pytest.approx(2 / 0.02)
    # the proposer choice too: each row committed 1 token in the round's 0.02 s
    assert choice.state()["d"][str(batch_bucket(2))]["goodput"]["draft_model"] == pytest.approx(50)
    assert stats.decode_wall_s == pytest.approx(0.02)
    assert RoundStats(2, 0, False, total_s=0.01, wall_s=0.011, prefill_s=0.5).decode_wall_s == 0.01


@pytest.mark.parametrize("rejoin", [True, False])
def test_rows_admitted_after_the_plan_follow_the_gate_of_the_batch_they_join(rejoin):
    """An idle engine plans its next round at the first request of a burst (one
    sequence: drafting); the other 15 join a batch of 16, whose gate has decided against
    drafting. They run at k = 0 and are not sent to the draft (no prefill there). The
    twin, which keeps the plan of one sequence for them, drafts them all."""
    gate = GateConfig(min_rounds=2, compare_rounds=3)
    policy = SpeculationLength(LengthPolicyConfig(max_k=4, default_k=4, gate=gate))
    wide = batch_bucket(16)
    for _ in range(2):  # 16 rows: drafting measured 10 tokens/s, not drafting 100
        policy.gate.observe(wide, True, 10, 1.0)
        policy.gate.observe(wide, False, 100, 1.0)
    assert not policy.gate.is_open(wide)  # decided
    sched = Scheduler(max_num_seqs=16, max_model_len=1000, draft_max_model_len=1000, policy=policy)
    sched.has_draft = True
    first = running(sched, item("a0", k=4, auto=True))
    sched.plan_round(1, [])
    while sched.forced is not None:  # one sequence's first cost measurements
        sched.plan_round(1, [])
    assert sched.next_round(first).num_speculative_tokens == 4  # one sequence: drafting
    burst = [running(sched, item(f"a{i}", k=4, auto=True)) for i in range(1, 16)]
    if rejoin:
        sched.admitted([seq.seq_id for seq in burst])  # as the engine core after a prefill
    items = [sched.next_round(seq) for seq in burst]
    if rejoin:
        assert items == [None] * 15 and all(seq.k_next == 0 and seq.paused for seq in burst)
        # ... and the first row, planned at one sequence, runs this round without drafts
        # (one padded verification pass); the draft keeps it (a pause comes after
        # PAUSE_AFTER_ROUNDS at k = 0, as for any row), so nothing is sent again in full.
        assert first.k_next == 0 and first.synced
        sched.plan_round(16, [])
        again = sched.next_round(first)
        assert again.num_speculative_tokens == 0 and again.restart is None
        assert sched.take_dropped() == [seq.seq_id for seq in burst]
    else:
        assert all(it is not None and it.num_speculative_tokens == 4 for it in items)
        assert first.k_next == 4


@pytest.mark.parametrize("rejoin", [True, False])
def test_a_cost_measurement_planned_for_another_batch_size_is_dropped_at_admission(rejoin):
    """A round planned at one sequence measures k = 1 there; 15 rows admitted before it
    runs make it a round of 16, which would measure nothing of one sequence: the
    measurement is dropped and the admitted rows draft as the batch of 16 would (its
    gate open, no costs yet: ``default_k``). The twin runs them all at k = 1."""
    policy = SpeculationLength(LengthPolicyConfig(max_k=4, default_k=4))
    sched = Scheduler(max_num_seqs=16, max_model_len=1000, draft_max_model_len=1000, policy=policy)
    sched.has_draft = True
    first = running(sched, item("a0", k=4, auto=True))
    sched.plan_round(1, [])
    while sched.forced != 1:  # one sequence's first cost measurements: k = 0, then 1
        sched.plan_round(1, [])
    assert sched.next_round(first).num_speculative_tokens == 1
    burst = [running(sched, item(f"a{i}", k=4, auto=True)) for i in range(1, 16)]
    if rejoin:
        sched.admitted([seq.seq_id for seq in burst])
    ks = [sched.next_round(seq).num_speculative_tokens for seq in burst]
    assert ks == [4 if rejoin else 1] * 15
    assert (sched.forced is None) == rejoin and first.k_next == 1


@pytest.mark.parametrize("cap", [6, None])
def test_a_cost_measurement_is_dropped_by_admissions_past_disable_by_batch_size(cap):
    """A round planned at 4 rows measures k = 1; 2 rows admitted before it runs make 6 rows,
    the same bucket but the operator's cap: the measurement is dropped and no row drafts
    (the admitted ones are never sent to the draft). The twin, without a cap, keeps the
    measurement for all 6."""
    policy = SpeculationLength(LengthPolicyConfig(max_k=4, default_k=4, disable_by_batch_size=cap))
    sched = Scheduler(max_num_seqs=8, max_model_len=1000, draft_max_model_len=1000, policy=policy)
    sched.has_draft = True
    rows = [running(sched, item(f"a{i}", k=4, auto=True)) for i in range(4)]
    sched.plan_round(4, [])
    while sched.forced != 1:  # 4 rows' first cost measurements: k = 0, then 1
        sched.plan_round(4, [])
    assert [sched.next_round(seq).num_speculative_tokens for seq in rows] == [1] * 4
    late = [running(sched, item(f"b{i}", k=4, auto=True)) for i in range(2)]
    sched.admitted([seq.seq_id for seq in late])
    items = [sched.next_round(seq) for seq in late]
    if cap is None:
        assert sched.forced == 1 and [it.num_speculative_tokens for it in items] == [1, 1]
        assert all(seq.k_next == 1 for seq in rows)
    else:
        assert sched.forced is None and items == [None, None]
        assert all(seq.k_next == 0 for seq in rows + late)
        assert sched.take_dropped() == ["b0", "b1"]


@pytest.mark.parametrize("cap", [6, None])
def test_rounds_past_disable_by_batch_size_tell_no_policy_and_look_nothing_up(cap):
    """Rounds planned at 7 rows, past a cap of 6, run the rows whose proposer the choice
    picks on the draft model at k = 0 (no n-gram lookup either), and neither the gate, the
    costs nor the proposer choice hear them; a round of 4 rows is heard as before. The
    twin, without a cap, looks rows up and is heard at 7 rows."""
    policy = SpeculationLength(LengthPolicyConfig(max_k=4, disable_by_batch_size=cap))
    choice = ProposerChoice(ProposerChoiceConfig())
    sched = Scheduler(
        max_num_seqs=8, max_model_len=1000, draft_max_model_len=1000, policy=policy, choice=choice
    )
    sched.has_draft = True
    for _ in range(40):  # the choice measured: lookup pays at 7 rows
        choice.observe("d", 7, "ngram", 4, 0.01)
        choice.observe("d", 7, "draft_model", 1, 0.01)
    rows = []
    for i in range(7):
        seq = running(sched, item(f"a{i}", k=4, auto=True))
        seq.domain, seq.auto_method = "d", True
        rows.append(seq)
    sched.plan_round(7, [])
    while sched.forced is not None:  # (uncapped: 7 rows' first cost measurements)
        sched.plan_round(7, [])
    for seq in rows:
        sched.next_round(seq)
    assert {seq.method_next for seq in rows} == ({"draft_model"} if cap else {"ngram"})
    if cap:
        assert all(seq.k_next == 0 and seq.ngram_next == 0 for seq in rows)

    def model_goodput():
        return choice.state()["d"][str(batch_bucket(7))]["goodput"]["draft_model"]

    before = model_goodput()
    sched.plan_round(7, [])  # the round planned above runs now and is observed
    stats = RoundStats(7, 0, False, total_s=0.01, wall_s=0.02, policy_rows=True)
    stats.rows = [RowOutcome("d", 0, 0, False, 1, True, auto_method=True)] * 7
    sched.observe_round(stats)
    heard = (batch_bucket(7), False) in policy.gate.rates()
    assert heard == (cap is None)
    assert (0 in policy._costs[batch_bucket(7)].seconds) == (cap is None)
    assert (model_goodput() != before) == (cap is None)
