"""The channel between a mount's coordinator and a worker (``fuse.worker_channel``), over a
real socketpair: messages and batches arrive whole and in order, a peer that sends what is
not a message, or goes away, is told apart from a message, and a worker answers ``SYNC``
(``fuse.worker._listen``) after every hit it has gathered."""

from __future__ import annotations

import errno
import socket
import struct
from pathlib import Path

import pytest
import trio

from spokefs.config import SpokeConfig
from spokefs.fuse.worker import _listen
from spokefs.fuse.worker_channel import (
    HELLO,
    HIT,
    LISTED,
    READ,
    REPLY,
    SYNC,
    SYNCED,
    XATTR,
    CallFailed,
    Calls,
    Channel,
    ChannelBroken,
    ChannelClosed,
    WorkerSetup,
    encode,
)


def pair() -> tuple[Channel, Channel, socket.socket]:
    a, b = socket.socketpair()
    raw = b.dup()
    return (Channel(trio.SocketStream(trio.socket.from_stdlib_socket(a))),
            Channel(trio.SocketStream(trio.socket.from_stdlib_socket(b))), raw)


class Hits:
    """What the native read loop's ``take_hits`` gives: the reads since the last call, their
    counts summed, their latencies, the errors answered."""

    def __init__(self) -> None:
        self.reads: list[tuple[int, int, int, list[tuple[bytes, bool, int]]]] = []

    def add(self, file_id: int) -> None:
        self.reads.append((file_id, 0, 4096, [(b"k" * 24, False, 7)]))

    def take(self) -> tuple[object, ...]:
        n, self.reads = len(self.reads), []
        return ([(i, 0, 4096, [(b"k" * 24, False, 7)]) for i in range(n)], [n, 2 * n, 0, 0],
                4000 * n, [0.001] * n, [("lookup", errno.ENOENT, n)] if n else [])


async def test_requests_replies_and_queued_events_arrive_in_order() -> None:
    ours, theirs, raw = pair()
    raw.close()
    hits = Hits()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(theirs.send_queued)
        for i in range(300):  # (a test that sends more would need a reader running)
            theirs.queue(LISTED, i)
            hits.add(i)
            theirs.queue_collected(HIT, hits.take)
        await theirs.send(READ, (1, 99, 0, 131072))
        got = [await ours.receive() for _ in range(302)]
        # a request goes out at once, maybe ahead of queued events, which keep their order;
        # the 300 hits gathered before it are one message, and go just ahead of it
        kinds = [k for k, _ in got]
        assert kinds.index(HIT) + 1 == kinds.index(READ)
        assert got[kinds.index(READ)] == (READ, (1, 99, 0, 131072))
        assert got[kinds.index(HIT)] == (
            HIT, ([(i, 0, 4096, [(b"k" * 24, False, 7)]) for i in range(300)],
                  [300, 600, 0, 0], 300 * 4000, [0.001] * 300, [("lookup", errno.ENOENT, 300)]))
        assert [m for m in got if m[0] == LISTED] == [(LISTED, i) for i in range(300)]
        assert hits.take() == ([], [0, 0, 0, 0], 0, [], [])  # and the collector starts again
        replies: list[tuple[int, object]] = []
        replied = trio.Event()

        async def take() -> None:
            replies.append(await theirs.receive())
            replied.set()

        nursery.start_soon(take)  # a whole 1 MiB read is more than the socket holds
        await ours.send(REPLY, (1, 0, b"x" * (1 << 20)))
        await replied.wait()
        assert replies == [(REPLY, (1, 0, b"x" * (1 << 20)))]
        nursery.cancel_scope.cancel()


async def test_hello_carries_the_setup(tmp_path: Path) -> None:
    ours, theirs, raw = pair()
    raw.close()
    cfg = SpokeConfig(hub_url="http://h:1", mountpoint=tmp_path, cache_dir=tmp_path,
                      cache_max_bytes=1 << 30, workers=3, open_mode="kernel")
    setup = WorkerSetup(cfg, 1, 3, None)
    await ours.send_raw(encode(HELLO, setup.encode()))
    kind, body = await theirs.receive()
    assert kind == HELLO and WorkerSetup.decode(body) == setup


