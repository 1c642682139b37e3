"""``LogLimiter``: at most N lines a minute per condition, and the count of those left out."""

from __future__ import annotations

import logging

import pytest

from spokefs.log_limit import LogLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_at_most_n_lines_a_minute_then_the_left_out_count(caplog: pytest.LogCaptureFixture):
    clock = Clock()
    limiter = LogLimiter(logging.getLogger("t.limit"), per_minute=3, clock=clock)
    with caplog.at_level(logging.WARNING, logger="t.limit"):
        written = [limiter.warning("k", "event %d", i) for i in range(100)]
        assert written == [True] * 3 + [False] * 97
        assert limiter.suppressed == {"k": 97}
        clock.now += 61
        assert limiter.warning("k", "event %d", 100)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["event 0", "event 1", "event 2",
                     "event 100 (97 more like it not logged)"]
    assert limiter.suppressed == {}


def test_keys_are_limited_apart(caplog: pytest.LogCaptureFixture):
    limiter = LogLimiter(logging.getLogger("t.keys"), per_minute=1, clock=Clock())
    with caplog.at_level(logging.WARNING, logger="t.keys"):
        assert limiter.warning("a", "a1")
        assert not limiter.warning("a", "a2")
        assert limiter.warning("b", "b1")
    assert [r.getMessage() for r in caplog.records] == ["a1", "b1"]
