"""The access trace of a cache dir: which file versions its mounts read, and which extents
of the large ones, in the order of first access (``spokefs trace save`` exports it,
``trace_file`` is the portable form, ``replay`` fetches it ahead on the next run).

Training jobs repeat: a run after a crash or a hyperparameter change, and every node of a
multi-node job, reads the same files. What one run read is the best prefetch list for the
next one.

**Cost on the read path.** The reader calls ``note`` only when a stream reads a new extent
(``Stream.traced_extent``): once per small file, once per ``EXTENT_BYTES`` of a large file
read in order; ``note`` is a set lookup and, the first time, a 28-byte append to a
``bytearray``. No syscall per read: the ``run`` task appends the buffer to the records file
once a second, in a worker thread.

**Records.** ``<cache dir>/trace/records``: a magic line, then fixed-size records ``(file
id, version, size, extent)``, little-endian; ``extent`` is ``WHOLE`` for a file of at most
``EXTENT_BYTES`` (it is read whole: one round trip, see ``reader``), else the index of the
``EXTENT_BYTES`` extent first touched. Records name ids, not paths: ids are stable across
remounts, and ``trace save`` resolves them to paths through the namespace.

**One trace per cache dir.** A remount continues the trace (the records are loaded and
their keys seeded, so nothing is recorded twice): a job restarted after a crash or a
``kill -9`` of the spoke goes on recording into the trace of its first attempt.
``spokefs trace clear`` starts a new one.

**Crash states.** A ``kill -9`` loses the records of at most the last ``_FLUSH_S`` (they are
in the page cache once written; a machine crash may lose what the kernel had not written
back). A torn last record (a crash in the middle of an append) is cut off at load; a file
that does not start with the magic line is set aside as ``records.bad`` and a new trace
begins.

**Bound.** At most ``max_records`` records (default 1 Mi: 28 MiB on disk, ~150 MiB of RAM
for the keys at worst). A trace that is full keeps its first ``max_records`` first accesses
(the ones a replay fetches first) and records nothing more until cleared; the loss is
counted (``spokefs_trace_dropped_total``) and logged once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from pathlib import Path

import trio

from spokefs import metrics
from spokefs.log_limit import LogLimiter
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

EXTENT_BYTES = 4 << 20
"""Unit of large-file ranges: a read-ahead window's order of size, so a sequential reader
costs one record per few hundred reads, and a replay fetches whole requests."""
WHOLE = 0xFFFFFFFF
RECORD = struct.Struct("<QQQI")
MAGIC = b"spokefs-trace-records 1\n"
_FLUSH_S = 1.0
_MAX_RECORDS = 1 << 20

Record = tuple[int, int, int, int]  # file id, version, size, extent (or WHOLE)


def extent_of(fv: FileVersion, offset: int) -> int:
    """The trace's extent of a read at ``offset``: WHOLE for a file of one extent."""
    return WHOLE if fv.size <= EXTENT_BYTES else offset // EXTENT_BYTES


def load_records(path: Path) -> list[Record]:
    """The records of a records file, a torn last record cut off.

    Raises:
        ValueError: the file does not start with the magic line.
    """
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.startswith(MAGIC):
        raise ValueError("not a spokefs trace records file")
    body = memoryview(raw)[len(MAGIC):]
    whole = len(body) - len(body) % RECORD.size
    return list(RECORD.iter_unpack(body[:whole]))