@pytest.mark.parametrize("garbage", [
    struct.pack("<IB", 4, 99) + b"abcd",              # no such kind
    struct.pack("<IB", 1 << 30, REPLY),               # longer than any message
    struct.pack("<IB", 3, REPLY) + b"\xff\xff\xff",  # not marshal
])
async def test_what_is_not_a_message_is_refused(garbage: bytes) -> None:
    ours, _theirs, raw = pair()
    raw.sendall(garbage)
    with pytest.raises(ChannelBroken):
        await ours.receive()


async def test_a_peer_that_goes_away_closes_the_channel() -> None:
    ours, theirs, raw = pair()
    raw.sendall(struct.pack("<IB", 10, REPLY))  # half a message, then the end
    raw.close()
    await theirs.aclose()
    with pytest.raises(ChannelClosed):
        await ours.receive()
    with pytest.raises(ChannelClosed):
        await ours.send(READ, (1, 2, 3, 4))


def test_a_hello_that_is_not_a_setup_is_refused() -> None:
    import pickle
    with pytest.raises(ChannelBroken):
        WorkerSetup.decode(pickle.dumps({"not": "a setup"}))


class Gathered(list[int]):
    """A collector's list: ``take`` empties it and gives what it held."""

    def take(self) -> list[int]:
        out = self[:]
        self.clear()
        return out


def collecting_pair(**delays: float) -> tuple[Channel, Channel]:
    """The coordinator's end and a worker's end whose batches wait as ``delays`` say."""
    a, b = socket.socketpair()
    return (Channel(trio.SocketStream(trio.socket.from_stdlib_socket(a))),
            Channel(trio.SocketStream(trio.socket.from_stdlib_socket(b)), **delays))


async def test_collected_messages_wait_for_company_but_not_longer_than_the_delay() -> None:
    ours, theirs = collecting_pair(collect_delay_s=0.2)
    gathered = Gathered()
    take = gathered.take

    async with trio.open_nursery() as nursery:
        nursery.start_soon(theirs.send_queued)
        for now in (False, True):  # alone it waits the delay; a full collector goes at once
            t0 = trio.current_time()
            gathered.append(1)
            theirs.queue_collected(HIT, take, now=now)
            await trio.sleep(0.05)
            gathered.append(2)
            theirs.queue_collected(HIT, take)
            assert await ours.receive() == (HIT, [1, 2] if not now else [1])
            waited = trio.current_time() - t0
            assert (waited >= 0.2) if not now else (waited < 0.2), (now, waited)
            if now:
                assert await ours.receive() == (HIT, [2])
        t0 = trio.current_time()
        gathered.append(3)
        theirs.queue_collected(HIT, take)
        theirs.queue(LISTED, 7)  # an event takes the gathered ones with it
        assert [await ours.receive(), await ours.receive()] == [(LISTED, 7), (HIT, [3])]
        assert trio.current_time() - t0 < 0.2
        nursery.cancel_scope.cancel()


async def test_a_batch_with_enough_goes_after_the_short_wait_and_one_without_waits_longer(
) -> None:
    """A slow reader's hits wait up to the long delay for ``enough`` company; once enough are
    gathered they go after the short one (or at once, if it is over)."""
    ours, theirs = collecting_pair(collect_delay_s=0.05, collect_max_delay_s=0.4)
    gathered = Gathered()
    take = gathered.take

    async with trio.open_nursery() as nursery:
        nursery.start_soon(theirs.send_queued)
        # never enough: the long wait
        t0 = trio.current_time()
        gathered.append(1)
        theirs.queue_collected(HIT, take)
        assert await ours.receive() == (HIT, [1])
        assert 0.4 <= trio.current_time() - t0 < 0.6
        # enough from the start: the short wait only
        t0 = trio.current_time()
        gathered.append(2)
        theirs.queue_collected(HIT, take, enough=True)
        assert await ours.receive() == (HIT, [2])
        assert 0.05 <= trio.current_time() - t0 < 0.3
        # enough once the short wait is over: at once then
        t0 = trio.current_time()
        gathered.append(3)
        theirs.queue_collected(HIT, take)
        await trio.sleep(0.15)
        gathered.append(4)
        theirs.queue_collected(HIT, take, enough=True)
        assert await ours.receive() == (HIT, [3, 4])
        assert 0.15 <= trio.current_time() - t0 < 0.35
        nursery.cancel_scope.cancel()


