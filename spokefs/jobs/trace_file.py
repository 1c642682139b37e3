"""The portable trace file (``spokefs trace save``), and its translation to and from the
namespace.

A trace made on one node must work on another node of the same hub, whose file ids may be
the same but need not be, so the file names files by **path** (relative to the export root,
``/``-separated) and **version** (the hub's version of the file when it was read). JSON
lines: a header object, then one entry per file in first-access order::

    {"format": "spokefs-trace", "version": 1, "extent_bytes": 4194304, "entries": 2, ...}
    ["train/000/img_0001.jpg", 7, 112417, null]
    ["shards/shard-0003.tar", 7, 1073741824, [0, 1, 2, 5]]

``null``: the file was read whole (or, in a list made by ``warm --files-from``, is to be
fetched whole); a list: the ``extent_bytes`` extents of a large file, in the order first
touched. A version of 0 means "whatever version is current" (lists). Names that are not
UTF-8 travel as Python's surrogate escapes.

Against a namespace, an entry **matches** when its path names a regular file of the same
version; a path that names a file of another version is **changed** (a replay fetches the
current version: that is what the job will read), one that names nothing is **missing**.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _quote  # a str as json.dumps writes it
from pathlib import Path

from spokefs.errors import NotFound, UserError
from spokefs.namespace.replica import ROOT_INODE, Namespace
from spokefs.read.trace import EXTENT_BYTES, WHOLE, Record
from spokefs.types import FileVersion

FORMAT = "spokefs-trace"
MAX_TRACE_BYTES = 1 << 30  # a trace of 1 Mi records is ~60 MiB; more is not a trace


@dataclass(frozen=True, slots=True)
class Entry:
    """One file of a trace: its path, version (0: any), size and extents (None: whole)."""

    path: str
    version: int
    size: int
    extents: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class Target:
    """An entry resolved against the namespace: what a replay fetches (``dir_id``: the id
    of the directory its path names, whose packs a small file comes in)."""

    fv: FileVersion
    extents: tuple[int, ...] | None
    dir_id: int = 0

    def nbytes(self, extent_bytes: int) -> int:
        if self.extents is None:
            return self.fv.size
        return sum(max(0, min(extent_bytes, self.fv.size - e * extent_bytes))
                   for e in self.extents)


@dataclass(frozen=True, slots=True)
class Resolved:
    targets: list[Target]
    changed: int  # entries whose path names another version now
    missing: int  # entries whose path names no regular file now


# -- the file -------------------------------------------------------------------------


def dumps(entries: Iterable[Entry], **header: object) -> bytes:
    entries = list(entries)
    head = {"format": FORMAT, "version": 1, "extent_bytes": EXTENT_BYTES,
            "entries": len(entries), **header}
    lines = [json.dumps(head, sort_keys=True)]
    # each line as ``json.dumps([path, version, size, extents])`` writes it, five times faster
    # (an order of a million files is written while its epoch starts)
    lines.extend(f"[{_quote(e.path)}, {e.version:d}, {e.size:d}, "
                 f"{'null' if e.extents is None else json.dumps(list(e.extents))}]"
                 for e in entries)
    return ("\n".join(lines) + "\n").encode()


def loads(raw: bytes, name: str) -> tuple[dict[str, object], list[Entry]]:
    """The header and entries of a trace file.

    Raises:
        UserError: not a trace, or a malformed line (the message names the line).
    """
    lines = raw.decode("utf-8", "replace").splitlines()
    try:
        head = json.loads(lines[0]) if lines else None
    except ValueError:
        head = None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise UserError(f"{name} is not a spokefs trace (no trace header on its first line)")
    if head.get("version") != 1 or head.get("extent_bytes") != EXTENT_BYTES:
        raise UserError(f"{name}: trace version {head.get('version')} with extents of "
                        f"{head.get('extent_bytes')} bytes is not supported")
    entries = []
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            path, version, size, extents = json.loads(line)
            entry = Entry(_clean_path(path), int(version), int(size),
                          None if extents is None else tuple(int(e) for e in extents))
        except (ValueError, TypeError) as exc:
            raise UserError(f"{name}, line {n}: not a trace entry ({exc})") from None
        if entry.version < 0 or entry.size < 0 or any(e < 0 for e in entry.extents or ()):
            raise UserError(f"{name}, line {n}: negative numbers in a trace entry")
        entries.append(entry)
    return head, entries


def read(path: Path, uid: int | None = None) -> tuple[dict[str, object], list[Entry]]:
    """Load a trace file from disk (blocking).

    Args:
        uid: read it for this user: only if it is theirs or readable by all (checked on the
            opened file, so a symlink swapped in after a check cannot slip through); None:
            with the caller's own rights.

    Raises:
        UserError: unreadable, not a regular file, too large, or not a trace.
        PermissionError: ``uid`` may not read it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not hang us
    except OSError as exc:
        raise UserError(f"cannot read trace {path}: {exc.strerror}") from None
    try:  # checked on the descriptor, before fdopen (which refuses a directory)
        st = os.fstat(fd)
        if uid not in (None, 0, st.st_uid) and not st.st_mode & stat.S_IROTH:
            raise PermissionError(f"uid {uid} may not read {path}")
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"trace {path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        if st.st_size > MAX_TRACE_BYTES:
            raise UserError(f"trace {path} is larger than {MAX_TRACE_BYTES >> 20} MiB")
        raw = f.read(MAX_TRACE_BYTES + 1)
    return loads(raw, str(path))


