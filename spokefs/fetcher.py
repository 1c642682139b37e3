"""Fills the block cache from the hub, single-flight per chunk, for demand reads and prefetch.

One table of in-flight chunks is shared by every caller: while anyone fetches blocks of a
chunk, everyone else who needs that chunk waits for it instead of asking the hub again, so a
reader catching up with the prefetcher waits for the bytes already on their way.

Fetched bytes are *staged* in the block cache (``BlockCache.stage``): readers see them at
once and the cache's writer stores them later, many fills to one transaction. So no read
ever waits for a store, and a chunk is released to its waiters the moment its bytes are in.
A reader looks in the cache and claims what it misses in one synchronous stretch (no await
between), so it can never fetch again what another task has just staged.

Ranges are asked for on the hub client's grid (``HubClient.align_bytes``: a tier's 1 MiB
cache slice, or one 4 KiB frame, i.e. one block, straight to the hub): a run of missing
blocks is widened to the grid, the free chunks of the widened range are claimed too (so
what is fetched is kept), and only blocks of claimed chunks are staged. So the spokes
behind one tier ask it for the same slices, and a random 4 KiB read straight to the hub
still moves 4 KiB.

- ``demand``: the blocks a read is missing. Fetches the chunks nobody is fetching, waits
  for the rest. Demand requests go straight to the hub: no prefetch limit applies, so
  prefetch can never starve them.
- ``demand_pack``: a small file a read is missing, through its directory's pack (not
  alone: behind a tier each small file must have one URL, else the far link carries it
  twice). The read returns once its own file is in; the pack streams on in the task group
  of ``run`` (the concurrency note below).
- ``prefetch_range``: whole chunks of a byte range that are neither cached nor in flight;
  never waits for others.
- ``fetch_pack``: the members of one pack that are neither cached nor in flight, each
  released to its waiters as soon as its last byte has streamed in.

Prefetched chunks are remembered (bounded) until a demand read uses them, which gives the
prefetch "used" figure; "wasted" is what was prefetched and evicted or never read.

Concurrency: ``run`` holds one task group for the packs that demand reads start. A demand
read claims the pack's free members synchronously, starts the pack there and waits only for
its own file's claim; the pack's task releases every claim whatever happens and keeps the
last ``_PACK_ERRORS_KEPT`` failures for the readers that waited (a stale pack, 412, makes
them fetch their file alone; any other failure is raised to them).
"""

from __future__ import annotations

from collections import OrderedDict

import trio

from spokefs import metrics, protocol
from spokefs.cache.block_cache import (
    ORIGIN_DEMAND,
    ORIGIN_PREFETCH,
    ORIGIN_REPLAY,
    ORIGIN_WARM,
    BlockCache,
)
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS, CHUNK_SIZE
from spokefs.errors import SpokeError, StaleExport, single_spoke_error
from spokefs.hub_client import HubClient
from spokefs.types import FileVersion

_RUN_BLOCKS = protocol.MAX_RANGE_BYTES // BLOCK_SIZE
_PACK_ERRORS_KEPT = 64  # failures of demand packs, until their readers look
_TRACKED_PREFETCH_CHUNKS = 1 << 20  # ~100 MiB of bookkeeping at most

ChunkKey = tuple[int, int, int]


