"""The bytes the replays of a mount have on their way, and the bound they share
(``InFlight``): every trace replay and every job's order (``replay.Replayer``) reserves
what it asks for here before it asks."""

from __future__ import annotations

import trio

from spokefs.hub.link_model import LinkReach

_MIN_INFLIGHT_BYTES = 8 << 20
_INITIAL_INFLIGHT_BYTES = 64 << 20  # as directory fills: 1 Gbit/s x 0.5 s, until measured


class InFlight:
    """The bytes replays have on their way, and the bound they share: about three times the
    link's bandwidth-delay product, so that several replays at once (the orders of several
    jobs on one node) keep the link full without queueing more at its bottleneck. Twice (as
    ``dir_fill``) left an order at 0.83 of the link at 60 ms: a pick is a 3.75 MiB answer,
    half the product, and four in flight left gaps between one's end and the next's first
    byte; three times took it to 0.92 of the samples' bound (``benchmarks/README.md``).

    **Slow start.** From an idle link the bound starts at one product and grows by what
    arrives (it is three products after about two round trips), as TCP's window does. The
    answers in flight share the link, so each arrives at its share's rate: with three
    products asked at once a replay's first files, the ones its job reads first, came after
    three products' worth of bytes (at 60 ms, 24 MB: 0.2 s, where the job's first batch is
    3.5 MB), and a link is full with one product on its way."""

    def __init__(self, reach: LinkReach, max_inflight_bytes: int) -> None:
        self._reach = reach
        self._max = max(max_inflight_bytes, _MIN_INFLIGHT_BYTES)
        self.bytes = 0
        self._arrived = 0  # since the link was last idle (nothing in flight)
        self._changed = trio.Event()

    def target(self) -> int:
        bdp = self._reach.bdp_bytes()
        if bdp is None:
            return _INITIAL_INFLIGHT_BYTES
        full = min(self._max, max(_MIN_INFLIGHT_BYTES, 3 * bdp))
        return min(full, max(_MIN_INFLIGHT_BYTES, bdp + self._arrived))

    async def reserve(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more fit (one request always does), and count them."""
        while self.bytes and self.bytes + nbytes > self.target():
            if self._changed.is_set():
                self._changed = trio.Event()
            with trio.move_on_after(0.25):  # the target follows the link as it is measured
                await self._changed.wait()
        self.bytes += nbytes

    def release(self, nbytes: int) -> None:
        self.bytes -= nbytes
        self._arrived = self._arrived + nbytes if self.bytes else 0
        self._changed.set()
