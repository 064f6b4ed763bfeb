"""``cpu_affinity`` (a worker's resources): the worker's model thread runs on its cores, the
CPU analogue of owning a GPU. No Ray: the pinning is a function of the calling thread."""

from __future__ import annotations

import logging
import os
import threading

import pytest
from pydantic import ValidationError

from deployments.config import WorkerResources
from deployments.workers.model_loader import pin_thread

ALLOWED = sorted(os.sched_getaffinity(0))


def in_thread(cores: list[int] | None) -> tuple[list[int], list[int]]:
    """``pin_thread(cores)`` in a new thread: what it returned, and the thread's cores."""
    out: dict[str, list[int]] = {}

    def body():
        out["pinned"] = pin_thread(cores)
        out["now"] = sorted(os.sched_getaffinity(0))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return out["pinned"], out["now"]


def test_the_calling_thread_runs_on_its_cores_and_no_other_thread_moves():
    assert in_thread([ALLOWED[-1]]) == ([ALLOWED[-1]], [ALLOWED[-1]])
    assert sorted(os.sched_getaffinity(0)) == ALLOWED  # this thread: untouched
    assert in_thread(None) == ([], ALLOWED)


def test_cores_the_process_may_not_use_are_left_out_and_logged(caplog):
    missing = max(ALLOWED) + 1000
    with caplog.at_level(logging.WARNING, logger="specserve.workers"):
        assert in_thread([ALLOWED[0], missing]) == ([ALLOWED[0]], [ALLOWED[0]])
        assert in_thread([missing]) == ([], ALLOWED)
    assert caplog.text.count("are not this worker's") == 2
    assert "left unpinned" in caplog.text


@pytest.mark.parametrize("bad", [[], [-1], [0, 0]])
def test_bad_core_lists_are_refused_naming_the_field(bad):
    with pytest.raises(ValidationError, match="cpu_affinity"):
        WorkerResources(cpu_affinity=bad)
