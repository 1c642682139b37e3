"""Changes between generations: the diff of two tables, the bounded history, the answers.

- ``diff(old, new)`` matches entries by their key ``(parent id, name)``, directory by
  directory: a directory whose children's records are byte-identical in both tables costs
  one comparison, the others are matched by name. One generation step is: a REMOVE of
  every old key that is gone or now names another id or file type, in reverse old order
  (children before their parents), then an UPSERT of every new key that is new or whose
  entry changed, in new order (parents before children). Applied in order to the old namespace,
  they give the new one (docs/protocol.md says what a spoke does with each record).
- ``History`` keeps the last steps, contiguous, at most ``max_steps`` of them and
  ``max_bytes`` of records in all; a step over ``max_bytes`` on its own is not kept (a
  spoke that far behind takes a full snapshot, which is then cheaper anyway).
- ``ChangeFeed`` answers ``GET /v2/changes?since=G``: it compresses the steps from G to the
  current generation in its one worker thread (so concurrent identical requests queue and
  then hit the cache) and caches answers per ``(since, to)`` for the current generation,
  ``max_bytes`` in total.

Memory: the history's records (at most ``max_bytes``) plus the answer cache (at most
``max_bytes``), plus one diff's index lists while a rescan runs.
"""

from __future__ import annotations

import asyncio
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hubd.errors import BadGeneration, GenerationGone
from hubd.snapshot import Table
from spokefs import protocol

_UPSERT = bytes((protocol.CHANGE_UPSERT,))


@dataclass(frozen=True, slots=True)
class Diff:
    """What changed from one table to the next.

    Attributes:
        added, changed, removed: keys only in the new table, in both with another entry
            (attributes or id), only in the old table.
        records: the encoded change records, or None if they would exceed the byte budget.
        count: how many records ``records`` holds.
    """

    added: int
    changed: int
    removed: int
    records: bytes | None = field(repr=False)
    count: int

    @property
    def empty(self) -> bool:
        return not (self.added or self.changed or self.removed)


class _Differ:
    """The state of one ``diff`` (see ``diff``)."""

    def __init__(self, old: Table, new: Table, max_bytes: int) -> None:
        self.old, self.new = old, new
        self.removes: list[int] = []  # old indexes
        self.upserts: list[int] = []  # new indexes
        self.added = self.changed = self.removed = 0
        self._budget = max_bytes  # an upper bound of the records' size, counted down
        self.too_big = False

    def remove(self, o: int) -> None:
        if not self.too_big:
            self.removes.append(o)
            self._spend(self.old.offsets[o + 1] - self.old.offsets[o])  # >= the REMOVE size

    def upsert(self, n: int) -> None:
        if not self.too_big:
            self.upserts.append(n)
            self._spend(1 + self.new.offsets[n + 1] - self.new.offsets[n])

    def _spend(self, size: int) -> None:
        self._budget -= size
        if self._budget < 0:  # keep counting, stop collecting
            self.too_big = True
            self.removes, self.upserts = [], []

    def run(self) -> None:
        old, new = self.old, self.new
        if old.record(0) != new.record(0):  # the root: key (0, b"")
            self.changed += 1
            self.upsert(0)
        old_blocks = old.blocks()
        for dir_id, news in new.blocks().items():
            olds = old_blocks.pop(dir_id, range(0))
            if old.records_of(olds.start, olds.stop) != new.records_of(news.start, news.stop):
                self.directory(olds, news)
        for olds in old_blocks.values():  # directories gone (or no longer listed)
            self.directory(olds, range(0))

    def directory(self, olds: range, news: range) -> None:
        """Compare the children of one directory, by name."""
        by_name = {self.old.entry(o).name: o for o in olds}
        for n in news:
            after = self.new.entry(n)
            o = by_name.pop(after.name, None)
            if o is None:
                self.added += 1
                self.upsert(n)
            elif self.old.record(o) != self.new.record(n):
                self.changed += 1
                before = self.old.entry(o)
                if (before.file_id != after.file_id
                        or stat.S_IFMT(before.mode) != stat.S_IFMT(after.mode)):
                    # Another inode under that name (or a reused inode number, hence the
                    # same id, of another type): unlink the old entry first.
                    self.remove(o)
                self.upsert(n)
        for o in by_name.values():
            self.removed += 1
            self.remove(o)

    def records(self) -> bytes:
        out = bytearray()
        for o in sorted(self.removes, reverse=True):  # children before their parents
            e = self.old.entry(o)
            out += protocol.encode_remove(e.parent_id, e.name)
        for n in sorted(self.upserts):  # parents before children
            out += _UPSERT
            out += self.new.record(n)
        return bytes(out)


