"""Eviction: which chunks leave the block cache when it is over its quota, and in what order.

The policy (a scan-resistant two-segment scheme for epochs over datasets larger than the
cache) is described in ``cache.block_cache``'s docstring; the access clock that feeds it is in
``cache.policy``. Everything here runs inside one of ``cache.store.ChunkStore``'s write
transactions, on a worker thread, and bounds how many order records one transaction looks at.
What it needs of that store is ``ChunkRecords`` (the store imports this module, not the
reverse); the policy's decisions come in a ``cache.policy.Plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import lmdb

from spokefs.cache.layout import (
    KEY,
    ORDER_KEY,
    PINNED,
    PROBATION,
    PROTECTED,
    BadHead,
    CacheState,
    ChunkHead,
)
from spokefs.cache.policy import Plan
from spokefs.config import BLOCK_SIZE, CHUNK_SIZE

_SCAN_LIMIT = 1024  # probation entries looked at per victim search (bounds a transaction)
_HAND_LIMIT = 4096  # protected entries the hand looks at per sweep
# probation entries looked at for chunks an order has passed (no header read unless its file
# is behind): past the chunks fetched ahead of the job (a horizon: ~1,300 at 60 ms, 1 Gbit/s)
_BEHIND_SCAN_LIMIT = 16384


class ChunkRecords(Protocol):
    """What the evictor needs of the store whose chunks it removes (``store.ChunkStore``)."""

    order_db: lmdb._Database  # (segment, seq) -> chunk key

    def get_head(self, txn: lmdb.Transaction, key: bytes) -> ChunkHead | None:
        """The chunk's header, None if absent; raises BadHead if it cannot be decoded."""

    def read_head(self, txn: lmdb.Transaction, key: bytes) -> ChunkHead | None:
        """The chunk's header, None if absent or undecodable."""

    def file_chunks(self, txn: lmdb.Transaction, file_id: int) -> list[bytes]:
        """The keys of every cached chunk of every version of a file."""

    def delete(self, txn: lmdb.Transaction, st: CacheState, key: bytes, head: ChunkHead) -> None:
        """Remove a chunk, its header and its order record, and uncount its bytes."""

    def delete_undecodable(self, txn: lmdb.Transaction, st: CacheState, key: bytes) -> None:
        """Remove a chunk whose header is garbage."""


