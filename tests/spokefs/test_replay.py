"""The replayer against a real block cache and a fake hub: the trace's working set in
first-access order, small files in picks (the uncached ones, in the trace's order) and large ones in
ranges of their extents only,
what is cached skipped (a rerun fetches nothing), the cache's bound respected, and the
replayed blocks counted under their own origin."""

from __future__ import annotations

import os
import time

import trio
from spoke_fakes import FakeHub, poll_until

from spokefs import protocol
from spokefs.cache.block_cache import ORIGIN_REPLAY, BlockCache
from spokefs.config import CHUNK_SIZE
from spokefs.hub.link_model import LinkReach
from spokefs.jobs import order_position
from spokefs.jobs import replay as replay_module
from spokefs.jobs.replay import Replayer
from spokefs.jobs.trace_file import Entry, Resolved, Target
from spokefs.read.block_source import BlockSource
from spokefs.read.trace import EXTENT_BYTES
from spokefs.types import FileVersion
from tests.helpers.block_cache import read_range

REQUEST = 3 << 20


def _setup(tmp_path, files: dict[str, bytes], budget: int = 1 << 40):
    fvs = {path: FileVersion(n + 1, 1, len(data)) for n, (path, data) in enumerate(files.items())}
    dir_ids = {d: 1000 + n for n, d in enumerate(sorted({p.rpartition("/")[0] for p in files}))}
    hub = FakeHub({(fv.file_id, 1): files[p] for p, fv in fvs.items()}, delay_s=0.01)
    cache = BlockCache(tmp_path, 1 << 30)
    source = BlockSource(cache, hub)  # type: ignore[arg-type]

    def resolve(entries: list[Entry]) -> Resolved:
        targets = [Target(fvs[e.path], e.extents, dir_ids[e.path.rpartition("/")[0]])
                   for e in entries if e.path in fvs]
        return Resolved(targets, 0, sum(1 for e in entries if e.path not in fvs))

    replayer = Replayer(source, LinkReach(lambda: 0, lambda: None, 1e8), resolve,
                        small_file_bytes=1 << 20,
                        request_bytes=REQUEST, max_inflight_bytes=64 << 20,
                        budget_bytes=lambda: budget)
    return hub, cache, replayer, fvs


def _order_replayer(first: Replayer, *, budget: int, horizon: int) -> Replayer:
    """A replayer of orders (a horizon) on ``first``'s source and namespace."""
    return Replayer(first._source, LinkReach(lambda: 0, lambda: None, 1e8), first._resolve,
                    small_file_bytes=1 << 20, request_bytes=REQUEST,
                    max_inflight_bytes=64 << 20, budget_bytes=lambda: budget,
                    horizon_bytes=lambda: horizon)


def _picked(hub: FakeHub) -> int:
    """Files the hub has sent in packs and picks."""
    return sum(len(p) for p in hub.packs)


async def _finished(replayer: Replayer) -> None:
    """Until no replay is resolving or running (what ``spokefs warm --trace`` polls)."""
    await poll_until(lambda: replayer.progress().state not in ("resolving", "running"), 0.01)


async def _replay(replayer: Replayer, cache: BlockCache, entries: list[Entry]):
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(replayer.run)
        replayer.start(entries, "t")
        await _finished(replayer)
        await cache.flush()
        nursery.cancel_scope.cancel()
    return replayer.progress()


