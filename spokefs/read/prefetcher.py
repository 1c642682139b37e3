"""Read-ahead: keeps the far link full so that readers rarely wait.

Four triggers, all filling the block cache (no private RAM queue; the RAM used is the
responses in flight, at most ``max_inflight_bytes``):

1. **Sequential streams.** Each open handle (or inode) is a ``stream.Stream``. A read that
   starts within ``_SEQ_SLACK`` of where the last one ended counts as sequential (the
   kernel's own read-ahead sends reads slightly out of order); after two in a row the window
   opens at what the link already showed it needs, its bandwidth-delay product
   (``link_model.LinkReach``; ``window_initial_bytes`` before any answer came), and doubles
   on every further sequential read up to ``window_max_bytes``. The range ahead of the
   reader up to the window is queued as jobs of ``request_bytes``. A read elsewhere (random
   access) closes the window at once, and jobs queued before that are dropped unfetched
   (``Stream.epoch``), so a random reader never moves bytes it did not ask for.
2. **Runs of shards.** Shards (WebDataset tars, record files) are read one after another in
   name order. When a stream's window reaches past its end of file, the rest of the window
   goes to the next file in name order in the same directory (at least ``small_file_bytes``
   large; ``Namespace.next_file``), and on to the one after if that is shorter, through a
   *successor* stream that the reader adopts when it opens that file: the window carries
   over, so a new shard starts at full speed instead of ramping again. What is read ahead
   past the end of the reader's file is at most twice the link's bandwidth-delay product
   (``spill_bytes``: what keeps the link full across the file's end; 15 MB at 60 ms and
   1 Gbit/s), and never more than the window, so a reader that stops at the end of a file
   leaves at most that much (plus one request) fetched and unread. A read
   elsewhere in the file cuts the successors off (their queued jobs are dropped), and
   successors nobody opened are forgotten after ``_AHEAD_KEPT`` newer ones.
3. **Small files** (up to ``small_file_bytes``) are fetched whole on first read by the reader
   itself; that is a demand fetch, not a prefetch.
4. **Directories.** The first read miss in a directory (or a readdir of it while reads
   miss) starts a fill of its small files in pack requests (``dir_fill``), within a budget
   of half the cache; not while a job's announced order is fetched (``defer_to``): the
   order says what comes next, and a fill would only share the link with it.

Priority: demand reads never wait for a prefetch slot (they go to the hub directly, see
``block_source``). Stream jobs share one limiter whose size ``LinkModel`` finds by measuring the
delivery rate (enough requests in flight to fill the link, no more than helps), and they go
out in the order they were queued, nearest the reader first; directory fills keep about
twice the link's bandwidth-delay product in flight.

**Paced starts.** Stream requests start no faster than 1.5 times the link's measured rate
(``LinkReach.rate_bps``). Requests that share a link share it evenly, so a batch that went out
together also lands together, however far each lay from the reader: the reader waits for
its nearest bytes while the batch's far ones arrive, then takes the whole batch at once and
queues the next one at once, and the link stands empty for the round trip before that
batch's first bytes come (one shard reader at 900 ms: the link idle or part-full for 3.4-4.9 s
of 40, in bursts after every shard's start). Started at about the link's rate, the requests
land one after another instead, and the link has bytes to carry while new ones go out. The
pace is above the rate so that it never limits what the link carries; the probe's starts
were the same with and without it (each request's whole answer, up to its TCP window,
reaches the bottleneck at once). On a link faster than the 1 Gbit/s assumed until measured,
the pace follows the measured rate up by half every 0.25 s: ~1.5 s to 10 Gbit/s.

Concurrency: ``on_open``/``on_read`` are synchronous (called from FUSE handlers; they only
update state and ``send_nowait`` jobs: a full queue drops the hint and counts it). The job
starter, the jobs and the controller live in the nursery of ``run``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol

import trio

from spokefs import metrics
from spokefs.config import CHUNK_SIZE, PrefetchConfig
from spokefs.errors import SpokeError, single_spoke_error
from spokefs.hub.link_model import LinkModel, LinkReach
from spokefs.read.block_source import BlockSource
from spokefs.read.dir_fill import DirFiller, DirLister
from spokefs.read.stream import Stream
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

_SEQ_SLACK = 2 << 20  # how far out of order the kernel's own read-ahead sends reads
_QUEUED_JOBS = 4096
_CONTROL_INTERVAL_S = 0.25
_PROBE_ABOVE_FLOOR = 16  # requests the model may probe up to above a small floor
_MAX_WARM = 64  # connections kept open for stream requests
_AHEAD_KEPT = 64  # successor streams not opened yet
_QUEUED_LOOKUPS = 64
_PACE_ABOVE_RATE = 1.5  # stream requests start at most this many times the link's rate
_PACE_BURST_S = 0.05  # ... after a burst of this long at that pace


class OrderWatch(Protocol):
    """What the prefetcher tells the jobs' orders (``jobs.orders.Orders``), and asks them."""

    def on_read(self, file_id: int) -> None: ...

    def running(self) -> bool: ...


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
        source: BlockSource,
        lister: DirLister,
        cfg: PrefetchConfig,
        cache_max_bytes: int,
    ) -> None:
        self._source = source
        self._cfg = cfg
        self._jobs_tx, self._jobs_rx = trio.open_memory_channel[_Job](_QUEUED_JOBS)
        max_requests = max(1, cfg.max_inflight_bytes // cfg.request_bytes)
        self._min_requests = min(8, max_requests)
        self.model = LinkModel(self._min_requests, max_requests, min(16, max_requests))
        self._limiter = trio.CapacityLimiter(self.model.limit)
        self.reach = LinkReach(source.received_bytes, source.rtt_s,
                               cfg.assumed_link_bytes_per_s)
        self._lister = lister
        self.dirs = DirFiller(
            source, lister, self.model, small_file_bytes=cfg.small_file_bytes,
            max_inflight_bytes=cfg.max_inflight_bytes,
            budget_bytes=cache_max_bytes // 2, reach=self.reach,
        )
        self._ahead: OrderedDict[FileVersion, Stream] = OrderedDict()  # successors unopened
        self._lookups_tx, self._lookups_rx = trio.open_memory_channel[tuple[Stream, int]](
            _QUEUED_LOOKUPS)
        self._orders: OrderWatch | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._start_jobs, nursery)
            await nursery.start(self.dirs.run)
            nursery.start_soon(self._control)
            nursery.start_soon(self._find_successors)
            task_status.started()

    # -- hints from the read path (synchronous) -------------------------------------

    def on_open(self, fv: FileVersion, parent_id: int) -> Stream:
        self.dirs.on_open(fv, parent_id)
        ahead = self._ahead.pop(fv, None)
        if ahead is not None and not ahead.closed:
            ahead.in_run = True
            return ahead  # the next shard of a run: read ahead already, window carried over
        return Stream(fv, parent_id)

    def defer_to(self, orders: OrderWatch) -> None:
        """Tell ``orders`` (``jobs.orders``) of every read, and while an order is being
        fetched start no directory fill, nor a pack of one queued before: the order says
        what comes next."""
        self._orders = orders
        self.dirs.pause_while(orders.running)

    def on_readdir(self, dir_id: int) -> None:
        if self._orders is None or not self._orders.running():
            self.dirs.on_readdir(dir_id)

    def on_miss(self, stream: Stream) -> None:
        """A read of the stream missed the cache."""
        if self._orders is None or not self._orders.running():
            self.dirs.on_miss(stream.fv, stream.parent_id)

    def on_close(self, stream: Stream) -> None:
        # its successor stays: closing one shard and opening the next is how a run goes on
        stream.closed = True
        stream.epoch += 1

    def on_read(self, stream: Stream, offset: int, size: int) -> None:
        if self._orders is not None:
            self._orders.on_read(stream.fv.file_id)
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
            self._cut(stream.successor)
            stream.successor = None
        if stream.sequential < 2 or stream.fv.size <= self._cfg.small_file_bytes:
            return
        cfg = self._cfg
        stream.window = min(max(stream.window * 2, self.seed_window()), cfg.window_max_bytes)
        self._issue(stream, end, end + stream.window)

    def seed_window(self) -> int:
        """A new sequential stream's window: the link's bandwidth-delay product as measured
        so far, within ``[window_initial_bytes, window_max_bytes]``."""
        cfg = self._cfg
        bdp = self.reach.bdp_bytes()
        return cfg.window_initial_bytes if bdp is None else \
            min(max(bdp, cfg.window_initial_bytes), cfg.window_max_bytes)

    def spill_bytes(self, stream: Stream | None = None) -> int:
        """At most this much is read ahead past the end of the file a reader is in: twice
        the bandwidth-delay product keeps the link full across the file's end, and more
        would only be lost if the reader does not go on to the next file.

        Once the reader has gone on from one file to the next (``stream.in_run``), it is a
        run, and the spill also covers what the stream requests hold in flight. Without
        that the spill's jobs are all in flight before the reader reaches the end of its
        file; they share the link with the file's last requests, so they land with them,
        and the link stands empty for a round trip while the reader's next requests go out
        (one gap per file: 5-6 % of one shard reader at 60 ms)."""
        cfg = self._cfg
        nbytes = 2 * self.seed_window()
        if stream is not None and stream.in_run:
            nbytes += int(self._limiter.total_tokens) * cfg.request_bytes
        return min(nbytes, cfg.window_max_bytes)

    def _issue(self, stream: Stream, end: int, target: int, *, whole: bool = True) -> None:
        """Queue jobs for ``[max(issued_to, end), target)`` of the stream; what lies past
        its end of file goes to its successor. With ``whole``, only once that is a whole
        request (or reaches EOF), so the link sees few, large ranges; a spill into the next
        file goes out as it is (it may never reach a whole request)."""
        cfg = self._cfg
        size = stream.fv.size
        start = max(stream.issued_to, end)
        stop = min(target, size)
        if stop > start and (not whole or stop == size
                             or stop - start >= min(cfg.request_bytes, stream.window // 2)):
            for job_start in range(start - start % CHUNK_SIZE, stop, cfg.request_bytes):
                job_end = min(job_start + cfg.request_bytes, stop)
                if not self._send(self._jobs_tx, _Job(stream, stream.epoch, job_start, job_end)):
                    stop = job_start
                    break
            stream.issued_to = max(stream.issued_to, stop)
        if target > size and stream.issued_to >= size:
            self._spill(stream, target - size)

    def _spill(self, stream: Stream, nbytes: int) -> None:
        """Read ``nbytes`` (at most ``spill_bytes``) ahead into the file after the stream's
        (found in a worker); the successor's own spill is what is left of that."""
        cap = self.spill_bytes(stream)
        nbytes = min(nbytes, cap)
        succ = stream.successor
        if succ is None:
            if not stream.seeking:
                stream.seeking = self._send(self._lookups_tx, (stream, stream.epoch))
            return
        if succ.next_offset == 0 and not succ.closed:  # not read by its own reader yet
            succ.window = max(succ.window, stream.window)
            # in steps of a request (or half the cap), as the reader nears its file's end
            step = min(self._cfg.request_bytes, cap // 2)
            if nbytes - succ.issued_to >= step or nbytes >= min(cap, succ.fv.size):
                self._issue(succ, 0, nbytes, whole=False)

    def _cut(self, succ: Stream | None) -> None:
        """Stop reading ahead into a chain of successor streams (their jobs are dropped)."""
        while succ is not None:
            if succ.next_offset == 0:  # its own reader never came: forget it
                succ.closed = True
                succ.epoch += 1
                self._ahead.pop(succ.fv, None)
            succ = succ.successor

    async def _find_successors(self) -> None:
        async for stream, epoch in self._lookups_rx:
            try:
                row = await self._lister.next_file(stream.parent_id, stream.fv.file_id,
                                                   self._cfg.small_file_bytes + 1)
            except SpokeError as exc:  # e.g. the directory went away in a refresh
                log.debug("no next file after %x: %s", stream.fv.file_id, exc)
                continue
            finally:
                stream.seeking = False
            if row is None or stream.epoch != epoch or stream.successor is not None:
                continue
            fv = FileVersion(*row)
            succ = self._ahead.get(fv) or Stream(fv, stream.parent_id, sequential=2)
            stream.successor = succ
            self._ahead[fv] = succ
            self._ahead.move_to_end(fv)
            while len(self._ahead) > _AHEAD_KEPT:
                _, old = self._ahead.popitem(last=False)
                self._cut(old)
            self._spill(stream, stream.next_offset + stream.window - stream.fv.size)

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
                nbytes = await self._source.prefetch_range(
                    fv, start, min(start + self._cfg.request_bytes, fv.size), warm=True
                )
                self.model.record(nbytes, time.monotonic() - began)
                fetched += nbytes

        with single_spoke_error():
            async with trio.open_nursery() as nursery:
                for start in range(0, fv.size, self._cfg.request_bytes):
                    nursery.start_soon(one, start)
        await self._source.flush()  # warmed means stored
        return fetched

    # -- background work ------------------------------------------------------------

    async def _start_jobs(self, nursery: trio.Nursery) -> None:
        """Start the stream jobs in the order they were queued, each once the limiter has
        room for it, so that the request nearest a reader goes out first.

        One task takes the slots, in queue order. With a task per job waiting on the limiter
        the order was trio's: it runs a batch of woken tasks in either order, so when a
        window opened, its requests went out in reverse about half the time, and the reader
        waited for the nearest bytes (or fetched them itself) while the far ones came in
        (a single reader at 60 ms was then up to 200 MiB behind the bytes already here).

        And no faster than ``_PACE_ABOVE_RATE`` times the link's rate (after a burst of
        ``_PACE_BURST_S``): see "Paced starts" in the module docstring."""
        held = self._source.holds_chunks
        next_start = trio.current_time()
        async for job in self._jobs_rx:
            if job.epoch != job.stream.epoch:
                continue  # the reader went elsewhere or closed the file
            first, last = job.start // CHUNK_SIZE, (job.end - 1) // CHUNK_SIZE
            if held(job.stream.fv, first, last):
                continue  # cached already (a warm reader): no slot, no task
            slot = object()
            await self._limiter.acquire_on_behalf_of(slot)
            now = trio.current_time()
            if next_start > now:
                await trio.sleep_until(next_start)
            if job.epoch != job.stream.epoch:
                self._limiter.release_on_behalf_of(slot)
                continue
            pace = _PACE_ABOVE_RATE * self.reach.rate_bps()
            next_start = max(next_start, now - _PACE_BURST_S) + (job.end - job.start) / pace
            nursery.start_soon(self._run_job, job, slot)

    async def _run_job(self, job: _Job, slot: object) -> None:
        try:
            await self._timed(self._source.prefetch_range(job.stream.fv, job.start, job.end))
        finally:
            self._limiter.release_on_behalf_of(slot)

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

    def _floor_requests(self) -> int:
        """Stream requests always allowed in flight: twice the link's bandwidth-delay product
        (a probe that starts at 16 requests of ~4 MiB needs several seconds to find the 60
        that a 900 ms, 1 Gbit/s link takes, and a run of shards would spend them at half
        speed). The model probes above it, up to twice as many: more only queue at the
        bottleneck, where every request shares the link, so the one a reader waits for
        arrives no sooner than all the others (at 60 ms the probe had reached 128 requests,
        480 MiB in flight for a 7.5 MB product, and a single reader got 0.75 of the link)."""
        bdp = self.reach.bdp_bytes() or 0
        need = -(-2 * bdp // self._cfg.request_bytes)
        return max(self._min_requests, min(self.model.max_requests, need))

    def warm_connections(self) -> int:
        """Connections for the hub client to keep open: what directory fills need, or the
        stream requests' floor if that is more."""
        return max(self.dirs.warm_connections(), min(self._floor_requests(), _MAX_WARM))

    async def _control(self) -> None:
        """Size the background limiter to the link, a few times a second."""
        while True:
            await trio.sleep(_CONTROL_INTERVAL_S)
            waiting = (
                self._limiter.statistics().tasks_waiting > 0
                or self._jobs_rx.statistics().current_buffer_used > 0
            )
            floor = self._floor_requests()
            self.model.set_bounds(floor, max(2 * floor, _PROBE_ABOVE_FLOOR))
            est = self.model.update(waiting)
            if est.limit != self._limiter.total_tokens:
                self._limiter.total_tokens = est.limit
            metrics.PREFETCH_INFLIGHT_LIMIT.set(est.limit)
            metrics.LINK_BDP.set(self.reach.bdp_bytes() or 0)
            metrics.PREFETCH_SPILL_LIMIT.set(self.spill_bytes())
