"""The block cache: 4 KiB blocks of ``(file_id, version)`` in an LMDB environment on local disk.

Storage unit: a *chunk* of ``CHUNK_BLOCKS`` consecutive blocks of one file version (see
``config.CHUNK_BLOCKS``), with a per-block presence map and xxh3 checksum; ``cache.layout``
has the databases and why the checksums and the data's last bytes live in a separate header
(so 16 blocks take exactly 16 pages and a lone block one page). Keys carry the version, so a
changed file gets new keys and old bytes are never mixed with new ones.

Eviction: scan-resistant, for epochs over datasets larger than the cache
-------------------------------------------------------------------------
Training reads a dataset again and again, its files shuffled each epoch. If the dataset is
larger than the cache, LRU and FIFO keep the end of the last epoch, which the next epoch reads
in random order, mostly after it was evicted: the hit ratio falls to a fraction of C/D (0.03
instead of 0.25 at 4x, ``benchmarks/bench_eviction.py``). What works is a *stable* subset: a
cached chunk that this epoch has not read yet will be read soon, while the chunk just read will
be read again only next epoch. So the victim is the chunk read most recently among those that
showed no re-use. The unit of time is a *visit* (a read touching a chunk; the access clock
in ``cache.policy`` counts them and remembers the last visit of cached and of evicted keys,
in memory). Two segments, each with its order in the ``order`` db:

- **probation** (every fill lands here, ordered by arrival); victims in this order:
  0. while a job's order runs (``jobs.orders``): the newest chunks, inside the window too,
     visited since the order came and whose file that job has read in it: the order says
     this epoch does not read them again, while every cached chunk it has not reached yet
     is read (the optimal choice within an epoch; the window guards what the order knows).
     Then the same in the protected segment, whose hand and cap (below) wait meanwhile:
     they guess at re-use, which the order tells;
  1. *dead* chunks: arrived more than ``probation_limit`` visits ago and never re-used,
     oldest first (3 observed re-use intervals, at least 8 cache-fulls of visits: the first
     epoch of a long loop survives until the second);
  2. the **most recently arrived chunk that has been read**, outside a *window* of the last
     ``window_bytes`` of fills (5% of the cache, but at least min(1 GiB, 25%)): the window gives
     prefetched chunks and a file read twice in a row time to be used; a chunk nobody has
     read yet (prefetched ahead of its reader) is skipped;
  3. the oldest, whatever it is.
- **protected**: chunks re-used during their stay, or back within ``ghost_limit`` visits of
  their last visit before an eviction (a workload LRU would serve: a dataset that fits, read
  in a loop), or stored by ``warm``; into a full segment only chunks LRU would keep (re-used
  within a cache-full of visits: swapping one long-loop chunk for another gains nothing and
  costs the evicted one's next hit). A CLOCK hand walks it at one revolution per
  ``protected_limit`` visits and evicts what was not visited for that long (so a hot set read
  every epoch stays, a finished job's data leaves). The segment's cap adapts as in ARC:
  ``protected_share`` of ``max_bytes - 2 * window_bytes`` grows by a chunk for each hit that
  LRU would have missed (a protected chunk visited after more than a cache-full of visits) and
  shrinks by one for each miss that LRU would have hit (a key back within a cache-full), down
  to 10%; above the cap the hand evicts chunks unvisited for a cache-full first, then any.

A third segment, **pinned** (``spokefs pin``, see ``pins``), is never walked by any eviction
rule: every walk seeks within its own segment's range of the ``order`` db. Its bytes count
toward ``max_bytes`` and apart (``pinned_bytes``); they are bounded by the mount
(``--max-pinned-share``, at most 0.9 of the cache), so the other segments keep room. A pin
moves a whole file version's chunks in one transaction (all or none); an unpin moves them to
protected.

Hits never write: visits live in memory (32 bytes of RAM per 64 KiB of cache, at most
256 MiB), and so do promotions until something needs them written. A first warm pass over a
dataset promotes every chunk it reads, and each promotion rewrites the header from its bytes
(``layout.promoted_head``, ~12 us a chunk measured alone): two per small file, on a warm
path that otherwise costs ~0.15 ms a file. Segments matter only to eviction, and the
policy evicts only in a fill's write transaction, which applies all pending promotions
first (they come in its ``Plan``). So promotions wait in memory, each with the tick of the
re-use that earned it (its stored tick once written, as if written then), and are written
with the next fill, alone once ``_PROMOTE_DEFER`` are pending (a bound on the memory and on
the transaction that carries them), and at ``close``. A cache that is not filling, which a
warm epoch over data that fits is, never writes them until then. (A full map or disk's
emergency eviction, ``make_room``, runs without them, as it did without the up to 255 that
could wait before; it writes as little as it can.) A ``kill -9`` loses them, as it loses
the access clock's last minutes: a chunk re-used again is promoted again.

Measured on the real class (32 MiB cache, 5% window): epochs over 2x and 4x the cache keep
0.43-0.47 and 0.19-0.22 hits (ideal 0.50, 0.25; LRU 0.12-0.20 and 0.02-0.04); a hot file read
every 32 chunks stays at 1.00; after a switch to a dataset that fits, hits are back to 1.00
in the third epoch over it (LRU: the second).

Invariants:
- Every block returned by ``read`` or ``read_on_disk`` matched its checksum (the chunk's, when
  most of a chunk is read, else its own); a block that does not is
  dropped (and counted) and reported missing, so the reader fetches it again; until the drop
  commits, its chunk does not count as present (``present_chunks_now``, ``has_file``), so a
  fill (a pack's above all) fetches it instead of trusting its header.
- ``bytes_used`` (block bytes stored, in the meta record, changed in the same transaction as
  every chunk) is at most ``max_bytes`` after every commit: a fill that crosses it evicts in
  the same transaction down to ``max_bytes`` minus one batch (1/64 of the cache, at most
  64 MiB). A full map or disk (MapFullError, ENOSPC) evicts an eighth of the cache and retries
  once; a fill that still cannot be stored is dropped (counted), never a failed read.
- ``blocks/`` (data.mdb, lock.mdb, the access clock's file) is at most ``bound_bytes``:
  ``layout.BOUND_RATIO`` (1.10) times ``max_bytes``, at least ``max_bytes`` + 1 MiB. The
  LMDB map is that bound less the other files, and LMDB never grows data.mdb past its map.
  The bytes rule alone does not keep the file there: LMDB reuses a freed page only from the
  transaction after next, so the file also holds the last two write batches' freed pages
  (hence batches of 1/64 of the cache: at 64 MiB, 1.35x a 128 MiB cache was measured through
  a mount), and small values leave free runs too short for a chunk. So a fill also evicts
  when the pages in use leave less than a headroom of the map free (``ChunkStore.put_pieces``;
  the headroom grows when the file still grows into the map's last batch): the map is rarely
  full. Measured at 128 MiB: 1.04x for large files read once, 1.10x for ~110 KiB files in a
  random order (which hold ~0.96 of ``max_bytes`` then), 1.05x for churn; 1.05x through a
  mount. A data.mdb made larger by an older spokefs or a larger ``max_bytes`` keeps its
  size (LMDB files never shrink; a warning at open) but does not grow.
- ``statistics()`` shows committed state only: the sync functions return the new totals and
  the trio thread applies them after the commit.
- Each chunk is in exactly one segment and has exactly one ``order`` record.
- ``pinned_bytes`` is the bytes of the chunks in the pinned segment (in the same meta record).

Concurrency: LMDB transactions begin and end inside one synchronous function. **Why reads
run inline:** a read (``read``, ``present_chunks_now``, ``has_file``) is one short read
transaction on the trio thread, because a ``trio.to_thread`` hop costs ~300 us on this 2-core
machine, more than the read itself (measured with the page cache dropped, cached 111 KiB files
read through LMDB with their checksums: 1,355 files/s through a thread, 3,551 inline); the
environment is opened with read-ahead, so a chunk's pages come in one disk read. Writes
(fills, promotions, drops) run in a worker thread through a limiter of 1, by the writer task
(see "Write-behind"); header-only scans of many files (``cached_bytes``, ``complete_files``)
through a limiter of 8, and reads of bytes that are not in RAM (``read_on_disk``) too.
Nothing is awaited while a transaction is open.

**Write-behind.** Fetched blocks are *staged* (``stage``): kept in memory, visible to every
read at once, and stored by the writer task (``run``) in one transaction per batch (all
that was staged since the last one, up to a batch: 1/64 of the cache, at most 64 MiB, so
that the pages it evicts are soon reused; see "Invariants"). So a demand read returns as soon as its
bytes are in, never behind a store, and a pack of thirty files costs one transaction, not
thirty. Staged bytes are bounded: background fills wait (``wait_room``) while more than
``_STAGED_MAX_BYTES`` (or a quarter of the cache) wait for the writer; demand reads never
wait. A piece leaves the staging table right after its transaction commits (or fails), so
every block is always in one of the two places a read looks, in one synchronous stretch.
``flush`` waits for what was staged before it (``warm``, unmount). A kill loses what was
staged and not yet stored: bytes only, fetched again on the next miss.

``AccessClock`` belongs to the trio thread; writer threads only read its
table (one array item at a time, atomic under the GIL; a stale value only makes one choice
worse), and its side file is written by a worker thread from the writer task every
``_CLOCK_SAVE_S`` while visits come (not while idle), and at ``close``. Blocking work
outside threads: only at open, after an unclean shutdown, the check below runs a child
process synchronously (before the mount serves anything).

Before adding an ``await``: keep transactions inside ``ChunkStore`` methods; go through
``_call`` (it counts the threads in use, which a reset waits for, and looks the store up at
call time); re-check any state read before the await (a reset may have replaced ``_store``;
other tasks may have moved the clock).

Crash states: ``kill -9`` leaves the last committed transaction (each fill, with its
evictions, is one); the access clock's side file may be up to ``_CLOCK_SAVE_S`` old, which
costs hit ratio only. The environment is opened with ``sync=False``: a machine crash may lose
recent fills, and may also tear LMDB's own pages. So a ``clean-shutdown`` marker is removed
at open and written at close; without it, a child process walks every database first, since a
torn B-tree page can crash LMDB itself (measured: SIGSEGV or abort on some corrupted leaf
pages), and the environment is set aside if the child fails. Corruption found while running
(``CorruptedError``, ``PageNotFoundError``, ...) is logged once as an ERROR: new calls see
an empty cache, and once the threads in use are done the environment is renamed to
``blocks.corrupt-<time>-<pid>`` and a new, empty one is opened. Corruption that crashes LMDB
while running takes the mount down once; as that leaves no clean-shutdown mark, the next
open checks and sets the environment aside. Bytes in a data value are covered by the
checksums (overwriting the middle of ``data.mdb`` mostly lands there).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import trio

from spokefs import metrics
from spokefs.cache import layout
from spokefs.cache.chunk_reader import (
    ORIGIN_DEMAND,
    ORIGIN_PREFETCH,
    ORIGIN_REPLAY,
    ORIGIN_WARM,
    ORIGINS,
    NotResident,
    ReadResult,
    Staged,
    Visit,
    nblocks,
)
from spokefs.cache.layout import KEY, CacheState
from spokefs.cache.policy import AccessClock, Plan
from spokefs.cache.store import ChunkStore, chunk_pieces
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS, CHUNK_SIZE
from spokefs.lmdb_env import LOCK_BYTES
from spokefs.log_limit import LogLimiter
from spokefs.types import FileVersion

__all__ = [
    "ORIGINS", "ORIGIN_DEMAND", "ORIGIN_PREFETCH", "ORIGIN_REPLAY", "ORIGIN_WARM", "BlockCache",
    "CacheStats",
    "ReadResult", "Visit",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

_READ_THREADS = 8
_MAP_FULL_FREE = 8  # a full map or disk frees 1/8 of the cache before the one retry
_HAND_LIMIT = 4096  # protected entries the hand may look at per transaction
# pending promotions that justify a write transaction of their own (~0.2 s of the writer
# thread, ~2 MiB of RAM); fewer wait for the next transaction that evicts, or the close
_PROMOTE_DEFER = 16384
_STAGED_MAX_BYTES = 256 << 20  # background fills wait while the writer is this far behind
_CLOCK_FILE = "access-clock"
_CLOCK_SAVE_S = 300.0  # what a kill -9 can cost the policy's memory (a few KiB-MiB to write)
_CLEAN_MARK = "clean-shutdown"
_VERIFY_TIMEOUT_S = 600.0  # ~2 us per chunk: 14 s for 500 GiB; a stuck check is not fatal
_CORRUPT: tuple[type[Exception], ...] = (
    lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
    lmdb.PanicError, lmdb.BadTxnError, lmdb.BadRslotError, lmdb.BadDbiError,
    lmdb.IncompatibleError,
)
_FULL: tuple[type[Exception], ...] = (lmdb.MapFullError, lmdb.DiskError)
# The child that checks an environment after an unclean shutdown: every record of every db
# (data values are not read: their overflow pages are guarded by the checksums).
_VERIFY = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=8)
with env.begin() as txn:
    names = [bytes(k) for k, _ in txn.cursor()]
for name in names:
    db = env.open_db(name, create=False)
    with env.begin() as txn:
        for _ in txn.cursor(db=db).iternext(keys=True, values=name != b"data"):
            pass
"""


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Committed totals: block bytes and chunks, and the protected and pinned segments'
    shares."""

    bytes_used: int
    max_bytes: int
    chunks: int
    protected_bytes: int = 0
    protected_chunks: int = 0
    pinned_bytes: int = 0


def _chunk_keys(file_id: int, version: int, blocks: list[int]) -> set[bytes]:
    """The keys of the chunks that hold ``blocks`` of a file version."""
    return {KEY.pack(file_id, version, ci) for ci in {i // CHUNK_BLOCKS for i in blocks}}


def _all_missing(offset: int, end: int) -> ReadResult:
    return ReadResult(missing=list(range(offset // BLOCK_SIZE, (end - 1) // BLOCK_SIZE + 1)))


class _Unavailable(Exception):
    """The environment is being set aside after corruption: behave as an empty cache."""


class BlockCache:
    """Get and put verified blocks; bounded by ``max_bytes``; scan-resistant eviction.

    Attributes:
        path: the environment's directory (``<cache-dir>/blocks``).
        max_bytes: the quota on block bytes (``--cache-size``).
        window_bytes: the most recent fills that probation eviction leaves alone.
    """

    def __init__(
        self, path: Path, max_bytes: int, *, window_bytes: int | None = None,
        map_bytes: int | None = None,
    ) -> None:
        """Open (or create) the cache in ``path``.

        Args:
            window_bytes: see the module docstring; default 5% of ``max_bytes``, at least
                min(1 GiB, 25%).
            map_bytes: the LMDB map size, the bound on ``data.mdb``; default
                ``BOUND_RATIO * max_bytes`` less lock.mdb and the access clock's side file
                (twice: its next version is written beside it).
        """
        self.path = path
        self.max_bytes = max_bytes
        if window_bytes is None:
            window_bytes = max(max_bytes // 20, min(max_bytes // 4, 1 << 30))
        self.window_bytes = window_bytes
        self._protected_max = max(max_bytes // 2, max_bytes - 2 * window_bytes)
        self._clock = AccessClock(max_bytes)
        # set by the mount (``jobs.orders.Orders.passed``): what the jobs' running orders have
        # passed, and since which tick, evicted first ("Eviction")
        self.order_passed: Callable[[], Callable[[int], int | None] | None] = lambda: None
        self._map_bytes = map_bytes or (self.bound_bytes(max_bytes) - LOCK_BYTES
                                        - 2 * self._clock.file_bytes())
        self._read_limiter = trio.CapacityLimiter(_READ_THREADS)
        self._write_limiter = trio.CapacityLimiter(1)
        self._active = 0  # threads inside the environment now
        self._broken: BaseException | None = None  # set: being set aside
        self._troubled = False  # a write failed and none has succeeded since
        self._generation = 0  # environments set aside so far (totals of older ones are void)
        # write-behind (see "Write-behind"): chunk key -> staged pieces, and the writer's queue
        self._staged: dict[bytes, list[Staged]] = {}
        self._queue: deque[tuple[bytes, Staged]] = deque()
        self._staged_bytes = 0
        self._staged_max = min(_STAGED_MAX_BYTES, max(max_bytes // 4, 4 * CHUNK_SIZE))
        self._queued_total = 0  # pieces the writer has taken
        self._done_total = 0  # pieces stored or dropped
        self._drops: list[tuple[int, int, list[int]]] = []  # blocks that failed a checksum
        # chunks holding such blocks until their drop commits: not "present" meanwhile, so
        # a fill fetches them again instead of trusting their headers (see ``_condemn``)
        self._condemned: dict[bytes, int] = {}
        self._log = LogLimiter(log)
        self._work = trio.Event()
        self._committed = trio.Event()
        self._store = self._open()
        self._stats = self._store.state
        self._clock.load(path / _CLOCK_FILE, self._stats.tick)
        self._hand_tick = self._clock.tick
        metrics.CACHE_CAPACITY.set(max_bytes)
        self._publish()

    bound_bytes = staticmethod(layout.bound_bytes)

    # -- lifecycle ------------------------------------------------------------------

    def _open(self) -> ChunkStore:
        """Open the environment, checked first after an unclean shutdown; set it aside and
        start empty if it is corrupt."""
        self.path.mkdir(parents=True, exist_ok=True)
        clean = self.path / _CLEAN_MARK
        try:
            if (self.path / "data.mdb").exists() and not clean.exists() and not self._check():
                raise lmdb.CorruptedError("the check after an unclean shutdown failed")
            store = ChunkStore(self.path, self.max_bytes, self.window_bytes, self._map_bytes)
        except _CORRUPT as exc:
            self._set_aside(exc)
            store = ChunkStore(self.path, self.max_bytes, self.window_bytes, self._map_bytes)
        clean.unlink(missing_ok=True)
        size = (self.path / "data.mdb").stat().st_size
        if size > self._map_bytes:
            log.warning(
                "block cache: %s/data.mdb is %d MiB, more than the %d MiB that --cache-size "
                "%d MiB allows (made by an older spokefs or a larger --cache-size); LMDB files "
                "never shrink, so it keeps its size, without growing: to get the space back, "
                "unmount and remove %s", self.path, size >> 20, self._map_bytes >> 20,
                self.max_bytes >> 20, self.path)
        return store

    def _check(self) -> bool:
        """Walk every database in a child process (a torn page can crash LMDB)."""
        log.info("block cache: checking %s after an unclean shutdown", self.path)
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _VERIFY, str(self.path)],
                capture_output=True, timeout=_VERIFY_TIMEOUT_S, check=False,
            )
        except subprocess.TimeoutExpired:
            log.warning("block cache: the check of %s took too long; using it", self.path)
            return True
        return proc.returncode == 0

    def _set_aside(self, exc: BaseException) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        dest = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{os.getpid()}")
        log.error("block cache %s is corrupt (%s): moved to %s, starting empty",
                  self.path, exc, dest.name)
        metrics.CACHE_CORRUPTIONS.inc()
        try:
            os.rename(self.path, dest)
        except OSError:
            shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        """Write the pending promotions, close the environment and mark it cleanly shut down
        (no check at the next open)."""
        pending = len(self._clock.promote)
        if pending and self._broken is None:
            try:
                self._store.promote(self._plan((), hand=False))
            except lmdb.Error as exc:  # a full disk: the re-uses are lost, nothing else
                log.warning("block cache: could not write %d promotions at close: %s",
                            pending, exc)
        self._store.close()
        if self._broken is None and self._save_clock():
            try:
                (self.path / _CLEAN_MARK).touch()
            except OSError as exc:
                log.warning("block cache: could not mark a clean shutdown: %s", exc)

    def _save_clock(self) -> bool:
        """Write the access clock's side file; whether it was written."""
        try:
            self._clock.save(self.path / _CLOCK_FILE)
        except OSError as exc:
            log.warning("block cache: could not save the access clock: %s", exc)
            return False
        return True

    def tick(self) -> int:
        """The access clock now (chunk visits so far; ``cache.policy``)."""
        return self._clock.tick

    def statistics(self) -> CacheStats:
        s = self._stats
        return CacheStats(s.nbytes, self.max_bytes, s.chunks, s.protected_bytes,
                          s.protected_chunks, s.pinned_bytes)

    def _publish(self) -> None:
        self._clock.cap_chunks = max(self.max_bytes // CHUNK_SIZE, self._stats.chunks)
        cap = self._protected_max * self._clock.protected_share
        self._clock.protected_full = self._stats.protected_bytes + CHUNK_SIZE > cap
        metrics.CACHE_BYTES.set(self._stats.nbytes)
        metrics.CACHE_PROTECTED_BYTES.set(self._stats.protected_bytes)
        metrics.CACHE_PINNED_BYTES.set(self._stats.pinned_bytes)

    # -- the thread hop, with corruption handling -----------------------------------

    async def _call(self, limiter: trio.CapacityLimiter, method: str, *args: Any) -> Any:
        """Run ``ChunkStore.<method>`` (one transaction) in a worker thread; corruption makes
        it ``_Unavailable`` (the store is looked up now: a reset may have replaced it)."""
        if self._broken is not None:
            raise _Unavailable
        self._active += 1
        try:
            return await trio.to_thread.run_sync(
                getattr(self._store, method), *args, limiter=limiter
            )
        except _CORRUPT as exc:
            if self._broken is None:
                self._broken = exc
            raise _Unavailable from None
        finally:
            self._active -= 1
            if self._broken is not None and self._active == 0:
                with trio.CancelScope(shield=True):  # short, and must not stop half way
                    await self._reset()

    async def _reset(self) -> None:
        """Set the broken environment aside and open an empty one (no thread is inside).

        If that fails too, the cache stays unavailable (every read a miss) until restart.
        """
        self._active += 1  # so that no other task starts a reset meanwhile
        try:
            self._store = await trio.to_thread.run_sync(self._reset_sync)
        except Exception:
            log.exception("block cache: could not start an empty cache; running without one")
            return
        finally:
            self._active -= 1
        self._generation += 1
        self._stats = self._store.state
        self._broken = None
        self._publish()

    def _reset_sync(self) -> ChunkStore:
        self._store.close()
        assert self._broken is not None
        self._set_aside(self._broken)
        return ChunkStore(self.path, self.max_bytes, self.window_bytes, self._map_bytes)

    # -- reads ------------------------------------------------------------------------

    def check_readers(self) -> int:
        """Free the reader slots of processes that died (``ChunkStore.check_readers``)."""
        freed: int = self._inline(0, "check_readers")
        return freed

    def visited(self, visits: list[Visit], first: int, last: int) -> None:
        """Count a read of blocks ``first..last`` as a visit of each chunk it touched (a
        serving worker's reads come here; ``read`` counts its own)."""
        for key, protected, stored_tick in visits:
            ci = KEY.unpack(key)[2]
            lo = max(first - ci * CHUNK_BLOCKS, 0)
            hi = min(last - ci * CHUNK_BLOCKS, CHUNK_BLOCKS - 1)
            if protected is None:
                self._clock.visit_missing(key, lo, hi)
            else:
                self._clock.visit_cached(key, lo, hi, protected, stored_tick)
        if len(self._clock.promote) >= _PROMOTE_DEFER:
            self._wake_writer()  # the writer stores them: no write transaction in a read

    def read(self, file_id: int, version: int, offset: int, end: int, *,
             record: bool = True) -> ReadResult:
        """The bytes ``[offset, end)`` of a file version from staged or stored blocks, or the
        blocks that are missing; on the trio thread (see "Why reads run inline").

        Returns ``ReadResult.on_disk`` set (and nothing else) when the stored bytes are not
        in RAM: the caller then reads with ``read_on_disk``.

        Args:
            record: count the read as a visit of its chunks (for eviction); a second look
                at the same range by the same read, after a fill, passes False.
        """
        try:
            res = self._inline(None, "read", file_id, version, offset, end, self._staged.get,
                               inline=True)
        except NotResident:
            return ReadResult(on_disk=True)
        return self._after_read(res, file_id, version, offset, end, record)

    async def read_on_disk(self, file_id: int, version: int, offset: int, end: int, *,
                           record: bool = True) -> ReadResult:
        """``read`` in a worker thread, for bytes that must come from the disk: the event
        loop goes on serving others meanwhile, and concurrent reads' disk waits overlap."""
        res: ReadResult | None = await self._read(None, "read", file_id, version, offset, end,
                                                  self._staged.get)
        return self._after_read(res, file_id, version, offset, end, record)

    def _after_read(self, res: ReadResult | None, file_id: int, version: int, offset: int,
                    end: int, record: bool) -> ReadResult:
        if res is None:
            return _all_missing(offset, end)
        if record:
            self.visited(res.visits(), offset // BLOCK_SIZE, (end - 1) // BLOCK_SIZE)
        if res.corrupt:
            self._condemn(file_id, version, res.corrupt)
            self._drops.append((file_id, version, res.corrupt))
            self._wake_writer()
        return res

    def _condemn(self, file_id: int, version: int, corrupt: list[int]) -> None:
        """Blocks that failed their checksum: counted, logged at a bounded rate, and their
        chunks no longer count as present until the drop commits (``present_chunks_now``).

        Without that, a fill asked for a file whose headers still say "all here" would find
        nothing to fetch, and the read would look, fail the checksum and ask again forever.
        """
        metrics.CHECKSUM_FAILURES.inc(len(corrupt))
        self._log.warning("checksum", "dropping %d cached blocks of file %x that failed "
                          "their checksum; fetching them again", len(corrupt), file_id)
        for key in _chunk_keys(file_id, version, corrupt):
            self._condemned[key] = self._condemned.get(key, 0) + 1

    async def _write_drop(self, file_id: int, version: int, corrupt: list[int]) -> None:
        """Drop blocks that failed their checksum; their chunks count as present again only
        when the drop has committed (or failed: a later read finds them bad again)."""
        try:
            await self._write("drop", file_id, version, corrupt)
        finally:
            for key in _chunk_keys(file_id, version, corrupt):
                left = self._condemned.get(key, 0) - 1
                if left > 0:
                    self._condemned[key] = left
                else:
                    self._condemned.pop(key, None)

    def present_chunks_now(self, fv: FileVersion, first: int, last: int) -> set[int]:
        """Chunk indexes among ``first..last`` held whole, stored or staged (inline)."""
        present: set[int] = self._inline(set(), "present", fv, first, last)
        if self._condemned:
            present = {ci for ci in present
                       if KEY.pack(fv.file_id, fv.version, ci) not in self._condemned}
        for ci in range(first, last + 1):
            if ci not in present and self._staged_whole(fv, ci):
                present.add(ci)
        return present

    def holds_chunks_now(self, fv: FileVersion, first: int, last: int) -> bool:
        """Whether chunks ``first..last`` are all held whole, stored or staged (inline,
        headers only): ``present_chunks_now`` that stops at the first chunk missing."""
        return self.holding_now([(fv, first, last)])[0]

    def holding_now(self, ranges: list[tuple[FileVersion, int, int]]) -> list[bool]:
        """``holds_chunks_now`` of each ``(file version, first, last)``, in one read
        transaction."""
        if self._condemned:  # rare: blocks failed a checksum, their drop not committed yet
            return [len(self.present_chunks_now(fv, first, last)) == last - first + 1
                    for fv, first, last in ranges]
        return self._inline([False] * len(ranges), "holds", ranges, self._staged_whole)

    def has_file(self, fv: FileVersion) -> bool:
        """Whether the whole file is cached or staged (inline, headers only)."""
        return self.holds_chunks_now(fv, 0, fv.chunks() - 1)

    def has_files(self, files: list[FileVersion]) -> list[bool]:
        """``has_file`` of each file, in one read transaction."""
        return self.holding_now([(fv, 0, fv.chunks() - 1) for fv in files])

    def _staged_whole(self, fv: FileVersion, ci: int) -> bool:
        pieces = self._staged.get(KEY.pack(fv.file_id, fv.version, ci))
        if not pieces:
            return False
        want = min(CHUNK_BLOCKS, fv.blocks() - ci * CHUNK_BLOCKS)
        bitmap = 0
        for p in pieces:
            bitmap |= ((1 << nblocks(p.data)) - 1) << p.slot
        return bitmap & ((1 << want) - 1) == (1 << want) - 1

    def _inline(self, empty: T, method: str, *args: Any, **kwargs: Any) -> T:
        """A short read transaction on the trio thread; trouble reads as ``empty``."""
        if self._broken is not None:
            return empty
        try:
            result: T = getattr(self._store, method)(*args, **kwargs)
            return result
        except _CORRUPT as exc:
            self._broken = exc
            self._wake_writer()  # the writer sets the environment aside
        except lmdb.Error as exc:  # e.g. ReadersFullError: the hub serves the read instead
            log.warning("could not read the block cache: %s", exc)
        return empty

    # -- write-behind: staged blocks and the writer -----------------------------------

    def stage(self, file_id: int, version: int, runs: list[tuple[int, bytes | memoryview]],
              origin: int = ORIGIN_DEMAND) -> None:
        """Hand verified runs of blocks to the writer; readers see them at once.

        Never waits: a demand read hands over what it fetched and returns its bytes, and the
        writer stores everything staged since its last transaction in one transaction.
        """
        for key, slot, piece in chunk_pieces(file_id, version, runs):
            item = Staged(slot, piece, origin)
            self._staged.setdefault(key, []).append(item)
            self._queue.append((key, item))
            self._staged_bytes += len(piece)
        self._wake_writer()

    async def wait_room(self) -> None:
        """Wait while the writer is far behind (background fills call this; reads never)."""
        while self._staged_bytes > self._staged_max:
            await self._committed.wait()

    async def flush(self) -> None:
        """Wait until everything staged before this call is stored (or dropped)."""
        target = self._queued_total + len(self._queue)
        while self._done_total < target:
            await self._committed.wait()

    def _wake_writer(self) -> None:
        self._work.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer: one write transaction for all that was staged since the last one,
        then the checksum drops and promotions; sets a broken environment aside."""
        task_status.started()
        saved_tick, save_at = self._clock.tick, trio.current_time() + _CLOCK_SAVE_S
        while True:
            with trio.move_on_at(save_at):
                await self._work.wait()
            if trio.current_time() >= save_at:
                save_at = trio.current_time() + _CLOCK_SAVE_S
                if self._clock.tick != saved_tick:  # visits came: a kill -9 would lose them
                    saved_tick = self._clock.tick
                    await trio.to_thread.run_sync(self._save_clock)
            if not self._work.is_set():
                continue
            self._work = trio.Event()
            if self._broken is not None and self._active == 0:
                with trio.CancelScope(shield=True):
                    await self._reset()
            while self._drops:
                await self._write_drop(*self._drops.pop())
            if self._queue:
                await self._write_staged()
            elif len(self._clock.promote) >= _PROMOTE_DEFER:
                await self._write("promote", self._plan((), hand=False))

    async def _write_staged(self) -> None:
        batch: list[tuple[bytes, Staged]] = []
        nbytes = 0
        limit = self._store.batch_bytes  # small, so that LMDB can reuse the pages evicted
        while self._queue and nbytes < limit:
            key, item = self._queue.popleft()
            batch.append((key, item))
            nbytes += len(item.data)
        self._queued_total += len(batch)
        pieces = [(key, item.slot, item.data, item.origin) for key, item in batch]
        try:
            await self._write("put_pieces", pieces, self._plan(list(dict.fromkeys(
                key for key, _ in batch))))
        finally:  # stored, or dropped (counted by _write): readers look in the cache now
            for key, item in batch:
                items = self._staged.get(key)
                if items is not None:
                    items.remove(item)
                    if not items:
                        del self._staged[key]
            self._staged_bytes -= nbytes
            self._done_total += len(batch)
            self._committed.set()
            self._committed = trio.Event()
            if self._queue:
                self._work.set()

    async def complete_files(self, files: list[FileVersion]) -> set[FileVersion]:
        """Those of ``files`` that are cached whole (headers only)."""
        return await self._read(set(), "complete", files)

    async def cached_bytes(self, files: list[FileVersion]) -> int:
        """Bytes of these file versions held in the cache (headers only, one thread hop)."""
        return await self._read(0, "cached_bytes", files)

    async def _read(self, empty: T, method: str, *args: Any) -> T:
        """A read transaction; any cache trouble reads as ``empty`` (a miss, never an error)."""
        try:
            result: T = await self._call(self._read_limiter, method, *args)
            return result
        except _Unavailable:
            return empty
        except lmdb.Error as exc:  # e.g. ReadersFullError: the hub serves the read instead
            log.warning("could not read the block cache: %s", exc)
            return empty

    # -- writes -----------------------------------------------------------------------

    def _plan(self, keys: list[bytes] | tuple[()], *, promote: bool = True,
              hand: bool = True) -> Plan:
        """The policy state for one write transaction: with ``promote`` it takes the pending
        promotions; with ``hand`` the protected hand may move (one revolution per
        ``protected_limit`` visits, spread over the transactions that evict)."""
        clock = self._clock
        limit = clock.protected_limit()
        budget = 0
        if hand:
            budget = self._stats.protected_chunks * (clock.tick - self._hand_tick) // limit
            if budget:
                self._hand_tick = clock.tick
        misses = {k: m for k in keys if (m := clock.take_miss(k)) is not None}
        protected_cap = int(self._protected_max * clock.protected_share)
        return Plan(clock.tick, clock.probation_limit(), limit, clock.cap_chunks, protected_cap,
                    min(_HAND_LIMIT, budget), clock.start_batch() if promote else [], misses,
                    clock.is_visited, clock.last, self.order_passed())

    async def _write(self, method: str, *args: Any) -> None:
        """Run a write transaction; if the map or disk is full, make room and retry once."""
        generation = self._generation
        try:
            try:
                stats = await self._call(self._write_limiter, method, *args)
            except _FULL as exc:
                self._trouble("block cache full on disk (%s): evicting 1/%d of it", exc,
                              _MAP_FULL_FREE)
                plan = self._plan((), promote=False, hand=False)
                await self._call(self._write_limiter, "make_room", plan, _MAP_FULL_FREE,
                                 isinstance(exc, lmdb.MapFullError))
                stats = await self._call(self._write_limiter, method, *args)
        except _Unavailable:
            return
        except lmdb.Error as exc:  # e.g. the disk is still full: the read is served anyway
            metrics.CACHE_WRITE_ERRORS.inc()
            self._trouble("could not update the block cache: %s", exc)
            return
        if self._troubled:
            self._troubled = False
            log.info("block cache writes work again")
        if generation != self._generation:  # committed to the environment set aside since
            return
        self._stats = stats
        metrics.CACHE_EVICTIONS.inc(stats.evicted)
        self._publish()

    # -- pins -------------------------------------------------------------------------

    async def pin(self, fv: FileVersion, limit_bytes: int) -> tuple[int, int]:
        """Pin a whole file version (see ``ChunkStore.pin``): ``(bytes newly pinned or -1
        if over ``limit_bytes``, bytes missing)``. Staged bytes are stored first."""
        await self.flush()
        got = await self._pin_call("pin", fv, limit_bytes, self._clock.tick)
        if got is None:
            return 0, fv.size  # the cache is unavailable: as if nothing were cached
        stats, added, missing = got
        self._apply(stats)
        return added, missing

    async def unpin(self, file_id: int) -> int:
        """Unpin every version of a file; the bytes unpinned."""
        got = await self._pin_call("unpin", file_id, self._clock.tick)
        if got is None:
            return 0
        stats, freed = got
        self._apply(stats)
        return int(freed)

    async def _pin_call(self, method: str, *args: Any) -> Any:
        try:
            return await self._call(self._write_limiter, method, *args)
        except _Unavailable:
            return None
        except lmdb.Error as exc:
            self._trouble("could not update the block cache: %s", exc)
            return None

    def _apply(self, stats: CacheState) -> None:
        self._stats = stats
        self._publish()

    def _trouble(self, msg: str, *args: Any) -> None:
        """Log the start of a write problem once (a WARNING), its repeats at DEBUG."""
        log.log(logging.DEBUG if self._troubled else logging.WARNING, msg, *args)
        self._troubled = True
