"""At most one log line per interval for a condition that repeats (a refused connection, a
failed accept() or open()), with the number of occurrences the line stands for.

A condition a client can cause thousands of times a second must not write a line each time
(the log is the operator's, and a flood of it costs disk and CPU); its counter metric holds
the exact figure, the line says that it is happening and how often.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable

LOG_INTERVAL_S = 60.0  # one line a minute: the goal allows at most 10 per repeated condition


class LogEvery:
    """Call ``occurred()`` at each occurrence; it says when to write a line.

    The first occurrence is logged at once; later ones at most once per ``interval_s``.
    Thread-safe: reads report from the executor's threads.
    """

    def __init__(self, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self._pending = 0
        self._lock = threading.Lock()

    def occurred(self) -> int:
        """Count one occurrence; returns 0 (stay quiet) or the occurrences since the last
        line, this one included (write a line now)."""
        with self._lock:
            self._pending += 1
            now = self._clock()
            if self._last is not None and now - self._last < self._interval_s:
                return 0
            self._last = now
            count, self._pending = self._pending, 0
            return count


class LogEveryPerKey:
    """A ``LogEvery`` for each key (an errno: each is its own condition)."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._by_key: dict[Hashable, LogEvery] = {}
        self._lock = threading.Lock()

    def occurred(self, key: Hashable) -> int:
        with self._lock:
            every = self._by_key.get(key)
            if every is None:
                every = self._by_key[key] = LogEvery(self._interval_s)
        return every.occurred()


def since_last(count: int, what: str) -> str:
    """The end of a rate-limited line standing for ``count`` occurrences of ``what``
    (nothing for the first one)."""
    return "" if count <= 1 else f" ({count:,} {what} since the last such line)"
