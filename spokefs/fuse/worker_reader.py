"""The read path of a serving worker: cached bytes served here, everything else asked of the
mount's own process (the coordinator) over the worker's channel.

A read looks in the block cache, read-only, in one read transaction that checks every
block's checksum (``cache.chunk_reader``): inline, or in a thread when the bytes are not in
RAM yet, as the coordinator's own reads do. A hit is answered at once and reported to the
coordinator as an event (``HIT``), which does there what a read does besides serving: the
prefetcher hears of it, the trace notes it, the chunks count as visited for eviction, the
metrics count it. Anything else (a miss, bytes staged only in the coordinator's memory, a
block that failed its checksum, an LMDB error) goes to the coordinator as a ``READ`` and is
answered with what the coordinator's read path answers, errors included: so a worker never
fetches, stages or stores anything, and never serves a byte it has not checked.

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

from spokefs.cache.chunk_reader import ChunkReader, NotResident, ReadResult, Staged
from spokefs.fuse.worker_channel import HIT, LISTED, READ, XATTR, Channel, ChannelClosed
from spokefs.namespace.replica import Attr
from spokefs.read.stream import Stream
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

_DISK_THREADS = 8  # reads of bytes not in RAM at once, as the coordinator's own


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
            self._channel.queue(HIT, (fv.file_id, offset, size, found.by_origin,
                                      found.visits(), time.monotonic() - started))
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


class ForwardedControl:
    """The ``user.spokefs.*`` attributes, answered by the coordinator."""

    def __init__(self, calls: Calls) -> None:
        self._calls = calls

    async def getxattr(self, attr: Attr, name: bytes, uid: int = 0) -> bytes:
        return await self._calls.call(XATTR, (attr.ino, name, uid))
