"""Directory fills: the small files of a directory fetched ahead, many to a request.

A shuffled pass over a dataset of small files (an ImageNet-style tree read by a DataLoader)
touches every directory within its first few hundred samples and then reads its files in
random order. Fetching each file when it is read costs a round trip per file; fetching the
directories it has touched, in pack requests at the link's full rate, costs the dataset's
bytes once and leaves the readers mostly reading what has already arrived.

- **Trigger.** The first open of a file in a directory, or a readdir of it, queues the
  directory: the first event is the cheapest moment to start (waiting for more opens only
  leaves the link idle while readers miss). A directory is listed once; its small files
  (up to ``small_file_bytes``) that are neither cached nor in flight join one FIFO queue.
- **Re-arming.** When a read misses a small file of a directory whose fill has finished (its
  files were evicted since, e.g. in a later epoch over a dataset larger than the cache), the
  directory is queued again; the files still cached are skipped.
- **Readers first.** A file a reader misses is fetched at once by the reader itself
  (``fetcher.demand``), whatever the queue holds; the pump skips it later as busy or cached.
  A file already in a pack on its way is waited for, and is released to its reader the
  moment its own bytes have streamed in (``fetcher.prefetch_files``), not at the pack's end.
- **Bytes in flight** follow the link: about twice its bandwidth-delay product (the peak
  delivery rate of background requests times the round trip, both from ``LinkModel``), from
  ``_INITIAL_INFLIGHT_BYTES`` before anything is measured, within ``[_MIN_INFLIGHT_BYTES,
  max_inflight_bytes]``. Packs are an eighth of that (at most ``request_bytes``), so
  several connections share the work; one connection carries at most its TCP window per
  round trip.
- **Budget.** Bytes fetched by fills and not yet opened stay under ``budget_bytes`` (half
  the cache): fills never push out more of the cache than readers can use. A fetched file
  leaves the budget when it is opened (or was opened while on its way), or, once the budget
  is spent, when it is found evicted unread (so a listing that nobody reads cannot stop
  fills for good).

Concurrency: ``on_dir``/``on_open``/``on_miss`` are synchronous (FUSE handlers call them);
they update state and ``send_nowait`` directory ids (a full channel drops the hint and
counts it). Two listers and one pump run in the nursery of ``run``; each pack is a task
of that nursery.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from spokefs import metrics
from spokefs.errors import SpokeError
from spokefs.fetcher import Fetcher
from spokefs.link_model import LinkModel
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

_TRACKED_DIRS = 1 << 16
_QUEUED_DIRS = 4096
_LISTERS = 2
_INITIAL_INFLIGHT_BYTES = 64 << 20  # before anything is measured: 1 Gbit/s x 0.5 s
_MIN_INFLIGHT_BYTES = 8 << 20
_MIN_PACK_BYTES = 256 << 10
_PACK_FILES = 1024  # hubd's limit is 4096 per pack
_RECLAIM_SCAN = 256  # unread files checked for eviction when the budget is spent


@dataclass(slots=True)
class _Dir:
    pending: int = 0  # its files queued or in flight
    listed: bool = False  # its files have been queued (a miss after that re-arms it)


class DirFiller:
    """Fetches the small files of touched directories ahead of the readers."""

    def __init__(
        self,
        fetcher: Fetcher,
        list_dir_files: Callable[[int], Awaitable[list[FileVersion]]],
        model: LinkModel,
        *,
        small_file_bytes: int,
        request_bytes: int,
        max_inflight_bytes: int,
        budget_bytes: int,
    ) -> None:
        self._fetcher = fetcher
        self._list_dir_files = list_dir_files
        self._model = model
        self._small = small_file_bytes
        self._request_bytes = request_bytes
        self._max_inflight = max(max_inflight_bytes, _MIN_INFLIGHT_BYTES)
        self._budget = budget_bytes
        self._dirs: OrderedDict[int, _Dir] = OrderedDict()
        self._dirs_tx, self._dirs_rx = trio.open_memory_channel[int](_QUEUED_DIRS)
        self._queue: deque[tuple[FileVersion, int]] = deque()  # (file, its directory)
        self._unread: dict[tuple[int, int], FileVersion] = {}  # fetched, not opened since
        self._unread_bytes = 0
        self._inflight_files: set[tuple[int, int]] = set()
        self._opened_early: set[tuple[int, int]] = set()  # opened while on their way
        self._inflight_bytes = 0
        self._changed = trio.Event()

    # -- hints (synchronous) ----------------------------------------------------------

    def on_dir(self, dir_id: int) -> None:
        """A readdir of the directory or an open in it: fill it if that has not begun."""
        state = self._dirs.get(dir_id)
        if state is not None:
            self._dirs.move_to_end(dir_id)
            return
        self._dirs[dir_id] = _Dir()
        if len(self._dirs) > _TRACKED_DIRS:
            self._dirs.popitem(last=False)
        self._send(dir_id)

    def on_open(self, fv: FileVersion, parent_id: int) -> None:
        self.on_dir(parent_id)
        key = (fv.file_id, fv.version)
        if key in self._inflight_files:  # its reader waits for the pack: it is not unread
            self._opened_early.add(key)
        elif (done := self._unread.pop(key, None)) is not None:
            self._unread_bytes -= done.size
            self._changed.set()

    def on_miss(self, fv: FileVersion, parent_id: int) -> None:
        """A read missed a small file: fill its directory again if its fill is over."""
        state = self._dirs.get(parent_id)
        if state is not None and state.listed and state.pending == 0 and fv.size <= self._small:
            state.listed = False
            self._send(parent_id)

    def _send(self, dir_id: int) -> None:
        try:
            self._dirs_tx.send_nowait(dir_id)
        except trio.WouldBlock:
            metrics.PREFETCH_DROPPED_HINTS.inc()
            self._dirs.pop(dir_id, None)  # so that a later event tries again

    def statistics(self) -> dict[str, int]:
        return {"queued_files": len(self._queue), "inflight_bytes": self._inflight_bytes,
                "unread_bytes": self._unread_bytes}

    # -- background work --------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(_LISTERS):
                nursery.start_soon(self._lister, self._dirs_rx.clone())
            nursery.start_soon(self._pump, nursery)
            task_status.started()

    async def _lister(self, dirs: trio.MemoryReceiveChannel[int]) -> None:
        async for dir_id in dirs:
            try:
                files = await self._list_dir_files(dir_id)
            except SpokeError as exc:  # e.g. the directory went away in a refresh
                log.info("directory fill of %x not started: %s", dir_id, exc)
                continue
            state = self._dirs.get(dir_id)
            if state is None:
                continue
            for f in files:
                if 0 < f.size <= self._small and not self._fetcher.busy_or_cached(f):
                    self._queue.append((f, dir_id))
                    state.pending += 1
            state.listed = True
            log.debug("directory fill of %x: %d files queued", dir_id, state.pending)
            self._changed.set()

    def _target_inflight(self) -> int:
        """About twice the bandwidth-delay product, once the link has been measured."""
        rate, rtt = self._model.peak_rate_bps, self._fetcher.rtt_s()
        if not rate or rtt is None:
            return _INITIAL_INFLIGHT_BYTES
        return int(min(self._max_inflight, max(_MIN_INFLIGHT_BYTES, 2 * rate * rtt)))

    def _next_batch(self, limit_bytes: int) -> tuple[list[tuple[FileVersion, int]], int]:
        """Files from the head of the queue, up to ``limit_bytes``, skipping those that are
        cached or in flight by now (a reader fetched them)."""
        batch: list[tuple[FileVersion, int]] = []
        nbytes = 0
        while self._queue and len(batch) < _PACK_FILES:
            f, dir_id = self._queue[0]
            if batch and nbytes + f.size > limit_bytes:
                break
            self._queue.popleft()
            if self._fetcher.busy_or_cached(f):
                self._done(dir_id)
                continue
            batch.append((f, dir_id))
            nbytes += f.size
        return batch, nbytes

    def _reclaim(self) -> None:
        """Stop counting fetched files that have left the cache unread (evicted): they use
        no budget any more. Looks at the oldest ``_RECLAIM_SCAN`` (headers, inline)."""
        for key, f in list(itertools.islice(self._unread.items(), _RECLAIM_SCAN)):
            if not self._fetcher.busy_or_cached(f):
                del self._unread[key]
                self._unread_bytes -= f.size

    async def _pump(self, nursery: trio.Nursery) -> None:
        while True:
            target = self._target_inflight()
            if self._queue and self._unread_bytes + self._queue[0][0].size > self._budget:
                self._reclaim()
            room = min(target - self._inflight_bytes, self._budget - self._unread_bytes)
            pack_bytes = max(_MIN_PACK_BYTES, min(self._request_bytes, target // 8))
            if not self._queue or room < min(pack_bytes, self._queue[0][0].size):
                self._changed = trio.Event()
                with trio.move_on_after(0.25):  # the target follows the link as it is measured
                    await self._changed.wait()
                continue
            await trio.lowlevel.checkpoint()  # a long queue must not hold the event loop
            batch, nbytes = self._next_batch(min(pack_bytes, room))
            if batch:
                self._inflight_bytes += nbytes
                nursery.start_soon(self._fetch, batch, nbytes)

    async def _fetch(self, batch: list[tuple[FileVersion, int]], nbytes: int) -> None:
        started = time.monotonic()
        keys = [(f.file_id, f.version) for f, _ in batch]
        self._inflight_files.update(keys)
        try:
            fetched = await self._fetcher.prefetch_files([f for f, _ in batch])
        except SpokeError as exc:  # a failed prefetch costs nothing but its bytes
            metrics.PREFETCH_ERRORS.inc()
            log.debug("directory fill request failed: %s", exc)
            fetched = []
        finally:
            self._inflight_bytes -= nbytes
            for _, dir_id in batch:
                self._done(dir_id)
            self._inflight_files.difference_update(keys)
            self._changed.set()
        got = 0
        for f in fetched:
            key = (f.file_id, f.version)
            got += f.size
            if key in self._opened_early:
                continue
            if key not in self._unread:
                self._unread[key] = f
                self._unread_bytes += f.size
        self._opened_early.difference_update(keys)
        if got:
            self._model.record(got, time.monotonic() - started)

    def _done(self, dir_id: int) -> None:
        state = self._dirs.get(dir_id)
        if state is not None and state.pending > 0:
            state.pending -= 1
