"""Prefetch decisions, deterministic: trio's autojump clock and a fake hub with a fixed delay."""

from __future__ import annotations

import os

import trio
from spoke_fakes import FakeHub, poll_until
from trio.testing import wait_all_tasks_blocked

from spokefs import protocol
from spokefs.cache.block_cache import BlockCache
from spokefs.config import PrefetchConfig
from spokefs.read.block_source import BlockSource
from spokefs.read.prefetcher import Prefetcher
from spokefs.read.reader import Reader
from spokefs.read.stream import Stream
from spokefs.types import FileVersion

MiB = 1 << 20
CFG = PrefetchConfig(window_initial_bytes=512 << 10, window_max_bytes=16 * MiB,
                     request_bytes=2 * MiB, max_inflight_bytes=8 * MiB,
                     small_file_bytes=256 << 10)


def setup(tmp_path, files, dirs=None, delay_s=0.03):
    """hub, prefetcher, reader, cache, source; run the source while reading (packs)."""
    hub = FakeHub(files, delay_s)
    cache = BlockCache(tmp_path, 1 << 30)

    class Lister:  # one directory level: no siblings; files named in the order given
        async def packs(self, dir_id: int) -> list[protocol.PackPlan]:
            files = (dirs or {}).get(dir_id, [])
            return protocol.plan_packs(dir_id, [(b"%08d" % i, f.file_id, f.version, f.size)
                                            for i, f in enumerate(files)])

        async def pack_of(self, dir_id: int, fv: FileVersion) -> protocol.PackPlan | None:
            for plan in await self.packs(dir_id):
                if (fv.file_id, fv.version, fv.size) in plan.members:
                    return plan
            return None

        async def siblings(self, dir_id: int) -> tuple[int, list[int]]:
            return 0, []

        async def next_file(self, dir_id: int, file_id: int,
                            min_size: int) -> tuple[int, int, int] | None:
            files = [f for f in (dirs or {}).get(dir_id, []) if f.size >= min_size]
            ids = [f.file_id for f in files]
            if file_id not in ids or ids.index(file_id) + 1 == len(ids):
                return None
            f = files[ids.index(file_id) + 1]
            return f.file_id, f.version, f.size

    lister = Lister()
    source = BlockSource(cache, hub, small_file_bytes=CFG.small_file_bytes,  # type: ignore[arg-type]
                         packs=lister)
    prefetcher = Prefetcher(source, lister, CFG, 1 << 30)
    return hub, prefetcher, Reader(source, prefetcher), cache, source


def test_window_grows_on_sequential_reads_and_closes_on_random(tmp_path):
    _, pf, _, _, _ = setup(tmp_path, {})
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
    _, pf, _, _, _ = setup(tmp_path, {})
    s = pf.on_open(FileVersion(5, 1, 256 * MiB), 2)
    for off in (0, 2, 1, 3, 5, 4, 6, 7):
        pf.on_read(s, off * MiB, MiB)
    assert s.window == 16 * MiB


def test_random_reader_queues_nothing(tmp_path):
    _, pf, _, _, _ = setup(tmp_path, {})
    s = pf.on_open(FileVersion(5, 1, 1 << 34), 2)
    for i in range(200):
        pf.on_read(s, (i * 7919 % 4001) * 4 * MiB, 4096)
    assert s.window == 0
    assert pf._jobs_rx.statistics().current_buffer_used == 0


