from __future__ import annotations

import collections
import logging
import os
import random
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest
import trio
import trio.lowlevel
from spoke_fakes import FakeHub, poll_until

from spokefs import metrics
from spokefs.cache import block_cache
from spokefs.cache.block_cache import (
    ORIGIN_DEMAND,
    ORIGIN_PREFETCH,
    ORIGIN_REPLAY,
    ORIGIN_WARM,
    BlockCache,
    CacheStats,
)
from spokefs.cache.layout import (
    KEY,
    PINNED,
    PROBATION,
    PROTECTED,
    BadHead,
    ChunkHead,
    head_bitmap,
    promoted_head,
)
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS, CHUNK_SIZE
from spokefs.read.block_source import BlockSource
from spokefs.read.reader import Reader
from spokefs.types import FileVersion
from tests.helpers.block_cache import cached_blocks, read_range, stage_and_store

REPO = Path(__file__).resolve().parents[2]


def blocks_of(data: bytes, indexes: range) -> list[tuple[int, bytes]]:
    return [(indexes.start, data[indexes.start * BLOCK_SIZE : indexes.stop * BLOCK_SIZE])]


def recount(cache: BlockCache) -> CacheStats:
    """The totals, counted from the records themselves."""
    store = cache._store
    nbytes = chunks = pbytes = pchunks = pinned = 0
    with store._env.begin() as txn:
        for key, raw in txn.cursor(db=store._head):
            head = ChunkHead.decode(raw)
            size = len(txn.get(key, db=store._data)) + len(head.tail)
            nbytes += size
            chunks += 1
            if head.segment == PROTECTED:
                pbytes += size
                pchunks += 1
            elif head.segment == PINNED:
                pinned += size
            assert txn.get(head.order_key(), db=store.order_db) == key
        assert txn.stat(store.order_db)["entries"] == chunks  # one order record per chunk
    return CacheStats(nbytes, cache.max_bytes, chunks, pbytes, pchunks, pinned)


def hits(name: str) -> float:
    return metrics.BLOCK_HITS.labels(origin=name)._value.get()


# -- storage ---------------------------------------------------------------------------


