"""Jobs' orders (``jobs.orders``): one replay per announcing job, a job's new order replacing
its last one while other jobs' orders go on, all within one shared in-flight bound."""

from __future__ import annotations

import functools
import os

import trio
from spoke_fakes import poll_until

from spokefs.jobs import orders as orders_module
from spokefs.jobs.in_flight import InFlight
from spokefs.jobs.orders import Orders
from spokefs.jobs.replay import Replayer
from spokefs.jobs.trace_file import Entry
from tests.spokefs.test_replay import _setup


def _orders(tmp_path, files, horizon_bytes=None):
    hub, cache, first, _fvs = _setup(tmp_path, files)
    make = functools.partial(Replayer, first._source, None, first._resolve,
                             small_file_bytes=1 << 20, request_bytes=3 << 20,
                             max_inflight_bytes=64 << 20, budget_bytes=lambda: 1 << 40,
                             flight=first.flight, horizon_bytes=horizon_bytes)
    return hub, cache, Orders(make), first.flight


def _of(orders: Orders, job: str) -> dict | None:
    return next((p for p in orders.progress() if p["job"] == job), None)


def _done(orders: Orders, job: str) -> bool:
    p = _of(orders, job)
    return p is not None and p["state"] not in ("resolving", "running")


async def test_an_order_read_whole_before_anyone_asked_still_gives_its_grace(tmp_path):
    """The head of an epoch can be fetched and read in an instant, before any miss asks
    whether an order runs: the mount's guesses stand aside from the order's start on."""
    files = {f"d/{i}.jpg": os.urandom(20_000) for i in range(4)}
    _hub, cache, orders, _flight = _orders(tmp_path, files)
    ids = {p: n + 1 for n, p in enumerate(files)}  # as ``_setup`` numbers them
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(orders.run)
        orders.start("job:head", [Entry(p, 0, 0, None) for p in files], "head")
        await poll_until(lambda: _done(orders, "job:head"), 0.01)
        for p in files:
            orders.on_read(ids[p])
        assert not any(r.following() for r, _ in orders._jobs.values())
        assert orders.running()
        nursery.cancel_scope.cancel()


async def test_each_job_has_its_order_and_a_new_one_replaces_its_last(tmp_path, monkeypatch):
    files = {f"d{i % 3}/{i}.jpg": os.urandom(20_000 + i) for i in range(12)}
    _hub, cache, orders, flight = _orders(tmp_path, files)
    paths = list(files)
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(orders.run)
        assert not orders.running()
        orders.start("rank0", [Entry(p, 0, 0, None) for p in paths[:6]], "e0")
        orders.start("rank1", [Entry(p, 0, 0, None) for p in paths[6:]], "e0")
        assert orders.running()
        await poll_until(lambda: _done(orders, "rank0") and _done(orders, "rank1"), 0.01)
        jobs = {p["job"]: p for p in orders.progress()}
        assert set(jobs) == {"rank0", "rank1"}
        assert all(p["state"] == "done" and p["entries"] == 6 for p in jobs.values())
        # rank0's next epoch: the same replayer, a new order; rank1's stays as it was
        second = orders.start("rank0", [Entry(p, 0, 0, None) for p in reversed(paths)], "e1")
        await poll_until(lambda: _done(orders, "rank0"), 0.01)
        assert _of(orders, "rank0")["id"] == second == 2
        assert _of(orders, "rank0")["fetched_bytes"] == 0  # cached by the first orders
        assert orders.running()  # over, but the next epoch's order may be on its way
        monkeypatch.setattr(orders_module, "GRACE_S", 0.0)
        assert not orders.running()
        assert [p["job"] for p in orders.progress()] == ["rank1", "rank0"]
        assert flight.bytes == 0
        nursery.cancel_scope.cancel()
    cache.close()


