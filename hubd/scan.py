"""The walk of ROOT: stable ids and versions, and one scan into a ``TableBuilder``.

Invariants:

- A file id is a 63-bit xxh64 of ``(st_ino, mount)`` (at least ``protocol.MIN_FILE_ID``), where
  ``mount`` names the filesystem the inode lives on *by where it sits in the export*, not
  by ``st_dev``: ``b""`` for ROOT's filesystem, and for an entry whose ``st_dev`` differs
  from its parent directory's (a mount point below ROOT) its path relative to ROOT; its
  descendants inherit that name. So two hubs that see the same tree through different
  ``st_dev`` numbers (one NFS export mounted on two machines) give every inode the same
  id, and equal inode numbers on two filesystems below ROOT still get different ids. Hard
  links share an id; an id survives renames (within its filesystem) and hub restarts. Two
  different inodes hashing to one id (a collision) keep the first; the second is logged
  and left out. The scan crosses mount points below ROOT, as it always has.
- A version is the xxh64 of ``(size, mtime_ns, st_ino)``: it changes whenever the bytes may
  have changed, and it does not depend on ``st_dev`` either.
- The scan never follows a symlink and never crosses a directory through a path string:
  each directory is opened relative to its parent's fd with ``O_NOFOLLOW`` and its identity
  checked with fstat, so a directory swapped for a symlink mid-scan is skipped, not followed.
- Each directory's children are added as one block, right after ``open_block``.
- An entry that cannot be listed, opened or stat'ed is left out with a warning, except
  when the error is the process's, not the entry's (out of file descriptors or memory:
  ``PROCESS_ERRNOS``): then the scan fails, so no snapshot ever lacks entries that are
  there, and the previous snapshot stays until the next rescan.

Threads: ``scan`` blocks; it runs in a worker thread.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import threading
from collections.abc import Iterator

import xxhash

from hubd.snapshot import TableBuilder
from spokefs import protocol

log = logging.getLogger(__name__)

# Ids are 63-bit so they also fit signed 64-bit integers (SQLite, off_t-like APIs).
_ID_MASK = (1 << 63) - 1
_INO = struct.Struct("<Q")
_VERSION = struct.Struct("<QqQ")
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_NLINK_MAX = 2**32 - 1  # the wire field is a uint32
# A scan holds one fd per directory level; 256 stays far below the usual 1024-fd soft limit
# and far above any real dataset's depth.
MAX_DEPTH = 256

# Errors that say nothing about the entry: leaving it out would publish a snapshot without
# it, and spokes would see it deleted (a burst of connections can take every descriptor
# for a moment).
PROCESS_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})

_SCAN_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SKIPPED_KINDS = {
    stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket", stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
}


def file_id_of(st: os.stat_result, mount: bytes = b"") -> int:
    """The stable id of the inode behind ``st`` (same for every hard link).

    Args:
        mount: where the inode's filesystem is mounted, relative to ROOT (``b""``: ROOT's
            own filesystem); see the module docstring.
    """
    return file_id_from(st.st_ino, mount)


def file_id_from(ino: int, mount: bytes = b"") -> int:
    """``file_id_of`` from the inode number alone (``hubd.members`` returns no stat_result)."""
    h = xxhash.xxh64_intdigest(_INO.pack(ino) + mount) & _ID_MASK
    return h if h >= protocol.MIN_FILE_ID else h + protocol.MIN_FILE_ID


def _mtime_ns(st: os.stat_result) -> int:
    return clamp_ns(st.st_mtime_ns)


def clamp_ns(ns: int) -> int:
    """A time in nanoseconds as the wire's int64 holds it (past year 2262: its largest)."""
    return min(max(ns, _I64_MIN), _I64_MAX)


def version_of(st: os.stat_result) -> int:
    """The content version of the inode behind ``st``."""
    return version_from(st.st_size, _mtime_ns(st), st.st_ino)


