"""HubOrigins: which hub replica is in use, failover, failback, and its metrics."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from spokefs import metrics
from spokefs.hub.origins import HubOrigins

A, B, C = "http://a:1", "http://b:2", "http://c:3"


def _origin(url: str) -> float:
    return metrics.HUB_ORIGIN.labels(url=url)._value.get()


def _failovers(reason: str) -> float:
    return metrics.HUB_FAILOVERS.labels(reason=reason)._value.get()


def test_one_hub_never_moves(caplog: pytest.LogCaptureFixture) -> None:
    origins = HubOrigins([A + "/"])
    assert (origins.urls, origins.several, origins.current()) == ((A,), False, A)
    with caplog.at_level(logging.WARNING):
        origins.failed(A, "ConnectError")
        origins.failed(A, "ConnectError")  # logged once, as a transition
        origins.worked(A)
    assert origins.current() == A
    assert caplog.messages == [f"hub {A} unreachable: ConnectError", f"hub {A} reachable again"]


def test_failover_moves_once_and_skips_hubs_known_down() -> None:
    origins = HubOrigins([A, B, C])
    before = _failovers("failed")
    assert (_origin(A), _origin(B), _origin(C)) == (1, 0, 0)
    origins.failed(A, "reset")
    assert origins.current() == B
    origins.failed(A, "reset")  # another request in flight to A notices later: no move
    assert origins.current() == B and _failovers("failed") == before + 1
    assert (_origin(A), _origin(B), _origin(C)) == (0, 1, 0)
    origins.failed(B, "reset")  # A is known down: C next
    assert origins.current() == C
    origins.failed(C, "reset")  # every hub down: simply the next, one of them may be back
    assert origins.current() == A
    assert not origins.all_reachable()
    origins.worked(B)
    assert origins.other_than({A}) == B  # answered again: a hub to ask
    assert origins.other_than({A, B}) is None  # C has not
    origins.worked(A)
    origins.worked(C)
    assert origins.all_reachable()


def test_other_than_lists_reachable_hubs_not_yet_asked() -> None:
    origins = HubOrigins([A, B, C])
    assert origins.other_than({A}) == B
    assert origins.other_than({A, B}) == C
    origins.failed(C, "timeout")
    assert origins.other_than({A, B}) is None
    assert origins.other_than({A}) == B


def test_bad_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="no hub"):
        HubOrigins([])
    with pytest.raises(ValueError, match="twice"):
        HubOrigins([A, A + "/"])


async def test_watch_preferred_moves_back_when_the_probe_answers(
        autojump_clock: trio.testing.MockClock) -> None:
    origins = HubOrigins([A, B], probe_interval_s=2.0)
    answers = {A: False}
    probed: list[float] = []

    async def probe(url: str) -> bool:
        assert url == A
        probed.append(trio.current_time())
        return answers[A]

    before = _failovers("preferred")
    async with trio.open_nursery() as nursery:
        await nursery.start(origins.watch_preferred, probe)
        await trio.sleep(10)
        assert probed == []  # A in use: nothing to probe
        origins.failed(A, "reset")
        await trio.sleep(5)
        assert origins.current() == B and len(probed) == 2  # every 2 s
        answers[A] = True
        await trio.sleep(2)
        assert origins.current() == A and origins.all_reachable()
        assert _failovers("preferred") == before + 1
        count = len(probed)
        await trio.sleep(10)
        assert len(probed) == count  # back on A: probing stops
        nursery.cancel_scope.cancel()
