"""The in-memory half of the block cache's eviction policy: access times and reuse evidence.

``block_cache``'s docstring describes the whole policy; this module holds what it learns from
reads without writing anything on a hit:

- **An access clock.** ``tick`` counts *chunk visits*: a read that touches a chunk advances it
  by one, except when it only continues the previous touch of one of the last ``_RECENT``
  chunks touched, i.e. starts after the last block that touch read (a sequential reader
  with small reads touches a 64 KiB chunk several times in a row: one visit; reading a block
  again is a new visit). The tick of each
  key's last visit is kept in a fixed-size hashed table (two slots per key, each tagged with
  16 bits of the key's hash, so a slot that another key took reads as unknown), so it also
  remembers keys that are no longer cached ("ghosts") at no cost per key; it forgets a key
  once both its slots are taken, which with 4 slots per cacheable chunk takes a few
  cache-fulls of visits.
- **The re-use interval** ``interval``: a moving average of the ticks between two visits of a
  cached chunk. It sets the limits the policy uses: ``probation_limit`` (a chunk stored that
  long ago and never re-used is dead: 3 intervals, at least 8 cache-fulls of visits, so that
  the first epoch of a long loop survives until the second), ``protected_limit`` (a protected
  chunk not visited for that long is dead: 3 intervals, at least 2 cache-fulls), and
  ``ghost_limit`` (a chunk that comes back sooner than that since its last visit is hot: a
  quarter interval, at most one cache-full).
- **Pending decisions** for the next write transaction: chunks to promote to the protected
  segment, and for chunks that missed, the tick of that miss and whether they may go straight
  to the protected segment when their fill arrives. A write transaction gets them, with the
  limits above and read access to the table, as a ``Plan`` (built by ``block_cache``, used by
  ``store`` and ``eviction``).

Concurrency: one instance per ``BlockCache``, mutated only by the trio thread. Writer threads
read ``last()``/``is_visited()`` while the trio thread may store into the table: reads of one
array item are atomic under the GIL and a stale answer only makes a policy choice slightly
worse. The table is saved to a side file on close and now and then (``save``), and loaded at
open; after ``kill -9`` it is at most one save interval old, which costs hit ratio, never
correctness.
"""

from __future__ import annotations

import contextlib
import os
import struct
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from spokefs.config import CHUNK_SIZE

_RECENT = 64  # chunks whose last touched slot is remembered: ~8 interleaved streams x 8
# Each slot: a 16-bit tag of the key (so a slot another key overwrote reads as "unknown",
# not as a recent visit) and a 48-bit tick. 4 slots per chunk the cache holds: about one live
# entry each for the cached chunks and for as many evicted ones (ghosts), each in 2 slots.
# That is 32 bytes of RAM per 64 KiB cached (0.05%), up to 256 MiB (an 8 TiB cache); a
# larger cache gets fewer slots per chunk and forgets visits sooner.
_TICK_BITS = 48
_TICK_MASK = (1 << _TICK_BITS) - 1
_SLOTS_PER_CHUNK = 4
_MIN_SLOTS = 1 << 12
_MAX_SLOTS = 1 << 25
_EWMA_WEIGHT = 1 / 256  # the interval follows the last few hundred re-uses
_DEAD_FLOOR_FILLS = 8  # a stored, never re-used chunk lives at least this many cache-fulls
_DEAD_INTERVALS = 3  # ...and at least 3 observed re-use intervals (shuffled epochs: up to 2)
_STALE_FILLS = 2  # a protected chunk proved itself once: it goes after 2 fulls unvisited
_GHOST_DIVISOR = 4  # a ghost re-visited within interval / 4 is hot (a loop's come back ~1)
_MIN_PROTECTED_SHARE = 0.1
_MAX_MISSES = 1 << 16  # misses remembered for their fills (two generations of this many)
_FILE_MAGIC = b"spokefs-clock-3\n"
_FILE_HEAD = struct.Struct("<QQdd")  # slots, tick, interval, protected share


