"""A worker's answer to ``SYNC`` (``fuse.worker._listen``) over a real socketpair: every hit
gathered before it arrives ahead of ``SYNCED``, whether the pump has queued them yet or not,
and without the wait a batch of hits would otherwise make for company (stretched here to
10-30 s, so that "without the wait" is plain even on a busy machine)."""

from __future__ import annotations

import socket
from pathlib import Path

import trio

from spokefs.fuse.worker import _listen
from spokefs.fuse.worker_channel import HIT, SYNC, SYNCED, Calls, Channel


class GatheredHits:
    """The two calls of the native read loop that ``_listen`` makes: ``pending_hits`` (hits
    gathered and their bytes) and ``take_hits`` (here: the file ids gathered)."""

    def __init__(self) -> None:
        self.files: list[int] = []

    def pending_hits(self) -> tuple[int, int]:
        return len(self.files), 4096 * len(self.files)

    def take_hits(self) -> list[int]:
        out, self.files = self.files, []
        return out


async def test_sync_is_answered_after_every_gathered_hit_and_without_the_batch_wait(
        tmp_path: Path) -> None:
    a, b = socket.socketpair()
    coordinator = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(a)))
    worker = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(b)),
                     collect_delay_s=10.0, collect_max_delay_s=30.0)
    loop = GatheredHits()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.send_queued)
        nursery.start_soon(_listen, loop, worker, Calls(worker), tmp_path, nursery.cancel_scope)
        # one hit the pump has queued (its batch would wait 10-30 s for company), and one it
        # has not seen yet
        loop.files.append(1)
        worker.queue_collected(HIT, loop.take_hits)
        loop.files.append(2)
        t0 = trio.current_time()
        await coordinator.send(SYNC, 7)
        assert await coordinator.receive() == (HIT, [1, 2])
        assert await coordinator.receive() == (SYNCED, 7)
        assert trio.current_time() - t0 < 5.0
        # nothing gathered: the answer alone
        await coordinator.send(SYNC, 8)
        assert await coordinator.receive() == (SYNCED, 8)
        nursery.cancel_scope.cancel()
