"""Fills the block cache from the hub, single-flight per chunk, for demand reads and prefetch.

One table of in-flight chunks is shared by every caller: while anyone fetches blocks of a
chunk, everyone else who needs that chunk waits for it instead of asking the hub again, so a
reader catching up with the prefetcher waits for the bytes already on their way.

Fetched bytes are *staged* in the block cache (``BlockCache.stage``): readers see them at
once and the cache's writer stores them later, many fills to one transaction. So no read
ever waits for a store, and a chunk is released to its waiters the moment its bytes are in.
A reader looks in the cache and claims what it misses in one synchronous stretch (no await
between), so it can never fetch again what another task has just staged.

- ``demand``: the blocks a read is missing. Fetches the ones nobody is fetching, waits for
  the rest. Demand requests go straight to the hub: no prefetch limit applies, so prefetch
  can never starve them.
- ``prefetch_range``: whole chunks of a byte range that are neither cached nor in flight;
  never waits for others.
- ``prefetch_files``: whole small files in one pack request, each released to its waiters
  as soon as its last byte has streamed in.

Prefetched chunks are remembered (bounded) until a demand read uses them, which gives the
prefetch "used" figure; "wasted" is what was prefetched and evicted or never read.
"""

from __future__ import annotations

from collections import OrderedDict

import trio

from hubd import wire
from spokefs import metrics
from spokefs.cache.block_cache import ORIGIN_DEMAND, ORIGIN_PREFETCH, ORIGIN_WARM, BlockCache
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS, CHUNK_SIZE
from spokefs.errors import single_spoke_error
from spokefs.hub_client import HubClient
from spokefs.types import FileVersion

_RUN_BLOCKS = wire.MAX_RANGE_BYTES // BLOCK_SIZE
_TRACKED_PREFETCH_CHUNKS = 1 << 20  # ~100 MiB of bookkeeping at most

ChunkKey = tuple[int, int, int]


