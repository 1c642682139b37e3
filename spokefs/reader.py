"""The read path of one request: split ``(offset, size)`` into 4 KiB blocks, take what the
block cache has, fetch the rest (``fetcher``, single-flight), and assemble exactly the bytes
asked for; tell the prefetcher where the reader is, before waiting on anything, so read-ahead
overlaps the demand fetch.

A small file (up to ``small_file_bytes``) is fetched whole on its first miss: one round trip
instead of one per kernel read.

A read that misses waits at most ``deadline_s`` (the hub deadline) in all, then fails with
``HubUnavailable`` (EIO): waiting for someone else's fetch of the same chunk (a prefetch) that
then fails does not start a whole new deadline for the read's own fetch.
"""

from __future__ import annotations

import time

import trio

from spokefs import metrics
from spokefs.block_cache import ORIGINS, CacheStats
from spokefs.config import BLOCK_SIZE
from spokefs.errors import HubUnavailable
from spokefs.fetcher import Fetcher
from spokefs.prefetcher import Prefetcher, Stream
from spokefs.types import FileVersion


class Reader:
    """Serves reads of open streams from the block cache, filling it from the hub."""

    def __init__(self, fetcher: Fetcher, prefetcher: Prefetcher | None, small_file_bytes: int,
                 deadline_s: float | None = None):
        self._fetcher = fetcher
        self._prefetcher = prefetcher
        self._small = small_file_bytes
        self._deadline_s = deadline_s  # None: only the hub client's own deadlines apply

    def open(self, fv: FileVersion, parent_id: int) -> Stream:
        """A stream for a newly opened handle (the prefetcher also learns of the open)."""
        if self._prefetcher is None:
            return Stream(fv, parent_id)
        return self._prefetcher.on_open(fv, parent_id)

    def close(self, stream: Stream) -> None:
        if self._prefetcher is not None:
            self._prefetcher.on_close(stream)

    async def warm(self, fv: FileVersion) -> int:
        """Fetch a whole file into the cache at the link's speed; bytes fetched."""
        if self._prefetcher is not None:
            return await self._prefetcher.warm(fv)
        return await self._fetcher.prefetch_range(fv, 0, fv.size, warm=True) if fv.size else 0

    async def cached_bytes(self, files: list[FileVersion]) -> int:
        """How many bytes of these file versions are in the cache."""
        return await self._fetcher.cache.cached_bytes(files)

    def cache_statistics(self) -> CacheStats:
        return self._fetcher.cache.statistics()

    async def read(self, stream: Stream, offset: int, size: int) -> bytes:
        """Exactly ``size`` bytes from ``offset``, fewer only at end of file."""
        fv = stream.fv
        end = min(offset + size, fv.size)
        if offset >= end:
            return b""
        if self._prefetcher is not None:
            self._prefetcher.on_read(stream, offset, size)
        started = time.monotonic()
        first, last = offset // BLOCK_SIZE, (end - 1) // BLOCK_SIZE
        blocks = await self._fetcher.cache.get_blocks(fv.file_id, fv.version, first, last)
        hits = len(blocks)
        if hits < last - first + 1:
            await self._fill_within_deadline(fv, first, last, blocks)
        self._fetcher.note_used(fv, first, last)
        data = b"".join(blocks[i] for i in range(first, last + 1))
        start = offset - first * BLOCK_SIZE
        out = data[start : start + end - offset]
        self._account(len(out), blocks.by_origin, last - first + 1, time.monotonic() - started)
        return out

    async def _fill_within_deadline(
        self, fv: FileVersion, first: int, last: int, blocks: dict[int, bytes]
    ) -> None:
        if self._deadline_s is None:
            await self._fill(fv, first, last, blocks)
            return
        with trio.move_on_after(self._deadline_s) as scope:
            await self._fill(fv, first, last, blocks)
        if scope.cancelled_caught:
            raise HubUnavailable(f"blocks not fetched within the hub deadline "
                                 f"({self._deadline_s:g}s)")

    async def _fill(self, fv: FileVersion, first: int, last: int, blocks: dict[int, bytes]) -> None:
        """Add blocks ``first..last`` to ``blocks``, from the hub or from others' fetches."""
        lo, hi = (0, fv.blocks() - 1) if fv.size <= self._small else (first, last)
        first_try = True
        while len(blocks) < last - first + 1:
            missing = [i for i in range(lo, hi + 1) if i not in blocks]
            got = await self._fetcher.demand(fv, missing, skip_recent=first_try)
            first_try = False
            blocks.update((i, b) for i, b in got.items() if first <= i <= last)
            if len(blocks) < last - first + 1:  # others fetched some: look in the cache again
                blocks.update(await self._fetcher.cache.get_blocks(
                    fv.file_id, fv.version, first, last, record=False  # the same read again
                ))
            lo, hi = first, last

    @staticmethod
    def _account(nbytes: int, by_origin: list[int], blocks: int, seconds: float) -> None:
        hits = sum(by_origin)
        source = "cache" if hits == blocks else "hub"
        metrics.READS.labels(source=source).inc()
        metrics.READ_SECONDS.observe(seconds)
        for origin, count in zip(ORIGINS, by_origin, strict=True):
            if count:
                metrics.BLOCK_HITS.labels(origin=origin).inc(count)
        metrics.BLOCK_MISSES.inc(blocks - hits)
        hit_bytes = min(nbytes, hits * BLOCK_SIZE)
        metrics.READ_BYTES.labels(source="cache").inc(hit_bytes)
        metrics.READ_BYTES.labels(source="hub").inc(nbytes - hit_bytes)