async def test_calls_match_replies_and_fail_when_the_coordinator_goes() -> None:
    ours, theirs, raw = pair()
    raw.close()
    calls = Calls(theirs)
    results: dict[str, object] = {}

    async def call(name: str, kind: int, args: tuple[object, ...]) -> None:
        try:
            results[name] = await calls.call(kind, args)
        except CallFailed as exc:
            results[name] = exc.errno

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, "read", READ, (7, 0, 4096))
        nursery.start_soon(call, "xattr", XATTR, (7, b"user.spokefs.status", 0))
        first = [await ours.receive() for _ in range(2)]
        by_kind = {kind: body for kind, body in first}
        # answered in the other order: each reply goes to its own request
        calls.replied(by_kind[XATTR][0], errno.ENODATA, b"")
        calls.replied(by_kind[READ][0], 0, b"bytes")
    assert results == {"read": b"bytes", "xattr": errno.ENODATA}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, "pending", READ, (8, 0, 1))
        await ours.receive()
        calls.close()  # the coordinator is gone: what waits fails, and so does what comes
    await call("later", READ, (9, 0, 1))
    assert results["pending"] == results["later"] == errno.EIO


class GatheredHits(Gathered):
    """The two calls of the native read loop that ``_listen`` makes on ``SYNC``:
    ``pending_hits`` (hits gathered and their bytes) and ``take_hits`` (here: file ids)."""

    def pending_hits(self) -> tuple[int, int]:
        return len(self), 4096 * len(self)

    def take_hits(self) -> list[int]:
        return self.take()


async def test_sync_is_answered_after_every_gathered_hit_and_without_the_batch_wait(
        tmp_path: Path) -> None:
    """The coordinator's ``SYNC`` (a ``Calls`` request, as ``workers.Workers.sync`` makes it)
    is answered after every hit the worker gathered, whether its pump has queued them yet or
    not, and without the wait a batch makes for company (stretched here to 10-30 s, so that
    "without the wait" is plain even on a busy machine)."""
    ours, theirs = collecting_pair(collect_delay_s=10.0, collect_max_delay_s=30.0)
    calls = Calls(ours)
    loop = GatheredHits()

    async def sync(done: trio.Event) -> None:
        await calls.call(SYNC, ())
        done.set()

    async def answered() -> None:
        """Take the worker's SYNCED, hand it to ``calls``, and see the sync return."""
        kind, body = await ours.receive()
        assert kind == SYNCED
        calls.replied(body[0], 0, b"")
        with trio.fail_after(5.0):
            await done.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(theirs.send_queued)
        nursery.start_soon(_listen, loop, theirs, Calls(theirs), tmp_path, nursery.cancel_scope)
        # one hit the pump has queued (its batch would wait 10-30 s for company), and one it
        # has not seen yet
        loop.append(1)
        theirs.queue_collected(HIT, loop.take_hits)
        loop.append(2)
        t0 = trio.current_time()
        done = trio.Event()
        nursery.start_soon(sync, done)
        assert await ours.receive() == (HIT, [1, 2])
        await answered()
        assert trio.current_time() - t0 < 5.0
        # nothing gathered: the answer alone
        done = trio.Event()
        nursery.start_soon(sync, done)
        await answered()
        nursery.cancel_scope.cancel()