def _clean_path(path: object) -> str:
    if not isinstance(path, str) or not path:
        raise ValueError("the path is not a non-empty string")
    parts = path.strip("/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"the path {path!r} has empty, '.' or '..' parts")
    return "/".join(parts)


def summary(entries: list[Entry]) -> dict[str, int]:
    """Files, bytes (the working set), directories and large files of a trace."""
    dirs = {e.path.rpartition("/")[0] for e in entries}
    nbytes = sum(e.size if e.extents is None else
                 sum(max(0, min(EXTENT_BYTES, e.size - x * EXTENT_BYTES)) for x in e.extents)
                 for e in entries)
    return {"files": len(entries), "bytes": nbytes, "directories": len(dirs),
            "ranged_files": sum(1 for e in entries if e.extents is not None)}


# -- against the namespace (blocking: run in a worker thread) -------------------------


def resolve(ns: Namespace, entries: list[Entry]) -> Resolved:
    """Each entry's path looked up in ``ns`` (directories looked up once each)."""
    dirs: dict[str, int | None] = {"": ROOT_INODE}
    targets: list[Target] = []
    changed = missing = 0
    for e in entries:
        parent, _, name = e.path.rpartition("/")
        dir_ino = _dir_inode(ns, parent, dirs)
        try:
            if dir_ino is None:
                raise NotFound(parent)
            a = ns.lookup(dir_ino, os.fsencode(name))
        except NotFound:
            missing += 1
            continue
        if not stat.S_ISREG(a.mode):
            missing += 1
            continue
        if e.version and a.version != e.version:
            changed += 1
        extents = e.extents
        if extents is not None and a.size <= EXTENT_BYTES:
            extents = None
        targets.append(Target(FileVersion(a.file_id, a.version, a.size), extents,
                              ns.file_id(dir_ino)))
    return Resolved(targets, changed, missing)


def _dir_inode(ns: Namespace, path: str, dirs: dict[str, int | None]) -> int | None:
    if path in dirs:
        return dirs[path]
    parent, _, name = path.rpartition("/")
    ino = _dir_inode(ns, parent, dirs)
    found: int | None = None
    if ino is not None:
        try:
            a = ns.lookup(ino, os.fsencode(name))
            found = a.ino if stat.S_ISDIR(a.mode) else None
        except NotFound:
            found = None
    dirs[path] = found
    return found


def entries_of(ns: Namespace, records: list[Record]) -> tuple[list[Entry], int]:
    """The records as entries with paths, in first-access order; and how many records name
    files that are in the namespace no more (left out)."""
    order: dict[tuple[int, int], list[int]] = {}
    sizes: dict[tuple[int, int], int] = {}
    for fid, version, size, extent in records:
        extents = order.setdefault((fid, version), [])
        sizes[(fid, version)] = size
        if extent != WHOLE:
            extents.append(extent)
    names = _Names(ns)
    entries: list[Entry] = []
    gone = 0
    for (fid, version), extents in order.items():
        path = names.path_of(fid)
        if path is None:
            gone += 1
            continue
        entries.append(Entry(path, version, sizes[(fid, version)],
                             tuple(dict.fromkeys(extents)) if extents else None))
    return entries, gone


class _Names:
    """Paths of file ids: each id's first parent is listed once, and each directory's path
    is found once, by walking up its parents."""

    def __init__(self, ns: Namespace) -> None:
        self._ns = ns
        self._root = ns.info.root_id if ns.info is not None else 0
        self._children: dict[int, dict[int, bytes]] = {}
        self._dirs: dict[int, str | None] = {self._root: ""}

    def path_of(self, fid: int) -> str | None:
        try:
            parent = self._ns.getattr(self._ns.inode(fid)).parent_id
        except NotFound:
            return None
        name = self._name_in(parent, fid)
        base = self._dir_path(parent)
        if name is None or base is None:
            return None
        return f"{base}/{name}" if base else name

    def _name_in(self, parent: int, fid: int) -> str | None:
        names = self._children.get(parent)
        if names is None:
            names = {}
            try:
                for _, name, ino, *_ in self._ns.readdir_rows(self._ns.inode(parent), 0):
                    names.setdefault(self._ns.file_id(ino), bytes(name))
            except NotFound:
                pass
            self._children[parent] = names
        raw = names.get(fid)
        return None if raw is None else os.fsdecode(raw)

    def _dir_path(self, dir_id: int) -> str | None:
        if dir_id in self._dirs:
            return self._dirs[dir_id]
        self._dirs[dir_id] = None  # a loop in a corrupt namespace ends here
        found = self.path_of(dir_id)
        self._dirs[dir_id] = found
        return found
