"""Background tasks that a bug or an unforeseen fault cannot turn into a lost mount.

The mount's background tasks (the cache's writer, the refresher, fills, the trace, the
replayer, ...) run in the nursery that also runs ``pyfuse3.main``: an exception that escapes
one of them cancels the nursery and unmounts the filesystem under every reader on the node.
Each known fault is handled where it happens (a full disk, a hub that is away, a corrupt
cache); this is the net under them: an exception that still escapes is logged (its
traceback the first time, one line after that, at a bounded rate), counted in
``spokefs_internal_errors_total{op=<task>}``, and the task is started again after a pause
that doubles up to ``_MAX_PAUSE_S``. Cancellation is not an error and passes through.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from spokefs import metrics
from spokefs.log_limit import LogLimiter

log = logging.getLogger(__name__)

_FIRST_PAUSE_S = 1.0  # long enough that a task failing at once does not spin
_MAX_PAUSE_S = 60.0
_RUN_OK_S = 300.0  # a task that ran this long before failing starts over at the first pause

_limiter = LogLimiter(log)
_seen: set[str] = set()  # tasks whose traceback was logged


class _Started:
    """A ``task_status`` that may be told more than once (a restarted task tells again)."""

    def __init__(self, status: trio.TaskStatus[Any]) -> None:
        self._status = status
        self.done = False

    def started(self, value: Any = None) -> None:
        if not self.done:
            self.done = True
            self._status.started(value)


async def supervised(name: str, fn: Callable[..., Awaitable[object]], *args: Any,
                     task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
    """Run ``fn(*args, task_status=...)`` until it returns or is cancelled, starting it again
    whenever it raises an ``Exception``; for ``nursery.start``.

    The first run's ``started()`` is passed on; if it fails before that, the mount goes on
    (``started()`` is called for it) and the task is retried in the background.
    """
    status = _Started(task_status)
    pause = _FIRST_PAUSE_S
    while True:
        began = trio.current_time()
        try:
            await fn(*args, task_status=status)
            return
        except Exception as exc:
            metrics.INTERNAL_ERRORS.labels(op=name).inc()
            first = name not in _seen
            _seen.add(name)
            _limiter.log(logging.ERROR, name, "internal error in the %s task (%s: %s); "
                         "restarting it in %.0f s", name, type(exc).__name__, exc, pause)
            if first:  # a bug: its traceback once, for the report
                log.error("traceback of the %s task's first failure", name, exc_info=exc)
        status.started()
        if trio.current_time() - began > _RUN_OK_S:
            pause = _FIRST_PAUSE_S
        await trio.sleep(pause)
        pause = min(pause * 2, _MAX_PAUSE_S)

