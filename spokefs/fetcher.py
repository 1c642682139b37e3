"""Fills the block cache from the hub, single-flight per chunk, for demand reads and prefetch.

One table of in-flight chunks is shared by every caller: while anyone fetches blocks of a
chunk, everyone else who needs that chunk waits for it instead of asking the hub again, so a
reader catching up with the prefetcher waits for the bytes already on their way.

- ``demand``: the blocks a read is missing. Fetches the ones nobody is fetching, waits for
  the rest, and returns the blocks it fetched itself (so a read makes progress even when the
  cache could not keep them). Demand requests go straight to the hub: no prefetch limit
  applies, so prefetch can never starve them.
- ``prefetch_range``: whole chunks of a byte range that are neither cached nor in flight;
  never waits for others.
- ``prefetch_files``: whole small files in one pack request.

Prefetched chunks are remembered (bounded) until a demand read uses them, which gives the
prefetch "used" figure; "wasted" is what was prefetched and evicted or never read.
"""

from __future__ import annotations

from collections import OrderedDict

import trio

from hubd import wire
from spokefs import metrics
from spokefs.block_cache import ORIGIN_DEMAND, ORIGIN_PREFETCH, ORIGIN_WARM, BlockCache
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS, CHUNK_SIZE
from spokefs.errors import single_spoke_error
from spokefs.hub_client import HubClient
from spokefs.types import FileVersion

_RUN_BLOCKS = wire.MAX_RANGE_BYTES // BLOCK_SIZE
_TRACKED_PREFETCH_CHUNKS = 1 << 20  # ~100 MiB of bookkeeping at most
# Chunks stored in the last moments: a caller that looked in the cache just before another
# task stored them (the look is a thread hop) must not fetch them again.
_RECENT_CHUNKS = 8192

ChunkKey = tuple[int, int, int]


