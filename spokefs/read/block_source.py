"""The one way into the block cache on the read path: look, claim, fetch, stage, answer.

A read asks ``BlockSource.look`` for a range; on a miss it asks ``BlockSource.fill``, which
claims the chunks nobody is fetching (``claims``, single flight), waits for the others,
fetches what it claimed from the hub, stages it in the cache and answers with the bytes.
Fills ahead of readers (``prefetch_range``, ``fetch_pack``: the prefetcher, directory fills,
replays, ``spokefs warm``) go through the same claims, so nothing is fetched twice. No other
module reaches the cache on the read path, and nothing here calls back out: a read goes
FUSE layer -> ``reader`` -> here -> ``cache`` (and the hub client) and returns.

Fetched bytes are *staged* (``BlockCache.stage``): readers see them at once and the cache's
writer stores them later, many fills to one transaction. So no read ever waits for a store,
and a chunk is released to its waiters the moment its bytes are in.

Ranges are asked for on the hub client's grid (``grid``): a run of missing blocks is widened
to the grid, the free chunks of the widened range are claimed too (so what is fetched is
kept), and only blocks of claimed chunks are staged.

- ``fill``: the blocks a read is missing. A small file (up to ``small_file_bytes``) comes
  whole in one round trip; one that belongs in a pack (``protocol.packable``, and a
  ``PackFinder`` is given) comes with the rest of its directory's pack. Behind a tier that
  is the pack itself, so each small file has one URL for the tier's cache; straight to the
  hub it is a pick of the pack's members not cached or in flight, the missed file first,
  so the reader waits a round trip and not also for the members streamed before it (see
  ``_demand_pack``). The read returns once its own file is in; the rest streams on in the
  task group of ``run``. Demand fetches go straight to the hub: no prefetch limit applies.
- ``prefetch_range``: whole chunks of a byte range that are neither cached nor in flight;
  never waits for others.
- ``fetch_pack``: the members of one pack that are neither cached nor in flight, each
  released to its waiters as soon as its last byte has streamed in.

Prefetched chunks are remembered (bounded) until a read uses them (``note_used``), which
gives the prefetch "used" figure; "wasted" is what was prefetched and evicted or never read.

Concurrency: ``run`` holds one task group for the packs that demand reads start; it must be
running before the first ``fill``. A demand read claims the pack's free members
synchronously, starts the pack there and waits only for its own file's claim; the pack's
task releases every claim whatever happens and keeps the last ``_PACK_ERRORS_KEPT`` failures
for the readers that waited (a stale pack, 412, makes them fetch their file alone; any other
failure is raised to them).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

import trio

from spokefs import metrics, protocol
from spokefs.cache.block_cache import (
    ORIGIN_DEMAND,
    ORIGIN_PREFETCH,
    ORIGIN_REPLAY,
    ORIGIN_WARM,
    BlockCache,
    CacheStats,
    ReadResult,
    Visit,
)
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS, CHUNK_SIZE
from spokefs.errors import SpokeError, StaleExport, single_spoke_error
from spokefs.hub.client import HubClient
from spokefs.read.claims import ChunkKey, Claims
from spokefs.read.grid import chunk_blocks, grid_runs
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

_PACK_ERRORS_KEPT = 64  # failures of demand packs, until their readers look
_TRACKED_PREFETCH_CHUNKS = 1 << 20  # ~100 MiB of bookkeeping at most
# Speculation that does not pay: prefetched chunks evicted before any read used them. The
# oldest tracked ones are checked every _WASTE_CHECK_S (_WASTE_SCAN at most); once the waste
# over the last _WASTE_WINDOW_BYTES prefetched passes _WASTE_MAX of it, packs and fills stop
# for _WASTE_HOLD_S, twice as long each time in a row (up to _WASTE_HOLD_MAX_S), back to
# _WASTE_HOLD_S once a window wastes little (``speculation_pays``).
_WASTE_CHECK_S = 0.5
_WASTE_SCAN = 512
_WASTE_WINDOW_BYTES = 64 << 20
_WASTE_MAX = 0.25
_WASTE_HOLD_S = 30.0
_WASTE_HOLD_MAX_S = 960.0

MemberKey = tuple[int, int]  # (file id, version) of a pack member


class PackFinder(Protocol):
    """Where a small file's pack is (``fuse.mount``'s lister, a ``dir_fill.DirLister``)."""

    async def pack_of(self, dir_id: int, fv: FileVersion) -> protocol.PackPlan | None: ...


class BlockSource:
    """The block cache, filled from the hub, single flight per chunk."""

    def __init__(self, cache: BlockCache, hub: HubClient, *, small_file_bytes: int = 0,
                 packs: PackFinder | None = None) -> None:
        self._cache = cache
        self._hub = hub
        self._small = small_file_bytes
        self._packs = packs
        self._claims = Claims()
        self._nursery: trio.Nursery | None = None
        self._pack_errors: OrderedDict[str, SpokeError] = OrderedDict()  # of demand packs
        # prefetched chunks no read has used yet -> (their bytes, their file's size)
        self._prefetched: OrderedDict[ChunkKey, tuple[int, int]] = OrderedDict()
        self._window_bytes = 0  # prefetched lately (``speculation_pays``'s window)
        self._wasted_bytes = 0  # of those, evicted before a read used them
        self._waste_checked = 0.0
        self._hold_until = 0.0
        self._hold_s = _WASTE_HOLD_S

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

    # -- a read ---------------------------------------------------------------------

    async def look(self, fv: FileVersion, offset: int, end: int, *,
                   record: bool = True) -> ReadResult:
        """The cache's answer for ``[offset, end)``: inline, or from a worker thread when
        the bytes are on disk (``record``: count it as a visit, see ``BlockCache.read``)."""
        found = self._cache.read(fv.file_id, fv.version, offset, end, record=record)
        if found.on_disk:
            found = await self._cache.read_on_disk(fv.file_id, fv.version, offset, end,
                                                   record=record)
        return found

    async def fill(self, fv: FileVersion, parent_id: int, offset: int, end: int,
                   missing: list[int]) -> bytes | memoryview:
        """The bytes of ``[offset, end)``, whose blocks ``missing`` were not cached: fetch
        (or wait for others' fetches of) them, stage them, answer (from the answer itself
        when one request of this fill brought them all: a view of it)."""
        small = fv.size <= self._small
        if small and self._packs is not None and protocol.packable(fv.size) and \
                self.speculation_pays():
            plan = await self._packs.pack_of(parent_id, fv)
            if plan is not None:
                await self._demand_pack(plan, fv)
                found = await self.look(fv, offset, end, record=False)
                if found.data is not None:
                    return found.data
                missing = found.missing  # the pack did not bring it: fetch it alone below
        if small:  # a small file comes whole, in one round trip
            present = self._cache.present_chunks_now(fv, 0, fv.chunks() - 1)
            wanted = set(missing)
            wanted.update(b for ci in range(fv.chunks()) if ci not in present
                          for b in chunk_blocks(ci, fv.blocks()))
            missing = sorted(wanted)
        while True:
            fetched = await self._demand(fv, missing)
            if fetched is not None:  # its own answer holds the whole read: served from it,
                first, data = fetched  # verified, without a second look or a copy
                a, b = offset - first * BLOCK_SIZE, end - first * BLOCK_SIZE
                if a >= 0 and b <= len(data):
                    return memoryview(data)[a:b]
            found = await self.look(fv, offset, end, record=False)
            if found.data is not None:
                return found.data
            missing = found.missing  # others' fetches failed, or the cache let them go
            # Each round fetches or waits on the hub, but a cache that loses what was just
            # staged could make one return at once: never spin without letting the deadline,
            # the writer and every other request run.
            await trio.lowlevel.checkpoint()

    def visited(self, visits: list[Visit], first: int, last: int) -> None:
        """A read that a serving worker answered looked at these chunks (for eviction)."""
        self._cache.visited(visits, first, last)

    def check_readers(self) -> int:
        """Free the cache's reader slots of processes that died."""
        return self._cache.check_readers()

    def note_used(self, fv: FileVersion, first: int, last: int) -> None:
        """A read used blocks ``first..last``: count the prefetched chunks among them."""
        if not self._prefetched:
            return
        for ci in range(first // CHUNK_BLOCKS, last // CHUNK_BLOCKS + 1):
            kept = self._prefetched.pop((fv.file_id, fv.version, ci), None)
            if kept is not None:
                metrics.PREFETCH_USED_BYTES.inc(kept[0])

    def speculation_pays(self) -> bool:
        """Whether fetching what no reader asked for yet (a miss's whole directory pack,
        directory fills) still pays: False for a while (``_WASTE_HOLD_S``, doubling) once more
        than ``_WASTE_MAX`` of what was prefetched lately left the cache before any read used it
        (a cache smaller than what the readers go through: every pack pushes out the last
        one's files before they are read, and the link carries the data set many times)."""
        now = trio.current_time()
        if now < self._hold_until:
            return False
        if now - self._waste_checked >= _WASTE_CHECK_S:
            self._waste_checked = now
            self._count_waste()
            fetched, wasted = self._window_bytes, self._wasted_bytes
            if fetched < _WASTE_WINDOW_BYTES // 4:
                return True
            if wasted > _WASTE_MAX * fetched:
                self._hold_until = now + self._hold_s
                metrics.PREFETCH_HOLDS.inc()
                log.info("prefetch held for %.0f s: %d of the last %d bytes prefetched left "
                         "the cache unread (a cache smaller than what the readers go "
                         "through)", self._hold_s, wasted, fetched)
                self._hold_s = min(2 * self._hold_s, _WASTE_HOLD_MAX_S)
                self._window_bytes = self._wasted_bytes = 0
                return False
            if wasted < _WASTE_MAX / 4 * fetched:
                self._hold_s = _WASTE_HOLD_S
        return True

    def _count_waste(self) -> None:
        """Pop the oldest tracked prefetched chunks that are no longer cached (evicted
        before a read used them) into the waste window (inline header reads)."""
        oldest = list(itertools.islice(self._prefetched.items(), _WASTE_SCAN))
        # one read transaction for all of them (one each cost 7 % of the event loop's
        # samples over cold small files: the same oldest entries, every half second)
        held = self._cache.holding_now([(FileVersion(fid, ver, size), ci, ci)
                                        for (fid, ver, ci), (_, size) in oldest])
        gone = 0
        for (key, (nbytes, _)), kept in zip(oldest, held, strict=True):
            if not kept:
                del self._prefetched[key]
                gone += nbytes
        self._wasted_bytes += gone

    async def _demand(self, fv: FileVersion, missing: list[int]) -> tuple[int, bytes] | None:
        """Fetch the chunks of the missing blocks that nobody else is fetching and stage
        them; wait for the rest. Afterwards the blocks are in the cache unless a fetch failed
        (raised) or the cache dropped them meanwhile (the caller looks again). Returns
        ``(first block, data)`` of the fetch when it was one request, else None."""
        chunks = sorted({i // CHUNK_BLOCKS for i in missing})
        claimed, waits = self._claims.claim(fv, chunks)
        extra = self._claim_rest_of_grid(fv, chunks)
        if len(claimed) == len(chunks):  # all ours (the usual case): no test per block
            mine = list(missing)
        else:
            fid, ver = fv.file_id, fv.version
            mine = [i for i in missing if (fid, ver, i // CHUNK_BLOCKS) in claimed]
        claimed |= extra
        mine.extend(b for _, _, ci in extra for b in chunk_blocks(ci, fv.blocks()))
        fetched = None
        try:
            runs = grid_runs(mine, self._hub.align_bytes // BLOCK_SIZE, fv.blocks())
            if len(runs) == 1:
                data = await self._fetch_stage(fv, runs[0], claimed, ORIGIN_DEMAND)
                fetched = runs[0].start, data
            elif runs:
                with single_spoke_error():
                    async with trio.open_nursery() as nursery:
                        for run in runs:
                            nursery.start_soon(self._fetch_stage, fv, run, claimed,
                                               ORIGIN_DEMAND)
        finally:
            self._claims.release(claimed)
        for event in waits:
            await event.wait()
        return fetched

    async def _demand_pack(self, plan: protocol.PackPlan, fv: FileVersion) -> None:
        """Fetch ``fv`` (a member of ``plan``) through its pack, or wait for whoever fetches
        it; the other members nobody is fetching come along and are staged as prefetched.

        Returns once ``fv`` has arrived: the rest of the pack streams on in the task group
        of ``run``. Falls back to fetching ``fv`` alone when the pack is stale on the hub
        (another generation: 412) or answered it gone; raises what the pack fetch raised
        otherwise."""
        if self._nursery is None:
            raise RuntimeError("BlockSource.run is not running")
        if not self._claims.busy(fv, 0):
            free, claims = self._claim_pack(plan)
            self._nursery.start_soon(self._demand_pack_task, plan,
                                     self._demanded_first(plan, free, fv), free, claims, fv)
        if (event := self._claims.event(fv, 0)) is not None:
            await event.wait()
        if self.busy_or_cached(fv):
            return
        error = self._pack_errors.pop(plan.path, None)
        if error is not None and not isinstance(error, StaleExport):
            raise error
        await self._demand(fv, list(range(fv.blocks())))  # the pack is stale, or fv gone

    def _demanded_first(self, plan: protocol.PackPlan, free: dict[MemberKey, FileVersion],
                        fv: FileVersion) -> protocol.PackPlan:
        """What a miss of ``fv`` fetches of its pack ``plan`` (``free``: the members it
        claimed). Straight to the hub, a pick of the free members with ``fv`` first: in the
        pack's own order ``fv`` comes after the members before it, and while fills keep the
        link full a pack streams at a share of the link's rate, so a reader waited ~3 round
        trips at 60 ms (a median of 176-184 ms in a cold shuffled epoch) where ~1 will do. The
        same bytes cross the link (members cached or in flight are not named, where the pack
        sends them again). Behind a tier, or when the free members are more than one pick
        holds (``protocol.plan_picks``), the pack itself: one URL per small file for the
        tier's cache."""
        key = (fv.file_id, fv.version)
        if self._hub.through_tier or key not in free:
            return plan
        members = sorted((m for m in plan.members if (m[0], m[1]) in free),
                         key=lambda m: (m[0], m[1]) != key)  # stable: fv first, then in order
        picks = protocol.plan_picks(members)
        return picks[0] if len(picks) == 1 else plan

    async def _demand_pack_task(self, plan: protocol.PackPlan, fetched: protocol.PackPlan,
                                free: dict[MemberKey, FileVersion],
                                claims: dict[MemberKey, set[ChunkKey]], fv: FileVersion) -> None:
        """Fetch ``fetched`` (``plan`` or ``_demanded_first``'s pick of it); a failure is
        kept under ``plan``'s path for the waiting reader."""
        try:
            await self._fetch_claimed_pack(fetched, free, claims, fv)
        except SpokeError as exc:  # the waiting reader finds it in _pack_errors
            self._pack_errors[plan.path] = exc
            while len(self._pack_errors) > _PACK_ERRORS_KEPT:
                self._pack_errors.popitem(last=False)

    # -- ahead of readers -------------------------------------------------------------

    def in_flight(self, fv: FileVersion) -> bool:
        """Whether any of the file's chunks is being fetched."""
        return self._claims.any_busy(fv)

    def busy_or_cached(self, fv: FileVersion) -> bool:
        """Whether any of the file's chunks is in flight, or all of it is cached or staged."""
        return self._claims.any_busy(fv) or self._cache.has_file(fv)

    def to_fetch(self, files: Iterable[FileVersion]) -> list[FileVersion]:
        """The files neither in flight nor cached whole (``busy_or_cached`` of each, in one
        read transaction)."""
        idle = [f for f in files if not self._claims.any_busy(f)]
        return [f for f, held in zip(idle, self._cache.has_files(idle), strict=True)
                if not held]

    def present_chunks(self, fv: FileVersion, first: int, last: int) -> set[int]:
        """Which of chunks ``first..last`` are cached or staged (inline, headers only)."""
        return self._cache.present_chunks_now(fv, first, last)

    def holds_chunks(self, fv: FileVersion, first: int, last: int) -> bool:
        """Whether chunks ``first..last`` are all cached or staged (inline, headers only;
        stops at the first that is not)."""
        return self._cache.holds_chunks_now(fv, first, last)

    async def complete_files(self, files: list[FileVersion]) -> set[FileVersion]:
        """Which of these file versions are cached whole."""
        return await self._cache.complete_files(files)

    async def prefetch_range(self, fv: FileVersion, start: int, end: int, *,
                             warm: bool = False, replay: bool = False) -> int:
        """Fetch the chunks of ``[start, end)`` that are not cached or in flight; bytes
        fetched.

        ``warm``: for ``spokefs warm``; the chunks are stored as warmed (kept like hot data).
        ``replay``: for a trace replay; stored with their own origin, for hit accounting.
        """
        await self._cache.wait_room()
        first_chunk, last_chunk = start // CHUNK_SIZE, (end - 1) // CHUNK_SIZE
        present = self._cache.present_chunks_now(fv, first_chunk, last_chunk)
        wanted = [c for c in range(first_chunk, last_chunk + 1) if c not in present]
        claimed, _ = self._claims.claim(fv, wanted)
        claimed |= self._claim_rest_of_grid(fv, wanted)
        try:
            origin = ORIGIN_WARM if warm else ORIGIN_REPLAY if replay else ORIGIN_PREFETCH
            # callers pass about one request's worth, so this is usually one range request
            blocks = [b for _, _, ci in claimed for b in chunk_blocks(ci, fv.blocks())]
            runs = grid_runs(blocks, self._hub.align_bytes // BLOCK_SIZE, fv.blocks())
            sizes: list[int] = []

            async def one(run: range) -> None:
                sizes.append(len(await self._fetch_stage(fv, run, claimed, origin)))

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
            self._claims.release(claimed)

    async def fetch_pack(self, plan: protocol.PackPlan, *,
                         replay: bool = False) -> list[FileVersion]:
        """Fetch the members of a pack that are neither cached, staged nor in flight; the
        members fetched (none if every member is taken care of already).

        Each member is staged and released to its waiters as soon as it has arrived,
        before the pack ends; members cached or in flight are skipped on arrival.
        ``replay``: for a trace replay (its own origin and byte count).
        """
        await self._cache.wait_room()
        free, claims = self._claim_pack(plan)
        if not free:
            return []
        return await self._fetch_claimed_pack(plan, free, claims, None, replay=replay)

    # -- the cache as a whole -----------------------------------------------------------

    async def wait_room(self) -> None:
        """Wait while the cache's writer is behind (staged bytes over their bound)."""
        await self._cache.wait_room()

    async def flush(self) -> None:
        """Store everything staged so far (``warm`` and replays: done means stored)."""
        await self._cache.flush()

    async def cached_bytes(self, files: list[FileVersion]) -> int:
        """How many bytes of these file versions are in the cache."""
        return await self._cache.cached_bytes(files)

    def tick(self) -> int:
        """The cache's access clock now."""
        return self._cache.tick()

    def statistics(self) -> CacheStats:
        return self._cache.statistics()

    def received_bytes(self) -> int:
        """Bytes that have arrived from the hub so far (every kind of request)."""
        return self._hub.received_bytes

    def rtt_s(self) -> float | None:
        """The hub's round trip as measured (the shortest recent wait for an answer)."""
        return self._hub.rtt_s

    # -- internals ------------------------------------------------------------------

    def _claim_pack(self, plan: protocol.PackPlan) -> tuple[dict[MemberKey, FileVersion],
                                                        dict[MemberKey, set[ChunkKey]]]:
        """Claim the members that are neither cached, staged nor in flight (no await)."""
        free = {(f.file_id, f.version): f
                for f in self.to_fetch(map(FileVersion._make, plan.members))}
        claims = {key: self._claims.claim(f, range(f.chunks()))[0] for key, f in free.items()}
        return free, claims

    async def _fetch_claimed_pack(
        self, plan: protocol.PackPlan, free: dict[MemberKey, FileVersion],
        claims: dict[MemberKey, set[ChunkKey]], demanded: FileVersion | None,
        *, replay: bool = False,
    ) -> list[FileVersion]:
        """Fetch a pack whose ``free`` members are claimed (``claims``); stage each as it
        arrives, ``demanded`` as a demand fetch. Releases every claim, whatever happens."""
        fetched: list[FileVersion] = []

        def arrived(key: MemberKey, data: bytes | memoryview | None) -> None:
            claimed = claims.pop(key, None)
            if claimed is None:
                return  # cached or fetched by someone else meanwhile
            f = free[key]
            if data is not None and f == demanded:
                self._cache.stage(f.file_id, f.version, [(0, data)], ORIGIN_DEMAND)
            elif data is not None and replay:
                self._cache.stage(f.file_id, f.version, [(0, data)], ORIGIN_REPLAY)
                metrics.REPLAY_FETCHED_BYTES.inc(len(data))
                fetched.append(f)
            elif data is not None:  # None: gone on the hub; a later open sees the new version
                self._cache.stage(f.file_id, f.version, [(0, data)], ORIGIN_PREFETCH)
                self._remember_prefetched(f, list(range(f.chunks())))
                metrics.PREFETCH_ISSUED_BYTES.inc(len(data))
                fetched.append(f)
            self._claims.release(claimed)

        try:
            if free:
                await self._hub.fetch_pack(plan, arrived)
        finally:
            for claimed in claims.values():
                self._claims.release(claimed)
        return fetched

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
            present = self._cache.present_chunks_now(fv, lo, hi)
            extra.extend(c for c in range(lo, hi + 1)
                         if c not in present and not self._claims.busy(fv, c))
        return self._claims.claim(fv, extra)[0]

    async def _fetch_stage(self, fv: FileVersion, run: range, claimed: set[ChunkKey],
                           origin: int) -> bytes:
        """Fetch blocks ``run`` and stage those of them whose chunks are in ``claimed``; the
        bytes fetched."""
        start = run.start * BLOCK_SIZE
        stop = min(run.stop * BLOCK_SIZE, fv.size)
        data = await self._hub.fetch_frames(fv.file_id, fv.version, fv.size, start, stop)
        # (first block, view of the answer) of each stretch of claimed chunks: views, not
        # copies (the staged pieces keep the answer's bytes alive until they are stored)
        view = memoryview(data)
        pieces: list[tuple[int, bytes | memoryview]] = []
        fid, ver = fv.file_id, fv.version
        lo: int | None = None  # the first block of the claimed stretch being gathered
        for ci in range(run.start // CHUNK_BLOCKS, (run.stop - 1) // CHUNK_BLOCKS + 1):
            if (fid, ver, ci) in claimed:
                if lo is None:
                    lo = max(run.start, ci * CHUNK_BLOCKS)
                continue
            if lo is not None:
                pieces.append(_stretch(view, run.start, lo, ci * CHUNK_BLOCKS))
                lo = None
        if lo is not None:
            pieces.append(_stretch(view, run.start, lo, run.stop))
        if pieces:
            self._cache.stage(fid, ver, pieces, origin)
        return data

    def _remember_prefetched(self, fv: FileVersion, chunks: list[int]) -> None:
        size = fv.size
        for ci in chunks:
            nbytes = min(CHUNK_SIZE, size - ci * CHUNK_SIZE)
            self._prefetched[(fv.file_id, fv.version, ci)] = (nbytes, size)
            self._window_bytes += nbytes
        if self._window_bytes > _WASTE_WINDOW_BYTES:  # the window slides: halve both
            self._window_bytes //= 2
            self._wasted_bytes //= 2
        while len(self._prefetched) > _TRACKED_PREFETCH_CHUNKS:
            self._prefetched.popitem(last=False)


def _stretch(view: memoryview, base: int, first: int, stop: int) -> tuple[int, memoryview]:
    """Blocks ``first..stop-1`` of an answer whose first block is ``base``: ``(first,
    view)`` (short at the end of the file)."""
    return first, view[(first - base) * BLOCK_SIZE : (stop - base) * BLOCK_SIZE]
