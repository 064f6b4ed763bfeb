"""Worker calls a request makes that must outlive the request's own cancellation.

When an HTTP client leaves, Serve cancels the replica's call for its request with
``ray.cancel(..., recursive=True)``, and Ray cancels with it every actor call that call
submitted and that has not run yet. Ray knows which calls those are from the submitter's
current task, which an async actor keeps in a context variable of each asyncio task.

Two of the frontend's calls to the core are made on behalf of a request and must not be
cancelled with it:

- the *abort* that frees a request whose client left, submitted in the request's
  ``finally``: cancelled, the sequence generates on to ``max_tokens`` with nobody reading;
- the *add* of a request, awaited by the request.

Worse, the core is an in-order actor (each caller's calls numbered in the order sent,
then run by their concurrency group's threads): a call cancelled before it reached the
core leaves a hole in the numbering, and the core waits 30 s for it, then fails every
call queued behind it (CI, a key-limits test: ``Timed out waiting for seq_no 12 ...
Cancelling all queued tasks``, the next request of another client hung for the 60 s of
its timeout).

:class:`DetachedCalls` submits such calls in the context the engine started in (the
replica's constructor, a call that has ended and is never cancelled), so that Ray counts
them as that call's, not the request's. The request still awaits their results.
"""

from __future__ import annotations

import contextvars
from typing import Any


class DetachedCalls:
    """``calls.submit(actor.method, *args)``: ``actor.method.remote(*args)`` as if made
    where this object was created (its context variables, Ray's current task among them)."""

    def __init__(self) -> None:
        self._context = contextvars.copy_context()

    def submit(self, method: Any, *args: Any) -> Any:
        """The call's ObjectRef (a copy of the context each time: one Context object
        cannot be entered twice at once)."""
        return self._context.copy().run(method.remote, *args)
