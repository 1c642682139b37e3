"""Orders: the file order a job announces for its next epoch (``spokefs.torch.clairvoyant``),
fetched in that order ahead of its readers.

An order is a list (``trace_file``; version 0: whatever version is current) that a job sends
when its sampler has drawn an epoch's permutation. It is replayed like a trace
(``replay.Replayer``: small files in picks, demand misses first, nothing fetched twice,
within the cache), one replay per announcing job: the list's header names the job (``job``:
``spokefs.torch`` writes its host and process id), and a job's new order replaces its
previous one, while the orders of other jobs on the node (one per rank of a multi-GPU job)
go on beside it. All of them, and the trace replay of ``--replay``/``warm``, share one
in-flight bound (``in_flight.InFlight``), so eight ranks do not put eight times the link's
bandwidth-delay product on it.

At most ``MAX_JOBS`` jobs are kept; announcing one more forgets the one announced longest ago
(stopping its replay).

Each order goes at most a horizon ahead of the furthest file of it that has been read
(``replay.Replayer``'s ``horizon_bytes``; the mount sets twice the replays' in-flight bound
plus 32 MiB: 6 x the link's bandwidth-delay product + 32 MiB, 78 MB at 60 ms and 1 Gbit/s),
so a job that stops leaves at most that much fetched and unread.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import trio

from spokefs.jobs.replay import Replayer
from spokefs.jobs.trace_file import Entry

log = logging.getLogger(__name__)

MAX_JOBS = 64
GRACE_S = 10.0  # after the last order, the mount's own guesses wait this long for the next


class Orders:
    """One replayer per announcing job, made by ``make_replayer`` (sharing the in-flight bound)."""

    def __init__(self, make_replayer: Callable[[], Replayer],
                 trace: Replayer | None = None) -> None:
        """``trace``: the mount's trace replayer (``--replay``, ``warm --trace``), which
        ``running`` counts too: it fetches in a job's order as well."""
        self._make = make_replayer
        self._trace = trace
        self._jobs: OrderedDict[str, tuple[Replayer, trio.CancelScope]] = OrderedDict()
        self._nursery: trio.Nursery | None = None
        self._last_running = -GRACE_S  # when an order last ran

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def start(self, job: str, entries: list[Entry], name: str, *, head: bool = False) -> int:
        """Fetch ``entries`` in their order for ``job`` (replacing its earlier order); the
        order's id (its replayer's). ``head``: see ``Replayer.start``."""
        if self._nursery is None:
            raise RuntimeError("Orders.run is not running")
        kept = self._jobs.pop(job, None)
        if kept is None:
            replayer, scope = self._make(), trio.CancelScope()
            self._nursery.start_soon(self._serve, replayer, scope)
            while len(self._jobs) >= MAX_JOBS:
                old, (_, old_scope) = self._jobs.popitem(last=False)
                old_scope.cancel()
                log.info("order of job %s forgotten (more than %d jobs)", old, MAX_JOBS)
            kept = (replayer, scope)
        self._jobs[job] = kept
        self._last_running = time.monotonic()  # ran, if only for an instant (``running``)
        return kept[0].start(entries, name, head=head)

    def progress(self) -> list[dict[str, object]]:
        """Each job's current (or last) order, oldest announcement first."""
        return [{"job": job, "following": replayer.following(),
                 **replayer.progress().as_dict()}
                for job, (replayer, _) in self._jobs.items()]

    def on_read(self, file_id: int) -> None:
        """A job read a file (any job: a read names no job): each order's horizon moves on
        if it lists the file further on."""
        for replayer, _ in self._jobs.values():
            replayer.on_read(file_id)

    def passed(self) -> Callable[[int], int | None] | None:
        """While some job's order is being fetched or read (``running``), a function that
        says whether a file is one such a job has read: the cache's tick when that order
        came (the block cache evicts first the file's chunks visited since: this epoch does
        not read them again), else None; the newest order listing the file decides (a job's
        next epoch, told by another loader, outranks the last). Else None. Called on the
        trio thread; the function it returns runs on the cache's writer."""
        newest_first = sorted((r for r, _ in self._jobs.values() if r.following()),
                              key=lambda r: r.since, reverse=True)
        if not newest_first:
            return None

        def behind(file_id: int) -> int | None:
            for r in newest_first:  # the newest order that lists the file knows best
                if r.lists(file_id):
                    return r.since if r.behind(file_id) else None
            return None

        return behind

    def running(self) -> bool:
        """Whether some job's order is being fetched, or read by its job after it was fetched
        whole (``Replayer.following``), or a trace replay runs, or one of those did less
        than ``GRACE_S`` ago: the mount's own guesses (directory fills, a miss's whole
        directory pack) then stand aside, since the order says what comes next and they
        would only share the link with it, or push its files out of a small cache. The
        grace covers a job's next epoch, whose workers read their first files while the
        order of it is on its way."""
        now = time.monotonic()
        if any(r.following() for r, _ in self._jobs.values()) or \
                (self._trace is not None and self._trace.following()):
            self._last_running = now
            return True
        return now - self._last_running < GRACE_S

    @staticmethod
    async def _serve(replayer: Replayer, scope: trio.CancelScope) -> None:
        with scope:
            await replayer.run()