def diff(old: Table, new: Table, max_bytes: int) -> Diff:
    """The changes from ``old`` to ``new``; records are dropped above ``max_bytes``."""
    differ = _Differ(old, new, max_bytes)
    differ.run()
    if differ.too_big:
        records, count = None, 0
    else:
        records, count = differ.records(), len(differ.removes) + len(differ.upserts)
    return Diff(differ.added, differ.changed, differ.removed, records, count)


@dataclass(frozen=True, slots=True)
class Step:
    """The records that turn generation ``from_generation`` into ``to_generation``."""

    from_generation: int
    to_generation: int
    records: bytes = field(repr=False)
    count: int


@dataclass(frozen=True, slots=True)
class History:
    """The last steps up to the ``current`` generation (contiguous, oldest first)."""

    current: int
    steps: tuple[Step, ...] = ()

    @property
    def oldest(self) -> int:
        """The oldest generation a changes request can start from."""
        return self.steps[0].from_generation if self.steps else self.current

    def advance(self, to_generation: int, change: Diff, max_steps: int,
                max_bytes: int) -> History:
        """The history once ``change`` made ``to_generation`` current."""
        if change.records is None:
            return History(to_generation)
        steps = [*self.steps, Step(self.current, to_generation, change.records, change.count)]
        total = sum(len(s.records) for s in steps)
        while steps and (len(steps) > max_steps or total > max_bytes):
            total -= len(steps.pop(0).records)
        return History(to_generation, tuple(steps))

    def since(self, generation: int) -> tuple[Step, ...]:
        """The steps from ``generation`` to the current one.

        Raises:
            BadGeneration: ``generation`` is newer than the current one.
            GenerationGone: ``generation`` is not kept (unknown or too old).
        """
        if generation > self.current:
            raise BadGeneration(f"generation {generation} is newer than the current "
                                f"{self.current}")
        if generation == self.current:
            return ()
        for k, step in enumerate(self.steps):
            if step.from_generation == generation:
                return self.steps[k:]
        raise GenerationGone(f"generation {generation} is not kept (oldest kept: "
                             f"{self.oldest}): take a snapshot")


class ChangeFeed:
    """Compressed changes answers, built in one worker thread, cached for the current
    generation.

    The cache is written only by the worker thread and read (one ``dict.get``) by the
    event loop.
    """

    def __init__(self, zlib_level: int, max_cached_bytes: int) -> None:
        self._level = zlib_level
        self._max_cached = max_cached_bytes
        self._cache: dict[tuple[int, int], bytes] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hubd-changes")

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def answer(self, history: History, root_id: int, since: int) -> bytes:
        """The answer from ``since`` to ``history.current``; raises like ``History.since``."""
        steps = history.since(since)
        key = (since, history.current)
        body = self._cache.get(key)
        if body is None:
            loop = asyncio.get_running_loop()
            body = await loop.run_in_executor(self._executor, self._build, key, root_id, steps)
        return body

    def _build(self, key: tuple[int, int], root_id: int, steps: tuple[Step, ...]) -> bytes:
        body = self._cache.get(key)  # built while this request queued
        if body is not None:
            return body
        body = protocol.encode_changes(key[0], key[1], root_id, [s.records for s in steps],
                                   sum(s.count for s in steps), self._level)
        cache = {k: v for k, v in self._cache.items() if k[1] == key[1]}  # current only
        if sum(map(len, cache.values())) + len(body) <= self._max_cached:
            cache[key] = body
        self._cache = cache  # one assignment: the loop sees the old or the new dict
        return body