class AccessClock:
    """Visit times of chunk keys, the re-use interval, and decisions pending a write.

    Attributes:
        tick: chunk visits so far (persisted in the cache's meta record and in the side file).
        interval: moving average of ticks between two visits of a cached chunk; 0 = unknown.
        cap_chunks: chunks the cache holds when full (set by the cache as it fills).
        protected_share: the protected segment's cap, as a share of its largest (see
            ``block_cache``): ARC-like, up for hits LRU would miss, down for the converse.
        protected_full: the protected segment is at its cap (set by the cache).
        promote: probation chunks re-used since promotions were last written, each with the
            tick of its latest re-use (its protected stay begins there).
    """

    def __init__(self, max_bytes: int) -> None:
        self.cap_chunks = max(1, max_bytes // CHUNK_SIZE)
        slots = _MIN_SLOTS
        while slots < _SLOTS_PER_CHUNK * self.cap_chunks and slots < _MAX_SLOTS:
            slots *= 2
        self._mask = slots - 1
        self._table = array("Q", bytes(8 * slots))
        self._recent: OrderedDict[bytes, int] = OrderedDict()  # chunk key -> last block slot
        self.tick = 0
        self.interval = 0.0
        self.protected_share = 1.0
        self.protected_full = False
        self.promote: dict[bytes, int] = {}
        self._misses: dict[bytes, tuple[int, bool]] = {}
        self._older_misses: dict[bytes, tuple[int, bool]] = {}

    # -- limits ---------------------------------------------------------------------

    def probation_limit(self) -> int:
        """Visits after its arrival by which a never re-used chunk counts as dead."""
        return max(_DEAD_FLOOR_FILLS * self.cap_chunks, int(_DEAD_INTERVALS * self.interval))

    def protected_limit(self) -> int:
        """Visits without a visit after which a protected chunk counts as dead."""
        return max(_STALE_FILLS * self.cap_chunks, int(_DEAD_INTERVALS * self.interval))

    def ghost_limit(self) -> int:
        """A key re-visited within this many ticks of its last visit is hot (0: none yet)."""
        return min(self.cap_chunks, int(self.interval / _GHOST_DIVISOR))

    # -- the table ------------------------------------------------------------------

    def _slots(self, key: bytes) -> tuple[int, int, int]:
        h = xxhash.xxh3_64_intdigest(key)
        return h & self._mask, (h >> 24) & self._mask, (h >> _TICK_BITS) << _TICK_BITS

    def last(self, key: bytes) -> int:
        """Tick of the key's last visit, 0 if none is remembered (safe from any thread)."""
        return self._last_at(*self._slots(key))

    def _last_at(self, a: int, b: int, tag: int) -> int:
        """``last`` of the key whose slots and tag are these."""
        x, y = self._table[a], self._table[b]
        if x & ~_TICK_MASK == tag:
            return min(x & _TICK_MASK, y & _TICK_MASK) if y & ~_TICK_MASK == tag \
                else x & _TICK_MASK
        return y & _TICK_MASK if y & ~_TICK_MASK == tag else 0

    def is_visited(self, key: bytes, since: int) -> bool:
        """Whether the key was visited at or after tick ``since``."""
        last = self.last(key)
        return last != 0 and last >= since

    def _visit(self, key: bytes, lo: int, hi: int) -> int | None:
        """Count a visit to block slots ``lo..hi`` of a chunk; returns the previous visit's
        tick (0: none), or None if this touch only continues the last one (a sequential
        reader moving on within the chunk)."""
        recent = self._recent
        last_slot = recent.get(key)
        recent[key] = hi
        if last_slot is not None:
            recent.move_to_end(key)
            if lo > last_slot:
                return None
        elif len(recent) > _RECENT:
            recent.popitem(last=False)
        # _slots and _last_at written out (a visit is on every read's path: ~40 % less time
        # per visit), with the tag compared as its 16 bits, not as a 64-bit int
        h = xxhash.xxh3_64_intdigest(key)
        mask = self._mask
        a, b, tag = h & mask, (h >> 24) & mask, h >> _TICK_BITS
        table = self._table
        x, y = table[a], table[b]
        if x >> _TICK_BITS == tag:
            prev = min(x, y) & _TICK_MASK if y >> _TICK_BITS == tag else x & _TICK_MASK
        else:
            prev = y & _TICK_MASK if y >> _TICK_BITS == tag else 0
        self.tick = tick = self.tick + 1
        table[a] = table[b] = tag << _TICK_BITS | tick
        return prev

    # -- what reads tell us ---------------------------------------------------------

    def visit_cached(
        self, key: bytes, lo: int, hi: int, protected: bool, stored_tick: int
    ) -> None:
        """A read touched slots ``lo..hi`` of a cached chunk (``stored_tick``: when its
        stay began)."""
        prev = self._visit(key, lo, hi)
        if not prev:
            return
        gap = self.tick - prev
        if protected and gap > self.cap_chunks:  # a hit LRU would have missed
            self._move_share(+1)
        if protected or prev >= stored_tick:  # a re-use within this chunk's stay
            self._note_interval(gap)
            # into a full segment only what LRU would keep: swapping one long-loop chunk
            # for another gains nothing and costs the evicted one's next hit
            if not protected and (not self.protected_full or gap < self.cap_chunks):
                self.promote[key] = self.tick
        elif gap < self.ghost_limit():  # came back soon after an earlier stay
            self.promote[key] = self.tick

    def visit_missing(self, key: bytes, lo: int, hi: int) -> None:
        """A read touched slots ``lo..hi`` of a chunk that is not cached: remember it for
        the fill."""
        prev = self._visit(key, lo, hi)
        if prev is None:
            return
        hot = prev != 0 and self.tick - prev < self.ghost_limit()
        if prev and self.tick - prev < self.cap_chunks:  # a miss LRU would have hit
            self._move_share(-1)
        self._misses[key] = (self.tick, hot)
        if len(self._misses) > _MAX_MISSES:  # fills are not coming (the hub is down?)
            self._older_misses, self._misses = self._misses, {}

    def _move_share(self, chunks: int) -> None:
        share = self.protected_share + chunks / self.cap_chunks
        self.protected_share = min(1.0, max(_MIN_PROTECTED_SHARE, share))

    def take_miss(self, key: bytes) -> tuple[int, bool] | None:
        """The (tick, hot) of a recent miss of ``key`` that a fill now answers, if any."""
        found = self._misses.pop(key, None)
        if found is None:
            found = self._older_misses.pop(key, None)
        return found

    def start_batch(self) -> list[tuple[bytes, int]]:
        """Hand the pending promotions (key, tick of its latest re-use), in the order of
        those re-uses, to a write transaction, and age the miss records.

        A miss is kept for two batches, so a fill that takes a while (a hub round trip while
        other fills commit) still finds it.
        """
        # sorted by tick, then key: the protected order follows the re-uses, reproducibly
        promote = sorted(self.promote.items(), key=lambda kt: (kt[1], kt[0]))
        self.promote = {}
        self._older_misses, self._misses = self._misses, {}
        return promote

    def _note_interval(self, gap: int) -> None:
        if self.interval == 0:
            self.interval = float(gap)
        else:
            self.interval += (gap - self.interval) * _EWMA_WEIGHT

    # -- persistence ----------------------------------------------------------------

    def file_bytes(self) -> int:
        """The size of the side file ``save`` writes."""
        return len(_FILE_MAGIC) + _FILE_HEAD.size + self._table.itemsize * len(self._table)

    def save(self, path: Path) -> None:
        """Write the table to ``path`` atomically (from a worker thread or at close)."""
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_FILE_MAGIC)
            f.write(_FILE_HEAD.pack(len(self._table), self.tick, self.interval,
                                    self.protected_share))
            self._table.tofile(f)
        os.replace(tmp, path)

    def load(self, path: Path, tick_floor: int) -> None:
        """Load a saved table if it fits this cache size; the tick never goes back."""
        self.tick = max(self.tick, tick_floor)
        with contextlib.suppress(OSError, ValueError, EOFError, struct.error):
            with open(path, "rb") as f:
                if f.read(len(_FILE_MAGIC)) != _FILE_MAGIC:
                    return
                slots, tick, interval, share = _FILE_HEAD.unpack(f.read(_FILE_HEAD.size))
                if slots != len(self._table):
                    return
                table = array("Q")
                table.fromfile(f, slots)
            self._table = table
            self.tick = max(self.tick, tick)
            self.interval = interval
            self.protected_share = min(1.0, max(_MIN_PROTECTED_SHARE, share))


