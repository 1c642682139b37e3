"""The block cache driven through its production API only, as ``read.block_source`` drives
it: fills are ``BlockCache.stage``d and stored by the writer task (``BlockCache.run``,
``flush``); reads are ``BlockCache.read``, then ``read_on_disk`` when the bytes are not in RAM
(the reader's path, with its checksum checks and its visits for eviction)."""

from __future__ import annotations

import trio

from spokefs.cache.block_cache import ORIGIN_DEMAND, BlockCache, ReadResult
from spokefs.config import BLOCK_SIZE
from spokefs.types import FileVersion


async def stage_and_store(cache: BlockCache, file_id: int, version: int,
                          runs: list[tuple[int, bytes]], origin: int = ORIGIN_DEMAND) -> None:
    """Stage runs of blocks ``(first block, bytes)`` and run the writer task until it has
    stored them (``flush``); it does what was pending before them first (drops of blocks
    that failed their checksum, promotions). For a cache whose writer is not running."""
    cache.stage(file_id, version, runs, origin)
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await cache.flush()
        nursery.cancel_scope.cancel()


async def read_range(cache: BlockCache, file_id: int, version: int, offset: int, end: int, *,
                     record: bool = True) -> ReadResult:
    """Bytes ``[offset, end)`` as the reader looks them up: inline, or from a worker thread
    when the stored bytes are not in RAM."""
    res = cache.read(file_id, version, offset, end, record=record)
    if res.on_disk:
        res = await cache.read_on_disk(file_id, version, offset, end, record=record)
    return res


async def cached_blocks(cache: BlockCache, fv: FileVersion) -> dict[int, bytes]:
    """The blocks of a file version the cache serves, by index: each read alone through
    ``read_range`` (not counted as visits)."""
    found: dict[int, bytes] = {}
    for i in range(fv.blocks()):
        res = await read_range(cache, fv.file_id, fv.version, i * BLOCK_SIZE,
                               min(fv.size, (i + 1) * BLOCK_SIZE), record=False)
        if res.data is not None:
            found[i] = res.data
    return found
