"""Read-ahead: keeps the far link full so that readers rarely wait.

Three triggers, all filling the block cache (no private RAM queue; the RAM used is the
responses in flight, at most ``max_inflight_bytes``):

1. **Sequential streams.** Each open handle is a ``Stream``. A read that starts within
   ``_SEQ_SLACK`` of where the last one ended counts as sequential (the kernel's own
   read-ahead sends reads slightly out of order); after two in a row the window opens at
   ``window_initial_bytes`` and doubles on every further sequential read up to
   ``window_max_bytes``. The range ahead of the reader up to the window is queued as jobs of
   ``request_bytes``. A read elsewhere (random access) closes the window at once, and jobs
   queued before that are dropped unfetched (``Stream.epoch``), so a random reader never
   moves bytes it did not ask for.
2. **Small files** (up to ``small_file_bytes``) are fetched whole on first read by the reader
   itself; that is a demand fetch, not a prefetch.
3. **Directories.** The first open in a directory, or a readdir of it, starts a fill of its
   small files in pack requests (``dir_fill``), within a budget of half the cache.

Priority: demand reads never wait for a prefetch slot (they go to the hub directly, see
``fetcher``). Stream jobs share one limiter whose size ``LinkModel`` finds by measuring the
delivery rate (enough requests in flight to fill the link, no more than helps); directory
fills keep about twice the link's bandwidth-delay product in flight.

Concurrency: ``on_open``/``on_read`` are synchronous (called from FUSE handlers; they only
update state and ``send_nowait`` jobs: a full queue drops the hint and counts it). Workers
and the controller live in the nursery of ``run``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import trio

from spokefs import metrics
from spokefs.config import CHUNK_SIZE, PrefetchConfig
from spokefs.dir_fill import DirFiller, DirLister
from spokefs.errors import SpokeError, single_spoke_error
from spokefs.fetcher import Fetcher
from spokefs.link_model import LinkModel
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

_SEQ_SLACK = 2 << 20  # how far out of order the kernel's own read-ahead sends reads
_QUEUED_JOBS = 4096
_CONTROL_INTERVAL_S = 0.25


@dataclass(slots=True)
class Stream:
    """Access-pattern state of one open handle."""

    fv: FileVersion
    parent_id: int
    next_offset: int = 0
    sequential: int = 0
    window: int = 0
    issued_to: int = 0
    epoch: int = 0  # bumped on random access or close: queued jobs of older epochs are dropped
    closed: bool = False


@dataclass(frozen=True, slots=True)
class _Job:
    stream: Stream
    epoch: int
    start: int
    end: int


class Prefetcher:
    """Sequential read-ahead and directory fills into the block cache."""

    def __init__(
        self,
        fetcher: Fetcher,
        lister: DirLister,
        cfg: PrefetchConfig,
        cache_max_bytes: int,
    ) -> None:
        self._fetcher = fetcher
        self._cfg = cfg
        self._jobs_tx, self._jobs_rx = trio.open_memory_channel[_Job](_QUEUED_JOBS)
        max_requests = max(1, cfg.max_inflight_bytes // cfg.request_bytes)
        self.model = LinkModel(min(8, max_requests), max_requests, min(16, max_requests))
        self._limiter = trio.CapacityLimiter(self.model.limit)
        self.dirs = DirFiller(
            fetcher, lister, self.model, small_file_bytes=cfg.small_file_bytes,
            request_bytes=cfg.request_bytes, max_inflight_bytes=cfg.max_inflight_bytes,
            budget_bytes=cache_max_bytes // 2, assumed_link_bps=cfg.assumed_link_bytes_per_s,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(self.model.max_requests):
                nursery.start_soon(self._stream_worker, self._jobs_rx.clone())
            await nursery.start(self.dirs.run)
            nursery.start_soon(self._control)
            task_status.started()

    # -- hints from the read path (synchronous) -------------------------------------

    def on_open(self, fv: FileVersion, parent_id: int) -> Stream:
        self.dirs.on_open(fv, parent_id)
        return Stream(fv, parent_id)

    def on_readdir(self, dir_id: int) -> None:
        self.dirs.on_dir(dir_id)

    def on_miss(self, stream: Stream) -> None:
        """A read of the stream missed the cache."""
        self.dirs.on_miss(stream.fv, stream.parent_id)

    def on_close(self, stream: Stream) -> None:
        stream.closed = True
        stream.epoch += 1

    def on_read(self, stream: Stream, offset: int, size: int) -> None:
        end = offset + size
        if abs(offset - stream.next_offset) <= _SEQ_SLACK:
            stream.sequential += 1
            stream.next_offset = max(stream.next_offset, end)
        else:
            if stream.window:
                metrics.PREFETCH_RESETS.inc()
            stream.sequential = stream.window = stream.issued_to = 0
            stream.epoch += 1
            stream.next_offset = end
        if stream.sequential < 2 or stream.fv.size <= self._cfg.small_file_bytes:
            return
        cfg = self._cfg
        stream.window = min(max(stream.window * 2, cfg.window_initial_bytes), cfg.window_max_bytes)
        target = min(end + stream.window, stream.fv.size)
        start = max(stream.issued_to, end)
        # issue in whole requests (or up to EOF) so the link sees few, large ranges
        if target - start < min(cfg.request_bytes, stream.window // 2) and target < stream.fv.size:
            return
        for job_start in range(start - start % CHUNK_SIZE, target, cfg.request_bytes):
            job_end = min(job_start + cfg.request_bytes, target)
            if not self._send(self._jobs_tx, _Job(stream, stream.epoch, job_start, job_end)):
                target = job_start
                break
        stream.issued_to = max(stream.issued_to, target)

    @staticmethod
    def _send(tx: trio.MemorySendChannel, item: object) -> bool:
        try:
            tx.send_nowait(item)
        except trio.WouldBlock:
            metrics.PREFETCH_DROPPED_HINTS.inc()
            return False
        return True

    async def warm(self, fv: FileVersion) -> int:
        """Fetch a whole file now, in parallel requests through the background limiter."""
        fetched = 0

        async def one(start: int) -> None:
            nonlocal fetched
            async with self._limiter:
                began = time.monotonic()
                nbytes = await self._fetcher.prefetch_range(
                    fv, start, min(start + self._cfg.request_bytes, fv.size), warm=True
                )
                self.model.record(nbytes, time.monotonic() - began)
                fetched += nbytes

        with single_spoke_error():
            async with trio.open_nursery() as nursery:
                for start in range(0, fv.size, self._cfg.request_bytes):
                    nursery.start_soon(one, start)
        await self._fetcher.cache.flush()  # warmed means stored
        return fetched

    # -- background work ------------------------------------------------------------

    async def _stream_worker(self, jobs: trio.MemoryReceiveChannel[_Job]) -> None:
        async for job in jobs:
            if job.epoch != job.stream.epoch:
                continue  # the reader went elsewhere or closed the file
            async with self._limiter:
                if job.epoch == job.stream.epoch:
                    fetch = self._fetcher.prefetch_range(job.stream.fv, job.start, job.end)
                    await self._timed(fetch)

    async def _timed(self, fetch: Awaitable[int]) -> None:
        started = time.monotonic()
        try:
            nbytes = await fetch
        except SpokeError as exc:  # a failed prefetch costs nothing but its bytes
            metrics.PREFETCH_ERRORS.inc()
            log.debug("prefetch failed: %s", exc)
            return
        if nbytes:
            self.model.record(nbytes, time.monotonic() - started)

    async def _control(self) -> None:
        """Size the background limiter to the link, a few times a second."""
        while True:
            await trio.sleep(_CONTROL_INTERVAL_S)
            waiting = (
                self._limiter.statistics().tasks_waiting > 0
                or self._jobs_rx.statistics().current_buffer_used > 0
            )
            est = self.model.update(waiting)
            if est.limit != self._limiter.total_tokens:
                self._limiter.total_tokens = est.limit
            metrics.PREFETCH_INFLIGHT_LIMIT.set(est.limit)
