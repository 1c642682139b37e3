"""The block cache's LMDB transactions: reads, fills, promotions and drops (eviction, which
runs inside the fills' transactions, is ``cache.eviction``).

``ChunkStore`` owns the environment; each public method is one transaction, run by
``block_cache.BlockCache`` in a worker thread (see its docstring for the policy, the
concurrency protocol and the crash states; ``cache.layout`` for the records). Nothing here
awaits or touches trio; it may raise any ``lmdb.Error``, which the caller sorts out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import xxhash

from spokefs.cache.eviction import Evictor
from spokefs.cache.layout import (
    KEY,
    LAYOUT,
    PINNED,
    PROBATION,
    PROTECTED,
    BadHead,
    CacheState,
    ChunkHead,
    split_blocks,
    tail_len,
)
from spokefs.cache.policy import Plan
from spokefs.cache.residency import resident
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS, CHUNK_SIZE
from spokefs.lmdb_env import open_env
from spokefs.types import FileVersion

ORIGIN_DEMAND = 0
ORIGIN_PREFETCH = 1
ORIGIN_WARM = 2
ORIGIN_REPLAY = 3  # fetched by a trace replay (``replay``); kept like prefetched data
ORIGINS = ("demand", "prefetch", "warm", "replay")

# One write transaction stores at most a batch, and an eviction goes a batch below the quota:
# 1/64 of the cache (at least a chunk, at most 64 MiB). Why so small: LMDB reuses a page
# only from the transaction after the one that freed it (see ``make_room``), so the file
# holds, besides the live pages, the pages the last transaction freed and those the current
# one writes: two batches. At 64 MiB batches that was half of a 128 MiB cache (measured 1.35x
# its size through a mount); at 1/64 it is 3%.
_BATCH_SHARE = 64
_MAX_BATCH = 64 << 20
# Pages of the map that the live pages leave free (``headroom_pages``, see ``put_pieces``):
# those the previous transaction freed and those the current one writes, a batch each; one
# batch for free runs too short for a 16-page chunk (small files of mixed sizes leave them);
# and these pages for B-tree pages copied on write and the free list's own records.
_FREE_BATCHES = 3
_FREE_PAGES = 32
# The file growing into the map's last batch (or a full map) means the free list could not
# serve a fill although the headroom was kept: more short free runs than allowed for, or a
# reader held old pages. Each time the headroom widens by a batch, up to this share of the
# map, so that fills evict earlier from then on; and narrows by a batch again after fills of
# a whole map without the file growing (the workload changed: large files leave no short
# runs), never below where it started.
_MAX_HEADROOM_SHARE = 8


class ChunkStore:
    """The LMDB environment of the block cache and its transactions.

    Attributes:
        max_bytes: the quota on block bytes.
        batch_bytes: the most one write transaction stores, and how far below the quota an
            eviction goes (see ``_BATCH_SHARE``).
        headroom_pages: pages of the map that fills keep free (see ``put_pieces``).
        state: the meta totals as of opening (callers keep the latest returned ones).
    """

    def __init__(self, path: Path, max_bytes: int, window_bytes: int, map_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.batch_bytes = min(_MAX_BATCH, max(CHUNK_SIZE, max_bytes // _BATCH_SHARE))
        self._evictor = Evictor(self, window_bytes)
        # The map is the bound on the file: LMDB never grows data.mdb past it, it says
        # MapFullError instead (the caller then evicts and retries). Fills keep it from
        # coming to that (``put_pieces``). A file already larger (an older spokefs, a smaller
        # --cache-size) keeps its size, as LMDB files never shrink: LMDB raises the map to the
        # pages in use, and the fills evict down to ``map_bytes`` of them.
        self._env = open_env(path, map_size=map_bytes, max_dbs=8, sync=False, metasync=False)
        try:
            self._env.reader_check()  # slots of readers killed with -9 pin old pages
            self._page = self._env.stat()["psize"]
            self._map_pages = map_bytes // self._page
            self._batch_pages = self.batch_bytes // self._page
            self._min_headroom = _FREE_BATCHES * self._batch_pages + _FREE_PAGES
            self.headroom_pages = self._min_headroom
            self._calm_pages = 0  # pages filled since the file last grew
            self._extent = self._env.info()["last_pgno"] + 1  # pages the file has
            self._live = self._extent  # pages in use after the last fill (a guess until one)
            with self._env.begin(write=True) as txn:
                self._migrate(txn)
                self._data = self._env.open_db(b"data", txn=txn)
                self._head = self._env.open_db(b"head", txn=txn)
                self.order_db = self._env.open_db(b"order", txn=txn)
                self._meta = self._env.open_db(b"meta", txn=txn)
                self._dbs = (self._env.open_db(txn=txn), self._data, self._head,
                             self.order_db, self._meta)
                self.state = CacheState.decode(txn.get(b"state", db=self._meta))
                if txn.get(b"layout", db=self._meta) is None:  # once: a reopen writes
                    txn.put(b"layout", bytes([LAYOUT]), db=self._meta)  # nothing (full disk)
        except BaseException:
            self._env.close()
            raise

    def close(self) -> None:
        self._env.close()

    def _migrate(self, txn: lmdb.Transaction) -> None:
        """Drop the databases of an older layout (a cache: nothing is lost but time)."""
        meta = self._env.open_db(b"meta", txn=txn) if txn.get(b"meta") is not None else None
        layout = None if meta is None else txn.get(b"layout", db=meta)
        if layout is not None and bytes(layout) == bytes([LAYOUT]):
            return
        for name in (b"chunks", b"fifo", b"data", b"head", b"order", b"meta"):
            if txn.get(name) is not None:
                txn.drop(self._env.open_db(name, txn=txn), delete=True)

    # -- read transactions ----------------------------------------------------------

    def read(
        self, file_id: int, version: int, offset: int, end: int,
        staged: Callable[[bytes], list[Staged] | None], *, inline: bool = False,
    ) -> ReadResult:
        """The bytes ``[offset, end)`` of a file version, in one read transaction and one copy,
        or which blocks are missing.

        Each chunk of the range comes whole from one place when it can: a piece ``staged``
        for writing (fetched, verified, not yet committed) or the stored chunk, verified with
        its chunk checksum (most of a chunk read) or its block checksums (one or two blocks).
        A chunk whose blocks are spread over both is assembled block by block.

        Raises:
            NotResident: ``inline`` and a stored chunk's bytes are not in RAM (nothing has
                touched them yet): read again from a worker thread.
        """
        res = ReadResult()
        parts: list[memoryview | bytes] = []
        with self._env.begin(buffers=True) as txn:
            for ci in range(offset // CHUNK_SIZE, (end - 1) // CHUNK_SIZE + 1):
                base = ci * CHUNK_SIZE
                a, b = max(offset, base) - base, min(end, base + CHUNK_SIZE) - base
                key = KEY.pack(file_id, version, ci)
                got: list[memoryview | bytes] | None = _from_staged(staged(key), a, b, res)
                if got is None:
                    got = self._from_store(txn, key, a, b, staged(key), res, inline)
                else:
                    res.seen.append((key, None))
                if got is None:
                    first, last = (base + a) // BLOCK_SIZE, (base + b - 1) // BLOCK_SIZE
                    res.missing.extend(range(first, last + 1))
                elif not res.missing:
                    parts.extend(got)
            if not res.missing:
                res.data = b"".join(parts)  # the one copy, inside the transaction
        return res

    def _from_store(
        self, txn: lmdb.Transaction, key: bytes, a: int, b: int, staged: list[Staged] | None,
        res: ReadResult, inline: bool,
    ) -> list[memoryview | bytes] | None:
        """Bytes ``[a, b)`` of a stored chunk, verified; None if any block is not there."""
        lo, hi = a // BLOCK_SIZE, (b - 1) // BLOCK_SIZE
        base_block = KEY.unpack(key)[2] * CHUNK_BLOCKS
        try:
            head, value = self._stored(txn, key)
        except BadHead:
            res.corrupt.extend(range(base_block + lo, base_block + hi + 1))
            res.seen.append((key, None))
            return None
        res.seen.append((key, head))
        if head is None or value is None:
            return _assemble(None, None, staged, a, b, res) if staged else None
        need = ((1 << (hi - lo + 1)) - 1) << lo
        if head.bitmap & need != need:
            return _assemble(head, value, staged, a, b, res)
        view = memoryview(value)
        if inline and not resident(view):
            raise NotResident
        bad = _verify(head, view, lo, hi)
        if bad:
            res.corrupt.extend(base_block + s for s in bad)
            return None
        rank_lo = (head.bitmap & ((1 << lo) - 1)).bit_count()
        da = rank_lo * BLOCK_SIZE + a - lo * BLOCK_SIZE
        res.by_origin[min(head.origin, len(ORIGINS) - 1)] += hi - lo + 1
        return _span(view, head.tail, da, da + b - a)

    def _stored(
        self, txn: lmdb.Transaction, key: bytes
    ) -> tuple[ChunkHead | None, memoryview | bytes | None]:
        """A chunk's header and data value, (None, None) if absent; raises BadHead if the
        header cannot be decoded or has no data."""
        head = self.get_head(txn, key)
        value = None if head is None else txn.get(key, db=self._data)
        if head is not None and value is None:
            raise BadHead("a header without data")
        return head, value

    def get_head(self, txn: lmdb.Transaction, key: bytes) -> ChunkHead | None:
        """The chunk's header, None if absent; raises BadHead if it cannot be decoded."""
        raw = txn.get(key, db=self._head)
        return None if raw is None else ChunkHead.decode(raw)

    def read_head(self, txn: lmdb.Transaction, key: bytes) -> ChunkHead | None:
        try:
            return self.get_head(txn, key)
        except BadHead:
            return None

    def present(self, fv: FileVersion, first: int, last: int) -> set[int]:
        """Chunk indexes among ``first..last`` with all their blocks (headers only)."""
        with self._env.begin(buffers=True) as txn:
            return {ci for ci in range(first, last + 1) if self._chunk_full(txn, fv, ci)}

    def complete(self, files: list[FileVersion]) -> set[FileVersion]:
        """The files cached whole (headers only)."""
        with self._env.begin(buffers=True) as txn:
            return {
                f for f in files
                if all(self._chunk_full(txn, f, ci) for ci in range(f.chunks()))
            }

    def _chunk_full(self, txn: lmdb.Transaction, fv: FileVersion, ci: int) -> bool:
        want = min(CHUNK_BLOCKS, fv.blocks() - ci * CHUNK_BLOCKS)
        if want <= 0:
            return True
        head = self.read_head(txn, KEY.pack(fv.file_id, fv.version, ci))
        return head is not None and (head.bitmap & ((1 << want) - 1)).bit_count() == want

    def cached_bytes(self, files: list[FileVersion]) -> int:
        """Bytes of these files held (headers only)."""
        total = 0
        with self._env.begin(buffers=True) as txn:
            for f in files:
                last_ci, last_slot = divmod(f.blocks() - 1, CHUNK_BLOCKS)
                for ci in range(f.chunks()):
                    head = self.read_head(txn, KEY.pack(f.file_id, f.version, ci))
                    if head is None:
                        continue
                    total += head.bitmap.bit_count() * BLOCK_SIZE
                    if ci == last_ci and head.bitmap >> last_slot & 1:
                        total -= f.blocks() * BLOCK_SIZE - f.size  # the short last block
        return total

    # -- write transactions ---------------------------------------------------------

    def put_pieces(
        self, pieces: list[tuple[bytes, int, memoryview, int]], plan: Plan
    ) -> CacheState:
        """Store ``(chunk key, first slot, contiguous blocks, origin)`` pieces, one transaction;
        evict in it if over quota, or if the pages in use leave less than ``headroom_pages``
        of the map.

        The second rule bounds the file: the pages in use are counted exactly (B-tree and
        data pages of every database: a 2 KiB file takes a 4 KiB page, a chunk header a
        share of a leaf), and the headroom is what a fill needs beyond them. Either rule
        evicts a batch further than it must, so that not every fill evicts.
        """
        extent = self._env.info()["last_pgno"] + 1
        if extent > self._extent:
            self._calm_pages = 0
            if extent > self._map_pages - self._batch_pages:
                self._widen(extent - self._live)
        elif self._calm_pages > self._map_pages and self.headroom_pages > self._min_headroom:
            self._calm_pages = 0
            self.headroom_pages = max(self._min_headroom,
                                      self.headroom_pages - self._batch_pages)
        self._extent = extent
        self._calm_pages += sum(len(piece) for _, _, piece, _ in pieces) // self._page
        with self._writing(plan) as (txn, st):
            for key, slot, piece, origin in pieces:
                self._put_piece(txn, st, key, slot, piece, origin, plan)
            target = st.nbytes
            if st.nbytes > self.max_bytes:
                target = self.max_bytes - self.batch_bytes
            over = self.pages_used(txn) + self.headroom_pages - self._map_pages
            if over > 0:  # a data page holds one block or less: a page frees a page
                target = min(target, st.nbytes - over * self._page - self.batch_bytes)
            if target < st.nbytes:
                self._evictor.evict(txn, st, max(0, target), plan)
            live = self.pages_used(txn)
        self._live = live
        return st

    def pages_used(self, txn: lmdb.Transaction) -> int:
        """Pages the live records take (not the free list's own few), as of ``txn``."""
        pages = 2  # the meta pages
        for db in self._dbs:
            stat = txn.stat(db)
            pages += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        return pages

    def _widen(self, free_pages: int) -> None:
        """The free list could not serve a fill while it held ``free_pages``: keep that many
        free from now on, and a batch more (see ``_MAX_HEADROOM_SHARE``)."""
        cap = max(self.headroom_pages, self._map_pages // _MAX_HEADROOM_SHARE)
        self.headroom_pages = min(cap, max(self.headroom_pages, free_pages) + self._batch_pages)

    def promote(self, plan: Plan) -> CacheState:
        """Only apply the plan's promotions."""
        with self._writing(plan) as (_, st):
            pass
        return st

    def make_room(self, plan: Plan, fraction: int, map_full: bool = False) -> CacheState:
        """Evict ``1/fraction`` of the quota below the current use (the map or disk is full).

        Two commits: LMDB reuses the pages a transaction frees only from the transaction
        after next (the previous snapshot may still be read), so the retry that follows can
        use them. ``map_full``: the headroom the fills keep was too small; widen it (see
        ``_MAX_HEADROOM_SHARE``).
        """
        if map_full:
            self._widen(self._env.info()["last_pgno"] + 1 - self._live)
        with self._writing(None) as (txn, st):
            target = min(st.nbytes, self.max_bytes) - self.max_bytes // fraction
            self._evictor.evict(txn, st, max(0, target), plan)
        with self._writing(None) as (txn, st):
            pass
        return st

    def drop(self, file_id: int, version: int, indexes: list[int]) -> CacheState:
        """Remove blocks that failed their checksum (a chunk left empty goes whole)."""
        with self._writing(None) as (txn, st):
            for ci in sorted({i // CHUNK_BLOCKS for i in indexes}):
                key = KEY.pack(file_id, version, ci)
                bad = {i % CHUNK_BLOCKS for i in indexes if i // CHUNK_BLOCKS == ci}
                self._drop_blocks(txn, st, key, bad)
        return st

    @contextlib.contextmanager
    def _writing(self, plan: Plan | None) -> Iterator[tuple[lmdb.Transaction, CacheState]]:
        """A write transaction with the meta totals, committed with them (or aborted)."""
        with self._env.begin(write=True, buffers=True) as txn:
            st = CacheState.decode(txn.get(b"state", db=self._meta))
            if plan is not None:
                st.tick = max(st.tick, plan.tick)
                self._apply_promotions(txn, st, plan)
            yield txn, st
            txn.put(b"state", st.encode(), db=self._meta)

    def _drop_blocks(
        self, txn: lmdb.Transaction, st: CacheState, key: bytes, bad: set[int]
    ) -> None:
        try:
            head = self.get_head(txn, key)
        except BadHead:
            self.delete_undecodable(txn, st, key)
            return
        value = None if head is None else txn.get(key, db=self._data)
        if head is None or value is None:
            if head is not None:
                self.delete(txn, st, key, head)
            return
        blocks = split_blocks(head, value)
        sums = dict(zip(head.slots(), head.sums, strict=True))
        keep = {s: b for s, b in blocks.items() if s not in bad}
        if not keep:
            self.delete(txn, st, key, head)
            return
        self._account(st, head, -(len(value) + len(head.tail)))
        self._store(txn, st, key, head, keep, sums)

    def _put_piece(
        self, txn: lmdb.Transaction, st: CacheState, key: bytes, slot: int, piece: memoryview,
        origin: int, plan: Plan,
    ) -> None:
        """Store contiguous blocks from ``slot`` on into one chunk (new or merged)."""
        try:
            head = self.get_head(txn, key)
        except BadHead:
            self.delete_undecodable(txn, st, key)
            head = None
        value = None if head is None else txn.get(key, db=self._data)
        if head is None or value is None:  # a new chunk: its bytes as they came, one copy
            if head is not None:  # a header without data
                self.delete(txn, st, key, head)
            head = self._new_head(txn, st, key, origin, plan)
            sums = [
                xxhash.xxh3_64_intdigest(piece[o : o + BLOCK_SIZE])
                for o in range(0, len(piece), BLOCK_SIZE)
            ]
            bitmap = ((1 << len(sums)) - 1) << slot
            self._write_chunk(txn, st, key, head, bitmap, sums, piece)
            return
        # a merge keeps origin, segment and order
        blocks = split_blocks(head, value)
        sums_of = dict(zip(head.slots(), head.sums, strict=True))
        self._account(st, head, -(len(value) + len(head.tail)))
        for n, off in enumerate(range(0, len(piece), BLOCK_SIZE)):
            block = bytes(piece[off : off + BLOCK_SIZE])
            blocks[slot + n] = block
            sums_of[slot + n] = xxhash.xxh3_64_intdigest(block)
        self._store(txn, st, key, head, blocks, sums_of)

    def _new_head(
        self, txn: lmdb.Transaction, st: CacheState, key: bytes, origin: int, plan: Plan
    ) -> ChunkHead:
        """The header of a new chunk, with its order record written and counted."""
        miss = plan.misses.get(key)
        protect = origin == ORIGIN_WARM or (miss is not None and miss[1])
        st.seq += 1
        st.chunks += 1
        # a demand fill starts its stay at the read that missed: that read was its first use
        stored = miss[0] if miss is not None else plan.tick
        head = ChunkHead(0, origin, PROTECTED if protect else PROBATION, st.seq, stored, [], b"")
        if protect:
            st.protected_chunks += 1
        txn.put(head.order_key(), key, db=self.order_db)
        return head

    def _store(
        self, txn: lmdb.Transaction, st: CacheState, key: bytes, head: ChunkHead,
        blocks: dict[int, bytes], sums: dict[int, int],
    ) -> None:
        """Write a chunk from its blocks by slot (its order record exists)."""
        slots = sorted(blocks)
        body = b"".join(blocks[s] for s in slots)
        bitmap = sum(1 << s for s in slots)
        self._write_chunk(txn, st, key, head, bitmap, [sums[s] for s in slots], body)

    def _write_chunk(
        self, txn: lmdb.Transaction, st: CacheState, key: bytes, head: ChunkHead, bitmap: int,
        sums: list[int], body: bytes | memoryview,
    ) -> None:
        """Write a chunk's data and header and count its bytes (its order record exists).
        The data goes from ``body`` into the map in one copy (LMDB's)."""
        cut = len(body) - tail_len(len(body), self._page)
        head.bitmap = bitmap
        head.sums = sums
        head.tail = bytes(body[cut:])
        head.chunk_sum = xxhash.xxh3_64_intdigest(body)
        txn.put(key, body[:cut], db=self._data)
        txn.put(key, head.encode(), db=self._head)
        self._account(st, head, len(body))

    @staticmethod
    def _account(st: CacheState, head: ChunkHead, nbytes: int) -> None:
        st.nbytes += nbytes
        if head.segment == PROTECTED:
            st.protected_bytes += nbytes
        elif head.segment == PINNED:
            st.pinned_bytes += nbytes

    def delete(self, txn: lmdb.Transaction, st: CacheState, key: bytes, head: ChunkHead) -> None:
        """Remove a chunk, its header and its order record, and uncount its bytes."""
        value = txn.pop(key, db=self._data)
        txn.delete(key, db=self._head)
        txn.delete(head.order_key(), db=self.order_db)
        self._account(st, head, -(len(value) + len(head.tail) if value is not None else 0))
        st.chunks -= 1
        if head.segment == PROTECTED:
            st.protected_chunks -= 1

    def delete_undecodable(self, txn: lmdb.Transaction, st: CacheState, key: bytes) -> None:
        """Remove a chunk whose header is garbage (its order record goes when reached)."""
        value = txn.pop(key, db=self._data)
        txn.delete(key, db=self._head)
        st.nbytes -= len(value) if value is not None else 0
        st.chunks -= 1

    def pin(self, fv: FileVersion, limit_bytes: int, tick: int) -> tuple[CacheState, int, int]:
        """Move a file version's chunks to the PINNED segment, all or none.

        Returns the totals, the bytes newly pinned, and the bytes missing (chunks not held
        whole: nothing is pinned then, the caller fetches and tries again). Pinning nothing
        but what fits: if the pinned bytes would exceed ``limit_bytes``, nothing changes and
        the bytes newly pinned are -1.
        """
        with self._writing(None) as (txn, st):
            st.tick = max(st.tick, tick)
            moves: list[tuple[bytes, ChunkHead, int]] = []
            missing = 0
            for ci in range(fv.chunks()):
                key = KEY.pack(fv.file_id, fv.version, ci)
                want = min(CHUNK_BLOCKS, fv.blocks() - ci * CHUNK_BLOCKS)
                head = self.read_head(txn, key)
                value = None if head is None else txn.get(key, db=self._data)
                if head is None or value is None or \
                        (head.bitmap & ((1 << want) - 1)).bit_count() < max(want, 0):
                    missing += min(CHUNK_SIZE, fv.size - ci * CHUNK_SIZE)
                elif head.segment != PINNED:
                    moves.append((key, head, len(value) + len(head.tail)))
            added = sum(n for _, _, n in moves)
            if missing:
                return st, 0, missing
            if st.pinned_bytes + added > limit_bytes:
                return st, -1, 0
            for key, head, nbytes in moves:
                self._move(txn, st, key, head, nbytes, PINNED)
        return st, added, 0

    def unpin(self, file_id: int, tick: int) -> tuple[CacheState, int]:
        """Move every pinned chunk of every version of a file to the PROTECTED segment (it
        was wanted; the clock hand lets it go once nobody reads it). Returns the totals and
        the bytes unpinned."""
        freed = 0
        prefix = KEY.pack(file_id, 0, 0)[:8]
        with self._writing(None) as (txn, st):
            st.tick = max(st.tick, tick)
            cur = txn.cursor(db=self._head)
            keys = []
            if cur.set_range(prefix):
                for key in cur.iternext(values=False):
                    if bytes(key[:8]) != prefix:
                        break
                    keys.append(bytes(key))
            for key in keys:
                head = self.read_head(txn, key)
                value = None if head is None else txn.get(key, db=self._data)
                if head is None or value is None or head.segment != PINNED:
                    continue
                nbytes = len(value) + len(head.tail)
                self._move(txn, st, key, head, nbytes, PROTECTED)
                freed += nbytes
        return st, freed

    def _move(self, txn: lmdb.Transaction, st: CacheState, key: bytes, head: ChunkHead,
              nbytes: int, segment: int) -> None:
        """Move a stored chunk of ``nbytes`` to the end of another segment."""
        self._account(st, head, -nbytes)
        if head.segment == PROTECTED:
            st.protected_chunks -= 1
        txn.delete(head.order_key(), db=self.order_db)
        st.seq += 1
        head.segment, head.seq, head.stored_tick = segment, st.seq, st.tick
        if segment == PROTECTED:
            st.protected_chunks += 1
        self._account(st, head, nbytes)
        txn.put(head.order_key(), key, db=self.order_db)
        txn.put(key, head.encode(), db=self._head)

    def _apply_promotions(self, txn: lmdb.Transaction, st: CacheState, plan: Plan) -> None:
        for key in plan.promote:
            head = self.read_head(txn, key)
            if head is None or head.segment != PROBATION:
                continue
            value = txn.get(key, db=self._data)
            if value is None:
                continue
            txn.delete(head.order_key(), db=self.order_db)
            st.seq += 1
            head.segment, head.seq, head.stored_tick = PROTECTED, st.seq, plan.tick
            txn.put(head.order_key(), key, db=self.order_db)
            txn.put(key, head.encode(), db=self._head)
            st.protected_bytes += len(value) + len(head.tail)
            st.protected_chunks += 1

class NotResident(Exception):
    """An inline read would wait for the disk (see ``residency``)."""


@dataclass(slots=True)
class Staged:
    """Blocks fetched and verified, waiting for the writer: ``data`` holds whole blocks of one
    chunk from ``slot`` on (the file's last block may be short)."""

    slot: int
    data: memoryview
    origin: int


@dataclass(slots=True)
class ReadResult:
    """What ``ChunkStore.read`` found.

    Attributes:
        data: the bytes asked for, or None when blocks are missing.
        on_disk: an inline read stopped before touching stored bytes that are not in RAM.
        missing: block indexes not cached (or corrupt), in order.
        corrupt: block indexes whose stored bytes failed their checksum.
        seen: each stored chunk looked at, with its header (None: not stored or staged).
        by_origin: blocks found, by the origin they arrived by.
    """

    data: bytes | None = None
    on_disk: bool = False
    missing: list[int] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    seen: list[tuple[bytes, ChunkHead | None]] = field(default_factory=list)
    by_origin: list[int] = field(default_factory=lambda: [0] * len(ORIGINS))


def chunk_pieces(
    file_id: int, version: int, runs: list[tuple[int, bytes]]
) -> Iterator[tuple[bytes, int, memoryview]]:
    """Split runs of blocks ``(first block, bytes)`` into ``(chunk key, slot, blocks)``."""
    for first, data in runs:
        view = memoryview(data)
        idx, end = first, first + nblocks(data)
        while idx < end:
            ci, slot = divmod(idx, CHUNK_BLOCKS)
            count = min(CHUNK_BLOCKS - slot, end - idx)
            off = (idx - first) * BLOCK_SIZE
            yield KEY.pack(file_id, version, ci), slot, view[off : off + count * BLOCK_SIZE]
            idx += count


def _span(value: memoryview, tail: bytes, start: int, stop: int) -> list[memoryview | bytes]:
    """``(value + tail)[start:stop]`` without joining them."""
    lv = len(value)
    if stop <= lv:
        return [value[start:stop]]
    if start >= lv:
        return [tail[start - lv : stop - lv]]
    return [value[start:], tail[: stop - lv]]


def _verify(head: ChunkHead, view: memoryview, lo: int, hi: int) -> list[int]:
    """Slots among ``lo..hi`` (all present) whose bytes fail their checksum."""
    if hi - lo >= 2:  # most of a chunk: one hash over all of it
        h = xxhash.xxh3_64()
        h.update(view)
        h.update(head.tail)
        if h.intdigest() == head.chunk_sum:
            return []
    bad: list[int] = []
    rank = (head.bitmap & ((1 << lo) - 1)).bit_count()
    for slot in range(lo, hi + 1):
        start = rank * BLOCK_SIZE
        parts = _span(view, head.tail, start, start + BLOCK_SIZE)
        block = parts[0] if len(parts) == 1 else b"".join(parts)
        if xxhash.xxh3_64_intdigest(block) != head.sums[rank]:
            bad.append(slot)
        rank += 1
    return bad


def _from_staged(
    staged: list[Staged] | None, a: int, b: int, res: ReadResult
) -> list[memoryview | bytes] | None:
    """Bytes ``[a, b)`` of a chunk from one staged piece that holds them all, if any."""
    if not staged:
        return None
    for piece in staged:
        start = piece.slot * BLOCK_SIZE
        if start <= a and b <= start + len(piece.data):
            res.by_origin[min(piece.origin, len(ORIGINS) - 1)] += (
                (b - 1) // BLOCK_SIZE - a // BLOCK_SIZE + 1
            )
            return [piece.data[a - start : b - start]]
    return None


def _assemble(
    head: ChunkHead | None, value: memoryview | bytes | None, staged: list[Staged] | None,
    a: int, b: int, res: ReadResult,
) -> list[memoryview | bytes] | None:
    """Bytes ``[a, b)`` of a chunk whose blocks are partly stored, partly staged (rare)."""
    lo, hi = a // BLOCK_SIZE, (b - 1) // BLOCK_SIZE
    blocks: dict[int, bytes] = {}
    origins: dict[int, int] = {}
    if head is not None and value is not None:
        view = memoryview(value)
        good = {s for s in head.slots() if lo <= s <= hi}
        for slot, data in split_blocks(head, view).items():
            if slot in good and xxhash.xxh3_64_intdigest(data) == head.sums[
                    head.slots().index(slot)]:
                blocks[slot], origins[slot] = data, head.origin
    for piece in staged or ():
        for n in range(nblocks(piece.data)):
            blocks[piece.slot + n] = bytes(piece.data[n * BLOCK_SIZE : (n + 1) * BLOCK_SIZE])
            origins[piece.slot + n] = piece.origin
    if any(s not in blocks for s in range(lo, hi + 1)):
        return None
    for s in range(lo, hi + 1):
        res.by_origin[min(origins[s], len(ORIGINS) - 1)] += 1
    body = b"".join(blocks[s] for s in range(lo, hi + 1))
    return [body[a - lo * BLOCK_SIZE : b - lo * BLOCK_SIZE]]


def nblocks(data: bytes | memoryview) -> int:
    return -(-len(data) // BLOCK_SIZE)
