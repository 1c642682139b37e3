"""How many background requests to keep in flight on the far link, from what it has shown.

A long link is full only when ``bytes in flight >= rate x round trip``, and one HTTP request
on one connection sees at most ``window / RTT`` (4 MiB / 900 ms is under 5 MB/s), so the
spoke keeps many requests going at once. How many depends on the link, the hub and this
machine, so it is found by measurement rather than assumed:

- The **delivery rate** is the bytes of finished background requests per second over one
  probe interval; the **request latency** is the median of recent requests.
- **Start-up.** Like TCP's slow start, the limit doubles every interval (one median latency
  long, at least ``_MIN_INTERVAL_S``) while the rate keeps improving: at 900 ms a reader
  reaches the link's ceiling in a few seconds, not tens of seconds.
- **Probing.** After that, while background work is waiting for a slot, the limit grows by
  half each interval (two median latencies long, so each setting is judged on requests that
  started and finished under it) as long as the rate keeps improving by more than
  ``_BETTER``; when it stops improving, the limit returns to the best setting seen and holds
  for ``_HOLD`` intervals, then probes again (the link may have grown). The best rate decays
  slowly so a link that got slower is re-measured. With no work waiting, the limit is not
  what limits the rate, and nothing changes.

The limit stays within ``[min_requests, max_requests]``; ``max_requests x request_bytes`` is
the memory bound on response bodies in flight.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

_BETTER = 1.05
_GROW = 1.5
_STARTUP_GROW = 2.0
_HOLD = 8
_DECAY = 0.98
_MIN_INTERVAL_S = 0.5
_LATENCY_SAMPLES = 64


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    rate_bps: float  # bytes per second delivered in the last interval
    latency_s: float  # median latency of recent background requests
    limit: int  # background requests allowed in flight


class LinkModel:
    """Rate and latency of background requests, and the in-flight limit that maximises rate."""

    def __init__(
        self, min_requests: int, max_requests: int, initial: int, now: float | None = None
    ) -> None:
        self.min_requests = min_requests
        self.max_requests = max_requests
        self._max_configured = max_requests
        self.limit = initial
        self._latencies: deque[float] = deque(maxlen=_LATENCY_SAMPLES)
        self._bytes = 0
        self._interval_start = time.monotonic() if now is None else now
        self._best_rate = 0.0
        self._best_limit = initial
        self._hold = 0
        self._starting = True
        self.last = LinkEstimate(0.0, 0.0, initial)

    def record(self, nbytes: int, seconds: float) -> None:
        """One background request finished: ``nbytes`` in ``seconds``."""
        self._bytes += nbytes
        self._latencies.append(seconds)

    def update(self, work_waiting: bool, now: float | None = None) -> LinkEstimate:
        """Called often; at the end of each probe interval, judge it and set the new limit."""
        now = time.monotonic() if now is None else now
        latency = statistics.median(self._latencies) if self._latencies else 0.0
        elapsed = now - self._interval_start
        if elapsed < max(_MIN_INTERVAL_S, (1 if self._starting else 2) * latency):
            return self.last
        rate = self._bytes / elapsed
        self._bytes = 0
        self._interval_start = now
        if work_waiting:
            self._probe(rate)
        self.last = LinkEstimate(rate, latency, self.limit)
        return self.last

    def _probe(self, rate: float) -> None:
        self._best_rate *= _DECAY
        if rate > self._best_rate * _BETTER:
            self._best_rate, self._best_limit = rate, self.limit
            self._hold = 0
            grow = _STARTUP_GROW if self._starting else _GROW
            self.limit = self._clamp(math.ceil(self.limit * grow))
        elif self._starting or self._hold < _HOLD:
            self._starting = False
            self._hold += 1
            self.limit = self._best_limit
        else:  # held long enough at the best setting: look for more again
            self._hold = 0
            self.limit = self._clamp(math.ceil(self._best_limit * _GROW))

    def set_bounds(self, low: int, high: int) -> None:
        """Keep the limit within ``[low, high]`` from now on (``high`` at most the
        ``max_requests`` it was made with)."""
        self.max_requests = min(high, self._max_configured)
        self.min_requests = min(low, self.max_requests)
        self.limit = self._clamp(self.limit)
        self._best_limit = self._clamp(self._best_limit)

    def _clamp(self, n: int) -> int:
        return max(self.min_requests, min(self.max_requests, n))


_METER_INTERVAL_S = 0.25


class DeliveryMeter:
    """The peak rate at which bytes arrive from the hub (all requests), from a running total.

    The rate is taken over intervals of at least ``_METER_INTERVAL_S`` as bytes arrive (the
    hub client counts an answer's bytes as they land, not when it ends: answers that share
    the link end together, and counted then they looked like several times its rate), and
    the peak decays by ``_DECAY`` per interval, so a link that got slower is seen as such
    within seconds.
    """

    def __init__(self, now: float | None = None) -> None:
        self.peak_bps = 0.0
        self._last_total = 0
        self._last_t = time.monotonic() if now is None else now
        self._first_t: float | None = None  # when bytes first arrived

    def sample(self, total: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_t
        if elapsed < _METER_INTERVAL_S:
            return
        rate = (total - self._last_total) / elapsed
        if rate and self._first_t is None:
            self._first_t = self._last_t
        self.peak_bps = max(rate, self.peak_bps * _DECAY)
        self._last_total, self._last_t = total, now

    def settled(self, rtt_s: float, now: float | None = None) -> bool:
        """Whether traffic has flowed long enough for the peak to be the link's (a few
        round trips: connections set up, windows full)."""
        if self._first_t is None:
            return False
        now = time.monotonic() if now is None else now
        return now - self._first_t >= 3 * rtt_s + 1.0


class LinkReach:
    """The far link's bandwidth-delay product: how many bytes must be on their way to keep
    it full. The rate is the peak at which hub bytes arrive (``DeliveryMeter``, all
    requests); the delay is the hub client's shortest recent wait for an answer. Until
    traffic has flowed for a few round trips the rate is taken to be at least
    ``assumed_bps``: a window that started small and doubled every round trip would take
    seconds to fill a 900 ms link.

    Args:
        received: the running total of bytes received from the hub.
        rtt_s: the current round-trip estimate, None before the first answer.
        assumed_bps: the rate assumed before it is measured.
    """

    def __init__(self, received: Callable[[], int], rtt_s: Callable[[], float | None],
                 assumed_bps: float) -> None:
        self._received = received
        self._rtt_s = rtt_s
        self._assumed_bps = assumed_bps
        self._meter = DeliveryMeter()

    def bdp_bytes(self, now: float | None = None) -> int | None:
        """Rate x round trip, in bytes; None while no answer has come (no round trip yet)."""
        rtt = self._rtt_s()
        rate = self._rate(rtt, now)
        return None if rtt is None else int(rate * rtt)

    def rate_bps(self, now: float | None = None) -> float:
        """The link's rate as measured (at least ``assumed_bps`` until it has settled)."""
        return self._rate(self._rtt_s(), now)

    def _rate(self, rtt: float | None, now: float | None) -> float:
        self._meter.sample(self._received(), now)
        rate = self._meter.peak_bps
        if rtt is None or not self._meter.settled(rtt, now):
            rate = max(rate, self._assumed_bps)
        return rate


class WindowedMin:
    """The smallest sample of the last ``window_s`` seconds (the latest one if none is that
    recent): a round-trip estimate that queueing does not inflate. With many requests in
    flight every answer waits behind others' bytes at the bottleneck, so the shortest wait
    of the last few dozen answers grows with the load; the shortest of the last minute is
    the path's own delay as long as the link was idle once in that minute (a new job's
    first requests, or the hub client's keep-alive touches).
    """

    def __init__(self, window_s: float = 60.0, max_samples: int = 4096) -> None:
        self._window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def append(self, value: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        samples = self._samples
        # a sample no smaller than the newest adds nothing while the newest is in the window
        while samples and samples[-1][1] >= value:
            samples.pop()
        samples.append((now, value))
        while samples[0][0] < now - self._window_s and len(samples) > 1:
            samples.popleft()

    def __bool__(self) -> bool:
        return bool(self._samples)

    def value(self, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        samples = self._samples
        while len(samples) > 1 and samples[0][0] < now - self._window_s:
            samples.popleft()
        return samples[0][1] if samples else None
