"""The exported directory: scans, rescans with their changes, stable ids, confined opens.

Responsibilities:

- ``scan.scan``: walk ROOT once into a compact ``Table`` (every directory, regular file
  and symlink, parent before child, root first; see ``scan.py`` and ``snapshot.py``).
- ``ExportRoot.rescan``: scan again (the old snapshot keeps serving meanwhile). Nothing
  changed: the generation stays and nothing is encoded. Else the new snapshot gets
  generation ``next_generation(previous, table)`` (below), is encoded once (so each
  ``GET /v2/snapshot`` only streams prebuilt bytes), its ``changes.diff`` from the previous
  one joins the ``History``, and snapshot and history are swapped in together.
- Generations are a function of the table, so that two hubs over one export (replicas,
  or one hub before and after a restart) that list the same entries give them the same
  generation, whenever each scanned: ``generation_of(table)`` is the newest mtime in the
  table in milliseconds, shifted left by 20 bits, plus the low 20 bits of the xxh3_64 of
  the table's records. A change to the tree normally sets some listed mtime to "now" (a
  new, written or renamed file; a directory whose entries changed), so it normally grows.
  When it does not (a chmod, an mtime set into the past: ``touch -d``, ``rsync -t``),
  ``next_generation`` takes the previous generation's millisecond plus one, with the new
  table's 20 bits: it still grows, but a replica that did not see the same sequence of
  trees may number that tree differently. That is safe (a spoke asking it for
  ``since=G`` gets 410 or 400 and takes a snapshot, see docs/protocol.md), only slower; the next
  ordinary change brings the numbers together again. One number names one tree unless
  two different trees with the same newest millisecond also agree in 20 hash bits.
- ``ExportRoot.open_file``: map a file id to its path in a snapshot and open it by walking
  from ROOT's directory fd with ``O_NOFOLLOW`` at every step, so no symlink (even one
  swapped in after the scan) is ever followed, and nothing outside ROOT is read.

Invariants:

- Ids and versions are defined in ``scan.py``; an open file is only served if its fstat
  still gives the id and version that were asked for.
- ``ExportRoot.state`` (snapshot + history) is immutable and replaced by one assignment,
  so a request that took it keeps a consistent view. One scan runs at a time.

Threads: ``rescan`` and ``open_file`` block; callers run them in an executor.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass

import xxhash

from hubd.changes import Diff, History, diff
from hubd.errors import Forbidden, ReadFailed, StaleVersion, UnknownFile
from hubd.log_rate import LogEveryPerKey, since_last
from hubd.scan import ScanCancelled, file_id_of, scan, version_of
from hubd.snapshot import IdCollision, Snapshot, Table, TableBuilder

__all__ = ["ExportRoot", "ExportState", "Rescan", "ScanCancelled", "Snapshot", "file_id_of",
           "generation_of", "next_generation", "version_of"]

log = logging.getLogger(__name__)
_OPEN_FAILURE_LINES = LogEveryPerKey()

# O_PATH: traversal needs no read permission and gives no access to the directory's data.
_WALK_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK|O_NOCTTY: if a fifo or tty is swapped in after the lstat check, open must not
# block forever or grab a terminal; fstat then rejects it.
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


# A generation is (milliseconds << _GEN_HASH_BITS) | hash bits, kept under 2**63 (signed
# 64-bit stores): milliseconds up to 2**43 (year 2248) leave 20 bits of tree hash.
_GEN_HASH_BITS = 20
_GEN_HASH_MASK = (1 << _GEN_HASH_BITS) - 1
_GEN_MS_MAX = (1 << (63 - _GEN_HASH_BITS)) - 1


def generation_of(table: Table) -> int:
    """The generation a table gets on any hub, unless its predecessor forbids it (below)."""
    ms = min(max(table.max_mtime_ns // 1_000_000, 0), _GEN_MS_MAX)
    return (ms << _GEN_HASH_BITS) | (xxhash.xxh3_64_intdigest(table.records) & _GEN_HASH_MASK)


def next_generation(previous: int, table: Table) -> int:
    """The generation of ``table`` after one numbered ``previous``: ``generation_of(table)``
    if it is above ``previous``, else previous's millisecond + 1 with table's hash bits."""
    derived = generation_of(table)
    if derived > previous:
        return derived
    bumped = (((previous >> _GEN_HASH_BITS) + 1) << _GEN_HASH_BITS) | (derived & _GEN_HASH_MASK)
    return bumped if bumped < 1 << 63 else previous + 1


@dataclass(frozen=True, slots=True)
class ExportState:
    """What the routes serve: the current snapshot and the changes that led to it."""

    snapshot: Snapshot
    history: History


@dataclass(frozen=True, slots=True)
class Rescan:
    """The outcome of one scan, for logs and metrics.

    Attributes:
        changed: False if the scan found the namespace of the current generation.
        added, updated, removed: entries (names) new, changed, gone since the previous one.
        seconds: walk + diff + encoding.
    """

    generation: int
    entries: int
    changed: bool
    added: int
    updated: int
    removed: int
    seconds: float


class ExportRoot:
    """ROOT, its directory fd, the current snapshot and the history of changes.

    Attributes:
        root: the path given on the command line.
        last_rescan: the outcome of the latest scan (None before the first).
    """

    def __init__(self, root: str, zlib_level: int = 6, max_change_steps: int = 16,
                 max_change_bytes: int = 64 * 1024 * 1024) -> None:
        self.root = root
        self._zlib_level = zlib_level
        self._max_steps = max_change_steps
        self._max_bytes = max_change_bytes
        self._root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._root_dev = os.fstat(self._root_fd).st_dev
        self._scan_lock = threading.Lock()  # one scan at a time
        self._state: ExportState | None = None
        self.last_rescan: Rescan | None = None

    @property
    def state(self) -> ExportState:
        """The current snapshot and history (read it once per request)."""
        assert self._state is not None  # the app only serves after the first scan
        return self._state

    @property
    def snapshot(self) -> Snapshot | None:
        """The current snapshot (None until the first scan)."""
        return self._state.snapshot if self._state is not None else None

    def close(self) -> None:
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    def rescan(self, cancel: threading.Event | None = None) -> Snapshot:
        """Scan ROOT; make a new generation current if anything changed (blocking).

        Returns:
            The current snapshot afterwards (the previous one if nothing changed).

        Raises:
            ScanCancelled: ``cancel`` was set; nothing changed.
            OSError: ROOT itself cannot be read, or the process is out of file descriptors
                or memory (``scan.PROCESS_ERRNOS``); nothing changed.
        """
        with self._scan_lock:
            start = time.perf_counter()
            builder, root_id = scan(self._root_fd, cancel)
            scanned = time.perf_counter()
            old = self._state
            if old is not None and builder.same_as(old.snapshot.table):
                return self._unchanged(old.snapshot, scanned - start)
            table = self._build(builder, root_id, cancel)
            del builder
            change = self._diff(old, table, cancel)
            if old is not None and change.empty:  # the same entries in another order
                return self._unchanged(old.snapshot, time.perf_counter() - start)
            if cancel is not None and cancel.is_set():
                raise ScanCancelled
            diffed = time.perf_counter()
            generation = next_generation(old.snapshot.generation if old is not None else 0,
                                         table)
            encoded = table.encode(generation, self._zlib_level)
            done = time.perf_counter()
            snap = Snapshot(generation, table, encoded, scanned - start, done - diffed)
            history = (old.history.advance(generation, change, self._max_steps, self._max_bytes)
                       if old is not None else History(generation))
            self._state = ExportState(snap, history)  # one assignment: routes see old or new
        self._log_new(snap, old is None, change, scanned - start, diffed - scanned, history)
        self.last_rescan = Rescan(generation, snap.count, True, change.added, change.changed,
                                  change.removed, done - start)
        return snap

    def _build(self, builder: TableBuilder, root_id: int,
               cancel: threading.Event | None) -> Table:
        try:
            return builder.build(root_id)
        except IdCollision as exc:
            log.warning("file id collision (%s): scanning again to leave the second inode out",
                        exc)
        builder, root_id = scan(self._root_fd, cancel, exact=True)
        return builder.build(root_id)

    def _diff(self, old: ExportState | None, table: Table,
              cancel: threading.Event | None) -> Diff:
        if old is None:
            return Diff(len(table), 0, 0, None, 0)
        if cancel is not None and cancel.is_set():
            raise ScanCancelled
        return diff(old.snapshot.table, table, self._max_bytes)

    def _unchanged(self, snap: Snapshot, seconds: float) -> Snapshot:
        log.info("rescanned %s: unchanged, %d entries, generation %d, %.2f s",
                 self.root, snap.count, snap.generation, seconds)
        self.last_rescan = Rescan(snap.generation, snap.count, False, 0, 0, 0, seconds)
        return snap

    def _log_new(self, snap: Snapshot, first: bool, change: Diff, scan_s: float, diff_s: float,
                 history: History) -> None:
        if first:
            log.info("scanned %s: %d entries, generation %d, %.2f s scan + %.2f s encode, "
                     "%d bytes", self.root, snap.count, snap.generation, scan_s,
                     snap.encode_seconds, len(snap.encoded))
            return
        log.info("rescanned %s: %d entries, generation %d: %d added, %d changed, %d removed "
                 "(%s); %.2f s scan + %.2f s index and diff + %.2f s encode, %d bytes",
                 self.root, snap.count, snap.generation, change.added, change.changed,
                 change.removed,
                 f"{change.count} change records" if change.records is not None
                 else "too many changes to keep: older generations need a snapshot",
                 scan_s, diff_s, snap.encode_seconds, len(snap.encoded))
        log.debug("changes kept from generation %d (%d steps)", history.oldest,
                  len(history.steps))

    def open_file(self, snap: Snapshot, file_id: int, version: int) -> tuple[int, int]:
        """Open regular file ``file_id`` at ``version``, confined to ROOT (blocking).

        Returns:
            ``(fd, size)``; the caller closes ``fd``.

        A version the snapshot does not list yet is served when the file on disk has it:
        a replica hub one rescan behind another (docs/protocol.md, "Replicas") still serves the
        versions its peer listed, for the files whose paths it knows. The disk check is
        what makes any answer right, listed version or not.

        Raises:
            UnknownFile: no such regular file in ``snap``, or it is gone from disk.
            StaleVersion: the disk has another version (or the path changed).
            Forbidden, ReadFailed: EACCES, or another OS error.
        """
        entry = snap.lookup(file_id)
        if entry is None or not stat.S_ISREG(entry.mode):
            raise UnknownFile(f"no file {file_id:016x} in generation {snap.generation}")
        parts = snap.path_parts(file_id)
        assert parts  # a regular file is never the root
        fd, dev, mount = self._open_confined(parts)
        try:
            st = os.fstat(fd)
            if st.st_dev != dev:  # the file itself is a mount point (a bind-mounted file)
                mount = b"/".join(parts)
            if not stat.S_ISREG(st.st_mode) or file_id_of(st, mount) != file_id:
                raise StaleVersion(f"file {file_id:016x} was replaced on disk")
            if version_of(st) != version:
                raise StaleVersion(f"file {file_id:016x} is at version {entry.version:016x}"
                                   if entry.version != version else
                                   f"file {file_id:016x} changed on disk")
            return fd, st.st_size
        except BaseException:
            os.close(fd)
            raise

    def open_dir(self, parts: list[bytes]) -> tuple[int, int, bytes]:
        """Walk ``parts`` (a directory's, from ROOT) never following a symlink, and keep the
        last one open (``O_PATH``: for ``*at`` calls only).

        Returns:
            ``(dir_fd, st_dev, mount)`` of the directory, ``mount`` as in
            ``scan.file_id_of``; the caller closes ``dir_fd``.

        Raises:
            UnknownFile, StaleVersion, Forbidden, ReadFailed: as ``open_file``.
        """
        try:
            dir_fd, dev, mount = self._walk(parts)
            return (os.dup(dir_fd) if dir_fd == self._root_fd else dir_fd), dev, mount
        except OSError as exc:
            raise open_error(exc) from None

    def _open_confined(self, parts: list[bytes]) -> tuple[int, int, bytes]:
        """Walk ``parts`` from ROOT's fd, never following a symlink; open the leaf.

        Returns:
            ``(fd, st_dev, mount)`` with ``st_dev`` and ``mount`` (``scan.file_id_of``) of
            the leaf's directory.
        """
        try:
            dir_fd, dev, mount = self._walk(parts[:-1])
        except OSError as exc:
            raise open_error(exc) from None
        try:
            # lstat first, so a device node swapped in is not even opened (O_NOFOLLOW
            # and fstat still cover the race between this check and the open).
            st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise StaleVersion("the file was replaced by another kind of entry")
            return os.open(parts[-1], FILE_FLAGS, dir_fd=dir_fd), dev, mount
        except OSError as exc:
            raise open_error(exc) from None
        finally:
            if dir_fd != self._root_fd:
                os.close(dir_fd)

    def _walk(self, parts: list[bytes]) -> tuple[int, int, bytes]:
        """The directory ``parts`` leads to from ROOT, each step opened ``O_PATH`` without
        following a symlink: ``(dir_fd, st_dev, mount)``, ``dir_fd`` ROOT's own fd (not to
        be closed) when ``parts`` is empty. Raises the walk's OSError, its fds closed."""
        dir_fd = self._root_fd
        dev, mount = self._root_dev, b""
        try:
            for depth, name in enumerate(parts, 1):
                fd = os.open(name, _WALK_DIR_FLAGS, dir_fd=dir_fd)
                if dir_fd != self._root_fd:
                    os.close(dir_fd)
                dir_fd = fd
                st = os.fstat(dir_fd)
                if st.st_dev != dev:  # a mount point below ROOT
                    dev, mount = st.st_dev, b"/".join(parts[:depth])
        except OSError:
            if dir_fd != self._root_fd:
                os.close(dir_fd)
            raise
        return dir_fd, dev, mount


def open_error(exc: OSError) -> Exception:
    """Map an errno from the confined walk to the HTTP-level error."""
    if exc.errno == errno.ENOENT:
        return UnknownFile("the file is gone from disk")
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO):
        # ELOOP: O_NOFOLLOW met a symlink where the snapshot had a directory or file.
        return StaleVersion("the path changed on disk since the snapshot")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return Forbidden("permission denied")
    # One line a minute per errno: out of descriptors (or a failing disk), every request
    # fails alike, and each is already answered 503 and counted in hubd_requests_total.
    count = _OPEN_FAILURE_LINES.occurred(exc.errno)
    if count:
        log.warning("open failed: %s%s", exc.strerror, since_last(count, "failed opens"))
    return ReadFailed(f"open failed: {exc.strerror}")