async def test_sequential_cold_read_moves_the_file_once(tmp_path, autojump_clock):
    data = os.urandom(48 * MiB + 12345)
    hub, pf, reader, cache, source = setup(tmp_path, {(5, 1): data})
    async with trio.open_nursery() as nursery:
        await nursery.start(pf.run)
        await nursery.start(source.run)
        await nursery.start(cache.run)
        s = reader.open(FileVersion(5, 1, len(data)), 2)
        for off in range(0, len(data), MiB):
            assert await reader.read(s, off, MiB) == data[off : off + MiB]
        nursery.cancel_scope.cancel()
    moved = sum(length for *_, length in hub.calls)
    assert moved == len(data)  # nothing fetched twice, nothing past EOF
    # 49 reads: two demand reads, a few smaller requests while the window ramps up (one per
    # doubling, and one demand read per doubling that claims its range before the job
    # queued for it reaches a worker), then 2 MiB read-ahead requests carry the rest
    ramp = (CFG.request_bytes // CFG.window_initial_bytes).bit_length()
    assert len(hub.calls) <= 2 + 2 * ramp + -(-len(data) // CFG.request_bytes)


async def test_demand_reads_do_not_wait_behind_prefetch(tmp_path):
    # real clock: the cache's thread hops would let an autojump clock run past the fetches
    big = os.urandom(64 * MiB)
    other = os.urandom(8 * MiB)
    hub, pf, reader, cache, source = setup(tmp_path, {(5, 1): big, (6, 1): other}, delay_s=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(pf.run)
        await nursery.start(source.run)
        await nursery.start(cache.run)
        s = reader.open(FileVersion(5, 1, len(big)), 2)
        for off in range(0, 8 * MiB, MiB):  # ramps the window: many prefetches queued
            pf.on_read(s, off, MiB)
        await wait_all_tasks_blocked()
        assert pf._jobs_rx.statistics().current_buffer_used > 0  # prefetches wait for a slot
        t = reader.open(FileVersion(6, 1, len(other)), 3)
        nursery.start_soon(reader.read, t, 5 * MiB, 4096)
        with trio.fail_after(5):
            await poll_until(lambda: (6, 1, 5 * MiB, 4096) in hub.calls, 0.01)
        # the demand fetch went out at once, while prefetches (1 s each) still wait for a slot
        assert pf._jobs_rx.statistics().current_buffer_used > 0
        nursery.cancel_scope.cancel()


async def test_directory_fill_starts_at_the_first_miss(tmp_path):
    files = {(100 + i, 1): os.urandom(20_000 + i) for i in range(40)}
    listing = [FileVersion(fid, ver, len(d)) for (fid, ver), d in files.items()]
    hub, pf, reader, cache, source = setup(tmp_path, files, dirs={7: listing})
    async with trio.open_nursery() as nursery:
        await nursery.start(pf.run)
        await nursery.start(source.run)
        await nursery.start(cache.run)
        s = reader.open(listing[0], 7)
        assert await reader.read(s, 0, 4096) == files[(listing[0].file_id, 1)][:4096]
        rest = listing[1:]
        with trio.fail_after(10):  # real clock: the cache's writer runs in a thread
            await poll_until(lambda: all(cache.has_file(fv) for fv in rest), 0.02)
        calls_before, packs_before = len(hub.calls), len(hub.packs)
        for fv in rest:  # the rest is served from the cache
            s = reader.open(fv, 7)
            assert await reader.read(s, 0, fv.size) == files[(fv.file_id, 1)]
        assert (len(hub.calls), len(hub.packs)) == (calls_before, packs_before)
        nursery.cancel_scope.cancel()
    packed = [key for pack in hub.packs for key in pack]
    # each file once, all with their directory's pack: the demanded one first in it (straight
    # to the hub the miss asks for a pick of the pack's members, the missed file first)
    assert sorted(packed) == sorted({(fv.file_id, 1) for fv in listing})
    assert hub.packs[0][0] == (listing[0].file_id, 1)
    assert hub.calls == []


async def _demand_one(tmp_path, listing, files, target, *, tier=False, cached=()):
    """Read ``target`` of directory 7 cold (``cached``: stored first); the packs asked for
    and the seconds the read waited. The pack streams one file per 0.1 s."""
    hub, _pf, reader, cache, source = setup(tmp_path, files, dirs={7: listing}, delay_s=0.05)
    hub.through_tier = tier
    hub.per_file_s = 0.1
    async with trio.open_nursery() as nursery:
        await nursery.start(source.run)
        await nursery.start(cache.run)
        for fv in cached:
            cache.stage(fv.file_id, fv.version, [(0, files[(fv.file_id, 1)])])
        s = reader.open(target, 7)
        started = trio.current_time()
        assert await reader.read(s, 0, target.size) == files[(target.file_id, 1)]
        waited = trio.current_time() - started
        nursery.cancel_scope.cancel()
    return hub.packs, waited


async def test_a_missed_file_comes_first_in_a_pick_of_its_pack(tmp_path, autojump_clock):
    files = {(100 + i, 1): os.urandom(20_000 + i) for i in range(40)}
    listing = [FileVersion(fid, ver, len(d)) for (fid, ver), d in files.items()]
    target = listing[30]  # 31st of its pack: at ~3.1 s in the pack's own order
    packs, waited = await _demand_one(tmp_path, listing, files, target, cached=listing[:2])
    assert waited < 0.5, waited  # a round trip and one file, not the 30 members before it
    # one request: the missed file, then the members neither cached nor in flight, in order
    assert packs == [[(target.file_id, 1)] + [(fv.file_id, 1) for fv in listing[2:]
                                              if fv != target]]


async def test_behind_a_tier_a_miss_asks_for_the_pack_itself(tmp_path, autojump_clock):
    files = {(100 + i, 1): os.urandom(20_000 + i) for i in range(40)}
    listing = [FileVersion(fid, ver, len(d)) for (fid, ver), d in files.items()]
    packs, waited = await _demand_one(tmp_path / "tier", listing, files, listing[30], tier=True)
    assert packs == [[(fv.file_id, 1) for fv in listing]]  # one URL per file for the tier
    assert waited > 3.0, waited


async def test_a_pack_of_more_members_than_a_pick_names_is_asked_for_whole(tmp_path,
                                                                          autojump_clock):
    n = protocol.PICK_MAX_FILES + 1
    files = {(100 + i, 1): os.urandom(5_000 + i) for i in range(n)}
    listing = [FileVersion(fid, ver, len(d)) for (fid, ver), d in files.items()]
    packs, _ = await _demand_one(tmp_path, listing, files, listing[-1])
    assert packs == [[(fv.file_id, 1) for fv in listing]]


async def test_a_waiting_reader_gets_its_file_before_its_pack_ends(tmp_path):
    files = {(100 + i, 1): os.urandom(20_000 + i) for i in range(40)}
    listing = [FileVersion(fid, ver, len(d)) for (fid, ver), d in files.items()]
    hub, pf, reader, cache, source = setup(tmp_path, files, dirs={7: listing}, delay_s=0.05)
    hub.per_file_s = 0.1  # the pack streams one file per 0.1 s: 4 s in all
    async with trio.open_nursery() as nursery:
        await nursery.start(pf.run)
        await nursery.start(source.run)
        await nursery.start(cache.run)
        pf.on_miss(Stream(listing[-1], 7))  # a read of the last file missed: fill starts
        with trio.fail_after(5):
            await poll_until(lambda: bool(hub.packs), 0.01)
        target = listing[3]  # 4th in the pack: in after ~0.45 s
        started = trio.current_time()
        s = reader.open(target, 7)
        assert await reader.read(s, 0, target.size) == files[(target.file_id, 1)]
        waited = trio.current_time() - started
        assert waited < 1.5, waited  # not the 4 s of the whole pack
        assert not hub.calls  # it waited for the pack: no second fetch of the same bytes
        nursery.cancel_scope.cancel()


async def test_an_evicted_directory_is_filled_again(tmp_path):
    files = {(100 + i, 1): os.urandom(20_000 + i) for i in range(20)}
    listing = [FileVersion(fid, ver, len(d)) for (fid, ver), d in files.items()]
    hub, pf, reader, cache, source = setup(tmp_path, files, dirs={7: listing})
    async with trio.open_nursery() as nursery:
        await nursery.start(pf.run)
        await nursery.start(source.run)
        await nursery.start(cache.run)
        pf.on_miss(Stream(listing[-1], 7))
        with trio.fail_after(10):
            await poll_until(lambda: all(cache.has_file(fv) for fv in listing), 0.02)
        await cache.flush()
        for fv in listing:  # as an eviction would
            await cache._write("drop", fv.file_id, fv.version, list(range(fv.blocks())))
        assert not any(cache.has_file(fv) for fv in listing)
        packs_before = len(hub.packs)
        s = reader.open(listing[5], 7)  # a later epoch misses a file of the filled directory
        assert await reader.read(s, 0, 100) == files[(listing[5].file_id, 1)][:100]
        with trio.fail_after(10):
            await poll_until(lambda: all(cache.has_file(fv) for fv in listing), 0.02)
        assert len(hub.packs) > packs_before
        nursery.cancel_scope.cancel()


async def test_a_directory_whose_first_read_hits_is_not_listed(tmp_path):
    files = {(100 + i, 1): os.urandom(20_000 + i) for i in range(10)}
    listing = [FileVersion(fid, ver, len(d)) for (fid, ver), d in files.items()]
    hub, pf, reader, cache, source = setup(tmp_path, files, dirs={7: listing})
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        cache.stage(100, 1, [(0, files[(100, 1)])])  # cached, as after a restart
        await cache.flush()
        await nursery.start(pf.run)
        await nursery.start(source.run)
        s = reader.open(listing[0], 7)
        assert await reader.read(s, 0, 4096) == files[(100, 1)][:4096]
        await trio.sleep(0.5)
        assert not hub.packs and not hub.calls  # a hit starts no fill
        nursery.cancel_scope.cancel()


def test_new_stream_window_starts_at_the_links_bandwidth_delay_product(tmp_path):
    hub, pf, _, _, _ = setup(tmp_path, {})
    hub.rtt_s = 0.05  # 1 Gbit/s assumed until measured: 6.25 MB in flight fill the link
    s = pf.on_open(FileVersion(5, 1, 256 * MiB), 2)
    pf.on_read(s, 0, MiB)
    pf.on_read(s, MiB, MiB)
    assert s.window == int(CFG.assumed_link_bytes_per_s * 0.05)  # no ramp from 512 KiB
    hub.rtt_s = 0.9
    t = pf.on_open(FileVersion(6, 1, 256 * MiB), 2)
    pf.on_read(t, 0, MiB)
    pf.on_read(t, MiB, MiB)
    assert t.window == CFG.window_max_bytes  # at most the largest window


async def test_read_ahead_requests_go_out_nearest_first(tmp_path, autojump_clock):
    """A window that opens at once queues many requests: they reach the hub in the file's
    order, so the one a reader waits for is not behind the far ones. (With a task per job
    waiting on the limiter, trio ran each batch of them in either order.)"""
    files = {(100 + i, 1): os.urandom(24 * MiB) for i in range(6)}
    hub, pf, _, cache, source = setup(tmp_path, files)
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(pf.run)
        await nursery.start(source.run)
        for (fid, ver), data in files.items():
            s = pf.on_open(FileVersion(fid, ver, len(data)), 7)
            for off in range(0, 8 * MiB, MiB):  # the window opens to 16 MiB in one go
                pf.on_read(s, off, MiB)
            await trio.sleep(10)  # the fake hub's delays, on the autojump clock
        nursery.cancel_scope.cancel()
    for fid, _ in files:
        starts = [start for f, _, start, _ in hub.calls if f == fid]
        assert len(starts) >= 8 and starts == sorted(starts), starts


async def test_read_ahead_requests_start_at_about_the_links_rate(tmp_path, autojump_clock):
    """A window that opens at once does not send its requests all at once: they start at
    1.5 times the link's rate (after a short burst), so that they do not share the link as
    one batch that lands together."""
    data = os.urandom(80 * MiB)
    hub, pf, _, cache, source = setup(tmp_path, {(5, 1): data}, delay_s=0.01)
    rate = 100e6  # what the prefetcher assumes before it has measured the link
    pf = Prefetcher(source, pf._lister, PrefetchConfig(
        window_initial_bytes=64 * MiB, window_max_bytes=64 * MiB, request_bytes=2 * MiB,
        max_inflight_bytes=256 * MiB, small_file_bytes=256 << 10,
        assumed_link_bytes_per_s=rate), 1 << 30)
    started: list[float] = []
    fetch = hub.fetch_frames

    async def timed(*args: int) -> bytes:
        started.append(trio.current_time())
        return await fetch(*args)

    hub.fetch_frames = timed  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(pf.run)
        await nursery.start(source.run)
        s = pf.on_open(FileVersion(5, 1, len(data)), 7)
        pf.on_read(s, 0, MiB)
        pf.on_read(s, MiB, MiB)  # the window opens: 64 MiB, 32 requests
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert len(started) == 32
    gap = 2 * MiB / (1.5 * rate)
    span = started[-1] - started[0]
    # all but the burst's few go out one gap apart (the fake hub is no limit: 10 ms each)
    assert (32 - 5) * gap <= span <= 32 * gap, (span, gap)


async def test_a_run_of_shards_is_read_ahead_across_file_ends(tmp_path, autojump_clock):
    shards = {(100 + i, 1): os.urandom(6 * MiB + 1000 * i) for i in range(4)}
    listing = [FileVersion(fid, ver, len(d)) for (fid, ver), d in shards.items()]
    hub, pf, reader, cache, source = setup(tmp_path, shards, dirs={7: listing})
    async with trio.open_nursery() as nursery:
        await nursery.start(pf.run)
        await nursery.start(source.run)
        await nursery.start(cache.run)
        for fv in listing[:2]:  # a reader takes the first two shards in name order
            s = reader.open(fv, 7)
            if fv == listing[1]:
                assert s.window and s.issued_to > 0  # the successor, read ahead already
                assert s.in_run  # so its own spill may also cover the requests in flight
                assert pf.spill_bytes(s) > pf.spill_bytes()
            for off in range(0, fv.size, MiB):
                data = await reader.read(s, off, MiB)
                assert data == shards[(fv.file_id, 1)][off : off + MiB]
            reader.close(s)
        await wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    moved = {fid: 0 for fid, _ in shards}
    for fid, _, _, length in hub.calls:
        moved[fid] += length
    assert moved[100] == listing[0].size and moved[101] == listing[1].size  # once each
    # the reader stopped after two shards: what was read ahead past them is the bound
    overshoot = moved[102] + moved[103]
    assert 0 < overshoot <= pf.spill_bytes(s) + CFG.request_bytes


async def test_a_jump_cuts_off_the_next_shard(tmp_path, autojump_clock):
    shards = {(100 + i, 1): os.urandom(12 * MiB) for i in range(2)}
    listing = [FileVersion(fid, ver, len(d)) for (fid, ver), d in shards.items()]
    _, pf, reader, _, source = setup(tmp_path, shards, dirs={7: listing})
    async with trio.open_nursery() as nursery:
        await nursery.start(pf.run)
        await nursery.start(source.run)
        s = reader.open(listing[0], 7)
        for off in range(0, 10 * MiB, MiB):  # nears the end: the window spills over
            pf.on_read(s, off, MiB)
        await wait_all_tasks_blocked()
        succ = s.successor
        assert succ is not None and succ.fv == listing[1] and succ.issued_to > 0
        pf.on_read(s, 0, 4096)  # the reader went back to the start
        assert s.successor is None and succ.closed
        assert pf.on_open(listing[1], 7) is not succ  # a fresh stream when it comes
        nursery.cancel_scope.cancel()


async def test_a_readdir_arms_its_directory_and_the_next_miss_fills_it(tmp_path):
    # find over a large tree reads no file: its readdirs must not set off fills
    files = {(100 + i, 1): os.urandom(20_000 + i) for i in range(10)}
    listing = [FileVersion(fid, ver, len(d)) for (fid, ver), d in files.items()]
    other = FileVersion(999, 1, 5000)
    files[(999, 1)] = os.urandom(5000)
    hub, pf, reader, cache, source = setup(tmp_path, files, dirs={7: listing, 8: [other]})
    async with trio.open_nursery() as nursery:
        await nursery.start(pf.run)
        await nursery.start(source.run)
        await nursery.start(cache.run)
        pf.on_readdir(7)
        await trio.sleep(1)
        assert not hub.packs and not hub.calls  # armed, not filled
        s = reader.open(other, 8)  # a reader misses elsewhere: armed directories go too
        assert await reader.read(s, 0, other.size) == files[(999, 1)]
        with trio.fail_after(10):
            await poll_until(lambda: all(cache.has_file(fv) for fv in listing), 0.02)
        pf.on_readdir(9)  # while reads miss, a readdir fills at once
        assert 9 in pf.dirs._dirs
        nursery.cancel_scope.cancel()


async def test_fills_queued_while_an_order_runs_are_dropped(tmp_path):
    """While a job's order runs (``pause_while``) the fills queued are dropped, not kept for
    later: once the order is over they are stale, and in a cache smaller than the data set
    they would push out what the order kept. A miss after that fills again."""
    files = {(100 + i, 1): os.urandom(20_000 + i) for i in range(20)}
    listing = [FileVersion(fid, ver, len(d)) for (fid, ver), d in files.items()]
    hub, pf, _reader, cache, source = setup(tmp_path, files, dirs={7: listing})
    ordered = [True]
    pf.dirs.pause_while(lambda: ordered[0])
    async with trio.open_nursery() as nursery:
        await nursery.start(pf.run)
        await nursery.start(source.run)
        await nursery.start(cache.run)
        pf.dirs.on_miss(listing[-1], 7)
        await trio.sleep(0.5)  # listed and queued, then dropped
        ordered[0] = False
        await trio.sleep(0.5)
        assert hub.packs == []
        pf.dirs.on_miss(listing[3], 7)
        with trio.fail_after(10):
            await poll_until(lambda: all(cache.has_file(fv) for fv in listing), 0.02)
        nursery.cancel_scope.cancel()


async def test_packs_stop_when_what_they_bring_leaves_the_cache_unread(tmp_path, monkeypatch):
    """A cache smaller than what the readers go through: each miss's directory pack pushes
    the last packs' files out before anyone reads them. Once most of what was prefetched
    left unread, misses fetch their file alone (for a while), not the pack."""
    from spokefs.read import block_source as block_source_module
    monkeypatch.setattr(block_source_module, "_WASTE_WINDOW_BYTES", 1 << 20)
    monkeypatch.setattr(block_source_module, "_WASTE_CHECK_S", 0.0)
    dirs = {d: [FileVersion(1000 * d + i, 1, 20_000 + i) for i in range(20)]
            for d in range(1, 31)}
    files = {(f.file_id, 1): os.urandom(f.size) for fs in dirs.values() for f in fs}
    hub, _pf, reader, unused, source = setup(tmp_path, files, dirs=dirs)
    unused.close()
    small = BlockCache(tmp_path / "small", 1 << 20)  # 1 MiB: two or three packs
    source._cache = small
    async with trio.open_nursery() as nursery:
        await nursery.start(source.run)
        await nursery.start(small.run)
        assert source.speculation_pays()
        for d, fs in dirs.items():  # one file read in each directory, the rest never
            s = reader.open(fs[0], d)
            assert await reader.read(s, 0, fs[0].size) == files[(fs[0].file_id, 1)]
            await small.flush()
        assert not source.speculation_pays()
        packs = len(hub.packs)
        for d, fs in dirs.items():  # held: a miss brings its own file only
            s = reader.open(fs[1], d)
            assert await reader.read(s, 0, fs[1].size) == files[(fs[1].file_id, 1)]
        assert len(hub.packs) == packs
        nursery.cancel_scope.cancel()
    small.close()
