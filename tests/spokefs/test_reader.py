from __future__ import annotations

import os
import random

import pytest
import trio
from spoke_fakes import FakeHub, poll_until

from spokefs import protocol
from spokefs.cache.block_cache import BlockCache
from spokefs.config import BLOCK_SIZE
from spokefs.errors import HubUnavailable
from spokefs.read.block_source import BlockSource
from spokefs.read.reader import Reader
from spokefs.types import FileVersion

SMALL = 64 << 10
# A safety net, not a timing assertion: a read whose fill never completes (a source that
# stages the wrong blocks, say) fails with HubUnavailable instead of spinning forever.
DEADLINE_S = 30.0


def make(tmp_path, files, quota=64 << 20, delay_s=0.0):
    hub = FakeHub(files, delay_s)
    source = BlockSource(BlockCache(tmp_path, quota), hub,  # type: ignore[arg-type]
                         small_file_bytes=SMALL)
    return hub, Reader(source, None, deadline_s=DEADLINE_S)


async def test_random_reads_equal_source_slices(tmp_path):
    data = os.urandom(BLOCK_SIZE * 50 + 777)
    _, reader = make(tmp_path, {(3, 1): data})
    stream = reader.open(FileVersion(3, 1, len(data)), 2)
    rng = random.Random(1)
    for _ in range(300):
        off = rng.randrange(0, len(data) + 5000)
        size = rng.choice([1, 4095, 4096, 4097, 131072, rng.randrange(1, 300000)])
        assert await reader.read(stream, off, size) == data[off : off + size]


async def test_second_read_is_served_from_cache(tmp_path):
    data = os.urandom(BLOCK_SIZE * 80)
    hub, reader = make(tmp_path, {(3, 1): data})
    stream = reader.open(FileVersion(3, 1, len(data)), 2)
    assert await reader.read(stream, 0, len(data)) == data
    assert len(hub.calls) == 1  # one range for one contiguous miss
    assert await reader.read(stream, 100, 5000) == data[100:5100]
    assert len(hub.calls) == 1


async def test_a_miss_is_answered_from_its_own_request_without_a_copy(tmp_path):
    """A miss whose blocks one request of its own brought is answered from that answer (a
    view of it, checked like every answer); after a partial hit or behind a tier's slice
    the bytes are right too, and they are stored for the next read."""
    mib = protocol.SLICE_DATA_BYTES
    data = os.urandom(3 * mib + 5000)
    hub, reader = make(tmp_path, {(3, 1): data})
    stream = reader.open(FileVersion(3, 1, len(data)), 2)
    got = await reader.read(stream, 70000, 200_000)
    assert isinstance(got, memoryview) and got == data[70000:270000]
    assert await reader.read(stream, 200_000, 300_000) == data[200_000:500_000]  # part held
    hub.align_bytes = mib
    got = await reader.read(stream, mib + 5, 100)  # a slice's worth comes; 100 bytes go
    assert bytes(got) == data[mib + 5 : mib + 105]
    calls = len(hub.calls)
    assert await reader.read(stream, 0, len(data)) == data
    assert len(hub.calls) == calls + 3  # the three slices not held whole yet


async def test_random_reads_fetch_only_their_blocks(tmp_path):
    """Straight to the hub a random 4 KiB read moves one 4 KiB frame, no more."""
    data = os.urandom(BLOCK_SIZE * 1000)
    hub, reader = make(tmp_path, {(3, 1): data})
    stream = reader.open(FileVersion(3, 1, len(data)), 2)
    for idx in random.Random(2).sample(range(1000), 50):
        assert await reader.read(stream, idx * BLOCK_SIZE, BLOCK_SIZE) == data[
            idx * BLOCK_SIZE : (idx + 1) * BLOCK_SIZE
        ]
    assert sum(length for *_, length in hub.calls) == 50 * BLOCK_SIZE


async def test_through_a_tier_ranges_start_and_end_on_the_slice_grid(tmp_path):
    """Behind a tier every range is whole 1 MiB slices (or ends at EOF), and what the
    widened range brought is kept: a read elsewhere in that slice needs no request."""
    mib = protocol.SLICE_DATA_BYTES
    data = os.urandom(3 * mib + 5000)
    hub, reader = make(tmp_path, {(3, 1): data})
    hub.align_bytes = mib  # FakeHub refuses any range off this grid
    stream = reader.open(FileVersion(3, 1, len(data)), 2)
    assert await reader.read(stream, mib + 70000, 4096) == data[mib + 70000 : mib + 74096]
    assert hub.calls == [(3, 1, mib, mib)]
    assert await reader.read(stream, 2 * mib - 4096, 4096) == data[2 * mib - 4096 : 2 * mib]
    assert len(hub.calls) == 1
    assert await reader.read(stream, 3 * mib + 100, 100) == data[3 * mib + 100 : 3 * mib + 200]
    assert hub.calls[-1] == (3, 1, 3 * mib, 5000)  # the last slice ends at EOF
    rng = random.Random(3)
    for _ in range(50):
        off = rng.randrange(0, len(data))
        assert await reader.read(stream, off, 70000) == data[off : off + 70000]


