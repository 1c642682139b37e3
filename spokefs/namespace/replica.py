"""The replicated namespace: the hub's snapshot in a local LMDB, so that lookup, getattr,
readdir, readlink and statfs never touch the network.

Inodes are the hub's stable file ids (hard links share one), except that the export root is
FUSE's inode 1. Nothing per-inode lives in memory, so ``forget`` has nothing to drop and a
restart sees the same inode numbers.

LMDB layout (environment ``<cache_dir>/namespace``; keys big-endian so one directory's
entries are adjacent):

| db   | key                        | value                                                 |
| ---- | -------------------------- | ----------------------------------------------------- |
| attr | id                         | ``_ATTR`` (mode, size, mtime_ns, nlink, version,      |
|      |                            | parent) + symlink target                              |
| dent | parent id + name           | child id + position (u32)                             |
| dpos | parent id + position (u32) | child id + name (readdir resumes at a position)       |
| info | b"generation" etc.         | values of the loaded snapshot                         |

A snapshot, or a batch of changes, is applied in one write transaction, so a crash leaves
either the old namespace or the new one, never a mix. Records carry no checksums; a clean
close seals the file with its digest instead (``namespace.seal``). Positions only grow: a
directory's entries keep their readdir offsets across changes, and new names go at the end.

Loading a snapshot is a bulk job (``_BulkLoader``): the stream is decoded a step at a time
and each db gets one ``putmulti`` per step, so a million entries cost a second or two, not a
Python object per entry. Where the C part ``snapshot_items`` is built (``deploy/setup.sh``
builds it) it checks the entries and makes the items in one pass, and the attr items go in
sorted with LMDB's append (ids are hashes: in stream order each would land at a random place);
without it the same runs in Python (``NATIVE`` False; the tests run both ways).

Changes (``apply_changes``) follow the protocol's rules (docs/protocol.md): REMOVE unlinks
one name and is never recursive; UPSERT sets one name to an entry. An inode that loses its
last name keeps its attributes, so a file open across its removal can still be stat'ed and
read (its bytes come from its own version); such orphans are small and stay until the next
full snapshot.

Reads are small gets on a memory map and run inline on the trio thread
(docs/contributing.md, section 5); the load and the listings that directory fills ask for
run in a worker thread. ``readdir_rows`` is the hot path of ``find`` over a large tree: it
yields tuples, never an ``Attr`` per entry.
"""

from __future__ import annotations

import stat
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb

from spokefs import protocol
from spokefs.errors import NotFound, StoreFailed
from spokefs.lmdb_env import open_env
from spokefs.namespace import seal as namespace_seal

try:  # C, optional: see the module docstring
    from spokefs.namespace import snapshot_items

    NATIVE = True
except ImportError:  # pragma: no cover - the package was installed without its C part
    NATIVE = False

ROOT_INODE = 1
_ID = struct.Struct(">Q")
_POS = struct.Struct(">QI")
_ATTR = struct.Struct("<IQqIQQ")
_MODE = struct.Struct("<I")  # the head of _ATTR
_U64 = struct.Struct("<Q")
_POS_ONLY = struct.Struct(">I")
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


# One directory entry for readdir: (position + 1, name, inode, mode, size, mtime_ns, nlink).
DirRow = tuple[int, bytes, int, int, int, int, int]


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    generation: int
    root_id: int
    entries: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class Applied:
    """What ``apply_changes`` changed, for the kernel's caches to forget.

    Attributes:
        info: the namespace after the changes.
        names: (parent inode, name) of every name removed or pointed elsewhere.
        inodes: inodes whose attributes or bytes changed.
        records: how many change records were applied.
    """

    info: NamespaceInfo
    names: list[tuple[int, bytes]]
    inodes: list[int]
    records: int


@dataclass(slots=True)
class _Batch:
    """Running totals of one ``apply_changes`` transaction."""

    entries: int
    total: int
    names: list[tuple[int, bytes]]
    inodes: set[int]
    unlinked: dict[int, int]  # file id -> size, for files whose name was removed
    next_pos: dict[int, int]


