from __future__ import annotations

import os

import lmdb

from spokefs.block_cache import BlockCache
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS


def blocks_of(data: bytes, indexes: range) -> list[tuple[int, bytes]]:
    return [(indexes.start, data[indexes.start * BLOCK_SIZE : indexes.stop * BLOCK_SIZE])]


async def test_put_get_roundtrip_with_partial_chunks(tmp_path):
    data = os.urandom(BLOCK_SIZE * 40 + 123)  # last block is short
    cache = BlockCache(tmp_path, 64 << 20)
    await cache.put_runs(7, 1, blocks_of(data, range(3, 5)))
    await cache.put_runs(7, 1, blocks_of(data, range(30, 41)))
    got = await cache.get_blocks(7, 1, 0, 40)
    assert sorted(got) == [3, 4, *range(30, 41)]
    for i, b in got.items():
        assert b == data[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
    assert len(got[40]) == 123
    assert await cache.get_blocks(7, 2, 0, 40) == {}  # another version shares nothing
    cache.close()


async def test_persists_across_reopen(tmp_path):
    data = os.urandom(BLOCK_SIZE * 20)
    cache = BlockCache(tmp_path, 64 << 20)
    await cache.put_runs(9, 9, blocks_of(data, range(20)))
    used = cache.statistics().bytes_used
    cache.close()
    cache = BlockCache(tmp_path, 64 << 20)
    assert cache.statistics().bytes_used == used
    assert len(await cache.get_blocks(9, 9, 0, 19)) == 20
    cache.close()


async def test_full_cache_evicts_and_stays_under_quota(tmp_path):
    quota = 1 << 20
    cache = BlockCache(tmp_path, quota)
    chunk = BLOCK_SIZE * CHUNK_BLOCKS
    for fid in range(2, 60):
        data = os.urandom(chunk)
        await cache.put_runs(fid, 1, blocks_of(data, range(CHUNK_BLOCKS)))
        assert cache.statistics().bytes_used <= quota
    assert cache.statistics().bytes_used > quota // 2
    # the oldest are gone, the newest are there
    assert await cache.get_blocks(2, 1, 0, CHUNK_BLOCKS - 1) == {}
    assert len(await cache.get_blocks(59, 1, 0, CHUNK_BLOCKS - 1)) == CHUNK_BLOCKS
    cache.close()


async def test_corrupt_block_is_dropped_and_reported_missing(tmp_path):
    data = os.urandom(BLOCK_SIZE * 4)
    cache = BlockCache(tmp_path, 64 << 20)
    await cache.put_runs(5, 5, blocks_of(data, range(4)))
    cache.close()
    # flip one byte of block 2 inside the stored value, behind the cache's back
    env = lmdb.open(str(tmp_path), max_dbs=3)
    db = env.open_db(b"chunks")
    with env.begin(write=True) as txn:
        key, value = next(iter(txn.cursor(db=db)))
        value = bytearray(value)
        value[-(BLOCK_SIZE + 10)] ^= 0xFF
        txn.put(key, bytes(value), db=db)
    env.close()
    cache = BlockCache(tmp_path, 64 << 20)
    got = await cache.get_blocks(5, 5, 0, 3)
    assert sorted(got) == [0, 1, 3]
    assert sorted(await cache.get_blocks(5, 5, 0, 3)) == [0, 1, 3]  # dropped, not re-reported
    await cache.put_runs(5, 5, blocks_of(data, range(2, 3)))
    assert (await cache.get_blocks(5, 5, 2, 2))[2] == data[2 * BLOCK_SIZE : 3 * BLOCK_SIZE]
    cache.close()
