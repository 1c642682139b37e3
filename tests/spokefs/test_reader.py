from __future__ import annotations

import os
import random

import trio

from spokefs.block_cache import BlockCache
from spokefs.config import BLOCK_SIZE
from spokefs.reader import FileVersion, Reader

from spoke_fakes import FakeHub


def make(tmp_path, files, quota=64 << 20, delay_s=0.0):
    hub = FakeHub(files, delay_s)
    return hub, Reader(BlockCache(tmp_path, quota), hub)  # type: ignore[arg-type]


async def test_random_reads_equal_source_slices(tmp_path):
    data = os.urandom(BLOCK_SIZE * 50 + 777)
    hub, reader = make(tmp_path, {(3, 1): data})
    fv = FileVersion(3, 1, len(data))
    rng = random.Random(1)
    for _ in range(300):
        off = rng.randrange(0, len(data) + 5000)
        size = rng.choice([1, 4095, 4096, 4097, 131072, rng.randrange(1, 300000)])
        assert await reader.read(fv, off, size) == data[off : off + size]


async def test_second_read_is_served_from_cache(tmp_path):
    data = os.urandom(BLOCK_SIZE * 8)
    hub, reader = make(tmp_path, {(3, 1): data})
    fv = FileVersion(3, 1, len(data))
    assert await reader.read(fv, 0, len(data)) == data
    assert len(hub.calls) == 1  # one range for one contiguous miss
    assert await reader.read(fv, 100, 5000) == data[100:5100]
    assert len(hub.calls) == 1


async def test_concurrent_misses_are_coalesced(tmp_path, autojump_clock):
    data = os.urandom(BLOCK_SIZE * 16)
    hub, reader = make(tmp_path, {(3, 1): data}, delay_s=0.06)
    fv = FileVersion(3, 1, len(data))
    results: list[bytes] = []

    async def one() -> None:
        results.append(await reader.read(fv, 0, BLOCK_SIZE * 4))

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(one)
    assert results == [data[: BLOCK_SIZE * 4]] * 10
    assert len(hub.calls) == 1


async def test_tiny_cache_still_reads_correctly(tmp_path):
    data = os.urandom(3 << 20)
    hub, reader = make(tmp_path, {(3, 1): data}, quota=1 << 20)
    fv = FileVersion(3, 1, len(data))
    for off in range(0, len(data), 128 << 10):
        assert await reader.read(fv, off, 128 << 10) == data[off : off + (128 << 10)]


async def test_empty_file_and_eof(tmp_path):
    hub, reader = make(tmp_path, {(3, 1): b"", (4, 1): b"abc"})
    assert await reader.read(FileVersion(3, 1, 0), 0, 4096) == b""
    assert await reader.read(FileVersion(4, 1, 3), 0, 4096) == b"abc"
    assert await reader.read(FileVersion(4, 1, 3), 3, 4096) == b""
    assert not [c for c in hub.calls if c[0] == 3]
