"""The block cache's LMDB transactions: reads, fills, promotions and drops (eviction, which
runs inside the fills' transactions, is ``cache.eviction``).

``ChunkStore`` owns the environment; each public method is one transaction, run by
``block_cache.BlockCache`` in a worker thread (see its docstring for the policy, the
concurrency protocol and the crash states; ``cache.layout`` for the records). Nothing here
awaits or touches trio; it may raise any ``lmdb.Error``, which the caller sorts out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import lmdb
import xxhash

from spokefs.cache.chunk_reader import (
    ORIGIN_WARM,
    ChunkReader,
    nblocks,
)
from spokefs.cache.eviction import Evictor
from spokefs.cache.layout import (
    KEY,
    LAYOUT,
    ORDER_KEY,
    PINNED,
    PROBATION,
    PROTECTED,
    BadHead,
    CacheState,
    ChunkHead,
    new_chunk_record,
    promoted_head,
    split_blocks,
)
from spokefs.cache.policy import Plan
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS, CHUNK_SIZE
from spokefs.lmdb_env import open_env
from spokefs.types import FileVersion

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


class ChunkStore(ChunkReader):
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

    def check_readers(self) -> int:
        """Free the reader slots of processes that died (a worker killed with -9): a slot
        left behind pins the pages its transaction saw. The slots freed."""
        freed: int = self._env.reader_check()
        return freed

    def _migrate(self, txn: lmdb.Transaction) -> None:
        """Drop the databases of an older layout (a cache: nothing is lost but time)."""
        meta = self._env.open_db(b"meta", txn=txn) if txn.get(b"meta") is not None else None
        layout = None if meta is None else txn.get(b"layout", db=meta)
        if layout is not None and bytes(layout) == bytes([LAYOUT]):
            return
        for name in (b"chunks", b"fifo", b"data", b"head", b"order", b"meta"):
            if txn.get(name) is not None:
                txn.drop(self._env.open_db(name, txn=txn), delete=True)

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
            segment, stored = self._admit(txn, st, key, origin, plan)
            record, cut = new_chunk_record(piece, slot, origin, segment, st.seq, stored,
                                           self._page)
            txn.put(key, piece[:cut], db=self._data)
            txn.put(key, record, db=self._head)
            self._count(st, segment, len(piece))
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

    def _admit(self, txn: lmdb.Transaction, st: CacheState, key: bytes, origin: int,
               plan: Plan) -> tuple[int, int]:
        """A new chunk's segment and stored tick, its order record (seq ``st.seq``) written
        and counted."""
        miss = plan.misses.get(key)
        protect = origin == ORIGIN_WARM or (miss is not None and miss[1])
        st.seq += 1
        st.chunks += 1
        segment = PROTECTED if protect else PROBATION
        if protect:
            st.protected_chunks += 1
        txn.put(ORDER_KEY.pack(segment, st.seq), key, db=self.order_db)
        # a demand fill starts its stay at the read that missed: that read was its first use
        return segment, miss[0] if miss is not None else plan.tick

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
        head.bitmap = bitmap
        head.sums = sums
        cut = head.take(body, self._page)
        txn.put(key, body[:cut], db=self._data)
        txn.put(key, head.encode(), db=self._head)
        self._account(st, head, len(body))

    @classmethod
    def _account(cls, st: CacheState, head: ChunkHead, nbytes: int) -> None:
        cls._count(st, head.segment, nbytes)

    @staticmethod
    def _count(st: CacheState, segment: int, nbytes: int) -> None:
        st.nbytes += nbytes
        if segment == PROTECTED:
            st.protected_bytes += nbytes
        elif segment == PINNED:
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

    def file_chunks(self, txn: lmdb.Transaction, file_id: int) -> list[bytes]:
        """The keys of every cached chunk of every version of a file (its headers)."""
        prefix = KEY.pack(file_id, 0, 0)[:8]
        cur = txn.cursor(db=self._head)
        keys = []
        if cur.set_range(prefix):
            for key in cur.iternext(values=False):
                if bytes(key[:8]) != prefix:
                    break
                keys.append(bytes(key))
        return keys

    def unpin(self, file_id: int, tick: int) -> tuple[CacheState, int]:
        """Move every pinned chunk of every version of a file to the PROTECTED segment (it
        was wanted; the clock hand lets it go once nobody reads it). Returns the totals and
        the bytes unpinned."""
        freed = 0
        with self._writing(None) as (txn, st):
            st.tick = max(st.tick, tick)
            for key in self.file_chunks(txn, file_id):
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
        """Move the plan's probation chunks to protected: headers rewritten from their bytes
        (``promoted_head``), then put with the new order keys in one call per database."""
        heads: list[tuple[bytes, bytearray]] = []
        orders: list[tuple[bytes, bytes]] = []
        head_db, data_db, order_db = self._head, self._data, self.order_db
        for key, tick in plan.promote:
            raw = txn.get(key, db=head_db)
            moved = None if raw is None else promoted_head(raw, st.seq + 1, tick)
            value = None if moved is None else txn.get(key, db=data_db)
            if moved is None or value is None:
                continue
            st.seq += 1
            left, new, tail = moved
            txn.delete(left, db=order_db)
            heads.append((key, new))
            orders.append((ORDER_KEY.pack(PROTECTED, st.seq), key))
            st.protected_bytes += len(value) + tail
            st.protected_chunks += 1
        if heads:  # most write transactions promote nothing: no cursors for them
            with txn.cursor(db=head_db) as cur:
                cur.putmulti(heads)
            with txn.cursor(db=order_db) as cur:
                cur.putmulti(orders)


def chunk_pieces(
    file_id: int, version: int, runs: list[tuple[int, bytes | memoryview]]
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