class TraceRecorder:
    """Records first accesses into ``<trace dir>/records``.

    Attributes:
        path: the records file.
        max_records: the bound (see "Bound").
    """

    def __init__(self, trace_dir: Path, max_records: int = _MAX_RECORDS) -> None:
        self.path = trace_dir / "records"
        self.max_records = max_records
        self._seen: set[tuple[int, int, int]] = set()
        self._buf = bytearray()
        self._count = 0
        self._full_logged = False
        self._truncate = False  # cleared: the next write starts a new file
        self._lock = trio.Lock()  # one writer of the file at a time
        self._log = LogLimiter(log)
        trace_dir.mkdir(parents=True, exist_ok=True)
        self._load()

    def _load(self) -> None:
        """Seed the keys from the records of earlier mounts (blocking: before serving)."""
        if not self.path.exists():
            self._truncate = True
            return
        try:
            records = load_records(self.path)
        except (OSError, ValueError) as exc:
            log.warning("trace %s unreadable (%s): set aside as records.bad, starting anew",
                        self.path, exc)
            os.replace(self.path, self.path.with_name("records.bad"))
            self._truncate = True
            return
        for fid, version, _, extent in records:
            self._seen.add((fid, version, extent))
        self._count = len(records)
        # cut a torn last record off, so that appends stay aligned
        os.truncate(self.path, len(MAGIC) + self._count * RECORD.size)
        metrics.TRACE_RECORDS.set(self._count)
        log.info("trace: %d records from earlier mounts", self._count)

    @property
    def records(self) -> int:
        return self._count

    def note(self, fv: FileVersion, offset: int, end: int) -> None:
        """A stream read ``[offset, end)`` of ``fv`` in an extent new to it (synchronous)."""
        extent = extent_of(fv, offset)
        self._add(fv, extent)
        if extent != WHOLE and (last := (end - 1) // EXTENT_BYTES) != extent:
            self._add(fv, last)

    def _add(self, fv: FileVersion, extent: int) -> None:
        key = (fv.file_id, fv.version, extent)
        if key in self._seen:
            return
        if self._count >= self.max_records:
            metrics.TRACE_DROPPED.inc()
            if not self._full_logged:
                self._full_logged = True
                log.info("trace full (%d records): first accesses are no longer recorded "
                         "until `spokefs trace clear`", self.max_records)
            return
        self._seen.add(key)
        self._buf += RECORD.pack(fv.file_id, fv.version, fv.size, extent)
        self._count += 1

    def clear(self) -> None:
        """Start a new trace (the file is cut at the next write)."""
        self._seen.clear()
        self._buf.clear()
        self._count = 0
        self._full_logged = False
        self._truncate = True
        metrics.TRACE_RECORDS.set(0)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Append the new records to the file every ``_FLUSH_S``; a last time when cancelled."""
        task_status.started()
        try:
            while True:
                await trio.sleep(_FLUSH_S)
                await self.flush()
        finally:
            with trio.CancelScope(shield=True):  # short: at most a second of records
                await self.flush()

    async def flush(self) -> None:
        """Write what was recorded so far."""
        async with self._lock:
            if not self._buf and not self._truncate:
                return
            data, truncate = bytes(self._buf), self._truncate
            self._buf.clear()
            self._truncate = False
            try:
                await trio.to_thread.run_sync(self._append, data, truncate)
            except OSError as exc:  # a full disk: these records are lost, the mount goes on
                self._truncate = truncate  # the file was left as it was (``_append``)
                metrics.STORE_ERRORS.labels(store="trace").inc()
                self._log.warning("write", "trace: could not write %s: %s", self.path, exc)
            metrics.TRACE_RECORDS.set(self._count)

    def _append(self, data: bytes, truncate: bool) -> None:
        """Append whole records, or leave the file as it was (a torn record would make
        the whole trace unreadable at the next mount)."""
        with open(self.path, "wb" if truncate else "ab") as f:
            start = f.tell()
            try:
                if truncate:
                    f.write(MAGIC)
                f.write(data)
                f.flush()
            except OSError:
                with contextlib.suppress(OSError):
                    f.truncate(start)
                raise

    async def saved_records(self) -> list[Record]:
        """Every record, in order (the buffer is written first)."""
        await self.flush()
        async with self._lock:
            if not self.path.exists():
                return []
            return await trio.to_thread.run_sync(load_records, self.path)
