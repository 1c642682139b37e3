"""The event loop's exception handler for failed accept() calls: at most one WARNING a
minute and a counter, instead of an ERROR with a traceback for every call.

asyncio hands every accept() that fails with EMFILE, ENFILE, ENOBUFS or ENOMEM to the
loop's exception handler ("socket.accept() out of system resource") and, within one turn
of the loop, tries again up to the listen backlog's times, failing each time: with
``ulimit -n 256`` and 2,000 clients the default handler wrote 70,981 tracebacks (31.7 MB) in
17 s. After a failure asyncio stops accepting for a second by itself (the kernel keeps the
waiting connections in its backlog meanwhile), so there is nothing to do but report it.

Python before 3.15 (CPython gh-151615) keeps looping after the failure, and each failed
call schedules its own retry a second later; retries still pending when hubd closes the
listening socket at shutdown run on the closed socket and fail with ``ValueError`` ("Invalid
file descriptor: -1"). After ``listener_closed()`` those are dropped without a line: the
condition was reported when the accept() calls failed.
Every other context goes to the handler installed before, by default asyncio's. The handler
stays installed until the loop ends, since the retries may run after hubd's teardown.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
from collections.abc import Callable
from typing import Any

from hubd.fd_limit import open_fds
from hubd.log_rate import LogEvery, since_last
from hubd.metrics import HubMetrics

log = logging.getLogger(__name__)

ACCEPT_OUT_OF_RESOURCE = "socket.accept() out of system resource"  # asyncio's message
_FD_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})
_MEMORY_ERRNOS = frozenset({errno.ENOBUFS, errno.ENOMEM})
# The callback asyncio schedules to accept again after a failure, as its handle names it.
_RETRY = "._start_serving("

Context = dict[str, Any]
Handler = Callable[[asyncio.AbstractEventLoop, Context], object]


class AcceptErrorHandler:
    """``loop.set_exception_handler`` target: ``install`` it, call ``listener_closed`` when
    the listening socket is closed."""

    def __init__(self, metrics: HubMetrics) -> None:
        self._metrics = metrics
        # One line a minute per condition: running out of descriptors and out of memory
        # are different faults for the operator.
        self._fd_lines = LogEvery()
        self._memory_lines = LogEvery()
        self._previous: Handler | None = None
        self._closed = False

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self._previous = loop.get_exception_handler()
        loop.set_exception_handler(self)

    def listener_closed(self) -> None:
        """The listening socket is closed: asyncio's pending accept retries will fail."""
        self._closed = True

    def __call__(self, loop: asyncio.AbstractEventLoop, context: Context) -> None:
        exc = context.get("exception")
        if context.get("message") == ACCEPT_OUT_OF_RESOURCE and isinstance(exc, OSError) \
                and exc.errno in _FD_ERRNOS | _MEMORY_ERRNOS:
            self._report(exc.errno)
        elif self._closed and isinstance(exc, ValueError) \
                and _RETRY in repr(context.get("handle")):
            pass  # a retry of a failed accept() that ran on the closed listening socket
        elif self._previous is not None:
            self._previous(loop, context)
        else:
            loop.default_exception_handler(context)

    def _report(self, code: int) -> None:
        self._metrics.accept_failures.labels(reason=errno.errorcode[code].lower()).inc()
        if code in _FD_ERRNOS:
            count = self._fd_lines.occurred()
            if count:
                soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                used = open_fds()
                if used is None and code == errno.EMFILE:  # EMFILE: every one is taken
                    used = soft
                table = " (the system's file table is full)" if code == errno.ENFILE else ""
                log.warning("out of file descriptors%s: %s open, limit %d; refusing "
                            "connections%s", table, "?" if used is None else used, soft,
                            since_last(count, "failed accept() calls"))
        else:
            count = self._memory_lines.occurred()
            if count:
                log.warning("out of memory in accept(): %s; refusing connections%s",
                            errno.errorcode[code],
                            since_last(count, "failed accept() calls"))