class Fetcher:
    """Single-flight fills of the block cache."""

    def __init__(self, cache: BlockCache, hub: HubClient) -> None:
        self.cache = cache
        self._hub = hub
        self._inflight: dict[ChunkKey, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self._pack_errors: OrderedDict[str, SpokeError] = OrderedDict()  # of demand packs
        self._prefetched: OrderedDict[ChunkKey, int] = OrderedDict()

    # -- demand ---------------------------------------------------------------------

    async def demand(self, fv: FileVersion, missing: list[int]) -> None:
        """Fetch the chunks of the missing blocks that nobody else is fetching and stage
        them; wait for the rest. Afterwards the blocks are in the cache unless a fetch failed
        (raised) or the cache dropped them meanwhile (the caller looks again)."""
        chunks = sorted({i // CHUNK_BLOCKS for i in missing})
        claimed, waits = self._claim(fv, chunks)
        extra = self._claim_rest_of_grid(fv, chunks)
        mine = [i for i in missing if (fv.file_id, fv.version, i // CHUNK_BLOCKS) in claimed]
        claimed |= extra
        mine.extend(b for _, _, ci in extra for b in _chunk_blocks(ci, fv.blocks()))
        try:
            runs = self._grid_runs(fv, mine)
            if len(runs) == 1:
                await self._fetch_stage(fv, runs[0], claimed, ORIGIN_DEMAND)
            elif runs:
                with single_spoke_error():
                    async with trio.open_nursery() as nursery:
                        for run in runs:
                            nursery.start_soon(self._fetch_stage, fv, run, claimed,
                                               ORIGIN_DEMAND)
        finally:
            self._release(claimed)
        for event in waits:
            await event.wait()

    async def demand_pack(self, plan: protocol.PackPlan, fv: FileVersion) -> None:
        """Fetch ``fv`` (a member of ``plan``) through its pack, or wait for whoever fetches
        it; the other members nobody is fetching come along and are staged as prefetched.

        Returns once ``fv`` has arrived: the rest of the pack streams on in the task group
        of ``run`` (inline, to its end, when ``run`` is not running: component tests).
        Falls back to fetching ``fv`` alone when the pack is stale on the hub (another
        generation: 412) or answered it gone; raises what the pack fetch raised otherwise.
        """
        key = (fv.file_id, fv.version, 0)
        if key not in self._inflight:
            free, claims = self._claim_pack(plan)
            if self._nursery is None:
                await self._demand_pack_task(plan, free, claims, fv)
            else:
                self._nursery.start_soon(self._demand_pack_task, plan, free, claims, fv)
        if (event := self._inflight.get(key)) is not None:
            await event.wait()
        if self.busy_or_cached(fv):
            return
        error = self._pack_errors.pop(plan.path, None)
        if error is not None and not isinstance(error, StaleExport):
            raise error
        await self.demand(fv, list(range(fv.blocks())))  # the pack is stale, or fv gone

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hosts the packs that demand reads start, so a read returns once its own file is
        in while the rest of its pack streams on."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    async def _demand_pack_task(self, plan: protocol.PackPlan, free: dict[tuple[int, int],
                                FileVersion], claims: dict[tuple[int, int], set[ChunkKey]],
                                fv: FileVersion) -> None:
        try:
            await self._fetch_claimed_pack(plan, free, claims, fv)
        except SpokeError as exc:  # the waiting reader finds it in _pack_errors
            self._pack_errors[plan.path] = exc
            while len(self._pack_errors) > _PACK_ERRORS_KEPT:
                self._pack_errors.popitem(last=False)

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
        self, fv: FileVersion, start: int, end: int, *, warm: bool = False,
        replay: bool = False,
    ) -> int:
        """Fetch the chunks of ``[start, end)`` that are not cached or in flight; bytes fetched.

        ``warm``: for ``spokefs warm``; the chunks are stored as warmed (kept like hot data).
        ``replay``: for a trace replay; stored with their own origin, for hit accounting.
        """
        await self.cache.wait_room()
        first_chunk, last_chunk = start // CHUNK_SIZE, (end - 1) // CHUNK_SIZE
        present = self.cache.present_chunks_now(fv, first_chunk, last_chunk)
        wanted = [c for c in range(first_chunk, last_chunk + 1) if c not in present]
        claimed, _ = self._claim(fv, wanted)
        claimed |= self._claim_rest_of_grid(fv, wanted)
        try:
            origin = ORIGIN_WARM if warm else ORIGIN_REPLAY if replay else ORIGIN_PREFETCH
            # callers pass about one request's worth, so this is usually one range request
            blocks = [b for _, _, ci in claimed for b in _chunk_blocks(ci, fv.blocks())]
            runs = self._grid_runs(fv, blocks)
            sizes: list[int] = []

            async def one(run: range) -> None:
                sizes.append(await self._fetch_stage(fv, run, claimed, origin))

            with single_spoke_error():
                async with trio.open_nursery() as nursery:
                    for run in runs:  # one request, or one per slice behind a tier
                        nursery.start_soon(one, run)
            nbytes = sum(sizes)
            if replay:
                metrics.REPLAY_FETCHED_BYTES.inc(nbytes)
            elif not warm:  # warmed bytes are asked for, not guessed: no prefetch accounting
                self._remember_prefetched(fv, sorted(ci for _, _, ci in claimed))
                metrics.PREFETCH_ISSUED_BYTES.inc(nbytes)
            return nbytes
        finally:
            self._release(claimed)

    async def fetch_pack(self, plan: protocol.PackPlan, *,
                         replay: bool = False) -> list[FileVersion]:
        """Fetch the members of a pack that are neither cached, staged nor in flight; the
        members fetched (none if every member is taken care of already).

        Each member is staged and released to its waiters as soon as it has arrived,
        before the pack ends; members cached or in flight are skipped on arrival.
        ``replay``: for a trace replay (its own origin and byte count).
        """
        await self.cache.wait_room()
        free, claims = self._claim_pack(plan)
        if not free:
            return []
        return await self._fetch_claimed_pack(plan, free, claims, None, replay=replay)

    def _claim_pack(self, plan: protocol.PackPlan) -> tuple[dict[tuple[int, int], FileVersion],
                                                        dict[tuple[int, int], set[ChunkKey]]]:
        """Claim the members that are neither cached, staged nor in flight (no await)."""
        members = [FileVersion(*m) for m in plan.members]
        free = {(f.file_id, f.version): f for f in members if not self.busy_or_cached(f)}
        claims = {key: self._claim(f, list(range(f.chunks())))[0] for key, f in free.items()}
        return free, claims

    async def _fetch_claimed_pack(
        self, plan: protocol.PackPlan, free: dict[tuple[int, int], FileVersion],
        claims: dict[tuple[int, int], set[ChunkKey]], demanded: FileVersion | None,
        *, replay: bool = False,
    ) -> list[FileVersion]:
        """Fetch a pack whose ``free`` members are claimed (``claims``); stage each as it
        arrives, ``demanded`` as a demand fetch. Releases every claim, whatever happens."""
        fetched: list[FileVersion] = []

        def arrived(key: tuple[int, int], data: bytes | None) -> None:
            claimed = claims.pop(key, None)
            if claimed is None:
                return  # cached or fetched by someone else meanwhile
            f = free[key]
            if data is not None and f == demanded:
                self.cache.stage(f.file_id, f.version, [(0, data)], ORIGIN_DEMAND)
            elif data is not None and replay:
                self.cache.stage(f.file_id, f.version, [(0, data)], ORIGIN_REPLAY)
                metrics.REPLAY_FETCHED_BYTES.inc(len(data))
                fetched.append(f)
            elif data is not None:  # None: gone on the hub; a later open sees the new version
                self.cache.stage(f.file_id, f.version, [(0, data)], ORIGIN_PREFETCH)
                self._remember_prefetched(f, list(range(f.chunks())))
                metrics.PREFETCH_ISSUED_BYTES.inc(len(data))
                fetched.append(f)
            self._release(claimed)

        try:
            if free:
                await self._hub.fetch_pack(plan, arrived)
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

    def _claim_rest_of_grid(self, fv: FileVersion, chunks: list[int]) -> set[ChunkKey]:
        """Claim the free, missing chunks of the grid cells that ``chunks`` touch (what a
        request widened to the grid fetches anyway); none when the grid is finer than a
        chunk (straight to the hub)."""
        grid = self._hub.align_bytes // CHUNK_SIZE
        if grid <= 1 or not chunks:
            return set()
        last = fv.chunks() - 1
        extra: list[int] = []
        for cell in sorted({c // grid for c in chunks}):
            lo, hi = cell * grid, min(cell * grid + grid - 1, last)
            present = self.cache.present_chunks_now(fv, lo, hi)
            extra.extend(c for c in range(lo, hi + 1)
                         if c not in present and (fv.file_id, fv.version, c) not in
                         self._inflight)
        return self._claim(fv, extra)[0]

    def _grid_runs(self, fv: FileVersion, blocks: list[int]) -> list[range]:
        """Block indexes as contiguous runs widened to the grid (``HubClient.align_bytes``)
        and clipped to the file, none longer than ``_RUN_BLOCKS`` (one request each).

        Behind a tier every run is one slice: nginx's slice module fetches the slices of
        one request one after the other, so a 4 MiB request that misses would wait four
        far round trips; four one-slice requests wait one, side by side (and the tier is
        near: the extra requests cost little)."""
        grid = max(1, self._hub.align_bytes // BLOCK_SIZE)
        nblocks = fv.blocks()
        if grid > CHUNK_BLOCKS:
            cells = sorted({b // grid for b in blocks})
            return [range(c * grid, min((c + 1) * grid, nblocks)) for c in cells]
        runs: list[range] = []
        for run in _runs(blocks, _RUN_BLOCKS):
            lo = run.start - run.start % grid
            hi = min(-(-run.stop // grid) * grid, nblocks)
            if runs and runs[-1].stop >= lo and hi - runs[-1].start <= _RUN_BLOCKS:
                runs[-1] = range(runs[-1].start, max(hi, runs[-1].stop))
            elif runs and runs[-1].stop > lo:  # overlaps a full run: the rest only
                runs.append(range(runs[-1].stop, hi))
            else:
                runs.append(range(lo, hi))
        return [r for r in runs if len(r)]

    async def _fetch_stage(self, fv: FileVersion, run: range, claimed: set[ChunkKey],
                           origin: int) -> int:
        """Fetch blocks ``run`` and stage those of them whose chunks are in ``claimed``;
        bytes fetched."""
        start = run.start * BLOCK_SIZE
        stop = min(run.stop * BLOCK_SIZE, fv.size)
        data = await self._hub.fetch_frames(fv.file_id, fv.version, fv.size, start, stop)
        pieces: list[tuple[int, bytes]] = []  # (first block, bytes) of claimed stretches
        b = run.start
        while b < run.stop:
            stop_b = b
            while stop_b < run.stop and (fv.file_id, fv.version,
                                         stop_b // CHUNK_BLOCKS) in claimed:
                stop_b += 1
            if stop_b > b:
                off = (b - run.start) * BLOCK_SIZE
                pieces.append((b, data[off : off + (stop_b - b) * BLOCK_SIZE]))
            b = stop_b + 1
        if pieces:
            self.cache.stage(fv.file_id, fv.version, pieces, origin)
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
    for idx in sorted(set(indexes)):
        if runs and runs[-1].stop == idx and len(runs[-1]) < max_len:
            runs[-1] = range(runs[-1].start, idx + 1)
        else:
            runs.append(range(idx, idx + 1))
    return runs
