"""Prefetch decisions, deterministic: trio's autojump clock and a fake hub with a fixed delay."""

from __future__ import annotations

import os

import trio
from trio.testing import wait_all_tasks_blocked

from spokefs.block_cache import BlockCache
from spokefs.config import PrefetchConfig
from spokefs.fetcher import Fetcher
from spokefs.prefetcher import Prefetcher
from spokefs.reader import Reader
from spokefs.types import FileVersion

from spoke_fakes import FakeHub

MiB = 1 << 20
CFG = PrefetchConfig(window_initial_bytes=512 << 10, window_max_bytes=16 * MiB,
                     request_bytes=2 * MiB, max_inflight_bytes=8 * MiB,
                     small_file_bytes=256 << 10, dir_trigger_files=4)


def setup(tmp_path, files, dirs=None, delay_s=0.03):
    hub = FakeHub(files, delay_s)
    fetcher = Fetcher(BlockCache(tmp_path, 1 << 30), hub)  # type: ignore[arg-type]

    async def lister(dir_id: int) -> list[FileVersion]:
        return (dirs or {}).get(dir_id, [])

    prefetcher = Prefetcher(fetcher, lister, CFG, 1 << 30)
    return hub, prefetcher, Reader(fetcher, prefetcher, CFG.small_file_bytes)


def test_window_grows_on_sequential_reads_and_closes_on_random(tmp_path):
    _, pf, _ = setup(tmp_path, {})
    s = pf.on_open(FileVersion(5, 1, 256 * MiB), 2)
    windows = []
    for i in range(8):
        pf.on_read(s, i * MiB, MiB)
        windows.append(s.window)
    assert windows == [0, 512 << 10, MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 16 * MiB]
    # issued in whole requests: the window's last partial request waits for the next read
    assert 8 * MiB + 16 * MiB - CFG.request_bytes < s.issued_to <= 8 * MiB + 16 * MiB
    epoch = s.epoch
    pf.on_read(s, 200 * MiB, 4096)  # a jump: random access
    assert (s.window, s.issued_to) == (0, 0) and s.epoch == epoch + 1


def test_slightly_out_of_order_reads_still_count_as_sequential(tmp_path):
    _, pf, _ = setup(tmp_path, {})
    s = pf.on_open(FileVersion(5, 1, 256 * MiB), 2)
    for off in (0, 2, 1, 3, 5, 4, 6, 7):
        pf.on_read(s, off * MiB, MiB)
    assert s.window == 16 * MiB


def test_random_reader_queues_nothing(tmp_path):
    _, pf, _ = setup(tmp_path, {})
    s = pf.on_open(FileVersion(5, 1, 1 << 34), 2)
    for i in range(200):
        pf.on_read(s, (i * 7919 % 4001) * 4 * MiB, 4096)
    assert s.window == 0
    assert pf._jobs_rx.statistics().current_buffer_used == 0


async def test_sequential_cold_read_moves_the_file_once(tmp_path, autojump_clock):
    data = os.urandom(48 * MiB + 12345)
    hub, pf, reader = setup(tmp_path, {(5, 1): data})
    async with trio.open_nursery() as nursery:
        await nursery.start(pf.run)
        s = reader.open(FileVersion(5, 1, len(data)), 2)
        for off in range(0, len(data), MiB):
            assert await reader.read(s, off, MiB) == data[off : off + MiB]
        nursery.cancel_scope.cancel()
    moved = sum(length for *_, length in hub.calls)
    assert moved == len(data)  # nothing fetched twice, nothing past EOF
    # 49 reads: two demand reads, a few smaller requests while the window ramps up (one per
    # doubling), then 2 MiB read-ahead requests carry the rest
    ramp = (CFG.request_bytes // CFG.window_initial_bytes).bit_length()
    assert len(hub.calls) <= 2 + ramp + -(-len(data) // CFG.request_bytes)


async def test_demand_reads_do_not_wait_behind_prefetch(tmp_path):
    # real clock: the cache's thread hops would let an autojump clock run past the fetches
    big = os.urandom(64 * MiB)
    other = os.urandom(8 * MiB)
    hub, pf, reader = setup(tmp_path, {(5, 1): big, (6, 1): other}, delay_s=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(pf.run)
        s = reader.open(FileVersion(5, 1, len(big)), 2)
        for off in range(0, 8 * MiB, MiB):  # ramps the window: many prefetches queued
            pf.on_read(s, off, MiB)
        await wait_all_tasks_blocked()
        assert pf._jobs_rx.statistics().current_buffer_used > 0  # prefetches wait for a slot
        t = reader.open(FileVersion(6, 1, len(other)), 3)
        nursery.start_soon(reader.read, t, 5 * MiB, 4096)
        with trio.fail_after(5):
            while (6, 1, 5 * MiB, 4096) not in hub.calls:
                await trio.sleep(0.01)
        # the demand fetch went out at once, while prefetches (1 s each) still wait for a slot
        assert pf._jobs_rx.statistics().current_buffer_used > 0
        nursery.cancel_scope.cancel()


async def test_directory_fill_after_several_opens(tmp_path):
    files = {(100 + i, 1): os.urandom(20_000 + i) for i in range(40)}
    listing = [FileVersion(fid, ver, len(d)) for (fid, ver), d in files.items()]
    hub, pf, reader = setup(tmp_path, files, dirs={7: listing})
    async with trio.open_nursery() as nursery:
        await nursery.start(pf.run)
        for fv in listing[:4]:
            s = reader.open(fv, 7)
            assert await reader.read(s, 0, 4096) == files[(fv.file_id, 1)][:4096]
        rest = listing[4:]
        with trio.fail_after(10):  # real clock: the fill's thread hops need real time
            while await reader._fetcher.cache.complete_files(rest) != set(rest):
                await trio.sleep(0.02)
        calls_before = len(hub.calls)
        for fv in rest:  # the rest is served from the cache
            s = reader.open(fv, 7)
            assert await reader.read(s, 0, fv.size) == files[(fv.file_id, 1)]
        assert len(hub.calls) == calls_before
        nursery.cancel_scope.cancel()
    packed = {key for pack in hub.packs for key in pack}
    assert packed == {(fv.file_id, 1) for fv in listing[4:]} | packed  # at least the rest
    assert len(hub.packs) == 1  # 36 small files, one round trip