class _BulkLoader:
    """Stores a whole snapshot into emptied dbs inside one write transaction, fast.

    The compressed stream is inflated a step at a time (about 1 MiB of compressed input,
    tens of thousands of entries). Natively (``snapshot_items.Items``), each step's entries
    are checked and held in C (about 100 bytes an entry), and stored at the end sorted, with
    LMDB's append, or sooner, in sorted batches, past ``_HELD_MAX``. In Python, each step is
    decoded into plain tuples (``protocol.SnapshotDecoder.feed_rows``), its keys and values
    built in list comprehensions and stored with one ``putmulti`` per db.

    Hard links: the first entry of an id gives its attributes (``overwrite=False``). A name
    listed twice in one directory is a ``WireError``.
    """

    _STEP = 1 << 20  # compressed bytes decoded per batch
    _HELD_MAX = 512 << 20  # ~5M entries' items held in C before a batch is stored

    # lmdb._Database: what open_db returns (the module exports no public name for it)
    def __init__(self, attr: lmdb._Database, dent: lmdb._Database,
                 dpos: lmdb._Database) -> None:
        self._attr, self._dent, self._dpos = attr, dent, dpos
        self._positions: dict[int, int] = {}
        self.count = 0
        self.total = 0

    def load(self, txn: lmdb.Transaction[bytes],
             compressed: bytes | Iterable[bytes]) -> protocol.SnapshotHeader:
        """Decode and store every entry of the stream (whole, or its pieces as they come);
        the snapshot's header.

        Raises:
            protocol.WireError: malformed or hostile (the caller aborts the transaction).
        """
        pieces: Iterable[bytes | memoryview]
        if isinstance(compressed, bytes):
            view = memoryview(compressed)
            pieces = (view[i : i + self._STEP] for i in range(0, len(view), self._STEP))
        else:
            pieces = compressed
        if NATIVE:
            return self._load_native(txn, pieces)
        decoder = protocol.SnapshotDecoder()
        for piece in pieces:
            rows = decoder.feed_rows(piece)
            if rows:
                self._store(txn, rows)
        return decoder.finish()

    def _load_native(self, txn: lmdb.Transaction[bytes],
                     pieces: Iterable[bytes | memoryview]) -> protocol.SnapshotHeader:
        decoder = protocol.SnapshotDecoder()
        items = snapshot_items.Items(protocol.WireError)
        appending = True  # into the emptied dbs, until a batch is stored before the end
        for piece in pieces:
            decoder.feed_into(piece, items)
            if items.held_bytes > self._HELD_MAX:
                self._store_held(txn, items, append=appending)
                appending = False
        header = decoder.finish()
        self._store_held(txn, items, append=appending)
        self.count, self.total = header.count, items.total
        return header

    def _store_held(self, txn: lmdb.Transaction[bytes], items: snapshot_items.Items, *,
                    append: bool) -> None:
        """The items ``items`` holds, sorted: appended to the emptied dbs, or put among
        those an earlier batch stored (where an id's first entry stays and a name listed
        again is found)."""
        dents, dposs = items.sorted_names()
        if not append:
            txn.cursor(db=self._attr).putmulti(items.sorted_attrs(), overwrite=False)
            self._store_names(txn, list(dents), list(dposs))
            return
        for db, sorted_items in ((self._attr, items.sorted_attrs()), (self._dent, dents),
                                 (self._dpos, dposs)):
            consumed, added = txn.cursor(db=db).putmulti(sorted_items, append=True)
            if added != consumed:  # LMDB's append skips a key not above the last one
                raise RuntimeError("snapshot items out of order for LMDB's append")

    def _store(self, txn: lmdb.Transaction[bytes], rows: list[protocol.Row]) -> None:
        pack_id, pack_attr = _ID.pack, _ATTR.pack
        attrs = [
            (pack_id(r[0]), pack_attr(r[2], r[3], r[4], r[5], r[6], r[1]) + r[8]) for r in rows
        ]
        txn.cursor(db=self._attr).putmulti(attrs, overwrite=False)
        self._store_names(txn, *self._names(rows))
        self.count += len(rows)
        self.total += sum(r[3] for r in rows if r[2] & 0o170000 != stat.S_IFDIR)

    def _store_names(self, txn: lmdb.Transaction[bytes], dents: list[tuple[bytes, bytes]],
                     dposs: list[tuple[bytes, bytes]]) -> None:
        if txn.cursor(db=self._dent).putmulti(dents, overwrite=False)[1] != len(dents):
            raise protocol.WireError(_duplicate_name(txn, self._dent, dents))
        txn.cursor(db=self._dpos).putmulti(dposs)

    def _names(self, rows: list[protocol.Row]) -> tuple[list[tuple[bytes, bytes]],
                                                    list[tuple[bytes, bytes]]]:
        """The dent and dpos items of ``rows``: each child gets its parent's next position."""
        positions = self._positions
        pack_id, pack_pos = _ID.pack, _POS_ONLY.pack
        dents: list[tuple[bytes, bytes]] = []
        dposs: list[tuple[bytes, bytes]] = []
        add_dent, add_dpos = dents.append, dposs.append
        for fid, parent, _, _, _, _, _, name, _ in rows:
            if not parent:
                continue  # the root has no name
            pos = positions.get(parent, 0)
            positions[parent] = pos + 1
            child, parent_key, pos_key = pack_id(fid), pack_id(parent), pack_pos(pos)
            add_dent((parent_key + name, child + pos_key))
            add_dpos((parent_key + pos_key, child + name))
        return dents, dposs


