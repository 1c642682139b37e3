"""Bounded, executor-backed reads: framed blob answers and deterministic packs.

- ``parse_range`` checks the ``Range`` header's syntax before any I/O; ``resolve_range``
  applies it to the size of the framed representation once the file is open.
- ``RangeReader.open_framed`` opens a file version (confined open, fstat checks) in one hop
  to its own ``ThreadPoolExecutor`` and returns a ``framed.FramedBlob``; ``read_piece``
  reads and frames one slice of it per hop, so the event loop never blocks.
- ``RangeReader.read_pack`` finds pack ``index`` of a directory (``framed.PackPlans``), then
  reads every member whole, in one executor hop, through the same confined open and the
  same before/after fstat checks.

Memory bound: a request holds one of ``max_concurrent_reads`` slots (an asyncio semaphore)
from before its first read until its body is written out; it holds at most one slice of a
blob (``protocol.SLICE_BYTES``) or one pack (``protocol.PACK_MAX_BYTES`` of files) at a time, so
read buffers stay under ``max_concurrent_reads * protocol.PACK_MAX_BYTES`` (plus a pack's
32-byte record headers). A request that waits longer than ``wait_s`` for a slot gets 503
``overloaded``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import xxhash

from hubd import members as members_io
from hubd.errors import (
    BadPack,
    BadRange,
    MultipleRanges,
    RangeNotSatisfiable,
    ReadFailed,
    StaleVersion,
    UnknownFile,
)
from hubd.export_root import ExportRoot, open_error
from hubd.framed import FramedBlob, FramedRange, PackPlans
from hubd.log_rate import LogEveryPerKey, since_last
from hubd.read_slots import ReadSlots
from hubd.scan import file_id_from, version_from
from hubd.snapshot import Snapshot
from spokefs import protocol

log = logging.getLogger(__name__)
_READ_FAILURE_LINES = LogEveryPerKey()

T = TypeVar("T")

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
class Pack:
    """The answer to one pack request.

    Attributes:
        body: the records (``protocol.encode_pack_record``) in ``plan_packs`` order.
        served, gone: how many records carry bytes, and how many are ``PACK_GONE``.
        file_bytes: the file bytes in ``body`` (without record headers).
    """

    body: bytes | bytearray
    served: int
    gone: int
    file_bytes: int

    @classmethod
    def of(cls, members: Iterable[tuple[int, int, bytes | None]]) -> Pack:
        """The pack of ``(file_id, version, data)`` in plan order; data None: the file is
        gone (a ``PACK_GONE`` record)."""
        parts: list[bytes] = []
        served = gone = file_bytes = 0
        for file_id, version, data in members:
            if data is None:
                parts.append(protocol.encode_pack_record(file_id, version, None, 0))
                gone += 1
                continue
            parts.append(protocol.encode_pack_record(file_id, version, data,
                                                 xxhash.xxh3_64_intdigest(data)))
            served += 1
            file_bytes += len(data)
        return cls(b"".join(parts), served, gone, file_bytes)


def pick_members(snap: Snapshot, items: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The ``(file_id, version, size)`` of a pick's members in ``snap``; size -1: not a
    regular file at that version here (its record is ``PACK_GONE``).

    Raises:
        BadPack: a member too large for a pack, or more than a pack's bytes in all (what a
            spoke planned with ``protocol.plan_picks`` never is).
    """
    members: list[tuple[int, int, int]] = []
    total = 0
    for file_id, version in items:
        entry = snap.lookup(file_id)
        if entry is None or not stat.S_ISREG(entry.mode) or entry.version != version:
            members.append((file_id, version, -1))
            continue
        if not protocol.packable(entry.size) and entry.size:
            raise BadPack(f"file {file_id:016x} is too large for a pick ({entry.size} bytes)")
        total += entry.size
        members.append((file_id, version, entry.size))
    if total > protocol.PACK_MAX_BYTES:
        raise BadPack(f"a pick of {total} bytes (at most {protocol.PACK_MAX_BYTES})")
    return members


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


