"""Directory fills: the small files of a directory fetched ahead, many to a request.

A shuffled pass over a dataset of small files (an ImageNet-style tree read by a DataLoader)
touches every directory within its first few hundred samples and then reads its files in
random order. Fetching each file when it is read costs a round trip per file; fetching the
directories it has touched, in pack requests at the link's full rate, costs the dataset's
bytes once and leaves the readers mostly reading what has already arrived.

- **Trigger.** The first read that misses in a directory (the read right after the
  first open of a file that is not cached) queues the directory: the first miss is the
  cheapest moment to start (waiting for more opens only leaves the link idle while readers
  miss). A first open whose read hits starts nothing: after a restart on a warm cache,
  listing every directory a reader passes through and reading its files' headers only
  competes with the reader. A readdir queues its directory too while reads are missing
  (within ``_READING_S`` of the last miss); otherwise it only *arms* it, and the next miss
  anywhere queues the armed directories as siblings (below). So a DataLoader that lists
  every class directory at start and then reads has them all filled from its first miss,
  while ``find`` over a million entries, which reads no file, sets off no fill at all
  (with fills it took five times as long: they listed and fetched every directory it
  passed). A directory is listed once; its packs (``protocol.plan_packs``: its small files in
  name order, cut at ``protocol.PACK_MAX_BYTES``) with a member that is neither cached nor in
  flight join one FIFO queue. Packs are fixed by the namespace, not sized to the link, so
  that every spoke of a region asks a regional cache for the same URLs.
- **Siblings.** When a second subdirectory of one parent is touched, the parent's other
  subdirectories are filled too, behind every touched directory (a second queue). A
  shuffled pass over ``class/file`` trees touches every class early, but its readers, each
  waiting a round trip per missed file, reveal new classes only a few per round trip: at
  900 ms the last of 20 classes was touched 6 s into a 7 s epoch. A directory that a
  reader touches later moves to the first queue. Siblings are listed one at a time, when
  the queues run short, and no more after ``_CACHED_STREAK`` of them in a row were cached
  whole: after a restart on a warm cache of a million files, two opens must not set off
  a listing of every directory and a read of every header.
- **Re-arming.** When a read misses a small file of a directory whose fill has finished (its
  files were evicted since, e.g. in a later epoch over a dataset larger than the cache), the
  directory is queued again; the files still cached are skipped.
- **Readers first.** A file a reader misses is fetched at once by the reader itself,
  through its pack (``BlockSource.fill``), whatever the queue holds; the pump skips that
  pack later as busy or cached.
  A file already in a pack on its way is waited for, and is released to its reader the
  moment its own bytes have streamed in (``BlockSource.fetch_pack``), not at the pack's end.
- **Bytes in flight** follow the link: about twice its bandwidth-delay product, the peak
  rate at which bytes arrive from the hub times the round trip (the hub client's shortest
  recent wait for an answer; ``link_model.LinkReach``), within ``[_MIN_INFLIGHT_BYTES,
  max_inflight_bytes]``. Until traffic has flowed for a few round trips the rate is taken
  to be at least the assumed link rate (1 Gbit/s): at 900 ms a fill that started from a
  small window and doubled it every round trip would take seconds to fill the link, which
  is the whole cold epoch of a small dataset; on a slower link the extra bytes only queue
  for a moment. Packs are at most ``protocol.PACK_MAX_BYTES`` (3.75 MiB), so many connections
  share the work; one connection carries at most its TCP window per round trip.
  ``warm_connections`` says how many connections that takes, for the hub client to keep
  open.
- **Budget.** Bytes fetched by fills and not yet opened stay under ``budget_bytes`` (half
  the cache): fills never push out more of the cache than readers can use. A fetched file
  leaves the budget when it is opened (or was opened while on its way), or, once the budget
  is spent, when it is found evicted unread (so a listing that nobody reads cannot stop
  fills for good).

Concurrency: ``on_dir``/``on_open``/``on_miss`` are synchronous (FUSE handlers call them);
they update state and ``send_nowait`` directory ids (a full channel drops the hint and
counts it). Two listers and one pump run in the nursery of ``run``; each pack is a task
of that nursery.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from spokefs import metrics, protocol
from spokefs.errors import SpokeError
from spokefs.hub.link_model import LinkModel, LinkReach
from spokefs.read.block_source import BlockSource
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

_TRACKED_DIRS = 1 << 16
_QUEUED_DIRS = 4096
_LISTERS = 2
_INITIAL_INFLIGHT_BYTES = 64 << 20  # before anything is measured: 1 Gbit/s x 0.5 s
_MIN_INFLIGHT_BYTES = 8 << 20
_MIN_WARM, _MAX_WARM = 4, 32  # 32 x a 4 MiB window per 900 ms carry ~150 MB/s
_LATER_PACKS = 64  # sibling packs queued (240 MiB) before the next sibling is listed
_RECLAIM_SCAN = 256  # unread files checked for eviction when the budget is spent
_READING_S = 30.0  # a readdir this soon after a read miss fills its directory at once
_CACHED_STREAK = 4  # sibling directories found cached whole before siblings are left alone


class DirLister(Protocol):
    """What fills (and the prefetcher's runs of shards) ask the namespace
    (``fuse.mount``'s lister: in a worker thread)."""

    async def packs(self, dir_id: int) -> list[protocol.PackPlan]: ...

    async def siblings(self, dir_id: int) -> tuple[int, list[int]]: ...

    async def next_file(self, dir_id: int, file_id: int,
                        min_size: int) -> tuple[int, int, int] | None: ...


@dataclass(slots=True)
class _Dir:
    pending: int = 0  # its files queued or in flight
    listed: bool = False  # its files have been queued (a miss after that re-arms it)
    touched: bool = True  # opened or listed by a reader (else: queued as a sibling)


class DirFiller:
    """Fetches the small files of touched directories ahead of the readers."""

    def __init__(
        self,
        source: BlockSource,
        lister: DirLister,
        model: LinkModel,
        *,
        small_file_bytes: int,
        max_inflight_bytes: int,
        budget_bytes: int,
        reach: LinkReach,
    ) -> None:
        self._source = source
        self._lister_ns = lister
        self._model = model
        self._small = small_file_bytes
        self._max_inflight = max(max_inflight_bytes, _MIN_INFLIGHT_BYTES)
        self._budget = budget_bytes
        self._reach = reach
        self._dirs: OrderedDict[int, _Dir] = OrderedDict()
        self._dirs_tx, self._dirs_rx = trio.open_memory_channel[int](_QUEUED_DIRS)
        self._queue: deque[tuple[protocol.PackPlan, int]] = deque()  # (pack, its directory)
        self._later: deque[tuple[protocol.PackPlan, int]] = deque()  # packs of sibling directories
        self._touched_children: dict[int, set[int]] = {}  # parent -> touched subdirectories
        self._expanded: set[int] = set()  # parents whose subdirectories were all queued
        self._siblings: deque[int] = deque()  # subdirectories to list when work runs short
        self._cached_streak = 0  # siblings in a row that were cached whole
        self._unread: dict[tuple[int, int], FileVersion] = {}  # fetched, not opened since
        self._unread_bytes = 0
        self._inflight_files: set[tuple[int, int]] = set()
        self._opened_early: set[tuple[int, int]] = set()  # opened while on their way
        self._inflight_bytes = 0
        self._changed = trio.Event()
        self._armed: OrderedDict[int, None] = OrderedDict()  # listed, no read missed since
        self._last_miss = -_READING_S
        self._paused: Callable[[], bool] = lambda: False

    def pause_while(self, paused: Callable[[], bool]) -> None:
        """Start no pack while ``paused()`` holds (a job's announced order is being fetched
        or read: the fills queued before it came would only share the link with it, fetch
        files its picks fetch too, and in a cache smaller than the data set push out what
        the order keeps); what was queued is dropped: once the order is over, its guesses
        from before it are stale (the next misses queue directories again)."""
        self._paused = paused

    # -- hints (synchronous) ----------------------------------------------------------

    def on_readdir(self, dir_id: int) -> None:
        """A readdir: fill the directory now if readers have been missing lately, else arm
        it (see "Trigger" in the module docstring)."""
        if time.monotonic() - self._last_miss < _READING_S:
            self.on_dir(dir_id)
        elif dir_id not in self._dirs:
            self._armed[dir_id] = None
            if len(self._armed) > _TRACKED_DIRS:
                self._armed.popitem(last=False)

    def on_dir(self, dir_id: int) -> None:
        """An open in the directory (or a readdir while readers miss): fill it if that has
        not begun."""
        state = self._dirs.get(dir_id)
        if state is not None:
            self._dirs.move_to_end(dir_id)
            if not state.touched:  # queued as a sibling: its files go first now
                state.touched = True
                self._send(dir_id)
            return
        self._track(dir_id, _Dir())

    def _track(self, dir_id: int, state: _Dir) -> None:
        self._dirs[dir_id] = state
        if len(self._dirs) > _TRACKED_DIRS:
            self._dirs.popitem(last=False)
        self._send(dir_id)

    def on_open(self, fv: FileVersion, parent_id: int) -> None:
        key = (fv.file_id, fv.version)
        if key in self._inflight_files:  # its reader waits for the pack: it is not unread
            self._opened_early.add(key)
        elif (done := self._unread.pop(key, None)) is not None:
            self._unread_bytes -= done.size
            self._changed.set()

    def on_miss(self, fv: FileVersion, parent_id: int) -> None:
        """A read missed: fill the file's directory, or fill it again if its fill is over
        (its files were evicted since); directories listed before go behind it."""
        self._last_miss = time.monotonic()
        if self._armed:
            self._siblings.extend(self._armed)
            self._armed.clear()
            self._changed.set()
        state = self._dirs.get(parent_id)
        if state is None or not state.touched:
            self.on_dir(parent_id)
        elif state.listed and state.pending == 0 and fv.size <= self._small:
            state.listed = False
            self._send(parent_id)

    def _send(self, dir_id: int) -> None:
        try:
            self._dirs_tx.send_nowait(dir_id)
        except trio.WouldBlock:
            metrics.PREFETCH_DROPPED_HINTS.inc()
            self._dirs.pop(dir_id, None)  # so that a later event tries again

    # -- background work --------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(_LISTERS):
                nursery.start_soon(self._lister, self._dirs_rx.clone())
            nursery.start_soon(self._pump, nursery)
            task_status.started()

    async def _lister(self, dirs: trio.MemoryReceiveChannel[int]) -> None:
        async for dir_id in dirs:
            try:
                state = self._dirs.get(dir_id)
                if state is not None and state.touched:
                    await self._expand_parent(dir_id)
            except SpokeError as exc:  # e.g. the directory went away in a refresh
                log.info("directory fill of %x not started: %s", dir_id, exc)
                continue
            state = self._dirs.get(dir_id)
            if state is None:
                continue
            queue = self._queue if state.touched else self._later
            plans = await self._lister_ns.packs(dir_id)
            # in a worker thread: after a restart every directory is listed again, and its
            # files' headers, read inline, would hold up the readers
            members = [FileVersion(*m) for p in plans for m in p.members]
            cached = await self._source.complete_files(members)
            for plan in plans:
                if any(FileVersion(*m) not in cached and not self._source.in_flight(
                        FileVersion(*m)) for m in plan.members):
                    queue.append((plan, dir_id))
                    state.pending += 1
            state.listed = True
            if not state.touched:
                self._cached_streak = 0 if state.pending else self._cached_streak + 1
            log.debug("directory fill of %x: %d packs queued", dir_id, state.pending)
            self._changed.set()

    async def _expand_parent(self, dir_id: int) -> None:
        """On the second touched subdirectory of a parent, queue all its subdirectories."""
        parent, siblings = await self._lister_ns.siblings(dir_id)
        if not parent or parent in self._expanded:
            return
        touched = self._touched_children.setdefault(parent, set())
        touched.add(dir_id)
        if len(touched) < 2:
            return
        self._expanded.add(parent)
        del self._touched_children[parent]
        self._siblings.extend(siblings)
        self._changed.set()

    def _list_next_sibling(self) -> None:
        """Send the next untracked sibling directory to the listers."""
        while self._siblings and self._cached_streak < _CACHED_STREAK:
            sibling = self._siblings.popleft()
            if sibling not in self._dirs:
                self._track(sibling, _Dir(touched=False))
                return

    def _target_inflight(self) -> int:
        """About twice the bandwidth-delay product (see the module docstring)."""
        bdp = self._reach.bdp_bytes()
        if bdp is None:
            return _INITIAL_INFLIGHT_BYTES
        return min(self._max_inflight, max(_MIN_INFLIGHT_BYTES, 2 * bdp))

    def warm_connections(self) -> int:
        """Connections that the bytes in flight need, for the hub client to keep open."""
        target = self._target_inflight()
        return max(_MIN_WARM, min(_MAX_WARM, -(-target // protocol.PACK_MAX_BYTES)))

    def _next_pack(self) -> tuple[protocol.PackPlan, int, int] | None:
        """The pack at the head of the queues and its directory, skipping packs whose
        members are all cached or in flight by now (readers fetched them); with the bytes
        still to come."""
        while queue := self._queue or self._later:
            plan, dir_id = queue.popleft()
            nbytes = sum(f.size for f in
                         self._source.to_fetch(map(FileVersion._make, plan.members)))
            if nbytes:
                return plan, dir_id, nbytes
            self._done(dir_id)
        return None

    def _reclaim(self) -> None:
        """Stop counting fetched files that have left the cache unread (evicted): they use
        no budget any more. Looks at the oldest ``_RECLAIM_SCAN`` (headers, inline, in one
        read transaction)."""
        oldest = list(itertools.islice(self._unread.items(), _RECLAIM_SCAN))
        gone = set(self._source.to_fetch(f for _, f in oldest))
        for key, f in oldest:
            if f in gone:
                del self._unread[key]
                self._unread_bytes -= f.size

    async def _pump(self, nursery: trio.Nursery) -> None:
        while True:
            target = self._target_inflight()
            if len(self._later) < _LATER_PACKS:
                self._list_next_sibling()
            queue = self._queue or self._later
            head = queue[0][0].file_bytes if queue else 0
            if queue and self._unread_bytes + head > self._budget:
                self._reclaim()
            room = min(target - self._inflight_bytes, self._budget - self._unread_bytes)
            if queue and (self._paused() or not self._source.speculation_pays()):
                self._drop_queued()
                continue
            if not queue or room < min(protocol.PACK_MAX_BYTES, head):
                self._changed = trio.Event()
                with trio.move_on_after(0.25):  # the target follows the link as it is measured
                    await self._changed.wait()
                continue
            await trio.lowlevel.checkpoint()  # a long queue must not hold the event loop
            picked = self._next_pack()
            if picked is not None:
                plan, dir_id, nbytes = picked
                self._inflight_bytes += nbytes
                nursery.start_soon(self._fetch, plan, dir_id, nbytes)

    def _drop_queued(self) -> None:
        """Forget every queued pack and sibling (``pause_while``)."""
        for _, dir_id in (*self._queue, *self._later):
            self._done(dir_id)
        self._queue.clear()
        self._later.clear()
        self._siblings.clear()
        self._armed.clear()

    async def _fetch(self, plan: protocol.PackPlan, dir_id: int, nbytes: int) -> None:
        started = time.monotonic()
        keys = plan.items
        self._inflight_files.update(keys)
        try:
            fetched = await self._source.fetch_pack(plan)
        except SpokeError as exc:  # a failed prefetch costs nothing but its bytes
            metrics.PREFETCH_ERRORS.inc()
            log.debug("directory fill request failed: %s", exc)
            fetched = []
        finally:
            self._inflight_bytes -= nbytes
            self._done(dir_id)
            self._inflight_files.difference_update(keys)
            self._changed.set()
        got = 0
        for f in fetched:
            key = (f.file_id, f.version)
            got += f.size
            if key in self._opened_early:
                continue
            if key not in self._unread:
                self._unread[key] = f
                self._unread_bytes += f.size
        self._opened_early.difference_update(keys)
        if got:
            self._model.record(got, time.monotonic() - started)

    def _done(self, dir_id: int) -> None:
        state = self._dirs.get(dir_id)
        if state is not None and state.pending > 0:
            state.pending -= 1
