"""The read path of a serving worker: cached bytes served here, everything else asked of the
mount's own process (the coordinator) over the worker's channel.

A read looks in the block cache, read-only, in one read transaction that checks every
block's checksum (``cache.chunk_reader``): inline, or in a thread when the bytes are not in
RAM yet, as the coordinator's own reads do. A hit is answered at once and reported to the
coordinator in the next batch of hits (``HIT``, gathered by ``Hits``), which does there what a
read does besides serving: the prefetcher hears of it, the trace notes it, the chunks count as
visited for eviction, the metrics count it. Anything else (a miss, bytes staged only in the
coordinator's memory, a block that failed its checksum, an LMDB error) goes to the coordinator
as a ``READ`` and is answered with what the coordinator's read path answers, errors included:
so a worker never fetches, stages or stores anything, and never serves a byte it has not
checked.

Part of the FUSE layer (docs/contributing.md): only these modules import pyfuse3.
"""

from __future__ import annotations

import errno
import itertools
import logging
import time
from typing import Any

import lmdb
import pyfuse3
import trio

from spokefs.cache.chunk_reader import ORIGINS, ChunkReader, NotResident, ReadResult, Staged
from spokefs.fuse.worker_channel import HIT, LISTED, READ, XATTR, Channel, ChannelClosed
from spokefs.namespace.replica import Attr
from spokefs.read.stream import Stream
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

_DISK_THREADS = 8  # reads of bytes not in RAM at once, as the coordinator's own
HIT_BATCH = 64  # hits that go to the coordinator at once, without waiting for more
HIT_DELAY_S = 0.005  # what a hit waits at most for others to go with it (``worker_channel``)


def _nothing_staged(key: bytes) -> list[Staged] | None:
    return None  # staged bytes live in the coordinator's memory only


class Calls:
    """Requests to the coordinator and their replies, matched by request id."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[trio.Event, list[Any]]] = {}
        self._closed = False

    async def call(self, kind: int, args: tuple[Any, ...]) -> bytes:
        """Send a request and wait for its reply.

        Raises:
            pyfuse3.FUSEError: the coordinator answered an errno, or is gone (EIO).
        """
        if self._closed:
            raise pyfuse3.FUSEError(errno.EIO)
        rid = next(self._ids)
        done = trio.Event()
        slot: list[Any] = []
        self._waiting[rid] = (done, slot)
        try:
            await self._channel.send(kind, (rid, *args))
            await done.wait()
        except ChannelClosed:
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            self._waiting.pop(rid, None)
        err, data = slot
        if err:
            raise pyfuse3.FUSEError(err)
        return bytes(data)

    def replied(self, rid: int, err: int, data: bytes) -> None:
        waiting = self._waiting.get(rid)
        if waiting is not None:
            waiting[1].extend((err, data))
            waiting[0].set()

    def close(self) -> None:
        """The coordinator is gone: every waiting request fails with EIO."""
        self._closed = True
        for done, slot in self._waiting.values():
            slot.extend((errno.EIO, b""))
            done.set()


class WorkerReader:
    """``read.stream.StreamReader`` for a serving worker (see the module docstring)."""

    def __init__(self, chunks: ChunkReader, channel: Channel, calls: Calls) -> None:
        self._chunks = chunks
        self._channel = channel
        self._calls = calls
        self._disk = trio.CapacityLimiter(_DISK_THREADS)
        self._hits = Hits()

    def open(self, fv: FileVersion, parent_id: int) -> Stream:
        return Stream(fv, parent_id)  # the access pattern is the coordinator's to keep

    def close(self, stream: Stream) -> None:
        return None

    def on_readdir(self, dir_id: int) -> None:
        self._channel.queue(LISTED, dir_id)

    async def read(self, stream: Stream, offset: int, size: int) -> bytes:
        fv = stream.fv
        end = min(offset + size, fv.size)
        if offset >= end:
            return b""
        started = time.monotonic()
        found = await self._look(fv, offset, end)
        if found is not None and found.data is not None:
            gathered = self._hits.add(fv.file_id, offset, size, end - offset, found,
                                      time.monotonic() - started)
            self._channel.queue_collected(HIT, self._hits.take, now=gathered >= HIT_BATCH)
            return found.data
        return await self._calls.call(READ, (fv.file_id, offset, size))

    async def _look(self, fv: FileVersion, offset: int, end: int) -> ReadResult | None:
        """The cache's answer, or None when the cache cannot be read (the coordinator
        then serves the read, and finds out what is wrong)."""
        try:
            try:
                return self._chunks.read(fv.file_id, fv.version, offset, end,
                                         _nothing_staged, inline=True)
            except NotResident:
                return await trio.to_thread.run_sync(
                    lambda: self._chunks.read(fv.file_id, fv.version, offset, end,
                                              _nothing_staged),
                    limiter=self._disk)
        except lmdb.Error as exc:
            log.warning("could not read the block cache: %s", exc)
            return None


class Hits:
    """The hits since the last ``HIT`` message: each read's place and visits, and their
    metric counts summed (see ``worker_channel``)."""

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self._reads: list[tuple[int, int, int, list[Any]]] = []
        self._by_origin = [0] * len(ORIGINS)
        self._nbytes = 0
        self._seconds: list[float] = []

    def add(self, file_id: int, offset: int, size: int, nbytes: int, found: ReadResult,
            seconds: float) -> int:
        """Gather one hit; how many are gathered now."""
        self._reads.append((file_id, offset, size, found.visits()))
        for i, count in enumerate(found.by_origin):
            self._by_origin[i] += count
        self._nbytes += nbytes
        self._seconds.append(seconds)
        return len(self._reads)

    def take(self) -> tuple[list[Any], list[int], int, list[float]]:
        """The ``HIT`` body, and start again."""
        body = (self._reads, self._by_origin, self._nbytes, self._seconds)
        self._clear()
        return body


class ForwardedControl:
    """The ``user.spokefs.*`` attributes, answered by the coordinator."""

    def __init__(self, calls: Calls) -> None:
        self._calls = calls

    async def getxattr(self, attr: Attr, name: bytes, uid: int = 0) -> bytes:
        return await self._calls.call(XATTR, (attr.ino, name, uid))
