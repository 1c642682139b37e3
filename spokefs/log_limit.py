"""Log lines for conditions that can repeat many times a second, at a bounded rate.

A condition that a loop or a flood of requests can hit (a cached block failing its checksum,
a store failing for want of disk, a refresh that cannot be written) must never write a line
per occurrence: a node's log fills and the one line that matters scrolls away. Each
condition, named by a key, gets at most ``per_minute`` lines in any minute; the next line
after a quiet spell says how many were left out, and a metric counts every occurrence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

# The fault suite's bound: at most 10 lines per minute for any repeated condition.
LINES_PER_MINUTE = 10
_MINUTE_S = 60.0


class LogLimiter:
    """At most ``per_minute`` lines a minute per key, on one logger.

    Attributes:
        suppressed: lines left out so far, by key (the next line that is written reports
            them and resets the count).
    """

    def __init__(self, logger: logging.Logger, per_minute: int = LINES_PER_MINUTE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._per_minute = per_minute
        self._clock = clock
        self._recent: dict[str, list[float]] = {}  # key -> times of its lines this minute
        self.suppressed: dict[str, int] = {}

    def log(self, level: int, key: str, msg: str, *args: object) -> bool:
        """Write ``msg % args`` at ``level`` unless ``key`` had its lines this minute;
        whether it was written."""
        now = self._clock()
        times = [t for t in self._recent.get(key, ()) if now - t < _MINUTE_S]
        if len(times) >= self._per_minute:
            self._recent[key] = times
            self.suppressed[key] = self.suppressed.get(key, 0) + 1
            return False
        times.append(now)
        self._recent[key] = times
        left_out = self.suppressed.pop(key, 0)
        if left_out:
            msg += " (%d more like it not logged)"
            args = (*args, left_out)
        self._log.log(level, msg, *args)
        return True

    def warning(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)
