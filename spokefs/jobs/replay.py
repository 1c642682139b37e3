"""Trace replay: fetch a trace's working set ahead of the job, in first-access order, at
the link's full speed (``spokefs mount --replay``, ``spokefs warm --trace``/``--files-from``).

- **Order.** Targets go in the trace's order, so the files a job reads first arrive first;
  epoch 1 of the next run then reads what has already arrived, as long as the replay stays
  ahead of it.
- **Full speed, in order.** Small files come in picks (``protocol.plan_picks``): the ones not
  cached yet, in the list's order, up to 64 files and ``protocol.PACK_MAX_BYTES`` a pick, so
  the next files a job reads arrive first and nothing it does not read comes along (a
  directory's pack brought thirty files of one directory for each one a shuffled epoch
  needed next); nodes with the same cache state ask for the same URLs, which a regional
  tier keeps. Large files come in ranges of ``request_bytes`` (runs of the trace's
  extents, cut); requests run in parallel until about three times the link's
  bandwidth-delay product is in flight (``in_flight.InFlight``): a long link is full only
  when that much is on its way.
- **Demand first.** A reader's miss is fetched by the reader at once (``BlockSource.fill``
  ignores every background limit), and a replay never has more than its in-flight bound on
  the link ahead of it; what a reader has fetched (or is fetching) is skipped when the
  replay gets there, and a pick's member that a reader fetched meanwhile is skipped on
  arrival.
- **Skips what is cached**, so a replay is resumable: run it again and it goes on where it
  stopped (cached chunks cost a header read, inline).
- **Bounded by the cache.** A trace replay's targets are cut where the working set would
  exceed the cache less its fill window and the pinned bytes: fetching more would evict the
  replay's own first bytes before the job reads them. What is left out is reported.
- **A horizon** (an order, ``horizon_bytes``): the replay starts no target that ends more
  than the horizon (at most the budget above) past the furthest target the job has read
  (``on_read``), so a job that stops leaves at most the horizon fetched and unread. An order
  is not cut: it runs along the epoch however large the data set, and what the job has read
  is what the cache evicts first (``behind``). A trace replay has no horizon: it warms a
  working set before the job runs.
- Replayed chunks are stored with their own origin (``ORIGIN_REPLAY``), so hits on them
  count apart (``spokefs_block_hits_total{origin="replay"}``).

One replay runs at a time: a new one replaces the one running. ``progress()`` is what
``spokefs warm`` draws and the metrics show.

Concurrency: ``start``/``stop`` are synchronous (control handlers call them); the job runs
in a task of ``run``'s nursery, its requests in a nursery of its own.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import trio

from spokefs import metrics, protocol
from spokefs.errors import SpokeError
from spokefs.hub.link_model import LinkReach
from spokefs.jobs.in_flight import InFlight
from spokefs.jobs.order_position import OrderPosition
from spokefs.jobs.trace_file import Entry, Resolved, Target
from spokefs.read.block_source import BlockSource
from spokefs.read.trace import EXTENT_BYTES
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

# an order fetched whole is followed while its job reads a file of it at least this often
_FOLLOW_S = 10.0
_EARLY_READS = 1 << 16  # reads kept while an order resolves
_HEAD_ENTRIES = 512  # a trace's first entries, resolved and fetched before the rest resolves
# The first picks of a list are small: at its start everything is requested at once and
# shares the link, and a pick arrives in about its size over one connection's share of it
# (at 900 ms a 4 MiB window carries 4.6 MB/s: a 3.75 MiB pick takes two round trips). A pick
# holds at most a sixteenth of the list's bytes before its end, and at least 512 KiB: 16 of
# those for the first 8 MiB, then growing to ``PACK_MAX_BYTES`` at 60 MiB (about 50 picks
# where there were 16). The cut depends on the list alone: the nodes of a trace share URLs.
_FIRST_PICK_BYTES = 512 << 10
_PICK_GROWTH = 16


@dataclass(slots=True)
class Progress:
    """Where the current (or last) replay is; bytes are the working set's.

    Attributes:
        id: the replay's number since the mount (a client knows when it was replaced).
        name: what it replays (a file name, for logs and ``status``).
        state: resolving, running, done, stopped or failed.
        entries, changed, missing: the trace's entries, and those whose path names another
            version now or nothing (see ``trace_file``).
        over_budget_bytes: bytes left out because they would not fit in the cache.
        total_bytes, done_bytes: the working set replayed, and the part cached so far.
        fetched_bytes: bytes this replay fetched (the rest was cached already).
        failed_bytes: bytes whose requests failed (a rerun fetches them).
        horizon_bytes: an order's horizon (the largest it has been), 0 for a trace replay:
            a job that stops leaves at most this much of the order fetched and unread.
    """

    id: int = 0
    name: str = ""
    state: str = "idle"
    entries: int = 0
    changed: int = 0
    missing: int = 0
    over_budget_bytes: int = 0
    total_bytes: int = 0
    done_bytes: int = 0
    fetched_bytes: int = 0
    failed_bytes: int = 0
    horizon_bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class Replayer:
    """Fetches traces' working sets ahead of the readers."""

    def __init__(
        self, source: BlockSource, reach: LinkReach, resolve: Callable[[list[Entry]], Resolved],
        *, small_file_bytes: int, request_bytes: int, max_inflight_bytes: int,
        budget_bytes: Callable[[], int], flight: InFlight | None = None,
        horizon_bytes: Callable[[], int] | None = None,
    ) -> None:
        """``flight``: the in-flight bound shared with other replayers (else its own);
        ``horizon_bytes``: how far ahead of the job's reads the replay may go (None: no
        bound but the cache)."""
        self._source = source
        self._resolve = resolve
        self._small = small_file_bytes
        self._request_bytes = request_bytes
        self.flight = flight if flight is not None else InFlight(reach, max_inflight_bytes)
        self._budget = budget_bytes
        self._horizon = horizon_bytes
        self._ahead: OrderPosition | None = None
        self._early: set[int] | None = None
        self.since = 0  # the cache's access clock when the current replay started
        self._ids = itertools.count(1)
        self._progress = Progress()
        self._pending: tuple[Progress, list[Entry], bool] | None = None
        self._scope: trio.CancelScope | None = None
        self._wake = trio.Event()

    # -- control (synchronous) ----------------------------------------------------------

    def start(self, entries: list[Entry], name: str, *, head: bool = False) -> int:
        """Replay ``entries`` (replacing a replay that runs); its id. ``head``: an order that
        is the first files of a longer one, which follows (``spokefs.torch``)."""
        progress = Progress(id=next(self._ids), name=name, state="resolving",
                            entries=len(entries))
        self._pending = (progress, entries, head)
        self._progress = progress
        self._ahead = None  # what the job read of its last order says nothing of this one
        self.since = self._source.tick()  # the cache's clock when the order came
        # reads while the order resolves, told to its ``OrderPosition`` once it has one
        self._early = set() if self._horizon is not None else None
        if self._scope is not None:
            self._scope.cancel()
        self._wake.set()
        return progress.id

    def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
        self._pending = None

    def progress(self) -> Progress:
        return self._progress

    def on_read(self, file_id: int) -> None:
        """The job read a file: the horizon moves on if the replay lists it further on."""
        ahead = self._ahead
        if ahead is not None:
            ahead.on_read(file_id)
            if ahead.over:  # its epoch is over (another order of the job reads it again)
                self._ahead = None
                if self._progress.state in ("resolving", "running"):
                    self.stop()
            elif ahead.finished() and self._progress.state != "running":
                self._ahead = None  # the job read every file: the order is over
        elif self._early is not None and len(self._early) < _EARLY_READS:
            self._early.add(file_id)

    def following(self) -> bool:
        """Whether an order is being fetched, or the job is still reading one fetched
        whole (it read a file of it within ``_FOLLOW_S`` and has not read them all)."""
        state = self._progress.state
        if state in ("resolving", "running"):
            return True
        ahead = self._ahead
        return ahead is not None and time.monotonic() - ahead.last_read < _FOLLOW_S

    def lists(self, file_id: int) -> bool:
        """Whether the current order lists the file (while it resolves: any file)."""
        ahead = self._ahead
        return ahead is None or file_id in ahead.index

    def behind(self, file_id: int) -> bool:
        """Whether the job has read this file of its order (called from the cache's writer
        thread: reads one attribute and one set)."""
        ahead = self._ahead
        if ahead is not None:
            return file_id in ahead.read
        early = self._early
        return early is not None and file_id in early

    async def cached_bytes(self, files: list[FileVersion]) -> int:
        """How many bytes of these file versions are cached already (a replay's check)."""
        return await self._source.cached_bytes(files)

    # -- the job --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            if self._pending is None:
                continue
            progress, entries, head = self._pending
            self._pending = None
            with trio.CancelScope() as scope:
                self._scope = scope
                await self._replay(progress, entries, head)
            self._scope = None
            if scope.cancelled_caught:
                self._ahead = None
            if scope.cancelled_caught and progress.state in ("resolving", "running"):
                progress.state = "stopped"
                log.info("replay %d (%s) stopped at %d of %d bytes", progress.id,
                         progress.name, progress.done_bytes, progress.total_bytes)

    async def _replay(self, progress: Progress, entries: list[Entry], head: bool) -> None:
        started = time.monotonic()
        # a trace replay resolves its first entries alone and fetches them while the rest
        # resolves (tens of ms per 10,000 entries: the job's first reads wait for them); an
        # order's first files come as a head of their own (``spokefs.torch``)
        split = self._horizon is None and len(entries) > 2 * _HEAD_ENTRIES
        first, rest = (entries[:_HEAD_ENTRIES], entries[_HEAD_ENTRIES:]) if split else \
            (entries, [])
        resolved = await self._resolved(progress, first)
        if resolved is None:
            return
        if self._horizon is None:
            targets, over = _within(resolved.targets, self._budget())
        else:  # an order: the horizon bounds what is fetched ahead (at most the cache's budget)
            targets, over = resolved.targets, 0
        self._ahead = None
        if self._horizon is not None:
            # the cache's room for the order's files: what it does not hold of them now; for
            # a head, only what it does not hold at all (the rest may be the epoch's files)
            if head:
                stats = self._source.statistics()
                cached = stats.bytes_used - stats.pinned_bytes
            else:
                cached = await self._source.cached_bytes([t.fv for t in targets])
            self._ahead = ahead = OrderPosition(targets, max(0, self._budget() - cached))
            for file_id in self._early or ():
                ahead.on_read(file_id)
        self._early = None
        progress.state = "running"
        metrics.REPLAY_DONE_BYTES.set(0)
        self._counted(progress, resolved, targets, over, final=not rest)
        try:
            async with trio.open_nursery() as nursery:
                tail: list[Resolved | None] = []
                tail_resolved = trio.Event()
                if rest:
                    nursery.start_soon(self._resolve_tail, progress, rest, tail, tail_resolved)
                listed = await self._issue(progress, targets, nursery)
                if rest:
                    await tail_resolved.wait()
                    if tail[0] is not None:  # else failed (logged): the first files came
                        whole = Resolved(resolved.targets + tail[0].targets,
                                         resolved.changed + tail[0].changed,
                                         resolved.missing + tail[0].missing)
                        everything, over = _within(whole.targets, self._budget())
                        self._counted(progress, whole, everything, over, final=True)
                        await self._issue(progress, everything[len(targets):], nursery, listed)
            await self._source.flush()  # done means stored, as for ``warm``
        finally:
            progress.seconds = time.monotonic() - started
        # an order's index is kept while its job reads the rest (``following``), dropped
        # when it has read every file, is cancelled or replaced (every read looks it up)
        if self._ahead is not None and self._ahead.finished():
            self._ahead = None
        if progress.state == "failed":
            return
        progress.state = "done"
        log.info("replay %d (%s) done: %d bytes fetched, %d cached already, %d failed, "
                 "in %.1f s", progress.id, progress.name, progress.fetched_bytes,
                 progress.done_bytes - progress.fetched_bytes - progress.failed_bytes,
                 progress.failed_bytes, progress.seconds)

    async def _resolved(self, progress: Progress, entries: list[Entry]) -> Resolved | None:
        """``entries`` resolved in the namespace (off the event loop), or None when that
        failed (logged; the replay failed)."""
        try:
            return await trio.to_thread.run_sync(self._resolve, entries)
        except SpokeError as exc:
            progress.state = "failed"
            log.warning("replay %d (%s): %s", progress.id, progress.name, exc)
            return None

    async def _resolve_tail(self, progress: Progress, entries: list[Entry],
                            out: list[Resolved | None], done: trio.Event) -> None:
        out.append(await self._resolved(progress, entries))
        done.set()

    def _counted(self, progress: Progress, resolved: Resolved, targets: list[Target],
                 over: int, *, final: bool) -> None:
        """The working set known so far in ``progress`` and the metrics; once ``final``
        (every entry resolved), logged."""
        progress.changed, progress.missing = resolved.changed, resolved.missing
        progress.over_budget_bytes = over
        progress.total_bytes = sum(t.nbytes(EXTENT_BYTES) for t in targets)
        metrics.REPLAY_TOTAL_BYTES.set(progress.total_bytes)
        if final:
            log.info("replay %d (%s): %d files, %d bytes (%d entries changed on the hub, "
                     "%d gone, %d bytes beyond the cache left out)", progress.id,
                     progress.name, len(targets), progress.total_bytes, resolved.changed,
                     resolved.missing, over)

    async def _issue(self, progress: Progress, targets: list[Target],
                     nursery: trio.Nursery, listed: int = 0) -> int:
        """Walk the targets in order, starting requests while the in-flight bound allows:
        the small files not cached gathered into picks, a pick started when it is full or
        when a large file comes next (the order is kept). ``listed``: the bytes of the
        targets walked before these (the first ones go in small picks); returned with
        these added."""
        pick: list[tuple[int, int, int]] = []
        in_pick: set[int] = set()
        nbytes = 0
        for n, t in enumerate(targets):
            if n % 256 == 0:
                await trio.lowlevel.checkpoint()  # a long run of cached files must not
                # hold the event loop
            if self._ahead is not None and self._horizon is not None:
                horizon = min(self._horizon(), self._budget())
                progress.horizon_bytes = max(progress.horizon_bytes, horizon)
                if self._ahead.beyond(n, horizon):  # wait for the job: start what is held first
                    if pick:
                        await self._launch_picks(nursery, progress, pick)
                        pick, in_pick, nbytes = [], set(), 0
                    await self._ahead.wait(n, horizon)
            fv = t.fv
            listed += fv.size
            if t.extents is None and protocol.packable(fv.size) and fv.size <= self._small:
                if fv.file_id in in_pick or self._source.busy_or_cached(fv):
                    self._done(progress, fv.size)
                    continue
                ahead = self._ahead
                if ahead is not None and not ahead.fits(nbytes + fv.size):
                    if pick:  # what has room goes now; the rest waits for the job's reads
                        await self._launch_picks(nursery, progress, pick)
                        pick, in_pick, nbytes = [], set(), 0
                    await ahead.wait_room(fv.size)
                    if self._source.busy_or_cached(fv):  # its reader came first
                        self._done(progress, fv.size)
                        continue
                most = min(protocol.PACK_MAX_BYTES,
                           max(_FIRST_PICK_BYTES, listed // _PICK_GROWTH))
                if pick and (nbytes + fv.size > most or len(pick) == protocol.PICK_MAX_FILES):
                    await self._launch_picks(nursery, progress, pick)
                    pick, in_pick, nbytes = [], set(), 0
                pick.append((fv.file_id, fv.version, fv.size))
                in_pick.add(fv.file_id)
                nbytes += fv.size
                continue
            if pick:
                await self._launch_picks(nursery, progress, pick)
                pick, in_pick, nbytes = [], set(), 0
            for start, end in _ranges(t, self._request_bytes):
                present = self._source.present_chunks(
                    t.fv, start // _CHUNK, (end - 1) // _CHUNK)
                if len(present) == (end - 1) // _CHUNK - start // _CHUNK + 1:
                    self._done(progress, end - start)
                    continue
                await self._launch(nursery, end - start, self._range, progress, t.fv, start,
                                   end)
        if pick:
            await self._launch_picks(nursery, progress, pick)
        return listed

    async def _launch_picks(self, nursery: trio.Nursery, progress: Progress,
                            files: list[tuple[int, int, int]]) -> None:
        """Start the pick of ``files`` once it fits in flight, without the ones a reader
        fetched meanwhile (they would cross the link twice: a pick's URL names them all)."""
        nbytes = sum(size for _, _, size in files)
        ahead = self._ahead
        if ahead is not None:  # ``_issue`` gathered them within its room
            ahead.fetching += nbytes
        await self._room_for(nbytes)
        still = self._source.to_fetch(map(FileVersion._make, files))
        if gone := nbytes - sum(size for _, _, size in still):
            self._done(progress, gone)
            self.flight.release(gone)
            if ahead is not None:
                ahead.fetching -= gone
        for plan in protocol.plan_picks(still):  # one at most: ``_issue`` cut at its limits
            nursery.start_soon(self._pick, progress, plan)

    async def _launch(self, nursery: trio.Nursery, nbytes: int,
                      fn: Callable[..., Awaitable[None]], *args: object) -> None:
        """Start ``fn(*args)`` once ``nbytes`` more fit in flight (one request at least)."""
        if self._ahead is not None:
            await self._ahead.wait_room(nbytes)
            self._ahead.fetching += nbytes
        await self._room_for(nbytes)
        nursery.start_soon(fn, *args)

    async def _room_for(self, nbytes: int) -> None:
        """Count ``nbytes`` in flight once they fit, and once the cache's writer keeps up."""
        await self.flight.reserve(nbytes)
        try:
            await self._source.wait_room()
        except BaseException:
            self.flight.release(nbytes)
            raise

    async def _pick(self, progress: Progress, plan: protocol.PackPlan) -> None:
        try:
            fetched = await self._source.fetch_pack(plan, replay=True)
            got = sum(f.size for f in fetched)
            progress.fetched_bytes += got
        except SpokeError as exc:  # a rerun fetches it
            progress.failed_bytes += plan.file_bytes
            log.debug("replay pick failed: %s", exc)
        finally:
            self._done(progress, plan.file_bytes)
            self.flight.release(plan.file_bytes)

    async def _range(self, progress: Progress, fv: FileVersion, start: int, end: int) -> None:
        try:
            got = await self._source.prefetch_range(fv, start, end, replay=True)
            progress.fetched_bytes += got  # not ``+= await``: that reads the total first
            self._done(progress, end - start)
        except SpokeError as exc:
            progress.failed_bytes += end - start
            self._done(progress, end - start)
            log.debug("replay range failed: %s", exc)
        finally:
            self.flight.release(end - start)

    def _done(self, progress: Progress, nbytes: int) -> None:
        progress.done_bytes += nbytes
        if progress is self._progress:
            metrics.REPLAY_DONE_BYTES.set(progress.done_bytes)


_CHUNK = 64 << 10  # config.CHUNK_SIZE; ranges are cut on chunk boundaries


def _ranges(t: Target, request_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges of a target, runs of its extents merged (in first-touch order of
    each run's start) and cut into requests of at most ``request_bytes``, chunk-aligned."""
    size = t.fv.size
    if size == 0:
        return []
    if t.extents is None:
        spans = [(0, size)]
    else:
        spans = []
        for e in t.extents:
            a, b = e * EXTENT_BYTES, min(size, (e + 1) * EXTENT_BYTES)
            if a >= b:
                continue
            if spans and spans[-1][1] == a:
                spans[-1] = (spans[-1][0], b)
            else:
                spans.append((a, b))
    step = max(_CHUNK, request_bytes // _CHUNK * _CHUNK)
    return [(s, min(s + step, b)) for a, b in spans for s in range(a, b, step)]


def _within(targets: list[Target], budget: int) -> tuple[list[Target], int]:
    """The longest prefix of the targets whose bytes fit in ``budget`` (the first accesses
    come first), and the bytes left out."""
    total = 0
    for n, t in enumerate(targets):
        size = t.nbytes(EXTENT_BYTES)
        if total + size > budget:
            return targets[:n], sum(u.nbytes(EXTENT_BYTES) for u in targets[n:])
        total += size
    return targets, 0