async def test_first_access_order_packs_and_extents(tmp_path):
    files = {f"d/{i}.jpg": os.urandom(50_000 + i) for i in range(6)}
    files["e/0.jpg"] = os.urandom(60_000)
    files["big.tar"] = os.urandom(3 * EXTENT_BYTES + 1000)
    hub, cache, replayer, fvs = _setup(tmp_path, files)
    order = ["d/4.jpg", "d/1.jpg", "big.tar", "e/0.jpg", "d/0.jpg", "gone.jpg"]
    entries = [Entry(p, 1, len(files.get(p, b"")), (2, 0) if p == "big.tar" else None)
               for p in order]
    p = await _replay(replayer, cache, entries)
    traced_small = sum(len(files[x]) for x in order if x.endswith(".jpg") and x in files)
    assert p.state == "done" and p.missing == 1
    assert p.total_bytes == p.done_bytes == traced_small + 2 * EXTENT_BYTES
    # the small files come in picks, in the trace's order, cut where a large file comes
    # (nothing the trace does not name comes along: not d/2, d/3, d/5); the large file's
    # extents 2 and 0 only, in requests of at most REQUEST
    ids = {p: fvs[p].file_id for p in files}
    assert sorted(hub.packs) == sorted([[(ids["d/4.jpg"], 1), (ids["d/1.jpg"], 1)],
                                        [(ids["e/0.jpg"], 1), (ids["d/0.jpg"], 1)]])
    assert p.fetched_bytes == traced_small + 2 * EXTENT_BYTES
    big = fvs["big.tar"].file_id
    ranges = [(s, n) for f, _, s, n in hub.calls if f == big]
    assert sum(n for _, n in ranges) == 2 * EXTENT_BYTES
    assert all(n <= REQUEST for _, n in ranges)
    assert {s // EXTENT_BYTES for s, _ in ranges} == {0, 2}
    got = await read_range(cache, big, 1, 0, EXTENT_BYTES)
    assert got.data == files["big.tar"][:EXTENT_BYTES]
    assert got.by_origin[ORIGIN_REPLAY] == EXTENT_BYTES // 4096
    skipped = await read_range(cache, big, 1, EXTENT_BYTES, EXTENT_BYTES + 4096)
    assert skipped.missing == [EXTENT_BYTES // 4096]
    # a rerun finds everything cached and fetches nothing
    calls, packs = len(hub.calls), len(hub.packs)
    again = await _replay(replayer, cache, entries)
    assert again.id == p.id + 1 and again.fetched_bytes == 0
    assert again.done_bytes == again.total_bytes == p.total_bytes
    assert (len(hub.calls), len(hub.packs)) == (calls, packs)
    cache.close()


async def test_the_first_picks_of_a_list_are_small_and_grow(tmp_path):
    """The job's first files do not wait in a full pick: a pick holds at most a sixteenth of
    the list's bytes up to its end (512 KiB at least), until picks are full (at 60 MiB)."""
    size = 200_000
    files = {f"d{i % 8}/{i}.jpg": os.urandom(size) for i in range(400)}  # 80 MB
    hub, cache, replayer, fvs = _setup(tmp_path, files)
    order = list(files)
    await _replay(replayer, cache, [Entry(p, 1, size, None) for p in order])
    ids = [fvs[p].file_id for p in order]
    picks = sorted(hub.packs, key=lambda pick: ids.index(pick[0][0]))
    assert [f for pick in picks for f, _ in pick] == ids  # each a run of the order, all there
    listed = 0
    for pick in picks:
        listed += len(pick) * size
        most = min(protocol.PACK_MAX_BYTES, max(512 << 10, listed // 16))
        assert len(pick) * size <= most
    assert [len(p) for p in picks[:2]] == [2, 2]  # 512 KiB: two of these files
    assert max(len(p) for p in picks) == protocol.PACK_MAX_BYTES // size  # full ones later
    cache.close()


async def test_the_working_set_is_cut_where_the_cache_is_full(tmp_path):
    files = {f"d{i}/x.jpg": os.urandom(CHUNK_SIZE * 4) for i in range(10)}
    hub, cache, replayer, fvs = _setup(tmp_path, files, budget=CHUNK_SIZE * 4 * 3 + 10)
    entries = [Entry(f"d{i}/x.jpg", 1, CHUNK_SIZE * 4, None) for i in (5, 2, 7, 1)]
    p = await _replay(replayer, cache, entries)
    assert p.total_bytes == p.fetched_bytes == CHUNK_SIZE * 4 * 3
    assert p.over_budget_bytes == CHUNK_SIZE * 4
    fetched = {f for pack in hub.packs for f, _ in pack}
    assert fetched == {fvs[f"d{i}/x.jpg"].file_id for i in (5, 2, 7)}
    cache.close()


async def test_a_long_trace_fetches_its_first_files_while_the_rest_resolves(tmp_path,
                                                                             monkeypatch):
    """The first entries resolve alone and their requests go out before the rest has
    resolved (the job's first reads wait for them); the whole is then cut to the cache's
    budget and counted once, in the trace's order."""
    monkeypatch.setattr(replay_module, "_HEAD_ENTRIES", 4)
    files = {f"d{i % 3}/{i}.jpg": os.urandom(10_000 + i) for i in range(20)}
    order = list(files)
    kept = sum(len(files[p]) for p in order[:15])
    hub, cache, replayer, fvs = _setup(tmp_path, files, budget=kept)
    resolve, sizes, picked_before_tail = replayer._resolve, [], []

    def observed(entries: list[Entry]) -> Resolved:
        sizes.append(len(entries))
        if len(sizes) == 2:  # the tail: the head's pick is asked for meanwhile
            deadline = time.monotonic() + 5
            while not hub.packs and time.monotonic() < deadline:
                time.sleep(0.005)
            picked_before_tail.append(len(hub.packs))
        return resolve(entries)

    replayer._resolve = observed
    entries = [Entry(p, 1, len(files[p]), None) for p in order] + [Entry("gone.jpg", 1, 1, None)]
    p = await _replay(replayer, cache, entries)
    assert sizes == [4, 17] and picked_before_tail == [1]
    assert p.state == "done" and p.missing == 1 and p.entries == 21
    assert p.total_bytes == p.done_bytes == p.fetched_bytes == kept
    assert p.over_budget_bytes == sum(len(files[x]) for x in order[15:])
    ids = [fvs[x].file_id for x in order]
    assert [f for pick in hub.packs for f, _ in pick] == ids[:15]
    cache.close()


async def test_a_new_replay_replaces_the_running_one(tmp_path):
    files = {f"{i}.jpg": os.urandom(100_000) for i in range(40)}
    hub, cache, replayer, _ = _setup(tmp_path, files)
    hub.delay_s = 0.5
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(replayer.run)
        first = replayer.start([Entry(f"{i}.jpg", 1, 100_000, None) for i in range(40)], "a")
        await trio.sleep(0.1)
        second = replayer.start([Entry("0.jpg", 1, 100_000, None)], "b")
        await _finished(replayer)
        assert replayer.progress().id == second == first + 1
        assert replayer.progress().state == "done"
        replayer.stop()
        nursery.cancel_scope.cancel()
    cache.close()


async def test_a_horizon_keeps_the_replay_that_far_ahead_of_the_job(tmp_path):
    """An order's replay starts nothing that ends more than the horizon past the furthest
    file the job has read: a job that stops leaves at most that much fetched and unread."""
    size = 100_000
    files = {f"d{i % 7}/{i:03}.jpg": os.urandom(size) for i in range(60)}
    hub, cache, first, fvs = _setup(tmp_path, files)
    replayer = _order_replayer(first, budget=1 << 40, horizon=10 * size)
    order = list(files)

    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(replayer.run)
        replayer.start([Entry(p, 0, 0, None) for p in order], "o")
        await poll_until(lambda: _picked(hub) >= 10, 0.01)
        await trio.sleep(0.3)  # it stays there while the job reads nothing
        assert _picked(hub) == 10 and replayer.progress().state == "running"
        replayer.on_read(fvs[order[4]].file_id)  # the job is at file 5: 5 more may come
        await poll_until(lambda: _picked(hub) >= 15, 0.01)
        await trio.sleep(0.3)
        assert _picked(hub) == 15
        replayer.on_read(fvs[order[2]].file_id)  # behind the furthest read: nothing changes
        replayer.on_read(fvs[order[-1]].file_id)  # the job read the last one: all may come
        await _finished(replayer)
        assert replayer.progress().state == "done" and _picked(hub) == 60
        # each pick a run of the order (picks started together may reach the hub in any order)
        ids = [fvs[p].file_id for p in order]
        runs = sorted(hub.packs, key=lambda pick: ids.index(pick[0][0]))
        assert [f for pick in runs for f, _ in pick] == ids
        nursery.cancel_scope.cancel()
    cache.close()


async def test_an_order_runs_past_the_cache_within_its_budget_ahead(tmp_path):
    """An order over a data set larger than the cache is not cut: it goes along the epoch,
    never more than the cache's budget ahead of the job (when that is below the horizon),
    fetching into the cache's room and what the job has read, and says which of its files
    the job has read (what the cache evicts first)."""
    size = 100_000
    files = {f"d{i % 7}/{i:03}.jpg": os.urandom(size) for i in range(40)}
    hub, cache, first, fvs = _setup(tmp_path, files)
    replayer = _order_replayer(first, budget=8 * size, horizon=1 << 40)
    order = list(files)

    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(replayer.run)
        replayer.start([Entry(p, 0, 0, None) for p in order], "o")
        await poll_until(lambda: _picked(hub) >= 8, 0.01)
        await trio.sleep(0.3)
        assert _picked(hub) == 8 and replayer.progress().over_budget_bytes == 0
        assert replayer.progress().total_bytes == 40 * size
        assert not replayer.behind(fvs[order[0]].file_id)
        replayer.on_read(fvs[order[19]].file_id)
        assert replayer.behind(fvs[order[19]].file_id)
        assert not replayer.behind(fvs[order[0]].file_id)  # passed, not read: kept
        # the room: 8 files of the cache, and each file the job has read (one so far)
        await poll_until(lambda: _picked(hub) >= 9, 0.01)
        await trio.sleep(0.3)
        assert _picked(hub) == 9
        for p in order[:19]:
            replayer.on_read(fvs[p].file_id)
        # now the budget ahead of file 20 is what holds it back
        await poll_until(lambda: _picked(hub) >= 28, 0.01)
        await trio.sleep(0.3)
        assert _picked(hub) == 28
        for p in order[20:]:
            replayer.on_read(fvs[p].file_id)
        await _finished(replayer)
        assert _picked(hub) == 40 and replayer.progress().state == "done"
        assert not replayer.behind(fvs[order[19]].file_id)  # over: no order says anything
        nursery.cancel_scope.cancel()
    cache.close()


async def test_a_head_fetches_only_into_room_the_cache_does_not_use(tmp_path):
    """The head of an epoch (its first files, sent before the whole order) does not know what
    the rest of the epoch is: what the cache holds may be those files, so a head fetches only
    into the budget's free room and what the job has read, where a whole order counts what
    the cache holds of other files as room."""
    size = 100_000
    files = {f"d/{i:03}.jpg": os.urandom(size) for i in range(20)}
    hub, cache, first, fvs = _setup(tmp_path, files)
    order = list(files)
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(first.run)
        first.start([Entry(p, 0, 0, None) for p in order[10:]], "the rest of the epoch")
        await _finished(first)
        await cache.flush()
        before = _picked(hub)
        head = _order_replayer(first, budget=11 * size, horizon=1 << 40)
        await nursery.start(head.run)
        head.start([Entry(p, 0, 0, None) for p in order[:6]], "o", head=True)
        await poll_until(lambda: _picked(hub) >= before + 1, 0.01)
        await trio.sleep(0.3)
        assert _picked(hub) == before + 1  # 10 files held: room for 1
        head.on_read(fvs[order[0]].file_id)  # each file the job reads makes room for one
        await poll_until(lambda: _picked(hub) >= before + 2, 0.01)
        await trio.sleep(0.3)
        assert _picked(hub) == before + 2
        head.stop()
        whole = _order_replayer(first, budget=11 * size, horizon=1 << 40)
        await nursery.start(whole.run)
        whole.start([Entry(p, 0, 0, None) for p in order[:6]], "o")
        await _finished(whole)
        assert _picked(hub) == before + 6  # the 10 held are not its files: room for all
        nursery.cancel_scope.cancel()
    cache.close()


async def test_an_order_fetched_whole_is_followed_until_its_job_has_read_it(tmp_path):
    """Once an order is fetched, the job still reads the rest of it: the mount's own guesses
    keep standing aside (``following``) until the job has read every file of it, or has read
    none of it for ``_FOLLOW_S``."""
    files = {f"d/{i}.jpg": os.urandom(10_000) for i in range(6)}
    _hub, cache, first, fvs = _setup(tmp_path, files)
    replayer = _order_replayer(first, budget=1 << 40, horizon=1 << 40)
    order = list(files)
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(replayer.run)
        assert not replayer.following()
        replayer.start([Entry(p, 0, 0, None) for p in order], "o")
        assert replayer.following()
        await _finished(replayer)
        assert replayer.progress().state == "done" and replayer.following()
        replayer.on_read(fvs[order[2]].file_id)
        assert replayer.following() and replayer.behind(fvs[order[2]].file_id)
        replayer.on_read(fvs[order[-1]].file_id)  # the last, read before others: not over
        assert replayer.following()
        for p in order:
            replayer.on_read(fvs[p].file_id)
        assert not replayer.following() and not replayer.behind(fvs[order[2]].file_id)
        replayer.start([Entry(p, 0, 0, None) for p in order], "again")
        await _finished(replayer)
        assert replayer.following()
        replayer._ahead.last_read -= replay_module._FOLLOW_S  # its job read nothing since
        assert not replayer.following()
        nursery.cancel_scope.cancel()
    cache.close()


async def test_an_order_is_over_when_its_files_are_read_again(tmp_path, monkeypatch):
    """A file of an order read again well after its first read is the job's next epoch: the
    order stops (fetching and being followed), so what its job read in the last epoch is not
    taken for what the new epoch has read; a file listed twice may be read twice."""
    monkeypatch.setattr(order_position, "_REREAD_S", 0.05)
    files = {f"d/{i}.jpg": os.urandom(10_000) for i in range(6)}
    _hub, cache, first, fvs = _setup(tmp_path, files)
    replayer = _order_replayer(first, budget=1 << 40, horizon=20_000)
    order = list(files)
    ids = [fvs[p].file_id for p in order]
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(replayer.run)
        replayer.start([Entry(p, 0, 0, None) for p in [*order, order[1]]], "o")
        await poll_until(lambda: replayer.progress().state == "running", 0.01)
        replayer.on_read(ids[0])
        replayer.on_read(ids[0])  # a file's second request: the same read
        replayer.on_read(ids[1])
        await trio.sleep(0.1)
        replayer.on_read(ids[1])  # listed twice: read twice
        assert replayer.following() and replayer.progress().state == "running"
        replayer.on_read(ids[0])  # the next epoch
        await poll_until(lambda: replayer.progress().state == "stopped", 0.01)
        assert not replayer.following() and not replayer.behind(ids[0])
        nursery.cancel_scope.cancel()
    cache.close()
