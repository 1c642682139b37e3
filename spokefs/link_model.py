"""How many bytes to keep in flight on the far link, from what the link has shown.

A long link is filled only when ``in-flight bytes >= bandwidth x round-trip time``; one HTTP
request per connection sees at most ``window / RTT`` (4 MiB / 900 ms is under 5 MB/s), so the
spoke must keep many requests going at once, and how many depends on the link. The model
follows BBR's idea at request granularity: the delivery rate (bytes of completed background
requests per second, over a short sliding window) and the least latency of a full-size
request (over a long window) estimate the link's "request-delay product"; the target is that
product times a gain: 2 while the rate is still growing (start-up, to find the ceiling), 1.25
once it has stopped (steady state, a little queue but not a long one, so demand reads are not
stuck behind a deep queue of prefetches).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

_RATE_WINDOW_S = 2.0
_LATENCY_WINDOW_S = 60.0
_STARTUP_GAIN = 2.0
_STEADY_GAIN = 1.25
_GROWTH = 1.25  # the rate "still grows" while it beat the best by this much recently
_GROWTH_WINDOW_S = 3.0


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    rate_bps: float  # bytes per second delivered
    latency_s: float  # least latency of a full-size request
    target_requests: int


class LinkModel:
    """Delivery-rate and latency estimates of background requests, and the concurrency target.

    Attributes:
        request_bytes: the standard size of one background request.
        min_requests, max_requests: bounds on the target (max = memory bound / request size).
    """

    def __init__(self, request_bytes: int, min_requests: int, max_requests: int) -> None:
        self.request_bytes = request_bytes
        self.min_requests = min_requests
        self.max_requests = max_requests
        self._done: deque[tuple[float, int]] = deque()
        self._latencies: deque[tuple[float, float]] = deque()
        self._best_rate = 0.0
        self._best_at = 0.0

    def record(self, nbytes: int, seconds: float, now: float | None = None) -> None:
        """One background request finished: ``nbytes`` in ``seconds``."""
        now = time.monotonic() if now is None else now
        self._done.append((now, nbytes))
        if nbytes >= self.request_bytes // 2:
            while self._latencies and self._latencies[-1][1] >= seconds:
                self._latencies.pop()  # a monotonic deque keeps the windowed minimum
            self._latencies.append((now, seconds))

    def estimate(self, current_requests: int, now: float | None = None) -> LinkEstimate:
        """The concurrency to aim for now (``current_requests`` if nothing is known yet)."""
        now = time.monotonic() if now is None else now
        while self._done and self._done[0][0] < now - _RATE_WINDOW_S:
            self._done.popleft()
        while self._latencies and self._latencies[0][0] < now - _LATENCY_WINDOW_S:
            self._latencies.popleft()
        rate = sum(n for _, n in self._done) / _RATE_WINDOW_S
        if not self._latencies or rate <= 0:
            return LinkEstimate(rate, 0.0, current_requests)
        if rate > self._best_rate * _GROWTH or now - self._best_at > _LATENCY_WINDOW_S:
            self._best_rate, self._best_at = rate, now  # growing, or the old best is stale
        self._best_rate = max(self._best_rate, rate)
        growing = now - self._best_at < _GROWTH_WINDOW_S
        gain = _STARTUP_GAIN if growing else _STEADY_GAIN
        latency = self._latencies[0][1]
        want = math.ceil(gain * self._best_rate * latency / self.request_bytes)
        return LinkEstimate(rate, latency, max(self.min_requests, min(self.max_requests, want)))
