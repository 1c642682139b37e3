"""The replicated namespace: the hub's snapshot in a local LMDB, so that lookup, getattr,
readdir, readlink and statfs never touch the network.

Inodes are the hub's stable file ids (hard links share one), except that the export root is
FUSE's inode 1. Nothing per-inode lives in memory, so ``forget`` has nothing to drop and a
restart sees the same inode numbers.

LMDB layout (environment ``<cache_dir>/namespace``; keys big-endian so one directory's
entries are adjacent):

| db     | key                        | value                                        |
| ------ | -------------------------- | -------------------------------------------- |
| attr   | id                         | ``_ATTR`` (mode, size, mtime_ns, nlink, version, parent) + symlink target |
| dent   | parent id + name           | child id                                     |
| dpos   | parent id + position (u32) | child id + name (readdir resumes at a position) |
| info   | b"generation" etc.         | values of the loaded snapshot                |

A snapshot is loaded in one write transaction, so a crash leaves either the old namespace or
the new one, never a mix. Reads are small gets on a memory map and run inline on the trio
thread (STYLE.md section 5); the load runs in a worker thread.
"""

from __future__ import annotations

import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb

from hubd import wire
from spokefs.errors import NotFound

ROOT_INODE = 1
_ID = struct.Struct(">Q")
_POS = struct.Struct(">QI")
_ATTR = struct.Struct("<IQqIQQ")
_U64 = struct.Struct("<Q")
_MAP_SIZE = 1 << 36  # 64 GiB of address space; the file grows only as entries need


@dataclass(frozen=True, slots=True)
class Attr:
    """Attributes of one inode, as exported by the hub."""

    ino: int
    file_id: int
    mode: int
    size: int
    mtime_ns: int
    nlink: int
    version: int
    parent_id: int  # the first directory that lists it (hard links have more)
    target: bytes


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    generation: int
    root_id: int
    entries: int
    total_bytes: int