async def test_small_file_is_fetched_whole_on_first_read(tmp_path):
    data = os.urandom(SMALL - 100)
    hub, reader = make(tmp_path, {(3, 1): data})
    stream = reader.open(FileVersion(3, 1, len(data)), 2)
    assert await reader.read(stream, 8192, 100) == data[8192:8292]
    assert hub.calls == [(3, 1, 0, len(data))]
    assert await reader.read(stream, 0, len(data)) == data
    assert len(hub.calls) == 1


async def test_concurrent_misses_are_coalesced(tmp_path, autojump_clock):
    data = os.urandom(BLOCK_SIZE * 160)
    hub, reader = make(tmp_path, {(3, 1): data}, delay_s=0.06)
    stream = reader.open(FileVersion(3, 1, len(data)), 2)
    results: list[bytes] = []

    async def one() -> None:
        results.append(await reader.read(stream, 0, BLOCK_SIZE * 4))

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(one)
    assert results == [data[: BLOCK_SIZE * 4]] * 10
    assert len(hub.calls) == 1


async def test_tiny_cache_still_reads_correctly(tmp_path):
    data = os.urandom(3 << 20)
    _, reader = make(tmp_path, {(3, 1): data}, quota=1 << 20)
    stream = reader.open(FileVersion(3, 1, len(data)), 2)
    for off in range(0, len(data), 128 << 10):
        assert await reader.read(stream, off, 128 << 10) == data[off : off + (128 << 10)]


async def test_empty_file_and_eof(tmp_path):
    hub, reader = make(tmp_path, {(3, 1): b"", (4, 1): b"abc"})
    empty = reader.open(FileVersion(3, 1, 0), 2)
    abc = reader.open(FileVersion(4, 1, 3), 2)
    assert await reader.read(empty, 0, 4096) == b""
    assert await reader.read(abc, 0, 4096) == b"abc"
    assert await reader.read(abc, 3, 4096) == b""
    assert not [c for c in hub.calls if c[0] == 3]


class _DownHub(FakeHub):
    """Every fetch fails after ``deadline_s``, as HubClient does while the hub is away."""

    def __init__(self, deadline_s: float) -> None:
        super().__init__({})
        self.deadline_s = deadline_s

    async def fetch_frames(self, file_id: int, version: int, size: int,
                           start: int, stop: int) -> bytes:
        self.calls.append((file_id, version, start, stop - start))
        await trio.sleep(self.deadline_s)
        raise HubUnavailable("hub away")


async def test_a_read_behind_a_failing_prefetch_fails_within_one_deadline(tmp_path):
    # the read waits for the prefetch of its chunk; when that fails, its own fetch gets only
    # what is left of the read's deadline, not a whole new one. Real clock: the cache's
    # thread hops would let an autojump clock leap past the deadlines under test.
    hub = _DownHub(1.0)
    source = BlockSource(BlockCache(tmp_path, 64 << 20), hub,  # type: ignore[arg-type]
                         small_file_bytes=SMALL)
    reader = Reader(source, None, deadline_s=1.0)
    fv = FileVersion(3, 1, BLOCK_SIZE * 64)
    stream = reader.open(fv, 2)

    async def prefetch() -> None:
        with pytest.raises(HubUnavailable):
            await source.prefetch_range(fv, 0, fv.size)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(prefetch)
        # the prefetch holds the chunk and waits for the hub
        await poll_until(lambda: bool(hub.calls), 0.001)
        await trio.sleep(0.5)
        started = trio.current_time()
        with pytest.raises(HubUnavailable):
            await reader.read(stream, 0, BLOCK_SIZE)
        # one deadline (1 s), not the prefetch's remaining 0.5 s plus a new 1 s of its own;
        # 0.4 s of slack for thread hops on a busy machine
        assert trio.current_time() - started <= 1.4
    assert len(hub.calls) == 2, hub.calls  # the prefetch, then the read's own try
