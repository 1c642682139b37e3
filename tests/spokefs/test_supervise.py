"""``supervised``: a background task that raises is logged, counted and started again; its
first ``started()`` reaches ``nursery.start``; cancellation passes through."""

from __future__ import annotations

import logging

import pytest
import trio

from spokefs import metrics
from spokefs.supervise import supervised


def _failures(op: str) -> float:
    return metrics.INTERNAL_ERRORS.labels(op=op)._value.get()


async def test_a_failing_task_is_restarted_and_counted(autojump_clock, caplog):
    runs: list[float] = []

    async def flaky(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started("up")
        runs.append(trio.current_time())
        if len(runs) < 3:
            raise RuntimeError(f"boom {len(runs)}")
        await trio.sleep_forever()

    before = _failures("t-flaky")
    with caplog.at_level(logging.ERROR, logger="spokefs.supervise"):
        async with trio.open_nursery() as nursery:
            assert await nursery.start(supervised, "t-flaky", flaky) == "up"
            await trio.sleep(10)
            nursery.cancel_scope.cancel()
    assert len(runs) == 3
    assert runs[1] - runs[0] == pytest.approx(1.0) and runs[2] - runs[1] == pytest.approx(2.0)
    assert _failures("t-flaky") - before == 2
    lines = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert sum(r.exc_info is not None for r in lines) == 1  # the traceback once
    assert "boom 2" in lines[-1].getMessage()


async def test_a_task_that_fails_before_it_started_does_not_hold_up_the_mount(autojump_clock):
    tries = 0

    async def broken(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        nonlocal tries
        tries += 1
        if tries == 1:
            raise OSError("no room")
        task_status.started()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        await nursery.start(supervised, "t-broken", broken)
        await trio.sleep(5)
        assert tries == 2
        nursery.cancel_scope.cancel()


async def test_a_task_that_returns_is_not_restarted():
    calls = 0

    async def once(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        nonlocal calls
        calls += 1
        task_status.started()

    async with trio.open_nursery() as nursery:
        await nursery.start(supervised, "t-once", once)
    assert calls == 1
