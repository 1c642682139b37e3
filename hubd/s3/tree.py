"""A bucket listing -> the hub's namespace table: keys become a tree of POSIX names.

Rules (mountpoint-s3's, where it documents one):

- Each key under the export prefix is split on ``/``; its segments are the path of a
  regular file, and every proper prefix of it a directory.
- Keys that cannot be POSIX paths are skipped and counted by reason (``SKIP_REASONS``):
  an empty segment (``a//b``, a leading ``/``), a ``.`` or ``..`` segment, a NUL byte, a
  segment over 255 bytes (NAME_MAX), and a key ending in ``/`` (a "directory marker"
  object; its directory still appears if a key lies below it).
- A key and a directory with the same name (``a`` and ``a/b``): the directory wins, the
  object ``a`` is skipped (``shadowed``).
- Ids are 63-bit xxh64s of ``(bucket, key)`` (``object_id``), stable across rescans and
  hub restarts; a directory's id is that of its key prefix with the trailing ``/``, the
  root's that of the export prefix. Two keys hashing to one id (about 1 in 10^7 for 1M
  keys) keep the first; the second is skipped (``id-collision``).
- A file's version is the xxh64 of its ETag and size (no HEAD per object): a replaced
  object gets a new version even when its size stays. Its mtime is LastModified.
- A directory has mode 0755, size 0, nlink 2 + its subdirectories, and the newest mtime
  below it (so an unchanged subtree gives the same records, and ``changes.diff`` finds
  nothing to send); files are 0644 with nlink 1. The hub is read-only either way.

The table lists entries as ``scan.py`` does: root first, then each directory's children
as one block, children sorted by name, depth first; the same listing gives the same bytes.

Memory: the tree holds one dict entry per key plus the ``ObjectInfo`` it came from while
the table is built (~250 bytes per key), then only the packed table remains.
"""

from __future__ import annotations

import stat
import struct
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import xxhash

from hubd.s3.client import ObjectInfo
from hubd.snapshot import TableBuilder
from spokefs import protocol

NAME_MAX = 255
FILE_MODE = stat.S_IFREG | 0o644
DIR_MODE = stat.S_IFDIR | 0o755
SKIP_REASONS = ("empty-segment", "dot-segment", "nul", "long-segment", "directory-marker",
                "shadowed", "id-collision")
_ID_MASK = (1 << 63) - 1
_SEP = b"\0"  # neither a bucket name nor a key holds NUL: (bucket, key) pairs never mix
_DIR_VERSION = struct.Struct("<qI")

Node = dict[str, "Node | ObjectInfo"]


def object_id(bucket: str, key: str) -> int:
    """The stable id of ``key`` in ``bucket`` (a directory's key ends with ``/``)."""
    h = xxhash.xxh64_intdigest(bucket.encode() + _SEP + key.encode()) & _ID_MASK
    return h if h >= protocol.MIN_FILE_ID else h + protocol.MIN_FILE_ID


def object_version(etag: str, size: int) -> int:
    """The version of an object: its ETag and size."""
    return xxhash.xxh64_intdigest(etag.encode() + _SEP + str(size).encode())


def skip_reason(rel_key: str) -> str | None:
    """Why ``rel_key`` (the key below the export prefix) is no file path, or None."""
    if not rel_key or rel_key.endswith("/"):
        return "directory-marker"
    if "\0" in rel_key:
        return "nul"
    for segment in rel_key.split("/"):
        if not segment:
            return "empty-segment"
        if segment in (".", ".."):
            return "dot-segment"
        if len(segment) > NAME_MAX // 4 and len(segment.encode()) > NAME_MAX:
            return "long-segment"
    return None


@dataclass(slots=True)
class TreeStats:
    """What one build found.

    Attributes:
        files, dirs: entries listed (the root counts as a directory).
        skipped: keys left out, by reason (``SKIP_REASONS``).
        examples: the first skipped key of each reason, for one log line per reason.
    """

    files: int = 0
    dirs: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)

    def skip(self, reason: str, key: str) -> None:
        self.skipped[reason] += 1
        self.examples.setdefault(reason, key)


@dataclass(slots=True)
class Tree:
    """What ``build_tree`` returns.

    Attributes:
        table: the entries (``TableBuilder.build(root_id)`` makes the snapshot table).
        root_id: the export root's id.
        stats: counts and skipped keys.
        etags: file id -> the ETag of the object listed under it (what reads send in
            ``If-Match``).
    """

    table: TableBuilder
    root_id: int
    stats: TreeStats
    etags: dict[int, str]


