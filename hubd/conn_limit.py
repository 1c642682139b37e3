"""ConnectionLimit: at most ``cap`` connections at once; one more is closed the moment it
is made, counted (``hubd_connections_refused_total``) and logged at most once a minute.

It wraps the protocol factory given to ``loop.create_server``. The decision is taken in
``connection_made``, not in the factory: asyncio accepts a whole backlog of sockets in one
turn of the loop and calls the factory for each before any of them is made, so a count
kept in the factory would let the whole burst in. ``connection_made`` calls come one at a
time, and ``connection_lost`` follows every one of them, so the count is exact. (A TLS
connection is made once its handshake is done; until then it is not counted.)

A refused connection gets no answer: reading its request to answer 503 would hold its
descriptor longer, and spokes retry a closed connection like a 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import cast

from hubd.log_rate import LogEvery, since_last
from hubd.metrics import HubMetrics

log = logging.getLogger(__name__)

ProtocolFactory = Callable[[], asyncio.Protocol]


class ConnectionLimit:
    """Counts the connections of one server and refuses those over ``cap``.

    Attributes:
        cap: the most connections open at once (``fd_limit.connection_cap``).
        open: connections open now.
        refused: connections refused since start.
    """

    def __init__(self, cap: int, metrics: HubMetrics, log_every: LogEvery | None = None) -> None:
        self.cap = cap
        self.open = 0
        self.refused = 0
        self._metrics = metrics
        self._log_every = log_every or LogEvery()
        metrics.connections_open.set_function(lambda: self.open)

    def factory(self, make: ProtocolFactory) -> ProtocolFactory:
        """A protocol factory for ``loop.create_server``: ``make()``'s protocols, counted;
        ``make`` is only called for a connection that is let in."""
        return lambda: _Counted(self, make)

    def _admit(self) -> bool:
        if self.open < self.cap:
            self.open += 1
            return True
        self.refused += 1
        self._metrics.connections_refused.inc()
        count = self._log_every.occurred()
        if count:
            log.warning("connection limit reached: %d of %d open; refusing connections%s",
                        self.open, self.cap, since_last(count, "refused"))
        return False

    def _release(self) -> None:
        self.open -= 1


class _Counted(asyncio.Protocol):
    """One connection: the protocol of ``make()`` if it is let in, else closed at once."""

    __slots__ = ("_inner", "_limit", "_make")

    def __init__(self, limit: ConnectionLimit, make: ProtocolFactory) -> None:
        self._limit = limit
        self._make = make
        self._inner: asyncio.Protocol | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._limit._admit():
            # at once: close() would flush, and a TLS close waits for its peer. A stream
            # server's transport (TCP or TLS) is an asyncio.Transport, which has abort().
            cast(asyncio.Transport, transport).abort()
            return
        self._inner = self._make()
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is not None:
            self._limit._release()
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()