async def test_put_get_roundtrip_with_partial_chunks(tmp_path):
    data = os.urandom(BLOCK_SIZE * 40 + 123)  # last block is short
    cache = BlockCache(tmp_path, 64 << 20)
    await stage_and_store(cache, 7, 1, blocks_of(data, range(3, 5)))
    await stage_and_store(cache, 7, 1, blocks_of(data, range(30, 41)))
    await stage_and_store(cache, 7, 1, blocks_of(data, range(8, 10)))  # merged into chunk 0
    got = await cached_blocks(cache, FileVersion(7, 1, len(data)))
    assert sorted(got) == [3, 4, 8, 9, *range(30, 41)]
    for i, b in got.items():
        assert b == data[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
    assert len(got[40]) == 123
    whole = await read_range(cache, 7, 1, 0, len(data))  # a miss: every absent block named
    absent = set(range(41)) - set(got)
    assert whole.data is None and absent <= set(whole.missing) <= set(range(32))
    tail = await read_range(cache, 7, 1, 30 * BLOCK_SIZE, len(data))  # across two chunks
    assert tail.data == data[30 * BLOCK_SIZE :]
    assert await cached_blocks(cache, FileVersion(7, 2, len(data))) == {}  # another version
    assert cache.statistics() == recount(cache)
    assert cache.statistics().bytes_used == 15 * BLOCK_SIZE - (BLOCK_SIZE - 123)
    cache.close()


async def test_a_full_chunk_takes_exactly_its_pages(tmp_path):
    # 16 blocks + the 16-byte overflow page header would need 17 pages; the last 16 bytes
    # live in the header record instead, so the value takes 16
    cache = BlockCache(tmp_path, 64 << 20)
    data = os.urandom(CHUNK_SIZE * 8)
    await stage_and_store(cache, 3, 1, [(0, data)])
    await stage_and_store(cache, 4, 1, [(5, data[:BLOCK_SIZE])])  # a lone block: one page
    store = cache._store
    with store._env.begin() as txn:
        assert txn.stat(store._data)["overflow_pages"] == 8 * CHUNK_BLOCKS + 1
        assert len(txn.get(KEY.pack(3, 1, 0), db=store._data)) == CHUNK_SIZE - 16
    assert (await read_range(cache, 3, 1, 0, len(data))).data == data
    cache.close()


async def test_persists_across_reopen(tmp_path):
    data = os.urandom(BLOCK_SIZE * 20)
    cache = BlockCache(tmp_path, 64 << 20)
    await stage_and_store(cache, 9, 9, blocks_of(data, range(20)), ORIGIN_WARM)
    stats = cache.statistics()
    assert stats.protected_chunks == 2  # warmed: protected at once
    cache.close()
    cache = BlockCache(tmp_path, 64 << 20)
    assert cache.statistics() == stats == recount(cache)
    assert (await read_range(cache, 9, 9, 0, len(data))).data == data
    cache.close()


async def test_cached_bytes_of_files(tmp_path):
    cache = BlockCache(tmp_path, 64 << 20)
    fv = FileVersion(5, 1, BLOCK_SIZE * 40 + 10)
    data = os.urandom(fv.size)
    assert await cache.cached_bytes([fv]) == 0
    await stage_and_store(cache, 5, 1, blocks_of(data, range(0, 3)))
    await stage_and_store(cache, 5, 1, blocks_of(data, range(39, 41)))
    assert await cache.cached_bytes([fv]) == 4 * BLOCK_SIZE + 10
    assert await cache.cached_bytes([fv, FileVersion(6, 1, 100)]) == 4 * BLOCK_SIZE + 10
    cache.close()


async def test_origin_of_hits_and_merges_keep_the_first(tmp_path):
    cache = BlockCache(tmp_path, 64 << 20)
    data = os.urandom(CHUNK_SIZE * 3)
    await stage_and_store(cache, 1, 1, [(0, data[:BLOCK_SIZE])], ORIGIN_DEMAND)
    await stage_and_store(cache, 1, 1, [(1, data[BLOCK_SIZE:CHUNK_SIZE])],
                          ORIGIN_PREFETCH)  # merged
    await stage_and_store(cache, 1, 1, [(CHUNK_BLOCKS, data[CHUNK_SIZE:2 * CHUNK_SIZE])],
                          ORIGIN_PREFETCH)
    await stage_and_store(cache, 1, 1, [(2 * CHUNK_BLOCKS, data[2 * CHUNK_SIZE:])],
                          ORIGIN_WARM)
    await stage_and_store(cache, 2, 1, [(0, data[:CHUNK_SIZE])], ORIGIN_REPLAY)
    got = await read_range(cache, 1, 1, 0, 3 * CHUNK_SIZE)
    assert got.data == data
    assert got.by_origin == [16, 16, 16, 0]
    got = await read_range(cache, 1, 1, 20 * BLOCK_SIZE, 41 * BLOCK_SIZE)
    assert got.by_origin == [0, 12, 9, 0]
    got = await read_range(cache, 2, 1, 0, CHUNK_SIZE)
    assert got.by_origin == [0, 0, 0, 16]
    cache.close()


async def test_reader_counts_hits_by_origin(tmp_path):
    fv = FileVersion(3, 1, CHUNK_SIZE * 8)
    data = os.urandom(fv.size)
    hub = FakeHub({(3, 1): data})
    cache = BlockCache(tmp_path, 64 << 20)
    source = BlockSource(cache, hub)  # type: ignore[arg-type]
    reader = Reader(source, None)
    stream = reader.open(fv, 2)
    await source.prefetch_range(fv, 0, 4 * CHUNK_SIZE)
    before = {o: hits(o) for o in ("demand", "prefetch", "warm")}
    assert await reader.read(stream, 0, 4 * CHUNK_SIZE) == data[: 4 * CHUNK_SIZE]
    block = data[4 * CHUNK_SIZE : 4 * CHUNK_SIZE + BLOCK_SIZE]
    assert await reader.read(stream, 4 * CHUNK_SIZE, BLOCK_SIZE) == block  # a miss
    assert await reader.read(stream, 4 * CHUNK_SIZE, BLOCK_SIZE) == block  # a demand hit
    assert hits("prefetch") - before["prefetch"] == 4 * CHUNK_BLOCKS
    assert hits("demand") - before["demand"] == 1
    assert hits("warm") == before["warm"]
    cache.close()


# -- capacity -----------------------------------------------------------------------------


async def test_full_cache_evicts_and_stays_under_quota(tmp_path):
    quota = 1 << 20
    cache = BlockCache(tmp_path, quota)
    for fid in range(2, 60):
        data = os.urandom(CHUNK_SIZE)
        await stage_and_store(cache, fid, 1, blocks_of(data, range(CHUNK_BLOCKS)))
        assert cache.statistics().bytes_used <= quota
    assert cache.statistics().bytes_used > quota // 2
    assert cache.statistics() == recount(cache)
    # nothing was read: the oldest went first, the newest are there
    assert (await read_range(cache, 2, 1, 0, CHUNK_SIZE)).missing == list(range(CHUNK_BLOCKS))
    assert (await read_range(cache, 59, 1, 0, CHUNK_SIZE)).data == data
    cache.close()


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


async def _read_through(cache: BlockCache, fid: int, data: bytes, lo: int, hi: int) -> bool:
    """Read ``[lo, hi)`` as the reader does: from the cache, or stage what a miss fetched
    (the writer task stores it behind); True if the bytes came back right."""
    ok = True
    for off in range(lo, hi, 1 << 20):
        end = min(hi, off + (1 << 20))
        res = cache.read(fid, 1, off, end)
        if res.on_disk:
            res = await cache.read_on_disk(fid, 1, off, end)
        if res.data is None:
            first = res.missing[0]
            stop = min(len(data), (res.missing[-1] + 1) * BLOCK_SIZE)
            cache.stage(fid, 1, [(first, data[first * BLOCK_SIZE : stop])])
            res = cache.read(fid, 1, off, end, record=False)
        ok = ok and res.data == data[off:end]
        await trio.lowlevel.checkpoint()  # the writer runs meanwhile, as under FUSE
    return ok


@pytest.mark.parametrize("workload", ["sequential", "small", "churn"])
async def test_the_cache_dir_stays_within_its_bound(tmp_path, workload):
    # blocks/ <= 1.10 x the quota whatever the fills: the LMDB map is that bound, and fills
    # evict early enough (write batches of 1/64 of the cache, headroom for pages freed but
    # not yet reusable) that the map is not full either
    quota = 16 << 20
    bound = BlockCache.bound_bytes(quota)
    assert bound == int(quota * 1.10)
    rng = random.Random(workload)
    if workload == "sequential":  # large files read once, 3x the cache
        files = {fid: 8 << 20 for fid in range(1, 7)}
        reads = [(fid, None) for fid in files]
    elif workload == "small":  # ~110 KiB files in a random order, 2 epochs over 3x the cache
        files = {fid: rng.randrange(96 << 10, 128 << 10) for fid in range(1, 450)}
        reads = [(fid, None) for _ in range(2) for fid in rng.sample(list(files), len(files))]
    else:  # 3 epochs over 3x the cache, mixed sizes, a third of the reads in part
        sizes = [4 << 10, 20 << 10, 110 << 10, 700 << 10, 3 << 20]
        files = {fid: rng.choice(sizes) - rng.randrange(4096) for fid in range(1, 62)}
        reads = [(fid, rng.random() < 1 / 3) for _ in range(3)
                 for fid in rng.sample(list(files), len(files))]
    cache = BlockCache(tmp_path, quota)
    errors = metrics.CACHE_WRITE_ERRORS._value.get()
    peak = 0
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        for fid, part in reads:
            data = random.Random(fid).randbytes(files[fid])
            lo, hi = 0, len(data)
            if part:
                lo = rng.randrange(len(data)) // BLOCK_SIZE * BLOCK_SIZE
                hi = min(hi, lo + rng.randrange(1, 17) * BLOCK_SIZE)
            assert await _read_through(cache, fid, data, lo, hi), fid
            peak = max(peak, _dir_bytes(tmp_path))
        await cache.flush()
        nursery.cancel_scope.cancel()
    assert cache.statistics().bytes_used <= quota
    assert cache.statistics() == recount(cache)
    cache.close()
    peak = max(peak, _dir_bytes(tmp_path))
    assert peak <= bound, f"{workload}: blocks/ reached {peak / quota:.3f}x the quota"
    assert metrics.CACHE_WRITE_ERRORS._value.get() == errors  # no fill dropped


async def test_a_file_larger_than_the_bound_does_not_grow(tmp_path, caplog):
    # a cache made with a larger --cache-size (or by an older spokefs): LMDB files never
    # shrink, but the fills evict down to the new bound's worth of pages and never grow it
    data = os.urandom(CHUNK_SIZE * 16)
    cache = BlockCache(tmp_path, 32 << 20)
    for fid in range(1, 40):
        await stage_and_store(cache, fid, 1, [(0, data)])
    cache.close()
    size = (tmp_path / "data.mdb").stat().st_size
    assert size > BlockCache.bound_bytes(8 << 20)
    with caplog.at_level(logging.WARNING, logger="spokefs.cache.block_cache"):
        cache = BlockCache(tmp_path, 8 << 20)
    assert any("never shrink" in m for m in caplog.messages)
    for fid in range(100, 160):
        await stage_and_store(cache, fid, 1, [(0, data)])
        assert (await read_range(cache, fid, 1, 0, len(data), record=False)).data == data
    assert cache.statistics().bytes_used <= 8 << 20
    assert cache.statistics() == recount(cache)
    cache.close()
    assert (tmp_path / "data.mdb").stat().st_size == size


async def test_pinned_chunks_are_never_evicted_and_pins_are_bounded(tmp_path):
    quota = 1 << 20
    cache = BlockCache(tmp_path, quota)
    keep = FileVersion(1, 1, 3 * CHUNK_SIZE)
    data = os.urandom(keep.size)
    assert await cache.pin(keep, quota // 2) == (0, keep.size)  # nothing cached: nothing done
    await stage_and_store(cache, 1, 1, blocks_of(data, range(3 * CHUNK_BLOCKS)))
    assert await cache.pin(keep, quota // 2) == (keep.size, 0)
    assert await cache.pin(keep, quota // 2) == (0, 0)  # pinned already
    assert cache.statistics().pinned_bytes == keep.size
    big = FileVersion(2, 1, 6 * CHUNK_SIZE)
    await stage_and_store(cache, 2, 1, blocks_of(os.urandom(big.size), range(6 * CHUNK_BLOCKS)))
    assert await cache.pin(big, quota // 2) == (-1, 0)  # 3 + 6 chunks > 8: refused, unchanged
    assert cache.statistics().pinned_bytes == keep.size
    rng = random.Random(2)
    for fid in range(10, 200):  # churn of 12x the cache, with reads: everything else goes
        await stage_and_store(cache, fid, 1, blocks_of(os.urandom(CHUNK_SIZE),
                                                      range(CHUNK_BLOCKS)))
        await read_range(cache, rng.randrange(10, fid + 1), 1, 0, CHUNK_SIZE)
        assert cache.statistics().bytes_used <= quota
    assert await cached_blocks(cache, big) == {}
    assert (await read_range(cache, 1, 1, 0, keep.size)).data == data
    assert cache.statistics() == recount(cache)
    cache.close()
    cache = BlockCache(tmp_path, quota)  # pins persist
    assert cache.statistics().pinned_bytes == keep.size == recount(cache).pinned_bytes
    # unpinning covers every version of the file
    await stage_and_store(cache, 1, 2, blocks_of(data[:CHUNK_SIZE], range(CHUNK_BLOCKS)))
    assert (await cache.pin(FileVersion(1, 2, CHUNK_SIZE), quota // 2))[0] == CHUNK_SIZE
    assert await cache.unpin(1) == keep.size + CHUNK_SIZE
    assert cache.statistics().pinned_bytes == 0
    assert cache.statistics() == recount(cache)
    cache.close()


async def test_random_operations_keep_the_totals_exact(tmp_path):
    quota = 2 << 20
    cache = BlockCache(tmp_path, quota)
    rng = random.Random(4)
    payload = os.urandom(CHUNK_SIZE * 4)
    for _ in range(400):
        fid = rng.randrange(1, 30)
        first = rng.randrange(0, 64)
        if rng.random() < 0.4:
            last = first + rng.randrange(0, 40)
            await read_range(cache, fid, 1, first * BLOCK_SIZE, (last + 1) * BLOCK_SIZE)
        elif rng.random() < 0.1:  # pins: whole files of one chunk, if they are there
            if rng.random() < 0.5:
                await cache.pin(FileVersion(fid, 1, CHUNK_SIZE), quota // 4)
            else:
                await cache.unpin(fid)
        else:
            n = rng.randrange(1, 40) * BLOCK_SIZE - rng.choice([0, 0, 100])
            origin = rng.choice([ORIGIN_DEMAND, ORIGIN_PREFETCH, ORIGIN_WARM, ORIGIN_REPLAY])
            await stage_and_store(cache, fid, 1, [(first, payload[:n])], origin)
        assert cache.statistics().bytes_used <= quota
        assert cache.statistics().pinned_bytes <= quota // 4
    assert cache.statistics() == recount(cache)
    cache.close()
    reopened = BlockCache(tmp_path, quota)
    assert reopened.statistics() == recount(reopened)
    reopened.close()


async def test_a_failed_transaction_leaves_the_totals_alone(tmp_path, monkeypatch):
    cache = BlockCache(tmp_path, 64 << 20)
    await stage_and_store(cache, 1, 1, [(0, os.urandom(CHUNK_SIZE))])
    before = cache.statistics()
    store = type(cache._store)
    real = store._admit  # each new chunk's first write (its order record)
    calls = []

    def fail_on_second(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise lmdb.TxnFullError("injected")
        return real(self, *args)

    monkeypatch.setattr(store, "_admit", fail_on_second)
    errors = metrics.CACHE_WRITE_ERRORS._value.get()
    # one transaction for the three chunks, aborted: no exception, the fill is dropped
    await stage_and_store(cache, 2, 1, [(0, os.urandom(3 * CHUNK_SIZE))])
    assert metrics.CACHE_WRITE_ERRORS._value.get() == errors + 1
    assert cache.statistics() == before == recount(cache)
    missed = await read_range(cache, 2, 1, 0, 3 * CHUNK_SIZE)
    assert missed.missing == list(range(3 * CHUNK_BLOCKS))
    cache.close()


async def test_a_full_map_evicts_and_retries(tmp_path, caplog):
    # a map too small for the quota, and no headroom kept in it (fills keep some, so that
    # the map is rarely full): LMDB says MapFullError long before the quota is reached
    cache = BlockCache(tmp_path, 64 << 20, map_bytes=4 << 20)
    cache._store.headroom_pages = 0
    data = os.urandom(CHUNK_SIZE * 4)
    errors = metrics.CACHE_WRITE_ERRORS._value.get()
    with caplog.at_level(logging.WARNING, logger="spokefs.cache.block_cache"):
        for fid in range(1, 40):  # 10 MiB through a 4 MiB map
            await stage_and_store(cache, fid, 1, [(0, data)])
            assert (await read_range(cache, fid, 1, 0, len(data), record=False)).data == data
    assert metrics.CACHE_WRITE_ERRORS._value.get() == errors
    assert any("full on disk" in m for m in caplog.messages)
    assert cache._store.headroom_pages > 0  # widened: later fills evict before it is full
    assert cache.statistics() == recount(cache)
    assert (tmp_path / "data.mdb").stat().st_size <= 4 << 20  # the map bounds the file
    cache.close()


# -- eviction policy -----------------------------------------------------------------------


async def _epochs(cache: BlockCache, files: int, epochs: int, rng: random.Random,
                  hot_every: int = 0, told: bool = False) -> tuple[list[float], float]:
    """Read ``files`` files of 4 chunks in a shuffled order per epoch; hit ratio per epoch,
    and that of a hot 1-chunk file read every ``hot_every`` chunks (after the first epoch).
    ``told``: the cache knows, as a job's order tells the mount, which files the epoch has
    read so far (``order_passed``)."""
    payload = os.urandom(CHUNK_SIZE)
    order = list(range(1, files + 1))
    ratios, hot_hits, hot_reads, n = [], 0, 0, 0
    passed: set[int] = set()
    since = [0]
    if told:
        cache.order_passed = lambda: lambda f: since[0] if f in passed else None

    async def read(fid: int, ci: int) -> bool:
        got = await read_range(cache, fid, 1, ci * CHUNK_SIZE, (ci + 1) * CHUNK_SIZE)
        if got.data is None:
            await stage_and_store(cache, fid, 1, [(ci * CHUNK_BLOCKS, payload)])
            return False
        return True

    for epoch in range(epochs):
        rng.shuffle(order)
        passed.clear()
        since[0] = cache.tick()
        hit = 0
        for fid in order:
            passed.add(fid)
            for ci in range(4):
                hit += await read(fid, ci)
                n += 1
                if hot_every and n % hot_every == 0:
                    h = await read(10**6, 0)
                    if epoch:
                        hot_hits += h
                        hot_reads += 1
        ratios.append(hit / (files * 4))
    return ratios, hot_hits / max(1, hot_reads)


async def test_epochs_over_a_dataset_larger_than_the_cache_keep_hitting(tmp_path):
    # 4 MiB cache = 64 chunks; dataset 4x: plain LRU gets ~0.03 of reads from the cache
    cache = BlockCache(tmp_path, 4 << 20, window_bytes=4 * CHUNK_SIZE)
    ratios, hot = await _epochs(cache, files=64, epochs=5, rng=random.Random(1), hot_every=40)
    assert ratios[0] == 0
    assert min(ratios[1:]) >= 0.6 * 0.25, ratios  # ideal C/D = 0.25
    assert hot >= 0.95  # the hot file survives the scan
    assert cache.statistics().protected_chunks > 16  # the stable set was promoted
    assert cache.statistics() == recount(cache)
    cache.close()
    # the stable set survives a restart (segments in LMDB, visits in the side file)
    cache = BlockCache(tmp_path, 4 << 20, window_bytes=4 * CHUNK_SIZE)
    ratios, _ = await _epochs(cache, files=64, epochs=1, rng=random.Random(2))
    assert ratios[0] >= 0.6 * 0.25, ratios
    cache.close()


async def test_an_order_told_keeps_the_ideal_share_of_a_dataset_twice_the_cache(tmp_path):
    # the default window (a quarter of a small cache) holds the newest fills, which a shuffled
    # epoch has just read; with the order told, those go first and the cached half stays
    figures = {}
    for told in (False, True):
        cache = BlockCache(tmp_path / str(told), 4 << 20)
        ratios, _ = await _epochs(cache, files=32, epochs=4, rng=random.Random(5), told=told)
        assert cache.statistics() == recount(cache)
        cache.close()
        figures[told] = ratios[1:]
    assert min(figures[True]) >= 0.48, figures  # ideal C/D = 0.50
    assert min(figures[True]) > max(figures[False]), figures


async def test_an_order_told_evicts_the_files_it_has_passed_whole(tmp_path):
    # a file left partly cached is fetched whole when it is read next: what stays of it only
    # takes room, so a file the order has passed goes with all of its chunks
    cache = BlockCache(tmp_path, 4 << 20)
    for seed in range(3):
        await _epochs(cache, files=32, epochs=1, rng=random.Random(seed), told=True)
        held = [await cache.cached_bytes([FileVersion(fid, 1, 4 * CHUNK_SIZE)])
                for fid in range(1, 33)]
        assert [h for h in held if 0 < h < 4 * CHUNK_SIZE] == [], held
    assert cache.statistics() == recount(cache)
    cache.close()


async def test_a_dataset_that_fits_replaces_one_that_is_done(tmp_path):
    cache = BlockCache(tmp_path, 4 << 20, window_bytes=4 * CHUNK_SIZE)
    await _epochs(cache, files=64, epochs=3, rng=random.Random(1))  # 4x, then stop
    payload = os.urandom(CHUNK_SIZE)
    ratios = []
    for _ in range(5):  # 8 files of 4 chunks: half the cache
        hit = 0
        for fid in random.Random(3).sample(range(500, 508), 8):
            for ci in range(4):
                got = await read_range(cache, fid, 1, ci * CHUNK_SIZE, (ci + 1) * CHUNK_SIZE)
                hit += got.data is not None
                if got.data is None:
                    await stage_and_store(cache, fid, 1, [(ci * 16, payload)])
        ratios.append(hit / 32)
    assert ratios[-1] == 1.0, ratios
    cache.close()


async def test_prefetched_chunks_wait_for_their_reader(tmp_path):
    # a full cache of read chunks; chunks prefetched ahead of a reader are not the victims
    cache = BlockCache(tmp_path, 2 << 20, window_bytes=CHUNK_SIZE)
    payload = os.urandom(CHUNK_SIZE)
    for fid in range(1, 33):
        await stage_and_store(cache, fid, 1, [(0, payload)])
        await read_range(cache, fid, 1, 0, CHUNK_SIZE)
    for fid in range(100, 108):  # prefetched, not yet read, while others keep filling
        await stage_and_store(cache, fid, 1, [(0, payload)], ORIGIN_PREFETCH)
    for fid in range(200, 216):
        await read_range(cache, fid, 1, 0, CHUNK_SIZE)
        await stage_and_store(cache, fid, 1, [(0, payload)])
    for fid in range(100, 108):
        assert (await read_range(cache, fid, 1, 0, CHUNK_SIZE)).data == payload, fid
    cache.close()


# -- corruption and crashes ---------------------------------------------------------------


def flip_stored_byte(path, stored: bytes) -> None:
    """Flip one byte inside ``stored`` where it lies in ``path/data.mdb``, behind the
    cache's back (the cache must be closed)."""
    raw = bytearray((path / "data.mdb").read_bytes())
    at = raw.find(stored)
    assert at > 0
    raw[at + 10] ^= 0xFF
    (path / "data.mdb").write_bytes(raw)


async def test_corrupt_block_is_dropped_and_reported_missing(tmp_path):
    """The reader's path: a block that fails its checksum is counted, reported missing (never
    served) and dropped by the writer task, its neighbours kept; a fill stores it again."""
    data = os.urandom(BLOCK_SIZE * 4)
    fv = FileVersion(5, 5, len(data))
    cache = BlockCache(tmp_path, 64 << 20)
    await stage_and_store(cache, 5, 5, blocks_of(data, range(4)))
    cache.close()
    flip_stored_byte(tmp_path, data[2 * BLOCK_SIZE : 2 * BLOCK_SIZE + 64])  # in block 2
    cache = BlockCache(tmp_path, 64 << 20)
    failures = metrics.CHECKSUM_FAILURES._value.get()
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        got = await read_range(cache, 5, 5, 0, len(data))
        assert got.data is None and got.corrupt == [2] and got.missing == [0, 1, 2, 3]
        assert metrics.CHECKSUM_FAILURES._value.get() == failures + 1
        assert not cache.has_file(fv)  # so a fill fetches it again
        assert not cache.holds_chunks_now(fv, 0, 0)
        with trio.fail_after(10):  # the writer drops block 2 alone
            await poll_until(lambda: cache.statistics().bytes_used == 3 * BLOCK_SIZE, 0.01)
        nursery.cancel_scope.cancel()
    assert cache.statistics() == recount(cache)
    got = await cached_blocks(cache, fv)  # dropped, not reported again
    assert sorted(got) == [0, 1, 3]
    assert metrics.CHECKSUM_FAILURES._value.get() == failures + 1
    await stage_and_store(cache, 5, 5, blocks_of(data, range(2, 3)))
    assert (await read_range(cache, 5, 5, 0, len(data))).data == data
    assert cache.has_file(fv) and cache.holds_chunks_now(fv, 0, 0)
    cache.close()


async def test_holds_chunks_counts_stored_and_staged_chunks_whole(tmp_path):
    """``holds_chunks_now`` (which stops at the first chunk missing) says what
    ``present_chunks_now`` says of every range: chunks 0-1 stored, 2 missing, 3 staged, 4
    stored but for one block."""
    data = os.urandom(5 * CHUNK_SIZE)
    fv = FileVersion(9, 1, len(data))
    cache = BlockCache(tmp_path, 64 << 20)
    await stage_and_store(cache, 9, 1, [(0, data[: 2 * CHUNK_SIZE]),
                                        (4 * CHUNK_BLOCKS, data[4 * CHUNK_SIZE : -BLOCK_SIZE])])
    cache.stage(9, 1, [(3 * CHUNK_BLOCKS, data[3 * CHUNK_SIZE : 4 * CHUNK_SIZE])])
    assert cache.present_chunks_now(fv, 0, 4) == {0, 1, 3}
    for first in range(5):
        for last in range(first, 5):
            want = all(ci in (0, 1, 3) for ci in range(first, last + 1))
            assert cache.holds_chunks_now(fv, first, last) == want, (first, last)
    head = FileVersion(9, 1, 2 * CHUNK_SIZE)  # as if the file were its first two chunks
    assert cache.has_files([fv, head]) == [False, True]
    assert not cache.has_file(fv) and cache.has_file(head)
    cache.close()


def test_head_bitmap_is_the_decoded_bitmap_or_none_where_decode_fails():
    """``head_bitmap`` (what "is it held?" reads of a header) agrees with ``ChunkHead.decode``
    on headers of every shape, and refuses what decode refuses."""
    rnd = random.Random(3)
    for _ in range(500):
        bitmap = rnd.randrange(1 << CHUNK_BLOCKS)
        head = ChunkHead(bitmap, rnd.randrange(4), rnd.randrange(3), rnd.randrange(1 << 40),
                         rnd.randrange(1 << 40), [rnd.randrange(1 << 64)
                                                  for _ in range(bitmap.bit_count())],
                         os.urandom(rnd.randrange(17)), rnd.randrange(1 << 64))
        raw = head.encode()
        assert head_bitmap(raw) == ChunkHead.decode(raw).bitmap == bitmap
        fixed = len(raw) - len(head.tail)  # the fields and the sums: cut, no header
        for bad in (raw[: rnd.randrange(fixed)], raw + os.urandom(17),
                    raw[:3] + bytes([3]) + raw[4:]):
            with pytest.raises(BadHead):
                ChunkHead.decode(bad)
            assert head_bitmap(bad) is None


def test_a_promoted_head_is_the_decoded_head_moved_to_protected():
    """``promoted_head`` (the header a promotion writes, made from its bytes) is what
    decoding, changing segment, seq and stored tick, and encoding again gives; it leaves the
    order key the old header had, and refuses what is not a decodable probation header."""
    rnd = random.Random(5)
    for _ in range(300):
        bitmap = rnd.randrange(1, 1 << CHUNK_BLOCKS)
        head = ChunkHead(bitmap, rnd.randrange(4), PROBATION, rnd.randrange(1 << 40),
                         rnd.randrange(1 << 40), [rnd.randrange(1 << 64)
                                                  for _ in range(bitmap.bit_count())],
                         os.urandom(rnd.randrange(17)), rnd.randrange(1 << 64))
        raw = head.encode()
        seq, tick = rnd.randrange(1 << 40), rnd.randrange(1 << 40)
        moved = promoted_head(memoryview(raw), seq, tick)
        assert moved is not None
        left, new, tail = moved
        want = ChunkHead.decode(raw)
        assert left == want.order_key()
        want.segment, want.seq, want.stored_tick = PROTECTED, seq, tick
        assert bytes(new) == want.encode() and tail == len(want.tail)
        assert promoted_head(new, seq + 1, tick) is None  # protected already
        assert promoted_head(raw + os.urandom(17), seq, tick) is None  # undecodable


async def test_a_corrupt_block_fails_a_read_of_most_of_its_chunk(tmp_path):
    """A read of most of a chunk is checked with the one chunk checksum (``chunk_reader._verify``),
    then block by block: a damaged byte anywhere makes its block corrupt and the read a
    miss, never bytes served."""
    data = os.urandom(CHUNK_SIZE)
    cache = BlockCache(tmp_path, 64 << 20)
    await stage_and_store(cache, 5, 5, blocks_of(data, range(CHUNK_BLOCKS)))
    cache.close()
    flip_stored_byte(tmp_path, data[7 * BLOCK_SIZE : 7 * BLOCK_SIZE + 64])  # in block 7
    cache = BlockCache(tmp_path, 64 << 20)
    failures = metrics.CHECKSUM_FAILURES._value.get()
    found = await cache.read_on_disk(5, 5, 0, CHUNK_SIZE, record=False)
    assert found.data is None and found.corrupt == [7]
    assert found.missing == list(range(CHUNK_BLOCKS))
    assert metrics.CHECKSUM_FAILURES._value.get() == failures + 1
    clean = await cache.read_on_disk(5, 5, 8 * BLOCK_SIZE, CHUNK_SIZE, record=False)
    assert clean.data == data[8 * BLOCK_SIZE :]  # the rest of the chunk still verifies
    cache.close()


def _pages(path: Path, want_flags: int) -> list[int]:
    """Page numbers of non-overflow pages with these flags (LMDB page header: pgno u64,
    pad u16, flags u16, then lower/upper or the overflow page count)."""
    raw = (path / "data.mdb").read_bytes()
    pages, pgno = [], 2
    while (pgno + 1) * 4096 <= len(raw):
        flags = struct.unpack_from("<H", raw, pgno * 4096 + 10)[0]
        if flags & 0x04:  # overflow: skip its run
            pgno += struct.unpack_from("<I", raw, pgno * 4096 + 12)[0]
            continue
        if flags & want_flags:
            pages.append(pgno)
        pgno += 1
    return pages


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path / "data.mdb", "r+b") as f:
        f.seek(offset)
        f.write(data)


async def _filled(path: Path) -> None:
    cache = BlockCache(path, 64 << 20)
    data = os.urandom(CHUNK_SIZE * 4)
    for fid in range(1, 200):
        await stage_and_store(cache, fid, 1, [(0, data[: (fid % 4 + 1) * CHUNK_SIZE])])
    cache.close()


def _assert_set_aside(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    aside = [p for p in path.parent.iterdir() if p.name.startswith(path.name + ".corrupt-")]
    assert len(aside) == 1 and (aside[0] / "data.mdb").exists()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "corrupt" in errors[0].getMessage()


async def _assert_empty_and_usable(cache: BlockCache) -> None:
    """A cache set aside starts empty and stores and serves again."""
    assert cache.statistics().bytes_used == 0
    data = os.urandom(CHUNK_SIZE)
    await stage_and_store(cache, 1, 1, [(0, data)])
    assert (await read_range(cache, 1, 1, 0, CHUNK_SIZE)).data == data
    assert cache.statistics() == recount(cache)


async def test_a_torn_meta_page_sets_the_cache_aside_at_open(tmp_path, caplog):
    path = tmp_path / "blocks"
    await _filled(path)
    _overwrite(path, 0, os.urandom(8192))  # both meta pages
    with caplog.at_level(logging.ERROR):
        cache = BlockCache(path, 64 << 20)
    _assert_set_aside(path, caplog)
    await _assert_empty_and_usable(cache)
    cache.close()


async def _open_then_corrupt(path: Path) -> BlockCache:
    """A filled cache, opened (cleanly shut down before: no check), whose B-tree leaf pages
    then all come to say they are something else, behind its back: "Located page was wrong
    type", which LMDB notices deterministically (``lmdb.CorruptedError``) at the next
    lookup. Corruption found while running, not at open (``_open`` sets that aside)."""
    await _filled(path)
    cache = BlockCache(path, 64 << 20)
    assert cache.statistics().bytes_used > 0  # opened as it was
    leaves = _pages(path, 0x02)
    assert leaves
    for pgno in leaves:
        _overwrite(path, pgno * 4096 + 10, b"\x00\x00")
    return cache


async def test_corruption_found_by_a_worker_thread_resets_the_cache(tmp_path, caplog):
    """``_call``: a read in a worker thread (``read_on_disk``) meets a corrupt environment;
    the call is a miss, not an error, and once no thread is inside, the environment is set
    aside and an empty one opened (``_reset``), without the writer task: the cache keeps
    serving, and a clean shutdown of the new one is a clean shutdown."""
    path = tmp_path / "blocks"
    cache = await _open_then_corrupt(path)
    corruptions = metrics.CACHE_CORRUPTIONS._value.get()
    with caplog.at_level(logging.ERROR):
        got = await cache.read_on_disk(7, 1, 0, CHUNK_SIZE)
        assert got.data is None and got.missing == list(range(CHUNK_BLOCKS))
        assert cache.statistics().bytes_used == 0  # the new environment's totals
        assert metrics.CACHE_CORRUPTIONS._value.get() == corruptions + 1
        assert await cache.cached_bytes([FileVersion(7, 1, CHUNK_SIZE)]) == 0
        assert await cache.complete_files([FileVersion(7, 1, CHUNK_SIZE)]) == set()
    _assert_set_aside(path, caplog)
    await _assert_empty_and_usable(cache)
    data = os.urandom(3 * CHUNK_SIZE)
    await stage_and_store(cache, 2, 1, [(0, data)])
    assert await cache.complete_files([FileVersion(2, 1, len(data))]) == {
        FileVersion(2, 1, len(data))}
    cache.close()
    assert (path / "clean-shutdown").exists()
    cache = BlockCache(path, 64 << 20)  # reopened without a check: what it stored is there
    assert (await read_range(cache, 2, 1, 0, len(data))).data == data
    assert cache.statistics() == recount(cache)
    cache.close()


async def test_corruption_found_by_an_inline_read_resets_the_cache(tmp_path, caplog):
    """A read on the trio thread (``read``) cannot wait for the threads inside the
    environment: it reads as a miss and leaves the reset to the writer task."""
    path = tmp_path / "blocks"
    cache = await _open_then_corrupt(path)
    with caplog.at_level(logging.ERROR):
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            got = cache.read(7, 1, 0, CHUNK_SIZE)
            assert got.data is None and got.missing == list(range(CHUNK_BLOCKS))
            assert not cache.has_file(FileVersion(7, 1, CHUNK_SIZE))
            with trio.fail_after(10):
                await poll_until(lambda: cache.statistics().bytes_used == 0, 0.01)
            nursery.cancel_scope.cancel()
    _assert_set_aside(path, caplog)
    await _assert_empty_and_usable(cache)
    cache.close()


async def test_concurrent_readers_of_a_corrupt_cache_all_get_misses(tmp_path, caplog):
    path = tmp_path / "blocks"
    cache = await _open_then_corrupt(path)
    results = []

    async def reader(fid: int) -> None:
        results.append(await cache.read_on_disk(fid, 1, 0, 4 * CHUNK_SIZE))

    async def fill() -> None:
        cache.stage(1000, 1, [(0, os.urandom(CHUNK_SIZE))])
        await cache.flush()

    with caplog.at_level(logging.ERROR):
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            async with trio.open_nursery() as users:
                for fid in range(1, 17):
                    users.start_soon(reader, fid)
                users.start_soon(fill)
            nursery.cancel_scope.cancel()
    assert len(results) == 16
    assert all(r.data is None and r.missing == list(range(4 * CHUNK_BLOCKS)) for r in results)
    _assert_set_aside(path, caplog)  # once, whatever the number of threads that saw it
    assert cache.statistics() == recount(cache)
    cache.close()


async def test_garbage_after_an_unclean_shutdown_is_caught_by_the_check(tmp_path, caplog):
    # random bytes over every B-tree page can crash LMDB itself (SIGSEGV): without the
    # clean-shutdown mark, a child process walks the databases first
    path = tmp_path / "blocks"
    await _filled(path)
    (path / "clean-shutdown").unlink()
    for pgno in _pages(path, 0x01 | 0x02):
        _overwrite(path, pgno * 4096, os.urandom(4096))
    with caplog.at_level(logging.ERROR):
        cache = BlockCache(path, 64 << 20)
    _assert_set_aside(path, caplog)
    assert (await read_range(cache, 3, 1, 0, CHUNK_SIZE)).missing == list(range(CHUNK_BLOCKS))
    cache.close()


_WRITER = textwrap.dedent("""
    import os, sys, trio
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from spokefs.cache.block_cache import BlockCache
    async def main():
        cache = BlockCache(Path(sys.argv[1]), 4 << 20)
        data = os.urandom(1 << 18)
        fid = 0
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            while True:
                fid += 1
                cache.stage(fid, 1, [(0, data)])
                await cache.flush()
                if cache.read(fid - 1, 1, 0, len(data)).on_disk:
                    await cache.read_on_disk(fid - 1, 1, 0, len(data))
                if fid == 20:
                    print("ready", flush=True)
    trio.run(main)
""")


def _kill_9_a_writer(path: Path) -> None:
    """Run ``_WRITER`` on the cache at ``path`` and SIGKILL it in the middle of its writes."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(REPO)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    finally:
        proc.kill()
        proc.wait()


async def test_kill_9_leaves_a_consistent_cache(tmp_path):
    path = tmp_path / "blocks"
    _kill_9_a_writer(path)
    assert not (path / "clean-shutdown").exists()
    cache = BlockCache(path, 4 << 20)  # checked in a child first: it passes
    assert not [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    stats = cache.statistics()
    assert stats == recount(cache)
    assert 0 < stats.bytes_used <= 4 << 20
    store = cache._store
    with store._env.begin() as txn:
        keys = [KEY.unpack(k) for k, _ in txn.cursor(db=store._head)]
    for fid, version, ci in keys:
        got = await read_range(cache, fid, version, ci * CHUNK_SIZE, (ci + 1) * CHUNK_SIZE)
        assert got.data is not None and len(got.data) == CHUNK_SIZE
    cache.close()


async def test_an_older_layout_is_dropped(tmp_path):
    env = lmdb.open(str(tmp_path), max_dbs=3)
    with env.begin(write=True) as txn:
        for name in (b"chunks", b"fifo", b"meta"):
            txn.put(b"x", b"y", db=env.open_db(name, txn=txn))
    env.close()
    (tmp_path / "clean-shutdown").touch()
    cache = BlockCache(tmp_path, 64 << 20)
    assert cache.statistics().bytes_used == 0
    await stage_and_store(cache, 1, 1, [(0, b"z" * 100)])
    assert (await read_range(cache, 1, 1, 0, 100)).data == b"z" * 100
    with cache._store._env.begin() as txn:
        assert txn.get(b"chunks") is None and txn.get(b"fifo") is None
    cache.close()


def _segments(cache: BlockCache) -> collections.Counter[int]:
    """Stored chunks per segment."""
    with cache._store._env.begin() as txn:
        heads = [ChunkHead.decode(v) for _, v in txn.cursor(db=cache._store._head)]
    return collections.Counter(h.segment for h in heads)


async def test_promotions_wait_in_memory_until_a_write_needs_them(tmp_path, monkeypatch):
    """A re-read chunk moves to the protected segment, never written by the read: a warm
    pass over data that fits writes nothing until a transaction that may evict (here a
    fill), ``_PROMOTE_DEFER`` promotions, or the close."""
    monkeypatch.setattr(block_cache, "_PROMOTE_DEFER", 150)
    cache = BlockCache(tmp_path, 64 << 20)
    data = os.urandom(300 * CHUNK_SIZE)

    def read_all(chunks: range) -> None:
        for ci in chunks:
            got = cache.read(1, 1, ci * CHUNK_SIZE, (ci + 1) * CHUNK_SIZE)
            assert got.data == data[ci * CHUNK_SIZE : (ci + 1) * CHUNK_SIZE]

    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        cache.stage(1, 1, [(0, data)])
        await cache.flush()
        read_all(range(300))  # the first use: nothing to promote
        read_all(range(100))  # re-used: pending, not written (a few keys may be forgotten:
        first = len(cache._clock.promote)  # the clock's table is hashed)
        assert first >= 90
        await trio.sleep(0.2)
        assert cache.statistics().protected_chunks == 0
        # a fill carries them (the eviction it may do sees them)
        await stage_and_store(cache, 2, 1, [(0, b"f" * 100)])
        assert cache.statistics().protected_chunks == first and not cache._clock.promote
        read_all(range(100, 300))  # more than 150: the writer writes them alone
        with trio.fail_after(10):
            await poll_until(lambda: cache.statistics().protected_chunks >= first + 150, 0.01)
        nursery.cancel_scope.cancel()
    written = cache.statistics().protected_chunks
    pending = len(cache._clock.promote)
    assert _segments(cache) == {PROTECTED: written, PROBATION: 301 - written}
    cache.close()  # writes the pending ones
    cache = BlockCache(tmp_path, 64 << 20)
    assert cache.statistics().protected_chunks == written + pending
    # each with the tick of its re-use
    await stage_and_store(cache, 3, 1, [(0, data[:CHUNK_SIZE])])
    cache.read(3, 1, 0, CHUNK_SIZE)
    tick = cache.tick()
    cache.read(3, 1, 0, CHUNK_SIZE)
    assert cache._clock.promote == {KEY.pack(3, 1, 0): tick + 1}
    cache.close()
    cache = BlockCache(tmp_path, 64 << 20)
    with cache._store._env.begin() as txn:
        head = ChunkHead.decode(txn.get(KEY.pack(3, 1, 0), db=cache._store._head))
    assert head.segment == PROTECTED and head.stored_tick == tick + 1
    cache.close()


async def test_the_access_clock_is_saved_while_visits_come(tmp_path, autojump_clock):
    """The writer saves the access clock every few minutes while reads visit chunks, so a
    kill -9 (no close) loses at most that much of what eviction has learned."""
    from spokefs.cache.block_cache import _CLOCK_FILE, _CLOCK_SAVE_S
    from spokefs.cache.policy import AccessClock

    cache = BlockCache(tmp_path, 64 << 20)
    data = os.urandom(CHUNK_SIZE)
    await stage_and_store(cache, 5, 1, [(0, data)])
    clock_file = tmp_path / _CLOCK_FILE
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await trio.sleep(_CLOCK_SAVE_S * 2)
        assert not clock_file.exists()  # idle: nothing to save
        for _ in range(3):
            assert (await read_range(cache, 5, 1, 0, CHUNK_SIZE)).data == data
        await trio.sleep(_CLOCK_SAVE_S + 1)
        await poll_until(clock_file.exists, 0.1)
        nursery.cancel_scope.cancel()
    saved = AccessClock(64 << 20)
    saved.load(clock_file, 0)
    assert saved.tick >= 3
    cache.close()
