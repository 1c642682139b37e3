"""The exported directory: namespace snapshots, stable file ids and confined opens.

Responsibilities:

- ``scan``: walk ROOT once and build a ``Snapshot`` (every directory, regular file and
  symlink, parent before child, root first), then encode it with ``wire.encode_snapshot``
  once, so each ``GET /v1/snapshot`` only streams prebuilt bytes.
- ``ExportRoot.open_file``: map a file id to its path in the current snapshot and open it
  by walking from ROOT's directory fd with ``O_NOFOLLOW`` at every step, so no symlink
  (even one swapped in after the scan) is ever followed, and nothing outside ROOT is read.

Invariants:

- A file id is a 63-bit xxh64 of ``(st_dev, st_ino)`` (at least ``wire.MIN_FILE_ID``):
  hard links share it, it survives renames and hub restarts. Two different inodes hashing
  to one id (a collision) keep the first; the second is logged and left out.
- A version is the xxh64 of ``(size, mtime_ns, st_ino)``: it changes whenever the bytes may
  have changed, and an open file is only served if its fstat still gives the same id and
  version.
- The scan never follows a symlink and never crosses a directory through a path string:
  each directory is opened relative to its parent's fd with ``O_NOFOLLOW`` and its identity
  checked with fstat, so a directory swapped for a symlink mid-scan is skipped, not followed.
- A ``Snapshot`` is immutable once built; ``ExportRoot.snapshot`` is swapped atomically, so a
  request that took a snapshot keeps a consistent view (room for rescans and
  ``/v1/changes`` later: ``generation`` and ``entries`` are what a diff needs).

Threads: ``scan`` and ``open_file`` block; callers run them in an executor.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from hubd import wire
from hubd.errors import Forbidden, ReadFailed, StaleVersion, UnknownFile

log = logging.getLogger(__name__)

# Ids are 63-bit so they also fit signed 64-bit integers (SQLite, off_t-like APIs).
_ID_MASK = (1 << 63) - 1
_DEV_INO = struct.Struct("<QQ")
_VERSION = struct.Struct("<QqQ")
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_NLINK_MAX = 2**32 - 1  # the wire field is a uint32
# A scan holds one fd per directory level; 256 stays far below the usual 1024-fd soft limit
# and far above any real dataset's depth.
MAX_DEPTH = 256

_SCAN_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_PATH: traversal needs no read permission and gives no access to the directory's data.
_WALK_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK|O_NOCTTY: if a fifo or tty is swapped in after the lstat check, open must not
# block forever or grab a terminal; fstat then rejects it.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
_SKIPPED_KINDS = {
    stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket", stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
}


def file_id_of(st: os.stat_result) -> int:
    """The stable id of the inode behind ``st`` (same for every hard link)."""
    h = xxhash.xxh64_intdigest(_DEV_INO.pack(st.st_dev, st.st_ino)) & _ID_MASK
    return h if h >= wire.MIN_FILE_ID else h + wire.MIN_FILE_ID


def _mtime_ns(st: os.stat_result) -> int:
    # Clamped: a timestamp past year 2262 does not fit the wire's int64 nanoseconds.
    return min(max(st.st_mtime_ns, _I64_MIN), _I64_MAX)


def version_of(st: os.stat_result) -> int:
    """The content version of the inode behind ``st``."""
    return xxhash.xxh64_intdigest(_VERSION.pack(st.st_size, _mtime_ns(st), st.st_ino))


def next_generation(previous: int) -> int:
    """A generation above ``previous`` that also grows across restarts (microsecond clock)."""
    return max(previous + 1, time.time_ns() // 1000)


class ScanCancelled(Exception):
    """The scan was asked to stop (hubd is shutting down)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One generation of the namespace.

    Attributes:
        generation: grows on every change and across restarts.
        root_id: the id of ROOT (the first entry).
        entries: parent-before-child order, root first; a hard-linked file once per link.
        by_id: id -> the first entry with that id (for paths and read checks).
        encoded: the zlib snapshot stream, exactly what ``GET /v1/snapshot`` sends.
        scan_seconds, encode_seconds: how long the walk and the encoding took.
    """

    generation: int
    root_id: int
    entries: tuple[wire.Entry, ...]
    by_id: dict[int, wire.Entry]
    encoded: bytes
    scan_seconds: float
    encode_seconds: float

    def path_parts(self, file_id: int) -> list[bytes] | None:
        """The names leading from ROOT to ``file_id`` (empty for the root), or None."""
        entry = self.by_id.get(file_id)
        if entry is None:
            return None
        parts: list[bytes] = []
        while entry.parent_id != 0:
            parts.append(entry.name)
            entry = self.by_id[entry.parent_id]
        parts.reverse()
        return parts


class _Walk:
    """The state of one scan; used by one thread, then dropped.

    Attributes:
        entries: what the snapshot will list, in order.
        by_id: id -> first entry with that id.
        _keys: id -> ``st_dev << 64 | st_ino``, to tell hard links from hash collisions.
    """

    def __init__(self, root_fd: int, cancel: threading.Event | None) -> None:
        self._root_fd = root_fd
        self._cancel = cancel
        self.entries: list[wire.Entry] = []
        self.by_id: dict[int, wire.Entry] = {}
        self._keys: dict[int, int] = {}

    def run(self) -> int:
        """Walk the whole tree; returns the root id."""
        root = self._add(os.fstat(self._root_fd), 0, b"", b"")
        assert root is not None  # the first entry cannot collide
        stack: list[tuple[int, Iterator[tuple[bytes, int]]]] = [
            (self._root_fd, iter(self._list(self._root_fd, root.file_id)))
        ]
        try:
            while stack:
                fd, subdirs = stack[-1]
                item = next(subdirs, None)
                if item is None:
                    stack.pop()
                    if fd != self._root_fd:
                        os.close(fd)
                    continue
                child_fd = self._open_dir(fd, *item, depth=len(stack))
                if child_fd is not None:
                    stack.append((child_fd, iter(self._list(child_fd, item[1]))))
        finally:
            for fd, _ in stack:
                if fd != self._root_fd:
                    os.close(fd)
        return root.file_id

    def _list(self, dir_fd: int, dir_id: int) -> list[tuple[bytes, int]]:
        """Add the children of one directory; returns its subdirectories (name, id)."""
        if self._cancel is not None and self._cancel.is_set():
            raise ScanCancelled
        subdirs: list[tuple[bytes, int]] = []
        try:
            with os.scandir(dir_fd) as it:
                for de in it:
                    entry = self._child(dir_fd, dir_id, os.fsencode(de.name), de)
                    if entry is not None and entry.is_dir:
                        subdirs.append((entry.name, entry.file_id))
        except OSError as exc:
            log.warning("cannot list %s: %s (skipped)", self._show(dir_id), exc.strerror)
        return subdirs

    def _child(
        self, dir_fd: int, dir_id: int, name: bytes, de: os.DirEntry[str]
    ) -> wire.Entry | None:
        try:
            st = de.stat(follow_symlinks=False)
            kind = stat.S_IFMT(st.st_mode)
            target = os.readlink(name, dir_fd=dir_fd) if kind == stat.S_IFLNK else b""
        except FileNotFoundError:  # removed while we listed: simply not in this snapshot
            return None
        except OSError as exc:
            log.warning("cannot stat %s: %s (skipped)", self._show(dir_id, name), exc.strerror)
            return None
        if kind not in (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK):
            what = _SKIPPED_KINDS.get(kind, "special file")
            log.warning("skipping %s %s", what, self._show(dir_id, name))
            return None
        return self._add(st, dir_id, name, target)

    def _add(
        self, st: os.stat_result, parent_id: int, name: bytes, target: bytes
    ) -> wire.Entry | None:
        file_id = file_id_of(st)
        key = (st.st_dev << 64) | st.st_ino
        known = self._keys.setdefault(file_id, key)
        if known != key:
            log.warning("file id collision: %s skipped", self._show(parent_id, name))
            return None
        if file_id in self.by_id and stat.S_ISDIR(st.st_mode):
            # A directory seen twice (a bind mount of an ancestor) would make a cycle.
            log.warning("directory %s seen twice (bind mount?): skipped",
                        self._show(parent_id, name))
            return None
        entry = wire.Entry(
            file_id, parent_id, st.st_mode, st.st_size, _mtime_ns(st),
            min(st.st_nlink, _NLINK_MAX), version_of(st), name, target,
        )
        self.entries.append(entry)
        self.by_id.setdefault(file_id, entry)
        return entry

    def _open_dir(self, parent_fd: int, name: bytes, dir_id: int, depth: int) -> int | None:
        if depth > MAX_DEPTH:
            log.warning("%s is deeper than %d levels: not listed", self._show(dir_id), MAX_DEPTH)
            return None
        try:
            fd = os.open(name, _SCAN_DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            log.warning("cannot open %s: %s (not listed)", self._show(dir_id), exc.strerror)
            return None
        if file_id_of(os.fstat(fd)) != dir_id:
            os.close(fd)
            log.warning("%s changed during the scan: not listed", self._show(dir_id))
            return None
        return fd

    def _show(self, parent_id: int, name: bytes = b"") -> str:
        """A printable relative path, for log lines only."""
        parts: list[bytes] = [name] if name else []
        entry = self.by_id.get(parent_id)
        while entry is not None and entry.parent_id != 0:
            parts.append(entry.name)
            entry = self.by_id.get(entry.parent_id)
        return repr(b"/".join(reversed(parts)) or b".")[2:-1]


def scan(root_fd: int, generation: int, zlib_level: int,
         cancel: threading.Event | None = None) -> Snapshot:
    """Walk the tree under ``root_fd`` and encode it as generation ``generation``.

    Raises:
        ScanCancelled: ``cancel`` was set during the walk.
        OSError: ROOT itself cannot be read.
    """
    start = time.perf_counter()
    walk = _Walk(root_fd, cancel)
    root_id = walk.run()
    scanned = time.perf_counter()
    encoded = wire.encode_snapshot(generation, root_id, walk.entries, level=zlib_level)
    done = time.perf_counter()
    return Snapshot(generation, root_id, tuple(walk.entries), walk.by_id, encoded,
                    scanned - start, done - scanned)


class ExportRoot:
    """ROOT, its directory fd and the current snapshot.

    Attributes:
        root: the path given on the command line.
        snapshot: the current ``Snapshot`` (None until the first scan); replaced whole.
    """

    def __init__(self, root: str, zlib_level: int = 6) -> None:
        self.root = root
        self._zlib_level = zlib_level
        self._root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._scan_lock = threading.Lock()  # one scan at a time
        self.snapshot: Snapshot | None = None

    def close(self) -> None:
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    def rescan(self, cancel: threading.Event | None = None) -> Snapshot:
        """Build a new snapshot and make it current (blocking: run it in an executor)."""
        with self._scan_lock:
            previous = self.snapshot.generation if self.snapshot is not None else 0
            snap = scan(self._root_fd, next_generation(previous), self._zlib_level, cancel)
            self.snapshot = snap
        log.info("scanned %s: %d entries, generation %d, %.2f s scan + %.2f s encode, %d bytes",
                 self.root, len(snap.entries), snap.generation, snap.scan_seconds,
                 snap.encode_seconds, len(snap.encoded))
        return snap

    def open_file(self, snap: Snapshot, file_id: int, version: int) -> tuple[int, int]:
        """Open regular file ``file_id`` at ``version``, confined to ROOT (blocking).

        Returns:
            ``(fd, size)``; the caller closes ``fd``.

        Raises:
            UnknownFile: no such regular file in ``snap``, or it is gone from disk.
            StaleVersion: the snapshot or the disk has another version (or the path changed).
            Forbidden, ReadFailed: EACCES, or another OS error.
        """
        entry = snap.by_id.get(file_id)
        if entry is None or not stat.S_ISREG(entry.mode):
            raise UnknownFile(f"no file {file_id:016x} in generation {snap.generation}")
        if entry.version != version:
            raise StaleVersion(f"file {file_id:016x} is at version {entry.version:016x}")
        parts = snap.path_parts(file_id)
        assert parts  # a regular file is never the root
        fd = self._open_confined(parts)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or file_id_of(st) != file_id:
                raise StaleVersion(f"file {file_id:016x} was replaced on disk")
            if version_of(st) != version:
                raise StaleVersion(f"file {file_id:016x} changed on disk")
            return fd, st.st_size
        except BaseException:
            os.close(fd)
            raise

    def _open_confined(self, parts: list[bytes]) -> int:
        """Walk ``parts`` from ROOT's fd, never following a symlink; open the leaf."""
        dir_fd = self._root_fd
        opened: list[int] = []
        try:
            for name in parts[:-1]:
                dir_fd = os.open(name, _WALK_DIR_FLAGS, dir_fd=dir_fd)
                opened.append(dir_fd)
            # lstat first, so a device node swapped in is not even opened (O_NOFOLLOW
            # and fstat still cover the race between this check and the open).
            st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise StaleVersion("the file was replaced by another kind of entry")
            return os.open(parts[-1], _FILE_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            raise _open_error(exc) from None
        finally:
            for fd in opened:
                os.close(fd)


def _open_error(exc: OSError) -> Exception:
    """Map an errno from the confined walk to the HTTP-level error."""
    if exc.errno == errno.ENOENT:
        return UnknownFile("the file is gone from disk")
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO):
        # ELOOP: O_NOFOLLOW met a symlink where the snapshot had a directory or file.
        return StaleVersion("the path changed on disk since the snapshot")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return Forbidden("permission denied")
    log.warning("open failed: %s", exc.strerror)
    return ReadFailed(f"open failed: {exc.strerror}")