async def test_what_running_orders_have_passed(tmp_path):
    """``passed``: None while no order runs, else whether some running order's job has read a
    file (any job's read counts for each order listing the file)."""
    files = {f"d/{i}.jpg": os.urandom(20_000) for i in range(8)}
    _hub, cache, orders, _ = _orders(tmp_path, files, horizon_bytes=lambda: 40_000)
    paths = list(files)
    ids = {p: n + 1 for n, p in enumerate(paths)}  # ``_setup``'s file ids
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(orders.run)
        assert orders.passed() is None
        orders.start("a", [Entry(p, 0, 0, None) for p in paths[:4]], "e0")
        orders.start("b", [Entry(p, 0, 0, None) for p in paths[4:]], "e0")
        await poll_until(lambda: all(_of(orders, j)["state"] == "running" for j in "ab"), 0.01)
        orders.on_read(ids[paths[1]])
        orders.on_read(ids[paths[6]])
        passed = orders.passed()
        assert passed is not None
        t = cache.tick()  # the orders' start (nothing was read through the cache here)
        assert [passed(ids[p]) for p in paths] == [None, t, None, None, None, None, t, None]
        for p in paths:
            orders.on_read(ids[p])
        await poll_until(lambda: _done(orders, "a") and _done(orders, "b"), 0.01)
        assert orders.passed() is None
        nursery.cancel_scope.cancel()
    cache.close()


async def test_jobs_beyond_the_limit_forget_the_oldest(tmp_path, monkeypatch):
    monkeypatch.setattr(orders_module, "MAX_JOBS", 2)
    files = {"d/a.jpg": b"a" * 5000}
    _hub, cache, orders, _ = _orders(tmp_path, files)
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(orders.run)
        for job in ("a", "b", "c"):
            orders.start(job, [Entry("d/a.jpg", 0, 0, None)], job)
        assert [p["job"] for p in orders.progress()] == ["b", "c"]
        nursery.cancel_scope.cancel()
    cache.close()


async def test_the_in_flight_bound_is_shared_and_starts_slow():
    class Reach:
        def bdp_bytes(self) -> int:
            return 5 << 20  # a bound of three times that, 15 MiB, once the link is busy

    flight = InFlight(Reach(), 64 << 20)  # type: ignore[arg-type]

    async def fits(nbytes: int) -> bool:
        with trio.move_on_after(0.1) as waited:
            await flight.reserve(nbytes)
        return not waited.cancelled_caught

    # from an idle link: one product (at least 8 MiB), growing by what arrives
    assert await fits(4 << 20) and await fits(4 << 20) and not await fits(1 << 20)
    flight.release(4 << 20)  # 4 MiB arrived: 9 MiB
    assert await fits(5 << 20) and not await fits(1 << 20)
    flight.release(4 << 20)  # 8 MiB arrived: 13 MiB
    assert await fits(8 << 20)
    flight.release(5 << 20)  # 13 MiB arrived: three products, 15 MiB, and no more
    assert await fits(7 << 20) and not await fits(1 << 20)
    assert flight.bytes == 15 << 20

    async def late() -> None:
        await flight.reserve(3 << 20)

    async with trio.open_nursery() as nursery:  # one bound for every replay that shares it
        nursery.start_soon(late)
        await trio.sleep(0.05)
        assert flight.bytes == 15 << 20
        flight.release(7 << 20)  # room again: the waiter goes at once
    assert flight.bytes == 11 << 20
    flight.release(11 << 20)  # idle again: the next start is slow again
    assert await fits(8 << 20) and not await fits(1 << 20)


async def test_a_trace_replay_counts_as_running(tmp_path, monkeypatch):
    """The mount's trace replay (``--replay``) fetches in a job's order too: while it runs
    the mount's own guesses stand aside as for an order."""
    monkeypatch.setattr(orders_module, "GRACE_S", 0.0)
    files = {f"d/{i}.jpg": os.urandom(20_000) for i in range(4)}
    hub, cache, first, _ = _setup(tmp_path, files)
    hub.delay_s = 0.3
    orders = Orders(lambda: first, trace=first)
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        await nursery.start(first.run)
        assert not orders.running()
        first.start([Entry(p, 0, 0, None) for p in files], "trace")
        assert orders.running()
        await poll_until(lambda: first.progress().state == "done", 0.01)
        assert not orders.running()
        nursery.cancel_scope.cancel()
    cache.close()
