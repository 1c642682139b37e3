"""``BucketReader``: the ``RangeReader`` of a bucket export (same methods, same bounds), on
protocol v2 (framed blobs with per-frame checksums, deterministic packs).

The routes call ``slot()``, ``open_framed(file_id, version, spec)``, ``read_piece(blob, i)``
and ``read_pack(dir_id, index, digest)`` and get the same answers as from a directory, so
neither the routes nor the wire protocol know which backend serves them:

- ``open_framed``: the version and the range are checked against the snapshot (its size,
  ``protocol.framed_size``) before any byte is fetched, so a stale version is a clean 412.
  The answer's file bytes, from its first frame to its last (not the whole slices at its
  edges: a spoke's 3.75 MiB range touches 4-5 slices, and their whole bytes were 1.27 x
  what it asked for), are then fetched in GETs of up to ``_GET_SLICES`` slices (5 MiB), each
  with ``If-Match`` on the listed ETag, the next GET started while the current one's slices
  are sent (at most two GETs' bytes per request in memory). Each GET's body is streamed:
  a slice is ready as soon as its 1 MiB has arrived, so the first frames leave while the
  rest of the GET is still coming (``S3Client.get_streamed``). ``read_piece`` frames one
  slice with ``protocol.encode_frames``, as ``framed.FramedBlob`` does for a file on disk:
  no byte reaches a spoke without its sum.
- ``read_pack``: ``framed.PackPlans`` finds the pack as for a directory, then every member
  is fetched whole, up to ``_PACK_PARALLEL`` GETs of a pack queued at once on the client's
  connection pool, whose queue is first come, first served: a pack asked for first is
  complete first, instead of every pack in flight finishing late together; a member
  replaced or deleted since the listing is answered ``PACK_GONE``, like a changed file on
  disk.

A replaced object after the answer started (a 412 on a later GET) ends the answer short,
as a file changed on disk does: the spoke, which knows the length it asked for, refuses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
from typing import Any

from hubd.errors import StaleVersion, UnknownFile
from hubd.framed import FramedRange, PackPlans
from hubd.range_reader import Pack, RangeSpec, pick_members, resolve_range
from hubd.read_slots import ReadSlots
from hubd.s3.bucket import BucketExport
from hubd.s3.errors import first_error
from hubd.snapshot import Snapshot
from spokefs import protocol

# One GET carries up to 5 slices (5 MiB of data): a spoke's request (3.75 MiB) touches 4 or 5
# slices, so it is always one GET (with 4, three requests in four were two: ~470 GETs per GB,
# each ~0.5 ms of the hub's CPU and a request billed by the store).
_GET_SLICES = 5
# GETs of one pack's members queued at once: all of a pack of files of 16 KiB and up
# (a pack holds at most 3.75 MiB). The pool (64 connections) bounds what runs; its queue is
# FIFO, so packs complete in the order they were asked for. With 32 (before), 8 packs in
# flight took turns and all finished late together: 0.61 of the directory hub's cold small
# files/s at 60 ms (bench_s3_link, at ae36e9e).
_PACK_PARALLEL = 256


class BucketBlob:
    """One framed answer of an object version; the bucket's ``framed.FramedBlob``.

    Attributes:
        range: the framed bytes to send.
        pieces: how many ``piece`` calls send them (one per slice touched).
    """

    def __init__(self, export: BucketExport, snap: Snapshot, file_id: int, version: int,
                 size: int, rng: FramedRange) -> None:
        self._export = export
        self._snap = snap
        self._file_id = file_id
        self._version = version
        self._size = size
        self.range = rng
        self._first_slice = rng.start // protocol.SLICE_BYTES
        last_slice = (rng.stop - 1) // protocol.SLICE_BYTES if rng.stop > rng.start else -1
        self.pieces = last_slice - self._first_slice + 1
        # the file bytes the answer's frames hold: [_data_start, _data_stop)
        self._data_start = rng.start // protocol.FRAME_BYTES * protocol.FRAME_DATA_BYTES
        last_frame = (rng.stop - 1) // protocol.FRAME_BYTES
        self._data_stop = min((last_frame + 1) * protocol.FRAME_DATA_BYTES,
                              size) if self.pieces else self._data_start
        self._gets: dict[int, asyncio.Task[None]] = {}  # GET number -> its task
        # piece -> its file bytes, as the views of the buffers they arrived in
        self._slices: dict[int, asyncio.Future[list[memoryview]]] = {}

    def close(self) -> None:
        """Cancel the GETs still running (the answer ended early); the error of one that
        failed unawaited (a read ahead) is dropped: the answer has ended anyway."""
        waiters: tuple[asyncio.Future[Any], ...] = (*self._gets.values(), *self._slices.values())
        for waiter in waiters:
            if waiter.done():
                if not waiter.cancelled():
                    waiter.exception()  # retrieved: no "never retrieved" warning
            else:
                waiter.cancel()
        self._gets.clear()
        self._slices.clear()

    def _get(self, n: int) -> None:
        """Start GET number ``n`` of this answer (once): its slices' futures are set as
        their bytes arrive, or all failed with its error."""
        if n in self._gets:
            return
        first = self._first_slice + n * _GET_SLICES
        start = max(first * protocol.SLICE_DATA_BYTES, self._data_start)
        stop = min((first + _GET_SLICES) * protocol.SLICE_DATA_BYTES, self._data_stop)
        loop = asyncio.get_running_loop()
        pending = [self._slices.setdefault(i, loop.create_future())
                   for i in range(n * _GET_SLICES, min((n + 1) * _GET_SLICES, self.pieces))]

        def deliver(data: list[memoryview]) -> None:
            waiter = pending.pop(0)
            if not waiter.done():  # not cancelled by close()
                waiter.set_result(data)

        async def fetch() -> None:
            try:
                await self._export.read_streamed(self._snap, self._file_id, self._version,
                                                 start, stop, protocol.SLICE_DATA_BYTES, deliver)
            except Exception as exc:  # handed to the pieces that wait for this GET
                for waiter in pending:
                    if not waiter.done():
                        waiter.set_exception(exc)
                        waiter.exception()  # the piece that awaits it raises it
                pending.clear()

        self._gets[n] = asyncio.ensure_future(fetch())

    async def piece(self, i: int) -> bytes | memoryview:
        """The framed bytes of the answer in its ``i``-th slice (a view where the answer
        starts or ends inside it: not copied again).

        Raises:
            StaleVersion, UnknownFile, Forbidden, ReadFailed: as ``BucketExport.read``.
        """
        n = i // _GET_SLICES
        self._get(n)
        if (n + 1) * _GET_SLICES < self.pieces:
            self._get(n + 1)  # the next GET runs while this one's slices are sent
        data = await self._slices.pop(i)  # the received buffers are freed once framed
        s = self._first_slice + i
        frame = max(s * protocol.SLICE_DATA_BYTES, self._data_start) // protocol.FRAME_DATA_BYTES
        framed = protocol.encode_frames(data, self._file_id, self._version, frame)
        return self.range.cut(framed, frame * protocol.FRAME_BYTES)


class BucketReader:
    """Reads framed ranges and packs of a ``BucketExport``'s current snapshot."""

    def __init__(self, export: BucketExport, max_concurrent: int, wait_s: float) -> None:
        self._export = export
        self._slots = ReadSlots(max_concurrent, wait_s)
        self._plans = PackPlans()

    def close(self) -> None:
        """Nothing to release: the S3 client belongs to the server."""

    def slot(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold one read slot (until the answer is written out, to bound memory)."""
        return self._slots.hold()

    @property
    def in_flight(self) -> int:
        """Requests holding a read slot right now."""
        return self._slots.in_flight

    def _current(self) -> Snapshot:
        snap = self._export.snapshot
        assert snap is not None  # the app only serves after the first listing
        return snap

    async def open_framed(self, file_id: int, version: int,
                          spec: RangeSpec | None) -> BucketBlob:
        """The framed answer of ``file_id`` at ``version`` (call inside ``slot()``; close it).

        Raises:
            UnknownFile, StaleVersion, RangeNotSatisfiable.
        """
        snap = self._current()
        entry = snap.lookup(file_id)
        if entry is None or not stat.S_ISREG(entry.mode):
            raise UnknownFile(f"no file {file_id:016x} in generation {snap.generation}")
        if entry.version != version:
            raise StaleVersion(f"file {file_id:016x} is at version {entry.version:016x}")
        rng = resolve_range(spec, protocol.framed_size(entry.size))
        return BucketBlob(self._export, snap, file_id, version, entry.size, rng)

    async def read_piece(self, blob: BucketBlob, index: int) -> bytes | memoryview:
        """Piece ``index`` of an open framed answer."""
        return await blob.piece(index)

    async def read_pick(self, items: list[tuple[int, int]]) -> Pack:
        """The objects a pick names, whole; a member not in the current snapshot at that
        version, or replaced since the listing, is ``PACK_GONE``.

        Raises:
            BadPack (``range_reader.pick_members``), Forbidden and ReadFailed as
            ``BucketExport.read``.
        """
        snap = self._current()
        return await self._read_members(snap, pick_members(snap, items))

    async def read_pack(self, dir_id: int, index: int, digest: str) -> Pack:
        """Pack ``index`` of directory ``dir_id`` of the current snapshot, members whole.

        Raises:
            UnknownFile (no such directory), StaleVersion (the pack differs in this
            generation), Forbidden and ReadFailed as ``BucketExport.read``.
        """
        snap = self._current()
        # the first lookup per snapshot lists every directory: off the loop
        plan = await asyncio.to_thread(self._plans.find, snap, dir_id, index, digest)
        return await self._read_members(snap, list(plan.members))

    async def _read_members(self, snap: Snapshot, members: list[tuple[int, int, int]]) -> Pack:
        """The pack of ``(file_id, version, size)`` members (size -1: gone), read
        ``_PACK_PARALLEL`` at a time."""
        gate = asyncio.Semaphore(_PACK_PARALLEL)

        async def whole(file_id: int, version: int, size: int) -> bytes | None:
            if size < 0:
                return None
            async with gate:
                try:
                    return await self._export.read(snap, file_id, version, 0, size)
                except (UnknownFile, StaleVersion):
                    return None  # replaced or deleted since the listing

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(whole(*m)) for m in members]
        except ExceptionGroup as group_error:  # Forbidden, ReadFailed: one answer for all
            raise first_error(group_error) from None
        return Pack.of((file_id, version, task.result())
                       for (file_id, version, _), task in zip(members, tasks, strict=True))
