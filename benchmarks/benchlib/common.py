"""What every part of benchlib shares: the paths, the units, the errors and the run's time
budget (``Deadline``: every wait takes min(its own timeout, what is left of the run))."""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
REPO = HERE.parent
if str(HERE) not in sys.path:  # longlink.py and the benchmark scripts' own modules
    sys.path.insert(0, str(HERE))

KIB, MIB = 1024, 1024 * 1024


class BenchError(RuntimeError):
    """A step failed (a process died, timed out or printed an error); the message says which."""


class BudgetExhausted(BenchError):
    """The whole run's time budget (``--max-seconds``) is used up: stop and report."""


class Deadline:
    """A whole run's time budget: every wait takes min(step timeout, what is left)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def expired(self) -> bool:
        return self.left() <= 0

    def timeout(self, step_s: float) -> float:
        """min(step_s, time left); raises BudgetExhausted when nothing is left."""
        left = self.left()
        if left <= 0:
            raise BudgetExhausted("the run's time budget (--max-seconds) is exhausted")
        return min(step_s, left)