class Fetcher:
    """Single-flight fills of the block cache."""

    def __init__(self, cache: BlockCache, hub: HubClient) -> None:
        self.cache = cache
        self._hub = hub
        self._inflight: dict[ChunkKey, trio.Event] = {}
        self._prefetched: OrderedDict[ChunkKey, int] = OrderedDict()
        self._recent: OrderedDict[ChunkKey, None] = OrderedDict()

    # -- demand ---------------------------------------------------------------------

    async def demand(
        self, fv: FileVersion, missing: list[int], *, skip_recent: bool = True
    ) -> dict[int, bytes]:
        """Fetch the missing blocks whose chunks nobody else is fetching; wait for the rest.

        With ``skip_recent``, chunks stored moments ago are left for the caller to read from
        the cache (it looked just before they arrived); a caller that still misses them
        there (evicted at once from a tiny cache) calls again without it.
        """
        chunks = sorted({i // CHUNK_BLOCKS for i in missing})
        claimed, waits = self._claim(fv, chunks, skip_recent=skip_recent)
        mine = [i for i in missing if (fv.file_id, fv.version, i // CHUNK_BLOCKS) in claimed]
        got: list[tuple[int, bytes]] = []
        try:
            with single_spoke_error():
                async with trio.open_nursery() as nursery:
                    for run in _runs(mine, _RUN_BLOCKS):
                        nursery.start_soon(self._fetch_run, fv, run, got)
            if got:
                await self.cache.put_runs(fv.file_id, fv.version, got, ORIGIN_DEMAND)
                self._remember_recent(claimed)
        finally:
            self._release(claimed)
        for event in waits:
            await event.wait()
        return {
            first + n: data[n * BLOCK_SIZE : (n + 1) * BLOCK_SIZE]
            for first, data in got
            for n in range(-(-len(data) // BLOCK_SIZE))
        }

    def note_used(self, fv: FileVersion, first: int, last: int) -> None:
        """Count prefetched chunks that a read has now used."""
        if not self._prefetched:
            return
        for ci in range(first // CHUNK_BLOCKS, last // CHUNK_BLOCKS + 1):
            nbytes = self._prefetched.pop((fv.file_id, fv.version, ci), None)
            if nbytes is not None:
                metrics.PREFETCH_USED_BYTES.inc(nbytes)

    # -- prefetch -------------------------------------------------------------------

    async def prefetch_range(
        self, fv: FileVersion, start: int, end: int, *, warm: bool = False
    ) -> int:
        """Fetch the chunks of ``[start, end)`` that are not cached or in flight; bytes fetched.

        ``warm``: for ``spokefs warm``; the chunks are stored as warmed (kept like hot data).
        """
        first_chunk, last_chunk = start // CHUNK_SIZE, (end - 1) // CHUNK_SIZE
        present = await self.cache.present_chunks(fv, first_chunk, last_chunk)
        wanted = [c for c in range(first_chunk, last_chunk + 1) if c not in present]
        claimed, _ = self._claim(fv, wanted, skip_recent=True)
        try:
            chunks = sorted(ci for _, _, ci in claimed)
            blocks = [b for ci in chunks for b in _chunk_blocks(ci, fv.blocks())]
            # callers pass about one request's worth, so this is usually one range request
            got: list[tuple[int, bytes]] = []
            for run in _runs(blocks, _RUN_BLOCKS):
                await self._fetch_run(fv, run, got)
            if got:
                origin = ORIGIN_WARM if warm else ORIGIN_PREFETCH
                await self.cache.put_runs(fv.file_id, fv.version, got, origin)
                if not warm:
                    self._remember_prefetched(fv, chunks)
                self._remember_recent(claimed)
            nbytes = sum(len(data) for _, data in got)
            if not warm:  # warmed bytes are asked for, not guessed: no prefetch accounting
                metrics.PREFETCH_ISSUED_BYTES.inc(nbytes)
            return nbytes
        finally:
            self._release(claimed)

    async def prefetch_files(self, files: list[FileVersion]) -> int:
        """Fetch small, non-empty files whole in one pack request; bytes fetched."""
        keys = {f: [(f.file_id, f.version, ci) for ci in range(f.chunks())] for f in files}
        free = [f for f in files if f.size and not any(k in self._inflight for k in keys[f])]
        claimed, _ = self._claim_keys([k for f in free for k in keys[f]], skip_recent=False)
        try:
            if not free:
                return 0
            got = await self._hub.fetch_pack([(f.file_id, f.version) for f in free])
            nbytes = 0
            for f in free:
                data = got.get((f.file_id, f.version))
                if data is None:
                    continue  # gone on the hub: a later open sees the new version
                await self.cache.put_runs(f.file_id, f.version, [(0, data)], ORIGIN_PREFETCH)
                self._remember_prefetched(f, list(range(f.chunks())))
                nbytes += len(data)
            metrics.PREFETCH_ISSUED_BYTES.inc(nbytes)
            return nbytes
        finally:
            self._release(claimed)

    # -- internals ------------------------------------------------------------------

    def _claim(
        self, fv: FileVersion, chunks: list[int], *, skip_recent: bool
    ) -> tuple[set[ChunkKey], list[trio.Event]]:
        keys = [(fv.file_id, fv.version, ci) for ci in chunks]
        return self._claim_keys(keys, skip_recent=skip_recent)

    def _claim_keys(
        self, keys: list[ChunkKey], *, skip_recent: bool
    ) -> tuple[set[ChunkKey], list[trio.Event]]:
        """Mark free chunks in flight (ours); return them and the events of the others."""
        claimed: set[ChunkKey] = set()
        waits: list[trio.Event] = []
        for key in keys:
            if skip_recent and key in self._recent:
                continue
            if (event := self._inflight.get(key)) is not None:
                waits.append(event)
            else:
                self._inflight[key] = trio.Event()
                claimed.add(key)
        return claimed, waits

    def _release(self, claimed: set[ChunkKey]) -> None:
        for key in claimed:
            self._inflight.pop(key).set()

    async def _fetch_run(self, fv: FileVersion, run: range, out: list[tuple[int, bytes]]) -> None:
        start = run.start * BLOCK_SIZE
        stop = min(run.stop * BLOCK_SIZE, fv.size)
        data = await self._hub.fetch_range(fv.file_id, fv.version, start, stop - start)
        out.append((run.start, data))

    def _remember_recent(self, keys: set[ChunkKey]) -> None:
        for key in keys:
            self._recent[key] = None
            self._recent.move_to_end(key)
        while len(self._recent) > _RECENT_CHUNKS:
            self._recent.popitem(last=False)

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
