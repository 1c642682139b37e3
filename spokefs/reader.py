"""The read path of one request: split ``(offset, size)`` into 4 KiB blocks, take what the
block cache has, fetch the rest from the hub, and assemble exactly the bytes asked for.

Misses are single-flight per chunk: while one reader fetches blocks of a chunk, another reader
that needs blocks of that chunk waits for it and then looks again, so concurrent readers of
the same bytes cause one hub request. A reader always uses the bytes it fetched itself, even if
the cache could not keep them (full, or a write error), so a tiny cache still makes progress.

Contiguous missing blocks go to the hub as one range request (split at
``wire.MAX_RANGE_BYTES``), run concurrently when a read has several.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import trio

from hubd import wire
from spokefs import metrics
from spokefs.block_cache import BlockCache
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS
from spokefs.hub_client import HubClient

_RUN_BLOCKS = wire.MAX_RANGE_BYTES // BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class FileVersion:
    """What an open handle reads: one version of one file, fixed from open to close."""

    file_id: int
    version: int
    size: int


class Reader:
    """Serves reads of file versions from the block cache, filling it from the hub."""

    def __init__(self, cache: BlockCache, hub: HubClient) -> None:
        self._cache = cache
        self._hub = hub
        self._inflight: dict[tuple[int, int, int], trio.Event] = {}

    async def read(self, fv: FileVersion, offset: int, size: int) -> bytes:
        """Exactly ``size`` bytes from ``offset``, fewer only at end of file."""
        end = min(offset + size, fv.size)
        if offset >= end:
            return b""
        started = time.monotonic()
        first, last = offset // BLOCK_SIZE, (end - 1) // BLOCK_SIZE
        blocks = await self._cache.get_blocks(fv.file_id, fv.version, first, last)
        hits = len(blocks)
        while len(blocks) < last - first + 1:
            missing = [i for i in range(first, last + 1) if i not in blocks]
            blocks.update(await self._fill(fv, missing))
            if len(blocks) < last - first + 1:  # others fetched some: look in the cache again
                blocks.update(await self._cache.get_blocks(fv.file_id, fv.version, first, last))
        data = b"".join(blocks[i] for i in range(first, last + 1))
        start = offset - first * BLOCK_SIZE
        out = data[start : start + end - offset]
        self._account(len(out), hits, last - first + 1, time.monotonic() - started)
        return out

    async def _fill(self, fv: FileVersion, missing: list[int]) -> dict[int, bytes]:
        """Fetch the missing blocks whose chunks nobody else is fetching; wait for the rest.

        Returns the blocks fetched here; the caller re-reads the cache for the others.
        """
        mine: list[int] = []
        waits: list[trio.Event] = []
        claimed: list[tuple[int, int, int]] = []
        for idx in missing:
            key = (fv.file_id, fv.version, idx // CHUNK_BLOCKS)
            if (event := self._inflight.get(key)) is not None and key not in claimed:
                waits.append(event)
                continue
            if key not in claimed:
                self._inflight[key] = trio.Event()
                claimed.append(key)
            mine.append(idx)
        fetched: dict[int, bytes] = {}
        try:
            async with trio.open_nursery() as nursery:
                for run in _runs(mine):
                    nursery.start_soon(self._fetch_run, fv, run, fetched)
            if fetched:
                await self._cache.put_blocks(fv.file_id, fv.version, fetched)
        finally:
            for key in claimed:
                self._inflight.pop(key).set()
        for event in waits:
            await event.wait()
        return fetched

    async def _fetch_run(self, fv: FileVersion, run: range, out: dict[int, bytes]) -> None:
        start = run.start * BLOCK_SIZE
        stop = min(run.stop * BLOCK_SIZE, fv.size)
        data = await self._hub.fetch_range(fv.file_id, fv.version, start, stop - start)
        for n, idx in enumerate(run):
            out[idx] = data[n * BLOCK_SIZE : (n + 1) * BLOCK_SIZE]

    @staticmethod
    def _account(nbytes: int, hits: int, blocks: int, seconds: float) -> None:
        source = "cache" if hits == blocks else "hub"
        metrics.READS.labels(source=source).inc()
        metrics.READ_SECONDS.observe(seconds)
        metrics.BLOCK_HITS.inc(hits)
        metrics.BLOCK_MISSES.inc(blocks - hits)
        hit_bytes = min(nbytes, hits * BLOCK_SIZE)
        metrics.READ_BYTES.labels(source="cache").inc(hit_bytes)
        metrics.READ_BYTES.labels(source="hub").inc(nbytes - hit_bytes)


def _runs(indexes: list[int]) -> list[range]:
    """Sorted block indexes as contiguous runs, none longer than one hub range."""
    runs: list[range] = []
    for idx in sorted(indexes):
        if runs and runs[-1].stop == idx and len(runs[-1]) < _RUN_BLOCKS:
            runs[-1] = range(runs[-1].start, idx + 1)
        else:
            runs.append(range(idx, idx + 1))
    return runs
