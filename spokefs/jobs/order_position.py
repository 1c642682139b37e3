"""Where a job is in its order (``jobs.orders``): what it has read, how far ahead of it an
order's replay (``replay.Replayer``) may fetch, and in how much room of the cache.

Concurrency: mutated by the trio thread (``on_read``, the replay's counts); ``read`` and
``index`` are also read by the block cache's writer thread through ``Replayer.behind`` and
``Replayer.lists`` (membership tests, atomic under the GIL).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import trio

from spokefs.jobs.trace_file import Target
from spokefs.read.trace import EXTENT_BYTES

# a file of an order read again this long after its first read: the order's epoch is over (a
# file's reads come within milliseconds; a sampler reads each file once an epoch)
_REREAD_S = 2.0


class OrderPosition:
    """Where the job is in an order's targets: the furthest target it has read, what it has
    read, and the room the order's fetches may take in the cache.

    **Room.** What an order fetches ahead takes room in the cache. Taken from what the
    job has read this epoch, or from what the cache holds of other files, it costs nothing;
    taken from files of the order the job has not read yet, it costs a fetch of each later
    (and a full cache holds only those at an epoch's start, when the data set is larger
    than the cache). So an order fetches at most ``room`` (the cache's budget less what it
    holds of the order's files when it starts) plus the bytes of its files the job has read
    since; a file the job reaches before its fetch is its reader's miss, fetched at once.

    **Over.** An order is over when the job has read every file of it, or reads one again
    ``_REREAD_S`` after its first read (the job's next epoch, told as another order: the
    ``clairvoyant`` of another loader, or a job that did not read the last few files);
    until then its read files are what the cache evicts first (``behind``)."""

    def __init__(self, targets: list[Target], room: int) -> None:
        self.index: dict[int, int] = {}
        self._repeated: set[int] = set()  # listed more than once (a sampler with replacement)
        for n, t in enumerate(targets):
            if self.index.setdefault(t.fv.file_id, n) != n:
                self._repeated.add(t.fv.file_id)
        self._ends = list(itertools.accumulate(t.nbytes(EXTENT_BYTES) for t in targets))
        self.room = room
        self.read_bytes = 0  # of the targets the job has read
        self.fetching = 0  # bytes the order has started to fetch
        self._read_to = 0  # the targets before this one are behind the job
        self._moved = trio.Event()
        self.read: dict[int, float] = {}  # the targets' files the job has read: when first
        self.over = False  # a file read again well after its first read: a new epoch
        self.last_read = time.monotonic()  # when the job last read one of them first

    def finished(self) -> bool:
        """Whether the job has read every target (the last one in the list comes before
        others when several workers read batches side by side)."""
        return len(self.read) >= len(self.index)

    def on_read(self, file_id: int) -> None:
        n = self.index.get(file_id)
        if n is None:
            return
        now = time.monotonic()
        first = self.read.get(file_id)
        if first is None:
            self.read[file_id] = self.last_read = now
            self.read_bytes += self._ends[n] - (self._ends[n - 1] if n else 0)
            self._moved.set()
        elif now - first > _REREAD_S and file_id not in self._repeated:
            self.over = True
        if n >= self._read_to:
            self._read_to = n + 1
            self._moved.set()

    def beyond(self, n: int, horizon: int) -> bool:
        """Whether target ``n`` ends more than ``horizon`` bytes past the job's reads."""
        behind = self._ends[self._read_to - 1] if self._read_to else 0
        return self._ends[n] - behind > horizon

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit in the order's room (see the class docstring)."""
        return self.fetching + nbytes <= self.room + self.read_bytes

    async def wait_room(self, nbytes: int) -> None:
        """Until ``nbytes`` more fit in the order's room."""
        await self._wait_until(lambda: self.fits(nbytes))

    async def wait(self, n: int, horizon: int) -> None:
        """Until target ``n`` is within ``horizon`` of the job's reads."""
        await self._wait_until(lambda: not self.beyond(n, horizon))

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        """Until ``ready()``, looked at again on each read of the job (and every 0.25 s)."""
        while not ready():
            if self._moved.is_set():
                self._moved = trio.Event()
            with trio.move_on_after(0.25):
                await self._moved.wait()