def resolve_range(spec: RangeSpec | None, total: int) -> FramedRange:
    """Apply ``spec`` to a representation of ``total`` bytes. No length limit: answers are
    streamed a slice at a time.

    Raises:
        RangeNotSatisfiable: the range starts at or past the end (or the file is empty).
    """
    if spec is None:
        return FramedRange(0, total, total, False)
    if spec.first is None:  # suffix: the last N bytes
        assert spec.last is not None
        if spec.last == 0 or total == 0:
            raise RangeNotSatisfiable("empty suffix range or empty file", total)
        return FramedRange(max(0, total - spec.last), total, total, True)
    if spec.first >= total:
        raise RangeNotSatisfiable(f"range starts at {spec.first}, the representation is "
                                  f"{total} bytes", total)
    stop = total if spec.last is None else min(spec.last + 1, total)
    return FramedRange(spec.first, stop, total, True)


class RangeReader:
    """Reads ranges of file versions from an ``ExportRoot`` in a bounded executor."""

    def __init__(self, export: ExportRoot, max_concurrent: int, wait_s: float) -> None:
        self._export = export
        self._slots = ReadSlots(max_concurrent, wait_s)
        self._executor = ThreadPoolExecutor(max_concurrent, thread_name_prefix="hubd-read")
        self._plans = PackPlans()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def slot(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold one read slot (until the answer is written out, to bound memory)."""
        return self._slots.hold()

    @property
    def in_flight(self) -> int:
        """Requests holding a read slot right now."""
        return self._slots.in_flight

    async def open_framed(self, file_id: int, version: int,
                          spec: RangeSpec | None) -> FramedBlob:
        """Open the current snapshot's ``file_id`` at ``version`` for a framed answer.

        Call inside ``slot()``; close the answer. Raises the ``HubError`` of
        ``ExportRoot.open_file`` or ``resolve_range``; ``ReadFailed`` on an I/O error.
        """
        snap = self._export.snapshot
        assert snap is not None  # the app only serves after the first scan
        return await self._in_thread(self._open_framed_sync, snap, file_id, version, spec)

    async def read_piece(self, blob: FramedBlob, index: int) -> bytes | memoryview:
        """Piece ``index`` of an open framed answer (``StaleVersion`` if the file changed)."""
        return await self._in_thread(blob.piece, index)

    async def read_pack(self, dir_id: int, index: int, digest: str) -> Pack:
        """Pack ``index`` of directory ``dir_id`` of the current snapshot, read whole.

        Call inside ``slot()``. Raises ``UnknownFile`` (no such directory),
        ``StaleVersion`` (the pack's members differ in this generation), ``Forbidden``, or
        ``ReadFailed`` on an I/O error; a member gone or changed on disk since the
        snapshot is answered ``PACK_GONE``.
        """
        snap = self._export.snapshot
        assert snap is not None  # the app only serves after the first scan
        plan = await self._in_thread(self._plans.find, snap, dir_id, index, digest)
        return await self._in_thread(self._read_pack_sync, snap, plan)

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, fn, *args)
        except OSError as exc:
            count = _READ_FAILURE_LINES.occurred(exc.errno)  # one a minute per errno
            if count:
                log.warning("read failed: %s%s", exc.strerror, since_last(count, "failures"))
            raise ReadFailed(f"read failed: {exc.strerror}") from None

    def _open_framed_sync(self, snap: Snapshot, file_id: int, version: int,
                          spec: RangeSpec | None) -> FramedBlob:
        fd, size = self._export.open_file(snap, file_id, version)
        try:
            rng = resolve_range(spec, protocol.framed_size(size))
        except BaseException:
            os.close(fd)
            raise
        return FramedBlob(fd, file_id, version, size, rng)

    async def read_pick(self, items: list[tuple[int, int]]) -> Pack:
        """The files a pick names, read whole (call inside ``slot()``); a member not in the
        current snapshot at that version, or gone or changed on disk, is ``PACK_GONE``.

        Raises:
            BadPack (``pick_members``), Forbidden, ReadFailed.
        """
        snap = self._export.snapshot
        assert snap is not None  # the app only serves after the first scan
        members = pick_members(snap, items)
        return await self._in_thread(self._read_pick_sync, snap, members)

    def _read_pick_sync(self, snap: Snapshot, members: list[tuple[int, int, int]]) -> Pack:
        return self._read_members(snap, members)

    def _read_pack_sync(self, snap: Snapshot, plan: protocol.PackPlan) -> Pack:
        return self._read_members(snap, plan.members)

    def _read_members(self, snap: Snapshot, members: Sequence[tuple[int, int, int]]) -> Pack:
        """The pack of ``(file_id, version, size)`` (size -1: gone), each member read
        straight into its place in the answer after its record header: one buffer, no
        copy of a member's bytes and no joining (``Pack.of`` from separate bytes cost two
        copies of every byte and a fresh 4 MiB answer's page faults: bench_cold_cpu.py).
        Members of one directory in a row (all of a pack's) are read in one call
        (``hubd.members``) from their directory, opened once. A member gone or changed on
        disk since the snapshot is ``PACK_GONE``."""
        record = protocol.PACK_RECORD
        body = bytearray(sum(record.size + max(size, 0) for _, _, size in members))
        pos = served = gone = file_bytes = 0
        for parent_id, run in _runs_by_directory(snap, members):
            names = [name for name, _ in run]
            sizes = [size for _, (_, _, size) in run]
            results: list[members_io.Read | int]
            parts = snap.path_parts(parent_id) if parent_id is not None else None
            try:
                if parts is None:
                    raise UnknownFile("not a file of the snapshot")
                dir_fd, dev, mount = self._export.open_dir(parts)
            except (UnknownFile, StaleVersion):
                results = [members_io.NOT_LISTED] * len(run)
            else:
                try:
                    results = members_io.read_members(dir_fd, names, sizes, body, pos,
                                                       record.size)
                finally:
                    os.close(dir_fd)
            for (name, (file_id, version, size)), got in zip(run, results, strict=True):
                if isinstance(got, int):
                    _raise_unless_gone(got)
                elif _is_version(got, file_id, version, mount if got.dev == dev else
                                 b"/".join([*(parts or ()), name])):
                    record.pack_into(body, pos, file_id, version, size, got.digest)
                    pos += record.size + size
                    served += 1
                    file_bytes += size
                    continue
                else:  # read whole, but not that version now: its bytes leave the answer
                    del body[pos + record.size : pos + record.size + size]
                record.pack_into(body, pos, file_id, version, protocol.PACK_GONE, 0)
                pos += record.size
                gone += 1
        del body[pos:]  # members gone: their bytes were never sent
        return Pack(body, served, gone, file_bytes)


def _runs_by_directory(snap: Snapshot, members: Sequence[tuple[int, int, int]]) -> Iterator[
        tuple[int | None, list[tuple[bytes, tuple[int, int, int]]]]]:
    """The members in order, cut into runs of one directory: ``(parent id, [(name,
    member)])``; a member not a regular file of the snapshot gets size -1 (gone) in a run
    of its parent's, or of None."""
    run: list[tuple[bytes, tuple[int, int, int]]] = []
    parent: int | None = None
    for file_id, version, size in members:
        entry = snap.lookup(file_id) if size >= 0 else None
        if entry is None or not stat.S_ISREG(entry.mode):
            here, name, size = parent, b"", -1  # joins the current run: nothing is opened
        else:
            here, name = entry.parent_id, entry.name
        if run and here != parent:
            yield parent, run
            run = []
        parent = here
        run.append((name, (file_id, version, size)))
    if run:
        yield parent, run


def _is_version(got: members_io.Read, file_id: int, version: int, mount: bytes) -> bool:
    """Whether a member read whole is ``file_id`` at ``version``, before and after the read
    (a write during it changes the mtime: the same inode, so the same id)."""
    return (file_id_from(got.ino, mount) == file_id
            and version_from(got.size, got.mtime_ns, got.ino) == version
            and version_from(got.size_after, got.mtime_ns_after, got.ino_after) == version)


_GONE = frozenset({errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO,
                   members_io.NOT_REGULAR, members_io.SIZE_DIFFERS, members_io.SHRANK,
                   members_io.NOT_LISTED})


def _raise_unless_gone(code: int) -> None:
    """A member not read: gone (its record says so), or an error for the whole pack, as
    ``ExportRoot.open_file`` maps it (EACCES: 403; any other: 503)."""
    if code not in _GONE:
        raise open_error(OSError(code, os.strerror(code)))
