"""What the core publishes for whole-response requests (pure: no Ray, no models)."""

from deployments.core.output_hold import OutputHold
from deployments.messages import EngineCoreOutput, TokenLogprob
from specdec.stats import SpecCounts


def out(new, n_out, finished=False, error=None, lps=False, prompt_lps=None, rid="r"):
    counts = SpecCounts(rounds=n_out)
    reason = "error" if error else ("length" if finished else None)
    logprobs = [TokenLogprob(-float(t), {}) for t in new] if lps else None
    return EngineCoreOutput(rid, new, finished, reason, n_out, counts, error, logprobs, prompt_lps)


def test_the_first_output_goes_at_once_also_when_it_is_the_last():
    hold = OutputHold()
    only = out([1], 1, finished=True, prompt_lps=[TokenLogprob(None, None)])
    assert hold.offer(only, "final_only") is only
    assert len(hold) == 0


def test_delta_requests_pass_through_every_round():
    hold = OutputHold()
    for o in (out([1], 1), out([2, 3], 3), out([4], 4, finished=True)):
        assert hold.offer(o, "delta") is o
    assert len(hold) == 0


def test_final_only_sends_the_first_output_then_everything_else_at_its_end():
    hold = OutputHold()
    prompt_lps = [TokenLogprob(None, None)]
    first = out([1], 1, lps=True, prompt_lps=prompt_lps)
    assert hold.offer(first, "final_only") is first
    assert hold.offer(out([2, 3], 3, lps=True), "final_only") is None
    assert hold.offer(out([4], 4, lps=True), "final_only") is None
    assert len(hold) == 1
    end = hold.offer(out([5, 6], 6, finished=True, lps=True), "final_only")
    assert end.new_token_ids == [2, 3, 4, 5, 6]
    assert [lp.logprob for lp in end.logprobs] == [-2.0, -3.0, -4.0, -5.0, -6.0]
    assert end.finished and end.finish_reason == "length" and end.num_output_tokens == 6
    assert end.spec_counts.rounds == 6  # the latest counts, not the first held
    assert end.prompt_logprobs is None  # (went with the first output)
    assert len(hold) == 0


def test_final_only_errors_go_at_once_with_what_was_held():
    hold = OutputHold()
    hold.offer(out([1], 1), "final_only")
    hold.offer(out([2], 2), "final_only")
    failed = hold.offer(out([3], 3, error="boom"), "final_only")
    assert failed.error == "boom" and failed.new_token_ids == [2, 3]
    assert len(hold) == 0


def test_final_only_outputs_go_anyway_once_flush_tokens_have_gathered():
    hold = OutputHold(flush_tokens=4)
    hold.offer(out([1], 1), "final_only")
    assert hold.offer(out([2, 3], 3), "final_only") is None
    flushed = hold.offer(out([4, 5], 5, lps=True), "final_only")
    assert flushed.new_token_ids == [2, 3, 4, 5] and not flushed.finished
    assert [lp.logprob for lp in flushed.logprobs] == [-4.0, -5.0]  # (only those asked)
    assert len(hold) == 0
    assert hold.offer(out([6], 6), "final_only") is None  # gathering again
    assert hold.offer(out([7], 7, finished=True), "final_only").new_token_ids == [6, 7]


def test_a_resumed_request_is_held_from_its_first_output_on_a_new_core():
    """A new core's first output for a request resumed after 5 tokens is not its first."""
    hold = OutputHold()
    assert hold.offer(out([6], 6), "final_only") is None
    assert hold.offer(out([7], 7, finished=True), "final_only").new_token_ids == [6, 7]


def test_requests_are_held_apart_and_dropped_when_they_leave():
    hold = OutputHold()
    for rid in ("a", "b"):
        hold.offer(out([1], 1, rid=rid), "final_only")
        hold.offer(out([2], 2, rid=rid), "final_only")
    hold.drop("a")  # aborted
    assert len(hold) == 1
    assert hold.offer(out([3], 3, True, rid="b"), "final_only").new_token_ids == [2, 3]
    assert len(hold) == 0