def version_from(size: int, mtime_ns: int, ino: int) -> int:
    """``version_of`` from its three fields (``mtime_ns`` already clamped to int64)."""
    return xxhash.xxh64_intdigest(_VERSION.pack(size, mtime_ns, ino))


# A subdirectory to walk: (name, id, st_dev, mount), ``mount`` as in ``file_id_of``.
_Subdir = tuple[bytes, int, int, bytes]


class ScanCancelled(Exception):
    """The scan was asked to stop (hubd is shutting down)."""


class _Walk:
    """The state of one scan; used by one thread, then dropped.

    Attributes:
        table: what the snapshot will list, in order, directory by directory.
        _dirs: directory id -> (parent id, name): names paths in log lines and mount points.
        _dir_keys: ``st_dev << 64 | st_ino`` of every directory listed: a directory seen
            twice (a bind mount of an ancestor: a cycle) is skipped, whatever its id.
        _seen, _links: only when ``exact``: every id listed so far, and the inode of each
            multi-link file, so a hash collision is left out at once. Without them (1M ids
            cost ~64 MB), ``TableBuilder.build`` detects collisions afterwards, and the scan
            is redone exactly: a collision is about as likely as 1 in 10^7 for 1M inodes.
    """

    def __init__(self, root_fd: int, cancel: threading.Event | None, exact: bool) -> None:
        self._root_fd = root_fd
        self._cancel = cancel
        self.table = TableBuilder()
        self._dirs: dict[int, tuple[int, bytes]] = {}
        self._dir_keys: set[int] = set()
        self._exact = exact
        self._seen: set[int] = set()
        self._links: dict[int, int] = {}

    def run(self) -> int:
        """Walk the whole tree; returns the root id."""
        root_st = os.fstat(self._root_fd)
        root_id = self._add(root_st, 0, b"", b"", b"")
        assert root_id is not None  # the first entry cannot collide
        stack: list[tuple[int, Iterator[_Subdir]]] = [
            (self._root_fd, iter(self._list(self._root_fd, root_id, root_st.st_dev, b"")))
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
                child_fd = self._open_dir(fd, item, depth=len(stack))
                if child_fd is not None:
                    stack.append((child_fd, iter(self._list(child_fd, *item[1:]))))
        finally:
            for fd, _ in stack:
                if fd != self._root_fd:
                    os.close(fd)
        return root_id

    def _list(self, dir_fd: int, dir_id: int, dev: int, mount: bytes) -> list[_Subdir]:
        """Add the children of one directory (on filesystem ``dev``, mounted at ``mount``);
        returns its subdirectories."""
        if self._cancel is not None and self._cancel.is_set():
            raise ScanCancelled
        subdirs: list[_Subdir] = []
        self.table.open_block(dir_id)
        try:
            with os.scandir(dir_fd) as it:
                for de in it:
                    name = os.fsencode(de.name)
                    child = self._child(dir_fd, dir_id, dev, mount, name, de)
                    if child is not None and child[1] in self._dirs:
                        subdirs.append(child)
        except OSError as exc:
            if exc.errno in PROCESS_ERRNOS:
                raise
            log.warning("cannot list %s: %s (skipped)", self._show(dir_id), exc.strerror)
        return subdirs

    def _child(self, dir_fd: int, dir_id: int, dev: int, mount: bytes, name: bytes,
               de: os.DirEntry[str]) -> _Subdir | None:
        """List one child; returns it (name, id, st_dev, mount), or None if left out."""
        try:
            st = de.stat(follow_symlinks=False)
            kind = stat.S_IFMT(st.st_mode)
            target = os.readlink(name, dir_fd=dir_fd) if kind == stat.S_IFLNK else b""
        except FileNotFoundError:  # removed while we listed: simply not in this snapshot
            return None
        except OSError as exc:
            if exc.errno in PROCESS_ERRNOS:
                raise
            log.warning("cannot stat %s: %s (skipped)", self._show(dir_id, name), exc.strerror)
            return None
        if kind not in (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK):
            what = _SKIPPED_KINDS.get(kind, "special file")
            log.warning("skipping %s %s", what, self._show(dir_id, name))
            return None
        if st.st_dev != dev:  # a mount point: its filesystem is named by its path
            mount = self._path(dir_id, name)
        file_id = self._add(st, dir_id, name, target, mount)
        return None if file_id is None else (name, file_id, st.st_dev, mount)

    def _add(self, st: os.stat_result, parent_id: int, name: bytes, target: bytes,
             mount: bytes) -> int | None:
        """List one entry; returns its id, or None if it is left out."""
        file_id = file_id_of(st, mount)
        key = (st.st_dev << 64) | st.st_ino
        is_dir = stat.S_ISDIR(st.st_mode)
        if is_dir and key in self._dir_keys:
            # A directory seen twice (a bind mount of an ancestor) would make a cycle.
            log.warning("directory %s seen twice (bind mount?): skipped",
                        self._show(parent_id, name))
            return None
        if file_id in self._dirs or (
                self._exact and not self._first_sighting(file_id, key, is_dir, st.st_nlink)):
            log.warning("file id collision: %s skipped", self._show(parent_id, name))
            return None
        if is_dir:
            self._dirs[file_id] = (parent_id, name)
            self._dir_keys.add(key)
        self.table.add(protocol.Entry(
            file_id, parent_id, st.st_mode, st.st_size, _mtime_ns(st),
            min(st.st_nlink, _NLINK_MAX), version_of(st), name, target,
        ), st.st_dev, st.st_ino)
        return file_id

    def _first_sighting(self, file_id: int, key: int, is_dir: bool, nlink: int) -> bool:
        """Exact mode: False if ``file_id`` was listed for another inode."""
        if file_id in self._seen:
            return not is_dir and self._links.get(file_id) == key  # another hard link
        self._seen.add(file_id)
        if not is_dir and nlink > 1:
            self._links[file_id] = key
        return True

    def _open_dir(self, parent_fd: int, item: _Subdir, depth: int) -> int | None:
        name, dir_id, dev, mount = item
        if depth > MAX_DEPTH:
            log.warning("%s is deeper than %d levels: not listed", self._show(dir_id), MAX_DEPTH)
            return None
        try:
            fd = os.open(name, _SCAN_DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in PROCESS_ERRNOS:
                raise
            log.warning("cannot open %s: %s (not listed)", self._show(dir_id), exc.strerror)
            return None
        st = os.fstat(fd)
        if st.st_dev != dev or file_id_of(st, mount) != dir_id:
            os.close(fd)
            log.warning("%s changed during the scan: not listed", self._show(dir_id))
            return None
        return fd

    def _path(self, parent_id: int, name: bytes = b"") -> bytes:
        """The path of ``name`` in directory ``parent_id``, relative to ROOT."""
        parts: list[bytes] = [name] if name else []
        known = self._dirs.get(parent_id)
        while known is not None and known[0] != 0:
            parts.append(known[1])
            known = self._dirs.get(known[0])
        return b"/".join(reversed(parts))

    def _show(self, parent_id: int, name: bytes = b"") -> str:
        """A printable relative path, for log lines only."""
        return repr(self._path(parent_id, name) or b".")[2:-1]


def scan(root_fd: int, cancel: threading.Event | None = None,
         exact: bool = False) -> tuple[TableBuilder, int]:
    """Walk the tree under ``root_fd``: ``(entries, root id)``.

    Args:
        exact: check every id for a collision during the walk (see ``_Walk``).

    Raises:
        ScanCancelled: ``cancel`` was set during the walk.
        OSError: ROOT itself cannot be read.
    """
    walk = _Walk(root_fd, cancel, exact)
    return walk.table, walk.run()
