"""The in-flight limit found by probing, on a simulated link (no clock, no network)."""

from __future__ import annotations

import time

import pytest

from spokefs.hub.link_model import LinkModel, LinkReach, WindowedMin

MB = 1_000_000


def drive(model: LinkModel, per_request_bps: float, cap_bps: float, latency_s: float,
          seconds: float) -> list[int]:
    """Feed the model what a link delivers: each request moves ``per_request_bps`` until
    the cap is reached; returns the limit after each step."""
    now, limits, step = 0.0, [], latency_s / 4
    while now < seconds:
        rate = min(cap_bps, model.limit * per_request_bps)
        model.record(int(rate * step), latency_s)
        now += step
        limits.append(model.update(work_waiting=True, now=now).limit)
    return limits


def test_long_link_reaches_its_ceiling_within_seconds_and_settles():
    # 900 ms: a 4 MiB request takes ~1.8 s on a 4 MiB window (~2.3 MB/s each); 125 MB/s cap
    model = LinkModel(min_requests=8, max_requests=128, initial=16, now=0.0)
    limits = drive(model, 2.3 * MB, 125 * MB, 1.8, 60)
    needed = 125 / 2.3  # ~55 requests fill the link
    reached = next(i for i, lim in enumerate(limits) if lim >= needed) * 1.8 / 4
    assert reached <= 12  # seconds: doubling, not +50% per two latencies
    assert needed <= limits[-1] <= 128  # it stays where the link is full


def test_a_link_that_is_full_already_does_not_grow_the_limit_much():
    model = LinkModel(min_requests=8, max_requests=128, initial=16, now=0.0)
    limits = drive(model, 40 * MB, 125 * MB, 0.1, 30)  # 4 requests fill it
    assert max(limits[-40:]) <= 48  # probes now and then, returns to a small limit
    assert min(limits) >= 8


def test_no_waiting_work_means_no_change():
    model = LinkModel(min_requests=8, max_requests=128, initial=16, now=0.0)
    for i in range(100):
        model.record(MB, 0.1)
        assert model.update(work_waiting=False, now=i * 0.1).limit == 16


def test_windowed_min_is_the_smallest_recent_sample():
    w = WindowedMin(window_s=10)
    assert w.value(0) is None
    w.append(0.5, now=0)
    w.append(0.06, now=1)  # an idle link answers in one round trip
    for t in range(2, 10):
        w.append(0.4 + t / 100, now=t)  # then answers queue behind each other's bytes
    assert w.value(9) == 0.06
    assert w.value(11.5) == pytest.approx(0.42)  # the clean one left the window: next smallest
    w.append(0.9, now=30)
    assert w.value(30) == 0.9  # nothing else is recent: the latest


def test_link_reach_rate_is_assumed_until_the_link_has_settled():
    total = [0]
    rtt: list[float | None] = [None]
    reach = LinkReach(lambda: total[0], lambda: rtt[0], 125e6)
    t0 = time.monotonic()  # the meter's clock starts when it is made
    assert reach.rate_bps(now=t0) == 125e6  # nothing measured: the assumed rate
    assert reach.bdp_bytes(now=t0) is None  # and no round trip yet
    rtt[0] = 0.1
    for step in range(1, 41):  # 10 s of 50 MB/s: settled after 3 round trips + 1 s
        total[0] += int(50e6 * 0.25)
        assert reach.rate_bps(now=t0 + step * 0.25) == (125e6 if step < 6 else
                                                        pytest.approx(50e6, rel=0.01))
    assert reach.bdp_bytes(now=t0 + 10.0) == pytest.approx(5e6, rel=0.01)