class Fetcher:
    """Single-flight fills of the block cache."""

    def __init__(self, cache: BlockCache, hub: HubClient) -> None:
        self.cache = cache
        self._hub = hub
        self._inflight: dict[ChunkKey, trio.Event] = {}
        self._prefetched: OrderedDict[ChunkKey, int] = OrderedDict()

    # -- demand ---------------------------------------------------------------------

    async def demand(self, fv: FileVersion, missing: list[int]) -> None:
        """Fetch the missing blocks whose chunks nobody else is fetching and stage them;
        wait for the rest. Afterwards the blocks are in the cache unless a fetch failed
        (raised) or the cache dropped them meanwhile (the caller looks again)."""
        chunks = sorted({i // CHUNK_BLOCKS for i in missing})
        claimed, waits = self._claim(fv, chunks)
        mine = [i for i in missing if (fv.file_id, fv.version, i // CHUNK_BLOCKS) in claimed]
        try:
            runs = _runs(mine, _RUN_BLOCKS)
            if len(runs) == 1:
                await self._fetch_stage(fv, runs[0], ORIGIN_DEMAND)
            elif runs:
                with single_spoke_error():
                    async with trio.open_nursery() as nursery:
                        for run in runs:
                            nursery.start_soon(self._fetch_stage, fv, run, ORIGIN_DEMAND)
        finally:
            self._release(claimed)
        for event in waits:
            await event.wait()

    def note_used(self, fv: FileVersion, first: int, last: int) -> None:
        """Count prefetched chunks that a read has now used."""
        if not self._prefetched:
            return
        for ci in range(first // CHUNK_BLOCKS, last // CHUNK_BLOCKS + 1):
            nbytes = self._prefetched.pop((fv.file_id, fv.version, ci), None)
            if nbytes is not None:
                metrics.PREFETCH_USED_BYTES.inc(nbytes)

    # -- prefetch -------------------------------------------------------------------

    def in_flight(self, fv: FileVersion) -> bool:
        """Whether any of the file's chunks is being fetched."""
        return any((fv.file_id, fv.version, ci) in self._inflight for ci in range(fv.chunks()))

    def busy_or_cached(self, fv: FileVersion) -> bool:
        """Whether any of the file's chunks is in flight, or all of it is cached or staged."""
        return self.in_flight(fv) or self.cache.has_file(fv)

    async def prefetch_range(
        self, fv: FileVersion, start: int, end: int, *, warm: bool = False
    ) -> int:
        """Fetch the chunks of ``[start, end)`` that are not cached or in flight; bytes fetched.

        ``warm``: for ``spokefs warm``; the chunks are stored as warmed (kept like hot data).
        """
        await self.cache.wait_room()
        first_chunk, last_chunk = start // CHUNK_SIZE, (end - 1) // CHUNK_SIZE
        present = self.cache.present_chunks_now(fv, first_chunk, last_chunk)
        wanted = [c for c in range(first_chunk, last_chunk + 1) if c not in present]
        claimed, _ = self._claim(fv, wanted)
        try:
            chunks = sorted(ci for _, _, ci in claimed)
            blocks = [b for ci in chunks for b in _chunk_blocks(ci, fv.blocks())]
            origin = ORIGIN_WARM if warm else ORIGIN_PREFETCH
            # callers pass about one request's worth, so this is usually one range request
            nbytes = 0
            for run in _runs(blocks, _RUN_BLOCKS):
                nbytes += await self._fetch_stage(fv, run, origin)
            if not warm:  # warmed bytes are asked for, not guessed: no prefetch accounting
                self._remember_prefetched(fv, chunks)
                metrics.PREFETCH_ISSUED_BYTES.inc(nbytes)
            return nbytes
        finally:
            self._release(claimed)

    async def prefetch_files(self, files: list[FileVersion]) -> list[FileVersion]:
        """Fetch small, non-empty files whole in one pack request; the files fetched.

        Files already cached, staged or in flight are left out; each file is staged and
        released to its waiters as soon as it has arrived, before the pack ends.
        """
        await self.cache.wait_room()
        free = {(f.file_id, f.version): f for f in files if f.size and not self.busy_or_cached(f)}
        if not free:
            return []
        claims = {key: self._claim(f, list(range(f.chunks())))[0] for key, f in free.items()}
        fetched: list[FileVersion] = []

        def arrived(key: tuple[int, int], data: bytes | None) -> None:
            f = free[key]
            if data is not None:  # None: gone on the hub; a later open sees the new version
                self.cache.stage(f.file_id, f.version, [(0, data)], ORIGIN_PREFETCH)
                self._remember_prefetched(f, list(range(f.chunks())))
                metrics.PREFETCH_ISSUED_BYTES.inc(len(data))
                fetched.append(f)
            self._release(claims.pop(key))

        try:
            await self._hub.fetch_pack(list(free), arrived)
        finally:
            for claimed in claims.values():
                self._release(claimed)
        return fetched

    def received_bytes(self) -> int:
        """Bytes that have arrived from the hub so far (every kind of request)."""
        return self._hub.received_bytes

    def rtt_s(self) -> float | None:
        """The hub's round trip as measured (the shortest recent wait for an answer)."""
        return self._hub.rtt_s

    # -- internals ------------------------------------------------------------------

    def _claim(self, fv: FileVersion, chunks: list[int]) -> tuple[set[ChunkKey], list[trio.Event]]:
        """Mark free chunks in flight (ours); return them and the events of the others."""
        claimed: set[ChunkKey] = set()
        waits: list[trio.Event] = []
        for ci in chunks:
            key = (fv.file_id, fv.version, ci)
            if (event := self._inflight.get(key)) is not None:
                waits.append(event)
            else:
                self._inflight[key] = trio.Event()
                claimed.add(key)
        return claimed, waits

    def _release(self, claimed: set[ChunkKey]) -> None:
        for key in claimed:
            self._inflight.pop(key).set()

    async def _fetch_stage(self, fv: FileVersion, run: range, origin: int) -> int:
        start = run.start * BLOCK_SIZE
        stop = min(run.stop * BLOCK_SIZE, fv.size)
        data = await self._hub.fetch_range(fv.file_id, fv.version, start, stop - start)
        self.cache.stage(fv.file_id, fv.version, [(run.start, data)], origin)
        return len(data)

    def _remember_prefetched(self, fv: FileVersion, chunks: list[int]) -> None:
        size = fv.size
        for ci in chunks:
            nbytes = min(CHUNK_SIZE, size - ci * CHUNK_SIZE)
            self._prefetched[(fv.file_id, fv.version, ci)] = nbytes
        while len(self._prefetched) > _TRACKED_PREFETCH_CHUNKS:
            self._prefetched.popitem(last=False)


def _chunk_blocks(ci: int, nblocks: int) -> range:
    return range(ci * CHUNK_BLOCKS, min((ci + 1) * CHUNK_BLOCKS, nblocks))


def _runs(indexes: list[int], max_len: int) -> list[range]:
    """Sorted block indexes as contiguous runs, none longer than ``max_len``."""
    runs: list[range] = []
    for idx in sorted(indexes):
        if runs and runs[-1].stop == idx and len(runs[-1]) < max_len:
            runs[-1] = range(runs[-1].start, idx + 1)
        else:
            runs.append(range(idx, idx + 1))
    return runs