class Namespace:
    """Read access to the replicated namespace, and the snapshot loader."""

    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(
            str(path), map_size=_MAP_SIZE, max_dbs=4, readahead=False, lock=True
        )
        self._attr = self._env.open_db(b"attr")
        self._dent = self._env.open_db(b"dent")
        self._dpos = self._env.open_db(b"dpos")
        self._info = self._env.open_db(b"info")
        self.info = self._read_info()

    def close(self) -> None:
        self._env.close()

    # -- loading ---------------------------------------------------------------------

    def load_snapshot(self, compressed: bytes) -> NamespaceInfo:
        """Replace the namespace with a snapshot from the hub (blocking; run in a thread).

        Raises:
            wire.WireError: the snapshot is malformed or hostile; nothing is changed.
        """
        decoder = wire.SnapshotDecoder()
        positions: dict[int, int] = {}
        total = count = 0
        with self._env.begin(write=True) as txn:
            for db in (self._attr, self._dent, self._dpos, self._info):
                txn.drop(db, delete=False)
            step = 1 << 20
            for i in range(0, len(compressed), step):
                for e in decoder.feed(compressed[i : i + step]):
                    self._put_entry(txn, e, positions)
                    count += 1
                    total += e.size if not e.is_dir else 0
            header = decoder.finish()
            info = NamespaceInfo(header.generation, header.root_id, count, total)
            for key, value in (
                (b"generation", info.generation), (b"root", info.root_id),
                (b"entries", info.entries), (b"total_bytes", info.total_bytes),
            ):
                txn.put(key, _U64.pack(value), db=self._info)
        # an exception above aborts the transaction: the old namespace stays
        self.info = info
        return info

    def _put_entry(self, txn: lmdb.Transaction, e: wire.Entry, positions: dict[int, int]) -> None:
        attr = _ATTR.pack(e.mode, e.size, e.mtime_ns, e.nlink, e.version, e.parent_id)
        txn.put(_ID.pack(e.file_id), attr + e.target, db=self._attr, overwrite=False)
        if e.parent_id == 0:
            return
        child = _ID.pack(e.file_id)
        if not txn.put(_ID.pack(e.parent_id) + e.name, child, overwrite=False, db=self._dent):
            raise wire.WireError(f"name {e.name[:40]!r} listed twice in {e.parent_id:x}")
        pos = positions.get(e.parent_id, 0)
        positions[e.parent_id] = pos + 1
        txn.put(_POS.pack(e.parent_id, pos), child + e.name, db=self._dpos)

    def _read_info(self) -> NamespaceInfo | None:
        with self._env.begin() as txn:
            raw = {k: _U64.unpack(v)[0] for k, v in txn.cursor(db=self._info)}
        if b"generation" not in raw:
            return None
        return NamespaceInfo(raw[b"generation"], raw[b"root"], raw[b"entries"], raw[b"total_bytes"])

    # -- lookups (inline: small gets on a memory map) ---------------------------------

    def _root_id(self) -> int:
        if self.info is None:
            raise NotFound("no namespace loaded")
        return self.info.root_id

    def file_id(self, ino: int) -> int:
        return self._root_id() if ino == ROOT_INODE else ino

    def inode(self, file_id: int) -> int:
        return ROOT_INODE if file_id == self._root_id() else file_id

    def getattr(self, ino: int) -> Attr:
        fid = self.file_id(ino)
        with self._env.begin(buffers=True) as txn:
            raw = txn.get(_ID.pack(fid), db=self._attr)
            if raw is None:
                raise NotFound(f"inode {ino}")
            return self._decode(fid, bytes(raw))

    def lookup(self, parent_ino: int, name: bytes) -> Attr:
        key = _ID.pack(self.file_id(parent_ino)) + name
        with self._env.begin() as txn:
            child = txn.get(key, db=self._dent)
            if child is None:
                raise NotFound(f"{name!r} in inode {parent_ino}")
            fid = _ID.unpack(child)[0]
            raw = txn.get(child, db=self._attr)
            if raw is None:
                raise NotFound(f"inode of {name!r}")
            return self._decode(fid, raw)

    def readdir(self, dir_ino: int, start: int) -> Iterator[tuple[int, bytes, Attr]]:
        """Yield ``(position + 1, name, attr)`` from position ``start`` on.

        The generator holds a read transaction; the caller consumes it within one
        synchronous stretch (no await in between), which ``fuse_ops.readdir`` does.
        """
        parent = self.file_id(dir_ino)
        with self._env.begin() as txn:
            cur = txn.cursor(db=self._dpos)
            if not cur.set_range(_POS.pack(parent, start)):
                return
            for key, value in cur:
                pid, pos = _POS.unpack(key)
                if pid != parent:
                    return
                fid = _ID.unpack_from(value)[0]
                raw = txn.get(value[:8], db=self._attr)
                if raw is None:
                    continue
                yield pos + 1, value[8:], self._decode(fid, raw)

    def dir_files(self, dir_id: int) -> list[tuple[int, int, int]]:
        """``(file_id, version, size)`` of the regular files in a directory (by file id).

        Blocking for a large directory: callers run it in a thread.
        """
        out = []
        with self._env.begin() as txn:
            cur = txn.cursor(db=self._dpos)
            if not cur.set_range(_POS.pack(dir_id, 0)):
                return out
            for key, value in cur:
                if _POS.unpack(key)[0] != dir_id:
                    break
                raw = txn.get(value[:8], db=self._attr)
                if raw is None:
                    continue
                mode, size, _, _, version, _ = _ATTR.unpack_from(raw)
                if stat.S_ISREG(mode):
                    out.append((_ID.unpack_from(value)[0], version, size))
        return out

    def _decode(self, fid: int, raw: bytes) -> Attr:
        mode, size, mtime_ns, nlink, version, parent = _ATTR.unpack_from(raw)
        return Attr(
            self.inode(fid), fid, mode, size, mtime_ns, nlink, version, parent,
            bytes(raw[_ATTR.size :]),
        )
