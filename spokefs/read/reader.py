"""The read path of one request, above the cache: hints, trace, deadline and metrics.

``Reader.read`` asks ``block_source`` for ``[offset, offset + size)`` (one read transaction
and one copy, inline: no thread hop); on a miss it tells the prefetcher (a directory fill may
start) and asks ``block_source`` to fill the missing blocks, within the deadline. It tells
the prefetcher where the reader is before waiting on anything, so read-ahead overlaps the
demand fetch. Everything that touches the cache or the hub is in ``block_source``.

Each stream's first read of a file (of each ``trace.EXTENT_BYTES`` extent, for a large file) is
noted in the access trace (``trace``): a comparison per read, a set lookup per new extent.

Deadline. A read that misses waits at most ``deadline_s`` (the hub deadline) in all, then
fails with ``HubUnavailable`` (EIO): waiting for someone else's fetch of the same chunk (a
prefetch) that then fails does not start a whole new deadline for the read's own fetch. When
a read fails, the kernel asks again at once (its read-ahead failed, so it reads the first
page itself): a read of the same file version that comes within ``_RETRY_WINDOW_S`` of a
failure gets a short deadline (``_RETRY_SHARE``), enough to reach a hub that is back, so one
``read(2)`` fails within 1.1-1.5 deadlines while the hub is away (1.5 only for deadlines of
2 s and less), not one deadline per kernel request. A read that comes later gets a whole
deadline again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import trio

from spokefs import metrics
from spokefs.cache.block_cache import ORIGINS, CacheStats, Visit
from spokefs.config import BLOCK_SIZE
from spokefs.errors import HubUnavailable
from spokefs.read.block_source import BlockSource
from spokefs.read.stream import Stream
from spokefs.read.trace import EXTENT_BYTES, WHOLE, TraceRecorder
from spokefs.types import FileVersion

if TYPE_CHECKING:
    from spokefs.read.prefetcher import Prefetcher

_FAILING_KEPT = 4096  # file versions whose reads are failing, remembered (a few hundred KiB)
# The kernel's retry of a read that failed comes at once (its read-ahead failed, so it reads
# the page itself): a read of the same file version within this long of a failure is taken
# for one ...
_RETRY_WINDOW_S = 0.5
# ... and gets this share of the deadline, at least _RETRY_MIN_S (a hub that is back needs a
# new connection, and a stale pooled one costs a retry first), at most half the deadline: so
# a failing read(2) ends within 1.1-1.5 deadlines, not one deadline per kernel request.
_RETRY_SHARE = 0.1
_RETRY_MIN_S = 1.0


class Reader:
    """Serves reads of open streams from the block cache, filling it from the hub."""

    def __init__(self, source: BlockSource, prefetcher: Prefetcher | None,
                 deadline_s: float | None = None, trace: TraceRecorder | None = None):
        self._source = source
        self._trace = trace
        self._prefetcher = prefetcher
        self._deadline_s = deadline_s  # None: only the hub client's own deadlines apply
        # file version -> when its last read failed (see "Deadline")
        self._failing: OrderedDict[tuple[int, int], float] = OrderedDict()

    def open(self, fv: FileVersion, parent_id: int) -> Stream:
        """A stream for a newly opened handle (the prefetcher also learns of the open)."""
        if self._prefetcher is None:
            return Stream(fv, parent_id)
        return self._prefetcher.on_open(fv, parent_id)

    def on_readdir(self, dir_id: int) -> None:
        """A directory is being listed (the prefetcher may fill it)."""
        if self._prefetcher is not None:
            self._prefetcher.on_readdir(dir_id)

    def close(self, stream: Stream) -> None:
        if self._prefetcher is not None:
            self._prefetcher.on_close(stream)

    async def warm(self, fv: FileVersion) -> int:
        """Fetch a whole file into the cache at the link's speed; bytes fetched."""
        if self._prefetcher is not None:
            return await self._prefetcher.warm(fv)
        fetched = await self._source.prefetch_range(fv, 0, fv.size, warm=True) if fv.size else 0
        await self._source.flush()  # warmed means stored
        return fetched

    async def cached_bytes(self, files: list[FileVersion]) -> int:
        """How many bytes of these file versions are in the cache."""
        return await self._source.cached_bytes(files)

    def cache_statistics(self) -> CacheStats:
        return self._source.statistics()

    async def read(self, stream: Stream, offset: int, size: int) -> bytes | memoryview:
        """Exactly ``size`` bytes from ``offset``, fewer only at end of file (a view of a
        hub answer when a miss's own request brought them: ``BlockSource.fill``)."""
        fv = stream.fv
        end = min(offset + size, fv.size)
        if offset >= end:
            return b""
        self._noticed(stream, offset, size, end)
        started = time.monotonic()
        found = await self._source.look(fv, offset, end)
        data: bytes | memoryview | None = found.data
        if data is None:
            if self._prefetcher is not None:
                self._prefetcher.on_miss(stream)
            data = await self._fill_within_deadline(stream, offset, end, found.missing)
        first, last = offset // BLOCK_SIZE, (end - 1) // BLOCK_SIZE
        self._source.note_used(fv, first, last)
        _account(len(data), found.by_origin, last - first + 1, len(found.missing),
                 time.monotonic() - started)
        return data

    def served(self, stream: Stream, offset: int, size: int, visits: list[Visit]) -> None:
        """A read of ``stream`` that a serving worker answered from the cache (``fuse.workers``):
        all that ``read`` does besides serving and counting (prefetcher, trace, eviction);
        ``account_served`` counts a batch of them."""
        fv = stream.fv
        end = min(offset + size, fv.size)
        if offset >= end:
            return
        self._noticed(stream, offset, size, end)
        first, last = offset // BLOCK_SIZE, (end - 1) // BLOCK_SIZE
        self._source.visited(visits, first, last)
        self._source.note_used(fv, first, last)

    @staticmethod
    def account_served(by_origin: list[int], nbytes: int, seconds: list[float]) -> None:
        """The metrics of a batch of reads a serving worker answered from the cache: blocks
        found per origin and bytes summed, and each read's latency."""
        _READS["cache"].inc(len(seconds))
        metrics.observe_many(metrics.READ_SECONDS, seconds)
        _count_block_hits(by_origin)
        _READ_BYTES["cache"].inc(nbytes)

    def _noticed(self, stream: Stream, offset: int, size: int, end: int) -> None:
        """Tell the prefetcher where the reader is, and note the read in the trace."""
        if self._prefetcher is not None:
            self._prefetcher.on_read(stream, offset, size)
        if self._trace is not None:  # once per small file, once per extent of a large one
            fv = stream.fv
            extent = WHOLE if fv.size <= EXTENT_BYTES else offset // EXTENT_BYTES
            if extent != stream.traced_extent:
                stream.traced_extent = extent
                self._trace.note(fv, offset, end)

    async def _fill_within_deadline(
        self, stream: Stream, offset: int, end: int, missing: list[int]
    ) -> bytes | memoryview:
        """``BlockSource.fill`` within the deadline; for the kernel's retry of a read that has just
        failed, a short one (see the module docstring, "Deadline")."""
        if self._deadline_s is None:
            return await self._source.fill(stream.fv, stream.parent_id, offset, end, missing)
        key = (stream.fv.file_id, stream.fv.version)
        now = trio.current_time()
        failed_at = self._failing.get(key)
        if failed_at is not None and now - failed_at <= _RETRY_WINDOW_S:
            budget = min(max(self._deadline_s * _RETRY_SHARE, _RETRY_MIN_S),
                         self._deadline_s / 2)
        else:
            budget = self._deadline_s
        with trio.move_on_after(budget):
            try:
                data = await self._source.fill(stream.fv, stream.parent_id, offset, end, missing)
            except HubUnavailable:  # the hub client's own deadline, as a rule
                self._note_failing(key)
                raise
            self._failing.pop(key, None)
            return data
        self._note_failing(key)
        raise HubUnavailable(f"blocks not fetched within the hub deadline "
                             f"({self._deadline_s:g}s)")

    def _note_failing(self, key: tuple[int, int]) -> None:
        self._failing[key] = trio.current_time()
        self._failing.move_to_end(key)
        while len(self._failing) > _FAILING_KEPT:
            self._failing.popitem(last=False)


def _account(nbytes: int, by_origin: list[int], blocks: int, misses: int,
             seconds: float) -> None:
    source = "hub" if misses else "cache"
    _READS[source].inc()
    metrics.READ_SECONDS.observe(seconds)
    _count_block_hits(by_origin)
    if misses:
        metrics.BLOCK_MISSES.inc(misses)
        metrics.READ_MISS_SECONDS.observe(seconds)
    hit_bytes = min(nbytes, (blocks - misses) * BLOCK_SIZE)
    _READ_BYTES["cache"].inc(hit_bytes)
    if nbytes > hit_bytes:
        _READ_BYTES["hub"].inc(nbytes - hit_bytes)


def _count_block_hits(by_origin: list[int]) -> None:
    for child, count in zip(_HITS, by_origin, strict=True):
        if count:
            child.inc(count)


# metric children bound once: a label lookup per read costs more than the increment
_READS = {src: metrics.READS.labels(source=src) for src in ("cache", "hub")}
_READ_BYTES = {src: metrics.READ_BYTES.labels(source=src) for src in ("cache", "hub")}
_HITS = [metrics.BLOCK_HITS.labels(origin=origin) for origin in ORIGINS]