def export_prefix(prefix: str) -> str:
    """The normalised export prefix: "" for the whole bucket, else ending with ``/``."""
    prefix = prefix.strip("/")
    return f"{prefix}/" if prefix else ""


def _insert(root: Node, obj: ObjectInfo, rel: str, stats: TreeStats) -> None:
    parts = rel.split("/")
    node = root
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            if child is not None:  # a file where a directory goes: the directory wins
                stats.skip("shadowed", child.key)
            child = node[part] = {}
        node = child
    leaf = parts[-1]
    if isinstance(node.get(leaf), dict):
        stats.skip("shadowed", obj.key)
    else:
        node[leaf] = obj


def _dir_summary(node: Node, out: dict[int, tuple[int, int]]) -> int:
    """Fill ``out[id(dict)] = (newest mtime below, subdirectory count)``; returns the mtime."""
    newest = 0
    subdirs = 0
    for child in node.values():
        if isinstance(child, dict):
            subdirs += 1
            newest = max(newest, _dir_summary(child, out))
        else:
            newest = max(newest, child.mtime_ns)
    out[id(node)] = (newest, subdirs)
    return newest


class _Emitter:
    def __init__(self, bucket: str, stats: TreeStats, summary: dict[int, tuple[int, int]]):
        self.bucket = bucket
        self.stats = stats
        self.summary = summary
        self.table = TableBuilder()
        self.seen: set[int] = set()
        self.etags: dict[int, str] = {}

    def add_dir(self, dir_id: int, parent_id: int, name: str, node: Node) -> None:
        mtime, subdirs = self.summary[id(node)]
        version = xxhash.xxh64_intdigest(_DIR_VERSION.pack(mtime, subdirs))
        self.table.add(protocol.Entry(dir_id, parent_id, DIR_MODE, 0, mtime, 2 + subdirs,
                                  version, name.encode(), b""), 0, dir_id)
        self.stats.dirs += 1

    def add_file(self, file_id: int, parent_id: int, name: str, obj: ObjectInfo) -> None:
        self.table.add(protocol.Entry(file_id, parent_id, FILE_MODE, obj.size, obj.mtime_ns, 1,
                                  object_version(obj.etag, obj.size), name.encode(), b""),
                       0, file_id)
        self.etags[file_id] = obj.etag
        self.stats.files += 1

    def new_id(self, key: str, shown: str) -> int | None:
        file_id = object_id(self.bucket, key)
        if file_id in self.seen:
            self.stats.skip("id-collision", shown)
            return None
        self.seen.add(file_id)
        return file_id


def build_tree(bucket: str, prefix: str, objects: Iterable[ObjectInfo]) -> Tree:
    """The namespace of ``objects`` (keys under ``prefix``).

    Args:
        prefix: the export prefix as ``export_prefix`` returns it ("" or ending in ``/``).
        objects: every object listed under ``prefix``, in any order.
    """
    stats = TreeStats()
    root: Node = {}
    for obj in objects:
        rel = obj.key[len(prefix):] if obj.key.startswith(prefix) else None
        if rel is None:
            raise ValueError(f"key {obj.key!r} is not under the prefix {prefix!r}")
        reason = skip_reason(rel)
        if reason is not None:
            stats.skip(reason, obj.key)
        else:
            _insert(root, obj, rel, stats)
    summary: dict[int, tuple[int, int]] = {}
    _dir_summary(root, summary)
    emit = _Emitter(bucket, stats, summary)
    root_id = object_id(bucket, prefix)
    emit.seen.add(root_id)
    emit.add_dir(root_id, 0, "", root)
    stack: list[tuple[int, str, Node]] = [(root_id, prefix, root)]
    while stack:
        dir_id, path, node = stack.pop()
        emit.table.open_block(dir_id)
        subdirs: list[tuple[int, str, Node]] = []
        for name in sorted(node):
            child = node[name]
            if isinstance(child, dict):
                key = f"{path}{name}/"
                child_id = emit.new_id(key, key)
                if child_id is not None:
                    emit.add_dir(child_id, dir_id, name, child)
                    subdirs.append((child_id, key, child))
            else:
                child_id = emit.new_id(child.key, child.key)
                if child_id is not None:
                    emit.add_file(child_id, dir_id, name, child)
        stack.extend(reversed(subdirs))
    return Tree(emit.table, root_id, stats, emit.etags)