@dataclass(frozen=True, slots=True)
class Plan:
    """What a write transaction needs from the policy state of the trio thread.

    Attributes:
        tick: the access clock now.
        probation_limit: visits after its arrival by which a probation chunk is dead.
        protected_limit: visits without a visit after which a protected chunk is dead.
        stale_after: visits without a visit after which a protected chunk goes first when
            the segment must shrink (one cache-full: LRU would not have it either).
        protected_cap: bytes the protected segment may hold now.
        hand_budget: protected entries the clock hand may look at for dead chunks.
        promote: probation chunks to move to the protected segment, each with the tick
            of the re-use that earned it (its new stored tick).
        misses: chunk key -> (tick of the read that missed it, whether it is hot), for fills.
        is_visited, last_visit: the access clock's table (read from this thread).
        behind: for a file (by id) a job's running order has passed, the tick when that
            order came (a chunk of it visited since has been read in its epoch), else None;
            None when no order runs (``jobs.orders.Orders.passed``, read from this thread).
    """

    tick: int
    probation_limit: int
    protected_limit: int
    stale_after: int
    protected_cap: int
    hand_budget: int
    promote: list[tuple[bytes, int]]
    misses: dict[bytes, tuple[int, bool]]
    is_visited: Callable[[bytes, int], bool]
    last_visit: Callable[[bytes], int]
    behind: Callable[[int], int | None] | None = None
