"""Which hub replica a spoke talks to: the list, the current one, failover and failback.

A spoke may be given several hub URLs (``spokefs mount URL1,URL2 ...``): replicas that
export the same tree, so they agree on file ids, versions and generations (docs/protocol.md,
"Replicas"). The first is *preferred*. ``HubClient`` asks ``current()`` for the base URL of
each request, and reports how it went:

- ``failed(url, why)``: a connection error, a 5xx, a timeout. If ``url`` is still the
  current hub, the next URL becomes current, for this request's retry and for every
  request after it (those already in flight to ``url`` follow as they fail). Logged once
  per hub as it becomes unreachable.
- ``worked(url)``: an answer came. A hub marked unreachable is marked reachable again.
- ``other_than(tried)``: a hub for one request to try after ``tried`` answered "no such
  version" (404/412): a replica one rescan behind its peer has not listed a new file yet,
  so one replica's "gone" is not final while another has not been asked; nor while
  another is unreachable (``all_reachable``): the request then waits and asks again,
  within its deadline, as for an outage.

``watch_preferred`` runs in the mount's nursery: while the current hub is not the
preferred one it probes the preferred one's ``/healthz`` every ``probe_interval_s`` and
moves back as soon as it answers. So a spoke fails over at its first failed request and
returns to the preferred hub within one probe interval of its return.

Nothing here does I/O but the probe it is given; every method but ``watch_preferred`` is
synchronous and atomic for trio (no await inside).

Metrics: ``spokefs_hub_origin{url}`` is 1 for the hub in use, 0 for the others;
``spokefs_hub_failovers_total{reason}`` counts switches away from a failing hub
(``failed``) and back to the preferred one (``preferred``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import trio

from spokefs import metrics

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 2.0
"""How often the preferred hub is probed while another one is in use: a hub back from a
restart takes over again within about this long, for a ``GET /healthz`` (a few bytes)
per interval."""


class HubOrigins:
    """The hub URLs of one mount, in order of preference, and the one in use.

    Attributes:
        urls: the base URLs (no trailing slash), the preferred one first; never empty.
    """

    def __init__(self, urls: Sequence[str], probe_interval_s: float = PROBE_INTERVAL_S) -> None:
        if not urls:
            raise ValueError("no hub URL")
        self.urls = tuple(u.rstrip("/") for u in urls)
        if len(set(self.urls)) != len(self.urls):
            raise ValueError("a hub URL is given twice")
        self._probe_interval_s = probe_interval_s
        self._current = 0
        self._down: set[str] = set()  # hubs whose last request failed (logged as such)
        self._moved = trio.Event()  # set whenever the current hub changes
        self._publish()

    @property
    def several(self) -> bool:
        """Whether there is another hub to fail over to."""
        return len(self.urls) > 1

    def current(self) -> str:
        """The base URL to send the next request to."""
        return self.urls[self._current]

    def all_reachable(self) -> bool:
        """Whether no hub's last request failed."""
        return not self._down

    def failed(self, url: str, why: str) -> None:
        """A request to ``url`` failed for a reason another hub may not have."""
        if url not in self._down:
            self._down.add(url)
            log.warning("hub %s unreachable: %s", url, why)
        if url != self.current() or not self.several:
            return  # already moved on (another request noticed first), or nowhere to go
        index = self._next_index()
        log.warning("using hub %s instead of %s", self.urls[index], url)
        metrics.HUB_FAILOVERS.labels(reason="failed").inc()
        self._move(index)

    def worked(self, url: str) -> None:
        """A request to ``url`` got an answer."""
        if url in self._down:
            self._down.discard(url)
            log.warning("hub %s reachable again", url)

    def other_than(self, tried: set[str]) -> str | None:
        """A reachable hub not in ``tried``, in order from the current one, or None."""
        for step in range(1, len(self.urls)):
            url = self.urls[(self._current + step) % len(self.urls)]
            if url not in tried and url not in self._down:
                return url
        return None

    async def watch_preferred(
        self, probe: Callable[[str], Awaitable[bool]], *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Move back to the preferred hub once it answers ``probe``; runs until cancelled."""
        task_status.started()
        preferred = self.urls[0]
        while True:
            if self._current == 0:
                await self._moved.wait()
                continue
            await trio.sleep(self._probe_interval_s)
            if self._current != 0 and await probe(preferred):
                self.worked(preferred)
                log.warning("moving back to the preferred hub %s (from %s)", preferred,
                            self.current())
                metrics.HUB_FAILOVERS.labels(reason="preferred").inc()
                self._move(0)

    def _next_index(self) -> int:
        """The next hub after the current one, skipping hubs known unreachable unless
        every other one is (then simply the next: one of them may be back)."""
        n = len(self.urls)
        for step in range(1, n):
            index = (self._current + step) % n
            if self.urls[index] not in self._down:
                return index
        return (self._current + 1) % n

    def _move(self, index: int) -> None:
        self._current = index
        self._moved.set()
        self._moved = trio.Event()
        self._publish()

    def _publish(self) -> None:
        for index, url in enumerate(self.urls):
            metrics.HUB_ORIGIN.labels(url=url).set(1 if index == self._current else 0)
