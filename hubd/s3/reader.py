"""``BucketReader``: the ``RangeReader`` of a bucket export (same methods, same bounds).

The routes call ``slot()``, ``read(file_id, version, spec)`` and ``read_pack(items)`` and
get the same ``Blob`` and ``Pack`` answers as from a directory, so neither the routes nor
the wire protocol know which backend serves them:

- ``read``: the range is checked against the snapshot's size (``resolve_range``), then
  fetched with one ranged GET (or parallel parts above ``S3Config.part_bytes``) carrying
  ``If-Match``; its xxh3 is computed as for a file on disk, off the loop above
  ``_INLINE_HASH_BYTES``.
- ``read_pack``: ``plan_pack`` as for a directory, then every wanted file whole, at most
  ``_PACK_PARALLEL`` GETs at once; a file replaced or deleted since the listing is
  answered ``PACK_GONE``, like a changed file on disk.

Memory bound: as ``RangeReader``: one of ``max_concurrent`` slots per request, at most
``wire.MAX_RANGE_BYTES`` of bodies per slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
from collections.abc import AsyncIterator

import xxhash

from hubd import wire
from hubd.errors import Overloaded, StaleVersion, UnknownFile
from hubd.range_reader import Blob, Pack, RangeSpec, plan_pack, resolve_range
from hubd.s3.bucket import BucketExport
from hubd.s3.errors import first_error
from hubd.snapshot import Snapshot

# xxh3 runs at ~10 GB/s here: 1 MiB takes ~0.1 ms inline, a 16 MiB range ~2 ms, which goes
# to a thread so the loop never stalls for more than about a millisecond.
_INLINE_HASH_BYTES = 1024 * 1024
# Whole small files of one pack fetched at once: enough to hide S3's first-byte latency
# (~10-30 ms per GET) without taking the whole connection pool from range reads.
_PACK_PARALLEL = 32


async def checksum(data: bytes) -> str:
    """xxh3_64 of ``data`` as the ``X-Spokefs-XXH3`` hex digest (big bodies off the loop)."""
    if len(data) <= _INLINE_HASH_BYTES:
        return xxhash.xxh3_64_hexdigest(data)
    return await asyncio.get_running_loop().run_in_executor(None, xxhash.xxh3_64_hexdigest,
                                                            data)


class BucketReader:
    """Reads ranges and packs of a ``BucketExport``'s current snapshot.

    Attributes:
        in_flight: requests holding a read slot right now.
    """

    def __init__(self, export: BucketExport, max_concurrent: int, wait_s: float) -> None:
        self._export = export
        self._wait_s = wait_s
        self._slots = asyncio.Semaphore(max_concurrent)
        self.in_flight = 0

    def close(self) -> None:
        """Nothing to release: the S3 client belongs to the server."""

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one read slot (until the answer is written out, to bound memory)."""
        try:
            async with asyncio.timeout(self._wait_s):
                await self._slots.acquire()
        except TimeoutError:
            raise Overloaded(f"no read slot free within {self._wait_s:g} s") from None
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self._slots.release()

    def _current(self) -> Snapshot:
        snap = self._export.snapshot
        assert snap is not None  # the app only serves after the first listing
        return snap

    async def read(self, file_id: int, version: int, spec: RangeSpec | None) -> Blob:
        """The range of ``file_id`` at ``version`` (call inside ``slot()``).

        Raises:
            UnknownFile, StaleVersion, the errors of ``resolve_range``, and those of
            ``BucketExport.read``.
        """
        snap = self._current()
        entry = snap.lookup(file_id)
        if entry is None or not stat.S_ISREG(entry.mode):
            raise UnknownFile(f"no file {file_id:016x} in generation {snap.generation}")
        if entry.version != version:
            raise StaleVersion(f"file {file_id:016x} is at version {entry.version:016x}")
        start, stop, partial = resolve_range(spec, entry.size)
        data = await self._export.read(snap, file_id, version, start, stop)
        return Blob(data, start, stop, entry.size, await checksum(data), partial)

    async def read_pack(self, items: list[tuple[int, int]]) -> Pack:
        """Whole files for a pack answer (call inside ``slot()``).

        Raises:
            BadPack, PackTooLarge (``plan_pack``); Forbidden and ReadFailed as ``read``.
        """
        snap = self._current()
        wanted = plan_pack(snap, items)
        gate = asyncio.Semaphore(_PACK_PARALLEL)

        async def whole(file_id: int, version: int) -> bytes | None:
            entry = snap.lookup(file_id)
            assert entry is not None  # plan_pack only wants current files
            async with gate:
                try:
                    return await self._export.read(snap, file_id, version, 0, entry.size)
                except (UnknownFile, StaleVersion):
                    return None  # replaced or deleted since the listing

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(whole(f, v)) if want else None
                         for (f, v), want in zip(items, wanted, strict=True)]
        except ExceptionGroup as group_error:  # Forbidden, ReadFailed: one answer for all
            raise first_error(group_error) from None
        parts: list[bytes] = []
        served = file_bytes = 0
        for (file_id, version), task in zip(items, tasks, strict=True):
            data = task.result() if task is not None else None
            if data is None:
                parts.append(wire.encode_pack_record(file_id, version, None, 0))
                continue
            parts.append(wire.encode_pack_record(file_id, version, data,
                                                 xxhash.xxh3_64_intdigest(data)))
            served += 1
            file_bytes += len(data)
        return Pack(b"".join(parts), served, len(items) - served, file_bytes)
