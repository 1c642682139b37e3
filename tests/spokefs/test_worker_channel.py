"""The channel between a mount's coordinator and a worker (``fuse.worker_channel``), over a
real socketpair: messages and batches arrive whole and in order, and a peer that sends what
is not a message, or goes away, is told apart from a message."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest
import trio

from spokefs.cache.chunk_reader import ReadResult
from spokefs.config import SpokeConfig
from spokefs.fuse.worker_channel import (
    HELLO,
    HIT,
    LISTED,
    READ,
    REPLY,
    Channel,
    ChannelBroken,
    ChannelClosed,
    WorkerSetup,
    encode,
)
from spokefs.fuse.worker_reader import Hits


def pair() -> tuple[Channel, Channel, socket.socket]:
    a, b = socket.socketpair()
    raw = b.dup()
    return (Channel(trio.SocketStream(trio.socket.from_stdlib_socket(a))),
            Channel(trio.SocketStream(trio.socket.from_stdlib_socket(b))), raw)


async def test_requests_replies_and_queued_events_arrive_in_order() -> None:
    ours, theirs, raw = pair()
    raw.close()
    hits = Hits()
    found = ReadResult(data=b"d", seen=[(b"k" * 24, None)], by_origin=[1, 2, 0, 0])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(theirs.send_queued)
        for i in range(300):  # (a test that sends more would need a reader running)
            theirs.queue(LISTED, i)
            hits.add(i, 0, 4096, 4000, found, 0.001)
            theirs.queue_collected(HIT, hits.take)
        await theirs.send(READ, (1, 99, 0, 131072))
        got = [await ours.receive() for _ in range(302)]
        # a request goes out at once, maybe ahead of queued events, which keep their order;
        # the 300 hits gathered before it are one message, and go just ahead of it
        kinds = [k for k, _ in got]
        assert kinds.index(HIT) + 1 == kinds.index(READ)
        assert got[kinds.index(READ)] == (READ, (1, 99, 0, 131072))
        assert got[kinds.index(HIT)] == (
            HIT, ([(i, 0, 4096, [(b"k" * 24, None, 0)]) for i in range(300)],
                  [300, 600, 0, 0], 300 * 4000, [0.001] * 300))
        assert [m for m in got if m[0] == LISTED] == [(LISTED, i) for i in range(300)]
        assert hits.take() == ([], [0, 0, 0, 0], 0, [])  # and the collector starts again
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
    setup = WorkerSetup(cfg, 2, b"\x01init", ("ro", "allow_other"), None)
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


async def test_collected_messages_wait_for_company_but_not_longer_than_the_delay() -> None:
    a, b = socket.socketpair()
    ours = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(a)))
    theirs = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(b)),
                     collect_delay_s=0.2)
    gathered: list[int] = []

    def take() -> list[int]:
        out = gathered[:]
        gathered.clear()
        return out

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