def _duplicate_name(txn: lmdb.Transaction[bytes], dent: lmdb._Database,
                    items: list[tuple[bytes, bytes]]) -> str:
    """The message for a name listed twice in a directory (one of ``items`` was not new)."""
    seen: set[bytes] = set()
    for key, value in items:
        stored = txn.get(key, db=dent)
        if key in seen or stored != value:
            return f"name {key[8:48]!r} listed twice in {_ID.unpack_from(key)[0]:x}"
        seen.add(key)
    return "a name listed twice in a directory"


class Namespace:
    """Read access to the replicated namespace, and the snapshot loader."""

    def __init__(self, path: Path) -> None:
        """Open (or create) the namespace in ``path``."""
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        namespace_seal.check(path)  # a file changed since its clean close goes aside
        self._env = open_env(path, map_size=_MAP_SIZE, max_dbs=4, readahead=False, lock=True)
        self._attr = self._env.open_db(b"attr")
        self._dent = self._env.open_db(b"dent")
        self._dpos = self._env.open_db(b"dpos")
        self._info = self._env.open_db(b"info")
        self.info = self._read_info()

    def close(self, *, seal: bool = True) -> None:
        """Close the environment; ``seal``: note its digest for the next open's check
        (``namespace.seal``; the loader child, which another process outlives, passes
        False)."""
        self._env.close()
        if seal:
            namespace_seal.seal(self.path)

    def check_readers(self) -> int:
        """Free the reader slots of processes that died (a worker killed with -9)."""
        freed: int = self._env.reader_check()
        return freed

    # -- loading ---------------------------------------------------------------------

    def reload_snapshot(self, compressed: bytes | Iterable[bytes]) -> Applied:
        """Replace the namespace with a snapshot (whole, or its pieces as they arrive);
        report what the kernel must forget.

        Without a change list, the kernel's caches are flushed wholesale: every name in the
        root (forgetting a directory's name prunes its whole cached subtree) and every file
        whose version changed or vanished (its cached pages hold the old bytes).

        Raises:
            protocol.WireError: the snapshot is malformed or hostile; nothing is changed.
        """
        old_versions: dict[int, int] = {}
        old_dirs: list[int] = []
        old_roots: list[bytes] = []
        old_root = self.info.root_id if self.info is not None else 0
        loader = _BulkLoader(self._attr, self._dent, self._dpos)
        with self._env.begin(write=True) as txn:
            if self.info is not None:
                old_versions, old_dirs = self._files_and_dirs(txn)
                old_roots = self._names_in(txn, self.info.root_id)
            for db in (self._attr, self._dent, self._dpos, self._info):
                txn.drop(db, delete=False)
            header = loader.load(txn, compressed)
            info = NamespaceInfo(header.generation, header.root_id, loader.count, loader.total)
            self._put_info(txn, info)
            new_versions = self._files_and_dirs(txn)[0] if old_versions else {}
        # an exception above aborts the transaction: the old namespace stays
        self.info = info
        stale = [fid for fid, ver in old_versions.items() if new_versions.get(fid) != ver]
        # Every old directory too: the kernel caches listings, and a directory a process
        # still sits in keeps its inode (and listing) after its name is forgotten.
        stale += [ROOT_INODE if fid == old_root else fid for fid in old_dirs]
        return Applied(info, [(ROOT_INODE, n) for n in old_roots], stale, loader.count)

    def _names_in(self, txn: lmdb.Transaction[bytes], dir_id: int) -> list[bytes]:
        prefix = _ID.pack(dir_id)
        cur = txn.cursor(db=self._dent)
        names = []
        if cur.set_range(prefix):
            for key in cur.iternext(values=False):
                if key[:8] != prefix:
                    break
                names.append(key[8:])
        return names

    def _files_and_dirs(self, txn: lmdb.Transaction[bytes]) -> tuple[dict[int, int], list[int]]:
        """Each regular file's version, and the directories (by file id)."""
        files, dirs = {}, []
        for key, raw in txn.cursor(db=self._attr):
            mode, _, _, _, version, _ = _ATTR.unpack_from(raw)
            if stat.S_ISREG(mode):
                files[_ID.unpack(key)[0]] = version
            elif stat.S_ISDIR(mode):
                dirs.append(_ID.unpack(key)[0])
        return files, dirs

    def apply_changes(self, compressed: bytes) -> Applied:
        """Apply a changes answer from the hub (blocking; run in a thread).

        Raises:
            protocol.WireError: malformed, hostile, or not based on this namespace's generation
                (the caller then loads a full snapshot); nothing is changed.
            StoreFailed: the changes could not be written (a full disk, a failing one);
                nothing is changed.
        """
        try:
            return self._apply_changes(compressed)
        except (lmdb.MapFullError, lmdb.DiskError) as exc:  # the transaction was aborted
            raise StoreFailed(f"cannot store namespace changes in {self.path}: {exc}") from None

    def _apply_changes(self, compressed: bytes) -> Applied:
        if self.info is None:
            raise protocol.WireError("no namespace to apply changes to")
        info = self.info
        decoder = protocol.ChangesDecoder()
        batch = _Batch(info.entries, info.total_bytes, [], set(), {}, {})
        count = 0
        with self._env.begin(write=True) as txn:
            step = 1 << 20
            for i in range(0, len(compressed), step):
                for rec in decoder.feed(compressed[i : i + step]):
                    if decoder.header is not None and (
                        decoder.header.from_generation != info.generation
                        or decoder.header.root_id != info.root_id
                    ):
                        raise protocol.WireError("changes are not based on this namespace")
                    if isinstance(rec, protocol.Remove):
                        self._remove(txn, rec.parent_id, rec.name, batch)
                    else:
                        self._upsert(txn, rec.entry, batch)
                    count += 1
            header = decoder.finish()
            if header.from_generation != info.generation or header.root_id != info.root_id:
                raise protocol.WireError("changes are not based on this namespace")
            for fid, size in batch.unlinked.items():
                raw = txn.get(_ID.pack(fid), db=self._attr)
                if raw is not None and _ATTR.unpack_from(raw)[3] <= 1:
                    batch.total -= size  # its last name is gone
            new = NamespaceInfo(header.to_generation, info.root_id, batch.entries, batch.total)
            self._put_info(txn, new)
        self.info = new
        return Applied(new, batch.names, sorted(batch.inodes), count)

    def _upsert(self, txn: lmdb.Transaction[bytes], e: protocol.Entry, b: _Batch) -> None:
        key = _ID.pack(e.file_id)
        old = txn.get(key, db=self._attr)
        if e.parent_id:
            self._check_parent(txn, e)
            self._link(txn, e, b)
        if old is not None:
            mode, size, mtime, nlink, version, _ = _ATTR.unpack_from(old)
            new = (e.mode, e.size, e.mtime_ns, e.nlink, e.version)
            if (mode, size, mtime, nlink, version) != new:
                b.inodes.add(self.inode(e.file_id))
            b.total += (e.size if not e.is_dir else 0) - (size if not stat.S_ISDIR(mode) else 0)
        elif not e.is_dir:
            b.total += e.size
        b.unlinked.pop(e.file_id, None)
        attr = _ATTR.pack(e.mode, e.size, e.mtime_ns, e.nlink, e.version, e.parent_id)
        txn.put(key, attr + e.target, db=self._attr)

    def _check_parent(self, txn: lmdb.Transaction[bytes], e: protocol.Entry) -> None:
        raw = txn.get(_ID.pack(e.parent_id), db=self._attr)
        if raw is None or not stat.S_ISDIR(_ATTR.unpack_from(raw)[0]):
            raise protocol.WireError(f"{e.name[:40]!r}: parent {e.parent_id:x} is not a directory")
        if not e.is_dir:
            return
        node, depth = e.parent_id, 0
        while node != self._root_id():  # a directory moved below itself would be a cycle
            if node == e.file_id or depth > 100_000 or raw is None:
                raise protocol.WireError(f"directory {e.file_id:x} would be its own ancestor")
            node = _ATTR.unpack_from(raw)[5]
            raw = txn.get(_ID.pack(node), db=self._attr)
            depth += 1

    def _link(self, txn: lmdb.Transaction[bytes], e: protocol.Entry, b: _Batch) -> None:
        dkey = _ID.pack(e.parent_id) + e.name
        child = _ID.pack(e.file_id)
        dent = txn.get(dkey, db=self._dent)
        if dent is not None:
            if dent[:8] == child:
                return
            pos = _POS_ONLY.unpack_from(dent, 8)[0]  # the name now means another inode
            b.names.append((self.inode(e.parent_id), e.name))
        else:
            pos = self._next_pos(txn, e.parent_id, b)
            b.entries += 1
        b.inodes.add(self.inode(e.parent_id))  # its listing changed (the kernel caches it)
        txn.put(dkey, child + _POS_ONLY.pack(pos), db=self._dent)
        txn.put(_POS.pack(e.parent_id, pos), child + e.name, db=self._dpos)

    def _remove(self, txn: lmdb.Transaction[bytes], parent: int, name: bytes, b: _Batch) -> None:
        dkey = _ID.pack(parent) + name
        dent = txn.get(dkey, db=self._dent)
        if dent is None:
            raise protocol.WireError(f"remove of {name[:40]!r} in {parent:x}: no such name")
        fid = _ID.unpack_from(dent)[0]
        txn.delete(dkey, db=self._dent)
        txn.delete(_POS.pack(parent, _POS_ONLY.unpack_from(dent, 8)[0]), db=self._dpos)
        b.entries -= 1
        b.names.append((self.inode(parent), name))
        b.inodes.add(self.inode(parent))  # its listing changed (the kernel caches it)
        raw = txn.get(dent[:8], db=self._attr)
        if raw is not None and not stat.S_ISDIR(_ATTR.unpack_from(raw)[0]):
            b.unlinked[fid] = _ATTR.unpack_from(raw)[1]

    def _next_pos(self, txn: lmdb.Transaction[bytes], parent: int, b: _Batch) -> int:
        pos = b.next_pos.get(parent)
        if pos is None:
            cur = txn.cursor(db=self._dpos)
            found = cur.set_range(_POS.pack(parent, 0xFFFFFFFF))
            if (cur.prev() if found else cur.last()) and _POS.unpack(cur.key())[0] == parent:
                pos = _POS.unpack(cur.key())[1] + 1
            else:
                pos = 0
        b.next_pos[parent] = pos + 1
        return pos

    def _put_info(self, txn: lmdb.Transaction[bytes], info: NamespaceInfo) -> None:
        for key, value in (
            (b"generation", info.generation), (b"root", info.root_id),
            (b"entries", info.entries), (b"total_bytes", info.total_bytes),
        ):
            txn.put(key, _U64.pack(value), db=self._info)

    def refresh_info(self) -> None:
        """Read ``info`` again (another process, ``snapshot_load``, replaced the namespace)."""
        self.info = self._read_info()

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
            dent = txn.get(key, db=self._dent)
            if dent is None:
                raise NotFound(f"{name!r} in inode {parent_ino}")
            fid = _ID.unpack_from(dent)[0]
            raw = txn.get(dent[:8], db=self._attr)
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

    def readdir_rows(self, dir_ino: int, start: int) -> Iterator[DirRow]:
        """What ``readdir`` yields, as plain tuples: ``(position + 1, name, inode, mode,
        size, mtime_ns, nlink)``, ``size`` being a symlink's target length for a symlink
        (a READDIRPLUS answer). No object per entry; same transaction rule as ``readdir``.
        """
        unpack_attr, fixed = _ATTR.unpack_from, _ATTR.size
        for next_pos, name, ino, raw in self._listing(dir_ino, start):
            mode, size, mtime_ns, nlink, _, _ = unpack_attr(raw)
            if mode & 0o170000 == stat.S_IFLNK:
                size = len(raw) - fixed
            yield next_pos, name, ino, mode, size, mtime_ns, nlink

    def readdir_types(self, dir_ino: int, start: int) -> Iterator[tuple[int, bytes, int, int]]:
        """``(position + 1, name, inode, mode)`` from position ``start`` on: what a plain
        READDIR answers (names, inode numbers and types), and nothing it does not need; the
        hot path of ``find`` over a large tree. Same transaction rule as ``readdir``."""
        unpack_mode = _MODE.unpack_from
        for next_pos, name, ino, raw in self._listing(dir_ino, start):
            yield next_pos, name, ino, unpack_mode(raw)[0]

    def _listing(self, dir_ino: int, start: int) -> Iterator[tuple[int, bytes, int, bytes]]:
        """``(position + 1, name, inode, stored attributes)`` of a directory's entries from
        position ``start`` on, inside one read transaction."""
        parent = self.file_id(dir_ino)
        root = self._root_id()
        unpack_key, unpack_id = _POS.unpack, _ID.unpack
        with self._env.begin() as txn:
            cur = txn.cursor(db=self._dpos)
            if not cur.set_range(_POS.pack(parent, start)):
                return
            get, attr_db = txn.get, self._attr
            for key, value in cur:
                pid, pos = unpack_key(key)
                if pid != parent:
                    return
                child = value[:8]
                raw = get(child, db=attr_db)
                if raw is None:
                    continue
                fid = unpack_id(child)[0]
                yield pos + 1, value[8:], ROOT_INODE if fid == root else fid, raw

    def dir_files_named(self, dir_id: int) -> list[tuple[bytes, int, int, int]]:
        """``(name, file_id, version, size)`` of the regular files in a directory: what
        ``protocol.plan_packs`` takes. Blocking for a large directory: callers run it in a
        thread."""
        return [(name, fid, version, size)
                for fid, mode, size, version, name in self._children(dir_id)
                if mode & 0o170000 == stat.S_IFREG]

    def next_file(self, dir_id: int, file_id: int, min_size: int) -> tuple[int, int, int] | None:
        """``(file_id, version, size)`` of the first regular file of at least ``min_size``
        bytes after ``file_id``'s name in a directory, in name (byte) order; None if there is
        none or ``file_id`` is not in it. Shards are read in name order, so this is the file a
        reader nearing the end of ``file_id`` reads next.

        Blocking for a large directory (a walk of its names): callers run it in a thread.
        """
        prefix = _ID.pack(dir_id)
        with self._env.begin() as txn:
            cur = txn.cursor(db=self._dent)
            if not cur.set_range(prefix):
                return None
            seen = False
            for key, value in cur:
                if key[:8] != prefix:
                    break
                child = _ID.unpack_from(value)[0]
                if not seen:
                    seen = child == file_id
                    continue
                raw = txn.get(value[:8], db=self._attr)
                if raw is None:
                    continue
                mode, size, _, _, version, _ = _ATTR.unpack_from(raw)
                if mode & 0o170000 == stat.S_IFREG and size >= min_size and child != file_id:
                    return child, version, size
        return None

    def subdirs(self, dir_id: int) -> list[int]:
        """Ids of the subdirectories of a directory (by file id). Blocking for a large
        directory: callers run it in a thread."""
        return [fid for fid, mode, _, _, _ in self._children(dir_id)
                if mode & 0o170000 == stat.S_IFDIR]

    def parent_of(self, dir_id: int) -> int:
        """The id of the directory that lists ``dir_id`` first; 0 for the export root.

        Raises:
            NotFound: no such id.
        """
        if dir_id == self._root_id():
            return 0
        return self.getattr(self.inode(dir_id)).parent_id

    def _children(self, dir_id: int) -> list[tuple[int, int, int, int, bytes]]:
        """``(file_id, mode, size, version, name)`` of every entry of a directory, in
        position order; one read transaction, no object per entry but the tuple."""
        prefix = _ID.pack(dir_id)
        unpack_attr = _ATTR.unpack_from
        out: list[tuple[int, int, int, int, bytes]] = []
        with self._env.begin() as txn:
            cur = txn.cursor(db=self._dpos)
            if not cur.set_range(prefix):
                return out
            get, attr_db = txn.get, self._attr
            for key, value in cur:
                if key[:8] != prefix:
                    break
                raw = get(value[:8], db=attr_db)
                if raw is not None:
                    mode, size, _, _, version, _ = unpack_attr(raw)
                    out.append((_ID.unpack_from(value)[0], mode, size, version,
                                bytes(value[8:])))
        return out

    def _decode(self, fid: int, raw: bytes) -> Attr:
        mode, size, mtime_ns, nlink, version, parent = _ATTR.unpack_from(raw)
        return Attr(
            self.inode(fid), fid, mode, size, mtime_ns, nlink, version, parent,
            bytes(raw[_ATTR.size :]),
        )
