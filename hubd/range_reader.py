"""Bounded, executor-backed reads of one byte range of one file version, or of a pack.

- ``parse_range`` checks the ``Range`` header's syntax before any I/O; ``resolve_range``
  applies it to the file size once the file is open.
- ``RangeReader`` runs each read (confined open, fstat checks, ``os.pread``, xxh3 of the
  body) in one hop to its own ``ThreadPoolExecutor``, so the event loop never blocks.
- ``plan_pack`` checks a pack request against the snapshot before any I/O (400 for a
  directory or symlink id, 413 above ``MAX_RANGE_BYTES`` in total); ``RangeReader.read_pack``
  then reads every file whole, in one executor hop, through the same confined open and the
  same before/after fstat checks as a range read.

Memory bound: a request holds one of ``max_concurrent_reads`` slots (an asyncio semaphore)
from before its read until its body is written out, and a read (a range, or all the files of
one pack together) is at most ``wire.MAX_RANGE_BYTES`` long, so read buffers stay under
``max_concurrent_reads * MAX_RANGE_BYTES`` (plus a pack's 32-byte record headers). A request
that waits longer than ``wait_s`` for a slot gets 503 ``overloaded``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import stat
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from hubd import wire
from hubd.errors import (
    BadPack,
    BadRange,
    MultipleRanges,
    Overloaded,
    PackTooLarge,
    RangeNotSatisfiable,
    RangeTooLarge,
    ReadFailed,
    StaleVersion,
    UnknownFile,
)
from hubd.export_root import ExportRoot, version_of
from hubd.snapshot import Snapshot

log = logging.getLogger(__name__)

_RANGE_RE = re.compile(r"(\d*)-(\d*)", re.ASCII)
_MAX_DIGITS = 19  # 10**19 > 2**63: any longer number is no file offset


@dataclass(frozen=True, slots=True)
class RangeSpec:
    """One ``bytes=`` range before the size is known: ``first-last``, ``first-`` or ``-suffix``.

    Attributes:
        first: first byte, or None for a suffix range.
        last: last byte (inclusive) for ``first-last``, the suffix length for ``-suffix``,
            None for ``first-``.
    """

    first: int | None
    last: int | None


@dataclass(frozen=True, slots=True)
class Blob:
    """Bytes ``[start, stop)`` of a file of ``size`` bytes; ``partial`` means answer 206."""

    data: bytes
    start: int
    stop: int
    size: int
    checksum: str
    partial: bool


@dataclass(frozen=True, slots=True)
class Pack:
    """The answer to one pack request.

    Attributes:
        body: the records (``wire.encode_pack_record``) in request order.
        served, gone: how many records carry bytes, and how many are ``PACK_GONE``.
        file_bytes: the file bytes in ``body`` (without record headers).
    """

    body: bytes
    served: int
    gone: int
    file_bytes: int


def plan_pack(snap: Snapshot, items: list[tuple[int, int]]) -> list[bool]:
    """Which items of a pack to read (False: answer ``PACK_GONE``), checked before any I/O.

    Raises:
        BadPack: an id names a directory or a symlink of ``snap``.
        PackTooLarge: the files to read add up to more than ``wire.MAX_RANGE_BYTES``.
    """
    wanted: list[bool] = []
    total = 0
    for file_id, version in items:
        entry = snap.lookup(file_id)
        if entry is not None and not stat.S_ISREG(entry.mode):
            raise BadPack(f"{file_id:016x} is not a regular file")
        current = entry is not None and entry.version == version
        if current:
            assert entry is not None
            total += entry.size
        wanted.append(current)
    if total > wire.MAX_RANGE_BYTES:
        raise PackTooLarge(f"the files add up to {total} bytes, more than "
                           f"{wire.MAX_RANGE_BYTES}: ask for fewer or use ranges")
    return wanted


def parse_range(values: list[str]) -> RangeSpec | None:
    """Parse the request's ``Range`` header values (None when there is none).

    Raises:
        BadRange: not ``bytes=``, not numeric, too large a number, end before start.
        MultipleRanges: more than one range.
    """
    if not values:
        return None
    if len(values) > 1:
        raise MultipleRanges("only one Range header is served")
    unit, sep, spec = values[0].strip().partition("=")
    if not sep or unit.strip().lower() != "bytes":
        raise BadRange("want Range: bytes=FIRST-LAST")
    if "," in spec:
        raise MultipleRanges("only one range per request is served")
    match = _RANGE_RE.fullmatch(spec.strip())
    if match is None or match.group(0) == "-":
        raise BadRange(f"malformed range {spec[:40]!r}")
    first_s, last_s = match.groups()
    if len(first_s) > _MAX_DIGITS or len(last_s) > _MAX_DIGITS:
        raise BadRange("range number too large")
    first = int(first_s) if first_s else None
    last = int(last_s) if last_s else None
    if first is not None and last is not None and last < first:
        raise BadRange(f"range end {last} before its start {first}")
    return RangeSpec(first, last)


def resolve_range(spec: RangeSpec | None, size: int) -> tuple[int, int, bool]:
    """Apply ``spec`` to a file of ``size`` bytes: ``(start, stop, partial)``.

    Raises:
        RangeNotSatisfiable: the range starts at or past the end (or the file is empty).
        RangeTooLarge: more than ``wire.MAX_RANGE_BYTES`` would be served.
    """
    if spec is None:
        if size > wire.MAX_RANGE_BYTES:
            raise RangeTooLarge(f"file is {size} bytes: ask for ranges", size)
        return 0, size, False
    if spec.first is None:  # suffix: the last N bytes
        assert spec.last is not None
        if spec.last == 0 or size == 0:
            raise RangeNotSatisfiable("empty suffix range or empty file", size)
        start, stop = max(0, size - spec.last), size
    else:
        if spec.first >= size:
            raise RangeNotSatisfiable(f"range starts at {spec.first}, file is {size} bytes", size)
        start = spec.first
        stop = size if spec.last is None else min(spec.last + 1, size)
    if stop - start > wire.MAX_RANGE_BYTES:
        raise RangeTooLarge(f"range longer than {wire.MAX_RANGE_BYTES} bytes", size)
    return start, stop, True


def _pread_exact(fd: int, start: int, stop: int) -> bytes:
    data = os.pread(fd, stop - start, start)
    if len(data) == stop - start:
        return data
    parts = [data]  # short read (rare): keep reading until EOF or done
    got = len(data)
    while got < stop - start:
        more = os.pread(fd, stop - start - got, start + got)
        if not more:
            raise StaleVersion("the file shrank while being read")
        parts.append(more)
        got += len(more)
    return b"".join(parts)


class RangeReader:
    """Reads ranges of file versions from an ``ExportRoot`` in a bounded executor.

    Attributes:
        in_flight: requests holding a read slot right now.
    """

    def __init__(self, export: ExportRoot, max_concurrent: int, wait_s: float) -> None:
        self._export = export
        self._wait_s = wait_s
        self._slots = asyncio.Semaphore(max_concurrent)
        self._executor = ThreadPoolExecutor(max_concurrent, thread_name_prefix="hubd-read")
        self.in_flight = 0

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

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

    async def read(self, file_id: int, version: int, spec: RangeSpec | None) -> Blob:
        """Read the range of the current snapshot's ``file_id`` at ``version``.

        Call inside ``slot()``. Raises the ``HubError`` of ``ExportRoot.open_file`` or
        ``resolve_range``; ``ReadFailed`` on an I/O error.
        """
        snap = self._export.snapshot
        assert snap is not None  # the app only serves after the first scan
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, self._read_sync, snap, file_id, version, spec
        )

    async def read_pack(self, items: list[tuple[int, int]]) -> Pack:
        """Read whole files of the current snapshot for a pack answer.

        Call inside ``slot()``. Raises ``BadPack``/``PackTooLarge`` (``plan_pack``),
        ``Forbidden``, or ``ReadFailed`` on an I/O error; a file gone or changed on disk
        since the snapshot is answered ``PACK_GONE``, like an unknown id or an old version.
        """
        snap = self._export.snapshot
        assert snap is not None  # the app only serves after the first scan
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._read_pack_sync, snap, items)

    def _read_pack_sync(self, snap: Snapshot, items: list[tuple[int, int]]) -> Pack:
        wanted = plan_pack(snap, items)  # here too: 4096 lookups take milliseconds
        parts: list[bytes] = []
        served = file_bytes = 0
        for (file_id, version), want in zip(items, wanted, strict=True):
            blob = None
            if want:
                try:
                    blob = self._read_sync(snap, file_id, version, None)
                except (UnknownFile, StaleVersion):
                    blob = None  # gone from disk or changed since the snapshot
            if blob is None:
                parts.append(wire.encode_pack_record(file_id, version, None, 0))
                continue
            # The hex digest is the canonical form of the int one: no second hash.
            parts.append(wire.encode_pack_record(file_id, version, blob.data,
                                                 int(blob.checksum, 16)))
            served += 1
            file_bytes += len(blob.data)
        return Pack(b"".join(parts), served, len(items) - served, file_bytes)

    def _read_sync(self, snap: Snapshot, file_id: int, version: int,
                   spec: RangeSpec | None) -> Blob:
        try:
            return self._read_blob(snap, file_id, version, spec)
        except OSError as exc:
            log.warning("read of %016x failed: %s", file_id, exc.strerror)
            raise ReadFailed(f"read failed: {exc.strerror}") from None

    def _read_blob(self, snap: Snapshot, file_id: int, version: int,
                   spec: RangeSpec | None) -> Blob:
        fd, size = self._export.open_file(snap, file_id, version)
        try:
            start, stop, partial = resolve_range(spec, size)
            data = _pread_exact(fd, start, stop)
            st = os.fstat(fd)  # again: a write during the read changes mtime, so the version
            if version_of(st) != version:  # the same fd: the same inode, so the same id
                raise StaleVersion(f"file {file_id:016x} changed while being read")
        finally:
            os.close(fd)
        return Blob(data, start, stop, size, xxhash.xxh3_64_hexdigest(data), partial)
