"""The replayer against a real block cache and a fake hub: the trace's working set in
first-access order, small files in their directories' packs (each once) and large ones in
ranges of their extents only,
what is cached skipped (a rerun fetches nothing), the cache's bound respected, and the
replayed blocks counted under their own origin."""

from __future__ import annotations

import os

import trio
from spoke_fakes import FakeHub, poll_until

from spokefs import protocol
from spokefs.cache.block_cache import ORIGIN_REPLAY, BlockCache
from spokefs.config import CHUNK_SIZE
from spokefs.hub.link_model import LinkReach
from spokefs.jobs.replay import Replayer
from spokefs.jobs.trace_file import Entry, Resolved, Target
from spokefs.read.block_source import BlockSource
from spokefs.read.trace import EXTENT_BYTES
from spokefs.types import FileVersion
from tests.helpers.block_cache import read_range

REQUEST = 3 << 20


class FakePacks:
    """``mount._DirLister.pack_of`` over the test's files: each directory's packs planned as
    the hub plans them (``protocol.plan_packs``)."""

    def __init__(self, fvs: dict[str, FileVersion], dir_ids: dict[str, int]) -> None:
        rows: dict[int, list[tuple[bytes, int, int, int]]] = {}
        for path, fv in fvs.items():
            parent, _, name = path.rpartition("/")
            rows.setdefault(dir_ids[parent], []).append(
                (name.encode(), fv.file_id, fv.version, fv.size))
        self.plans = {d: protocol.plan_packs(d, r) for d, r in rows.items()}

    async def pack_of(self, dir_id: int, fv: FileVersion) -> protocol.PackPlan | None:
        return next((p for p in self.plans.get(dir_id, [])
                     if (fv.file_id, fv.version, fv.size) in p.members), None)


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
                        FakePacks(fvs, dir_ids), small_file_bytes=1 << 20,
                        request_bytes=REQUEST, max_inflight_bytes=64 << 20,
                        budget_bytes=lambda: budget)
    return hub, cache, replayer, fvs


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
    # the small files come in their directories' packs, each pack once (so d/2, d/3 and d/5
    # come along with d/4, d/1 and d/0); the large file's extents 2 and 0 only, in requests
    # of at most REQUEST
    assert sorted(hub.packs) == sorted([
        [(fvs[f"d/{i}.jpg"].file_id, 1) for i in range(6)], [(fvs["e/0.jpg"].file_id, 1)]])
    pack_bytes = sum(len(files[f"d/{i}.jpg"]) for i in range(6)) + len(files["e/0.jpg"])
    assert p.fetched_bytes == pack_bytes + 2 * EXTENT_BYTES
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