class Evictor:
    """Evicts from one ``ChunkStore`` inside its write transactions.

    Args:
        store: the store whose records it removes.
        window_bytes: the newest fills the "most recently read" rule leaves alone.
    """

    def __init__(self, store: ChunkRecords, window_bytes: int) -> None:
        self._store = store
        self._window_chunks = max(1, window_bytes // CHUNK_SIZE)

    def evict(self, txn: lmdb.Transaction, st: CacheState, target: int, plan: Plan) -> None:
        """Evict until ``st.nbytes <= target``, in the order of the module docstring."""
        start = st.nbytes

        def over() -> bool:
            return st.nbytes > target

        if plan.behind is not None:
            # a job's order says what this epoch reads: what it has passed goes first, and
            # the protected segment's rules (which guess at re-use) wait until it is over
            for segment in (PROBATION, PROTECTED):
                if over():
                    self._evict_behind(txn, st, plan, target, segment)
        else:
            # the hand at its rate (dead protected chunks), then down to the segment's cap,
            # chunks not visited for a while first
            self._sweep(txn, st, plan, plan.hand_budget, lambda: False, plan.protected_limit)

            def capped() -> bool:
                return st.protected_bytes <= plan.protected_cap

            if not capped():
                self._sweep(txn, st, plan, _HAND_LIMIT, capped, plan.stale_after)
                self._sweep(txn, st, plan, _HAND_LIMIT, capped)
        if over():
            self._evict_dead(txn, st, plan, target)
        if over():
            self._evict_newest_read(txn, st, plan, target)
        if over():
            self._evict_oldest(txn, st, target)
        while over() and st.protected_chunks:
            before = st.chunks
            self._sweep(txn, st, plan, _HAND_LIMIT, lambda: not over())
            if st.chunks == before:  # nothing left to find (totals off after corruption)
                break
        st.evicted += start - st.nbytes

    def _remove(
        self, txn: lmdb.Transaction, st: CacheState, order_key: bytes, key: bytes
    ) -> None:
        """Evict the chunk an order record names (or drop the record if it is stale)."""
        try:
            head = self._store.get_head(txn, key)
        except BadHead:
            self._store.delete_undecodable(txn, st, key)
            head = None
        if head is None or head.order_key() != order_key:
            txn.delete(order_key, db=self._store.order_db)
            return
        self._store.delete(txn, st, key, head)

    def _sweep(
        self, txn: lmdb.Transaction, st: CacheState, plan: Plan, budget: int,
        stop: Callable[[], bool], unvisited_for: int = -1,
    ) -> None:
        """Move the protected segment's clock hand over up to ``budget`` entries, evicting
        each, or only those not visited for more than ``unvisited_for`` visits."""
        cur = txn.cursor(db=self._store.order_db)
        for _ in range(min(budget, st.protected_chunks)):
            if stop():
                return
            if not _seek(cur, ORDER_KEY.pack(PROTECTED, st.hand + 1), PROTECTED) and \
                    not _seek(cur, ORDER_KEY.pack(PROTECTED, 0), PROTECTED):
                return
            order_key, key = bytes(cur.key()), bytes(cur.value())
            st.hand = ORDER_KEY.unpack(order_key)[1]
            if unvisited_for >= 0:
                head = self._store.read_head(txn, key)
                seen = max(plan.last_visit(key), head.stored_tick if head else 0)
                if plan.tick - seen <= unvisited_for:
                    continue
            self._remove(txn, st, order_key, key)

    def _evict_dead(self, txn: lmdb.Transaction, st: CacheState, plan: Plan, target: int) -> None:
        """Probation chunks that arrived over ``probation_limit`` visits ago, oldest first."""
        cur = txn.cursor(db=self._store.order_db)
        while st.nbytes > target and _seek(cur, ORDER_KEY.pack(PROBATION, 0), PROBATION):
            order_key, key = bytes(cur.key()), bytes(cur.value())
            head = self._store.read_head(txn, key)
            if head is not None and plan.tick - head.stored_tick <= plan.probation_limit:
                return
            self._remove(txn, st, order_key, key)

    def _evict_behind(
        self, txn: lmdb.Transaction, st: CacheState, plan: Plan, target: int, segment: int
    ) -> None:
        """The segment's newest chunks, window or not, whose file a job's running order
        has passed (``Plan.behind``) and that were visited since that order came (a chunk
        read while it was staged was visited before its stored tick): the order says they
        are not read again this epoch, while every chunk it has not passed yet is.

        A file goes whole: with a chunk, its other chunks that qualify too, in either
        segment. Cut at the excess, chunk by chunk, a file stayed partly cached, and a
        partly cached file is fetched whole when it is read next, so what stayed of it only
        took room: 105 such files, 9.6 MB, at the third epoch of ``train.py``'s spoke-2x-order,
        where the second had 13."""
        behind = plan.behind
        assert behind is not None
        cur = txn.cursor(db=self._store.order_db)
        ok = cur.prev() if cur.set_range(ORDER_KEY.pack(segment + 1, 0)) else cur.last()
        victims: dict[bytes, bytes] = {}  # chunk key -> its order key
        excess = st.nbytes - target

        def passed(key: bytes, since: int) -> bool:
            # not one this transaction stores for a read that missed it: its reader may not
            # have taken the staged bytes yet, and would fetch them again
            return key not in victims and key not in plan.misses and \
                plan.last_visit(key) >= max(1, since)

        for _ in range(_BEHIND_SCAN_LIMIT):
            if not ok or excess <= 0 or cur.key()[0] != segment:
                break
            order_key, key = bytes(cur.key()), bytes(cur.value())
            file_id = KEY.unpack(key)[0]
            if (since := behind(file_id)) is not None and passed(key, since):
                head = self._store.read_head(txn, key)
                victims[key] = order_key
                excess -= len(head.sums) * BLOCK_SIZE if head else 0
                for k in self._store.file_chunks(txn, file_id):
                    if k != key and passed(k, since) and \
                            (head := self._store.read_head(txn, k)) is not None and \
                            head.segment != PINNED:
                        victims[k] = head.order_key()
                        excess -= len(head.sums) * BLOCK_SIZE
            ok = cur.prev()
        for key, order_key in victims.items():
            self._remove(txn, st, order_key, key)

    def _evict_newest_read(
        self, txn: lmdb.Transaction, st: CacheState, plan: Plan, target: int
    ) -> None:
        """The most recently stored probation chunks that have been read, outside the window."""
        cur = txn.cursor(db=self._store.order_db)
        bound = ORDER_KEY.pack(PROBATION, max(0, st.seq - self._window_chunks) + 1)
        ok = cur.prev() if cur.set_range(bound) else cur.last()
        victims: list[tuple[bytes, bytes]] = []
        excess = st.nbytes - target
        for _ in range(_SCAN_LIMIT):
            if not ok or excess <= 0 or cur.key()[0] != PROBATION:
                break
            order_key, key = bytes(cur.key()), bytes(cur.value())
            head = self._store.read_head(txn, key)
            if head is None or plan.is_visited(key, head.stored_tick):
                victims.append((order_key, key))
                excess -= len(head.sums) * BLOCK_SIZE if head else 0
            ok = cur.prev()
        for order_key, key in victims:
            self._remove(txn, st, order_key, key)

    def _evict_oldest(self, txn: lmdb.Transaction, st: CacheState, target: int) -> None:
        """The oldest probation chunks, whatever they are."""
        cur = txn.cursor(db=self._store.order_db)
        while st.nbytes > target and _seek(cur, ORDER_KEY.pack(PROBATION, 0), PROBATION):
            self._remove(txn, st, bytes(cur.key()), bytes(cur.value()))




def _seek(cur: lmdb.Cursor, key: bytes, segment: int) -> bool:
    """Position ``cur`` at the first order record at or after ``key`` within ``segment``."""
    return bool(cur.set_range(key)) and cur.key()[0] == segment
