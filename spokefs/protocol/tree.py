"""The namespace streams: the snapshot (every entry of a generation) and the changes between
two generations, their encoders (hubd) and bounded, validating decoders (the spoke)
(docs/protocol.md, "Snapshot format" and "Changes format")."""

from __future__ import annotations

import stat
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from spokefs.protocol.base import (
    FORMAT_VERSION,
    MIN_FILE_ID,
    NAME_MAX,
    TARGET_MAX,
    WireError,
)

# Plain bytes inflated per step while decoding: zlib expands up to ~1000:1, so a hostile
# stream could otherwise turn one 1 MiB chunk into 1 GiB in one call.
_PLAIN_STEP = 1 << 20


CHANGE_UPSERT = 1
CHANGE_REMOVE = 2
_HEADER = struct.Struct("<4sHQQQ")
_ENTRY = struct.Struct("<QQIQqIQHH")
_TRAILER = struct.Struct("<4sQ")
_CHANGES_HEADER = struct.Struct("<4sHQQQQ")
_REMOVE = struct.Struct("<BQH")  # type, parent id, name length
_MAGIC_HEAD = b"SPKS"
_MAGIC_CHANGES = b"SPKC"
_MAGIC_TAIL = b"SPKE"
_ALLOWED_TYPES = (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK)


@dataclass(frozen=True, slots=True)
class Entry:
    """One directory entry of the namespace: a name in a parent and the attributes it names."""

    file_id: int
    parent_id: int
    mode: int
    size: int
    mtime_ns: int
    nlink: int
    version: int
    name: bytes
    target: bytes = b""

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)

# One snapshot entry as a plain tuple, in ``Entry``'s field order: (file_id, parent_id, mode,
# size, mtime_ns, nlink, version, name, target). What bulk loaders take instead of ``Entry``.
Row = tuple[int, int, int, int, int, int, int, bytes, bytes]


@dataclass(frozen=True, slots=True)
class SnapshotHeader:
    generation: int
    root_id: int
    count: int


@dataclass(frozen=True, slots=True)
class ChangesHeader:
    from_generation: int
    to_generation: int
    root_id: int
    count: int


@dataclass(frozen=True, slots=True)
class Upsert:
    """Set the directory entry ``(entry.parent_id, entry.name)`` to ``entry``."""

    entry: Entry


@dataclass(frozen=True, slots=True)
class Remove:
    """Unlink the one directory entry ``name`` of directory ``parent_id``."""

    parent_id: int
    name: bytes


def encode_header(generation: int, root_id: int, count: int) -> bytes:
    return _HEADER.pack(_MAGIC_HEAD, FORMAT_VERSION, generation, root_id, count)


def encode_entry(e: Entry) -> bytes:
    fixed = _ENTRY.pack(
        e.file_id, e.parent_id, e.mode, e.size, e.mtime_ns, e.nlink, e.version,
        len(e.name), len(e.target),
    )
    return fixed + e.name + e.target


def encode_trailer(count: int) -> bytes:
    return _TRAILER.pack(_MAGIC_TAIL, count)


def encode_remove(parent_id: int, name: bytes) -> bytes:
    """One REMOVE change record."""
    return _REMOVE.pack(CHANGE_REMOVE, parent_id, len(name)) + name


def encode_changes(from_generation: int, to_generation: int, root_id: int,
                   records: list[bytes], count: int, level: int = 6) -> bytes:
    """The whole compressed changes answer.

    Args:
        records: encoded change records (an UPSERT is ``CHANGE_UPSERT`` and the entry's
            ``encode_entry``; a REMOVE is ``encode_remove``), in order, possibly several
            records per item; ``count`` records in all.
    """
    comp = zlib.compressobj(level)
    head = _CHANGES_HEADER.pack(_MAGIC_CHANGES, FORMAT_VERSION, from_generation, to_generation,
                                root_id, count)
    parts = [comp.compress(head)]
    parts.extend(comp.compress(r) for r in records)
    parts.append(comp.compress(encode_trailer(count)))
    parts.append(comp.flush())
    return b"".join(parts)


def validate_name(name: bytes) -> None:
    if not name or len(name) > NAME_MAX:
        raise WireError(f"bad name length {len(name)}")
    if b"/" in name or b"\0" in name or name in (b".", b".."):
        raise WireError(f"bad name {name[:40]!r}")


def _parse_entry(buf: bytes | bytearray, pos: int) -> tuple[Entry, int] | None:
    """The entry encoded at ``buf[pos:]`` and the position after it; None if cut short."""
    if len(buf) - pos < _ENTRY.size:
        return None
    fid, parent, mode, size, mtime, nlink, ver, nlen, tlen = _ENTRY.unpack_from(buf, pos)
    if nlen > NAME_MAX or tlen > TARGET_MAX:
        raise WireError(f"over-long name ({nlen}) or target ({tlen})")
    start = pos + _ENTRY.size
    end = start + nlen + tlen
    if end > len(buf):
        return None
    name = bytes(buf[start : start + nlen])
    target = bytes(buf[start + nlen : end])
    return Entry(fid, parent, mode, size, mtime, nlink, ver, name, target), end


def decode_entry(buf: bytes | bytearray, pos: int = 0) -> tuple[Entry, int]:
    """The entry encoded at ``buf[pos:]`` (not validated) and the position after it."""
    parsed = _parse_entry(buf, pos)
    if parsed is None:
        raise WireError("entry cut short")
    return parsed


def _check_attrs(e: Entry) -> None:
    """The checks every entry passes, wherever it sits in the tree."""
    if stat.S_IFMT(e.mode) not in _ALLOWED_TYPES:
        raise WireError(f"entry {e.file_id:x}: unsupported file type {e.mode:o}")
    if e.file_id < MIN_FILE_ID:
        raise WireError(f"entry id {e.file_id} below {MIN_FILE_ID}")
    if len(e.target) > TARGET_MAX or (e.target and not e.is_symlink):
        raise WireError(f"entry {e.file_id:x}: bad symlink target")
    if e.is_symlink and (not e.target or b"\0" in e.target):
        raise WireError(f"entry {e.file_id:x}: bad symlink target")
    if e.size < 0 or e.size > 2**62:
        raise WireError(f"entry {e.file_id:x}: absurd size {e.size}")

_Item = TypeVar("_Item")


class EntryParser(Protocol):
    """What ``SnapshotDecoder.feed_into`` hands plain bytes to."""

    def parse(self, buf: bytearray, pos: int, count: int, seen: int,
              root_id: int) -> tuple[int, int]:
        """Take every whole entry of ``buf[pos:]`` while fewer than ``count`` are seen; the
        position after the last one taken and the new number seen."""
        ...


class _StreamDecoder(Generic[_Item]):
    """A zlib stream of ``HEADER, ITEM * count, TRAILER``: the framing both formats share.

    Subclasses parse the header (``_parse_header`` returns the item count) and one item
    (``_parse_item``, an ``_Item``); this class handles chunks, the trailer and truncation.
    """

    _what = "stream"
    _header_size = 0

    def __init__(self, max_items: int) -> None:
        self._z = zlib.decompressobj()
        self._buf = bytearray()
        self._max_items = max_items
        self._count: int | None = None
        self._seen = 0
        self.done = False

    def _parse_header(self, buf: bytearray) -> int:
        raise NotImplementedError

    def _parse_item(self, buf: bytearray, pos: int) -> tuple[_Item, int] | None:
        raise NotImplementedError

    def _feed(self, data: bytes | memoryview) -> Iterator[_Item]:
        for _ in self._inflated(data):
            yield from self._drain()

    def _inflated(self, data: bytes | memoryview) -> Iterator[None]:
        """Inflate ``data`` into ``_buf`` at most ``_PLAIN_STEP`` plain bytes at a time;
        after each step the caller drains ``_buf``."""
        while True:
            plain = self._inflate(data)
            if self.done:
                if plain or self._z.unused_data or self._z.unconsumed_tail:
                    raise WireError(f"data after the {self._what} trailer")
                return
            self._buf += plain
            yield None
            data = self._z.unconsumed_tail  # more output than _PLAIN_STEP: go on
            if not data and len(plain) < _PLAIN_STEP:  # a full step may leave output held
                return

    def _inflate(self, data: bytes | memoryview) -> bytes:
        try:
            return self._z.decompress(data, _PLAIN_STEP)
        except zlib.error as exc:
            raise WireError(f"{self._what} is not a zlib stream ({exc})") from None

    def _finish(self) -> None:
        try:
            self._buf += self._z.flush()
        except zlib.error as exc:
            raise WireError(f"{self._what} is not a zlib stream ({exc})") from None
        self._drain_rest()
        if not self.done or not self._z.eof or self._count is None:
            raise WireError(f"{self._what} stream ended early (truncated)")
        if self._z.unused_data:
            raise WireError(f"data after the {self._what} stream")

    def _drain_rest(self) -> None:
        list(self._drain())

    def _start(self) -> int | None:
        """Parse the header once it is in ``_buf``; the position after it (0 once parsed),
        or None while it is incomplete."""
        if self._count is not None:
            return 0
        if len(self._buf) < self._header_size:
            return None
        self._count = self._parse_header(self._buf)
        return self._header_size

    def _trailer(self, pos: int) -> int:
        """Check the trailer at ``pos`` once all items are in; the position after it (or
        ``pos`` while it is incomplete)."""
        buf = self._buf
        if len(buf) - pos < _TRAILER.size:
            return pos
        magic, n = _TRAILER.unpack_from(buf, pos)
        if magic != _MAGIC_TAIL or n != self._count:
            raise WireError(f"bad {self._what} trailer")
        pos += _TRAILER.size
        self.done = True
        if pos != len(buf):
            raise WireError(f"data after the {self._what} trailer")
        return pos

    def _drain(self) -> Iterator[_Item]:
        pos = self._start()
        if pos is None:
            return
        buf = self._buf
        count = self._count
        while not self.done:
            if self._seen == count:
                pos = self._trailer(pos)
                break
            parsed = self._parse_item(buf, pos)
            if parsed is None:
                break
            item, pos = parsed
            self._seen += 1
            yield item
        del buf[:pos]


class SnapshotDecoder(_StreamDecoder[Row]):
    """Incremental, validating decoder: feed compressed chunks, get entries.

    It rejects what a hostile or broken hub could send: unknown magic or version, ids below
    MIN_FILE_ID, names with ``/`` or NUL, ``.``/``..``, over-long names or targets, file
    types other than dir/file/symlink, a parent that is not an earlier directory (which
    rules out cycles), a directory listed twice, and truncated or over-long streams.
    A name listed twice in one directory is caught by the spoke's namespace loader.

    Three ways to take the entries: ``feed`` yields ``Entry`` objects; ``feed_rows`` returns
    plain tuples in ``Entry``'s field order (``Row``), about twice as fast, for loaders of
    millions of entries; ``feed_into`` hands the plain bytes to a native parser (the
    namespace's ``snapshot_items.Items``) that runs the same checks as ``_drain_rows`` and
    makes no Python object per entry. This class keeps the stream's framing in every way:
    inflating, the header, the trailer, truncation.
    """

    _what = "snapshot"
    _header_size = _HEADER.size

    def __init__(self, max_entries: int = 50_000_000) -> None:
        super().__init__(max_entries)
        self.header: SnapshotHeader | None = None
        self._dirs: set[int] = set()
        self._parser: EntryParser | None = None

    def feed(self, data: bytes | memoryview) -> Iterator[Entry]:
        return (Entry(*row) for row in self.feed_rows(data))

    def feed_rows(self, data: bytes | memoryview) -> list[Row]:
        """The entries completed by one more chunk of the compressed stream, as ``Row``s.

        Raises:
            WireError: the stream is malformed or hostile (see the class docstring).
        """
        rows: list[Row] = []
        for _ in self._inflated(data):
            self._drain_rows(rows)
        return rows

    def feed_into(self, data: bytes | memoryview, parser: EntryParser) -> None:
        """Hand the entries completed by one more chunk to ``parser`` (the same one for every
        chunk of the stream; it raises WireError for a malformed or hostile entry)."""
        self._parser = parser
        for _ in self._inflated(data):
            self._drain_parsed(parser)

    def finish(self) -> SnapshotHeader:
        """Call after the last chunk; raises WireError if the stream was cut short."""
        self._finish()
        assert self.header is not None
        return self.header

    def _drain_rest(self) -> None:
        seen = self._seen
        rows: list[Row] = []
        if self._parser is not None:
            self._drain_parsed(self._parser)
        else:
            self._drain_rows(rows)
        if rows or self._seen != seen:  # zlib held output back after the last chunk
            raise WireError("snapshot entries after the last chunk")

    def _drain_parsed(self, parser: EntryParser) -> None:
        """``_drain_rows`` with the entries parsed (and checked) by ``parser``."""
        pos = self._start()
        if pos is None:
            return
        assert self.header is not None and self._count is not None
        pos, self._seen = parser.parse(self._buf, pos, self._count, self._seen,
                                       self.header.root_id)
        if self._seen == self._count:
            pos = self._trailer(pos)
        del self._buf[:pos]

    def _parse_header(self, buf: bytearray) -> int:
        count: int
        magic, ver, gen, root, count = _HEADER.unpack_from(buf, 0)
        if magic != _MAGIC_HEAD or ver != FORMAT_VERSION:
            raise WireError(f"not a v{FORMAT_VERSION} snapshot (magic {magic!r}, version {ver})")
        if count < 1 or count > self._max_items or root < MIN_FILE_ID:
            raise WireError(f"absurd snapshot header: count={count} root={root}")
        self.header = SnapshotHeader(gen, root, count)
        return count

    def _drain_rows(self, rows: list[Row]) -> None:
        """Append every whole entry in ``_buf`` to ``rows``, validated; keep the rest.

        One flat loop with the checks inlined: at a million entries each function call
        per entry costs about 0.1 s.
        """
        pos = self._start()
        if pos is None:
            return
        assert self.header is not None and self._count is not None
        buf, count, seen, dirs = self._buf, self._count, self._seen, self._dirs
        unpack, fixed, end_buf = _ENTRY.unpack_from, _ENTRY.size, len(buf)
        append = rows.append
        try:
            if seen == 0 and end_buf - pos >= fixed:
                parsed = _parse_entry(buf, pos)
                if parsed is None:
                    return
                root, pos = parsed
                _check_attrs(root)
                if (root.file_id != self.header.root_id or root.parent_id != 0 or root.name
                        or not root.is_dir):
                    raise WireError("the first entry must be the root directory")
                dirs.add(root.file_id)
                append((root.file_id, 0, root.mode, root.size, root.mtime_ns, root.nlink,
                        root.version, b"", b""))
                seen = 1
            while seen < count and end_buf - pos >= fixed:
                fid, parent, mode, size, mtime, nlink, ver, nlen, tlen = unpack(buf, pos)
                start = pos + fixed
                end = start + nlen + tlen
                if nlen > NAME_MAX or tlen > TARGET_MAX:
                    raise WireError(f"over-long name ({nlen}) or target ({tlen})")
                if end > end_buf:
                    break
                name = bytes(buf[start : start + nlen])
                kind = mode & 0o170000
                if tlen:
                    target = bytes(buf[start + nlen : end])
                    if kind != stat.S_IFLNK or b"\0" in target:
                        raise WireError(f"entry {fid:x}: bad symlink target")
                else:
                    target = b""
                    if kind == stat.S_IFLNK:
                        raise WireError(f"entry {fid:x}: bad symlink target")
                if kind not in _ALLOWED_TYPES:
                    raise WireError(f"entry {fid:x}: unsupported file type {mode:o}")
                if fid < MIN_FILE_ID:
                    raise WireError(f"entry id {fid} below {MIN_FILE_ID}")
                if size < 0 or size > 2**62:
                    raise WireError(f"entry {fid:x}: absurd size {size}")
                if not nlen or b"/" in name or b"\0" in name or name in (b".", b".."):
                    validate_name(name)
                if parent not in dirs:
                    raise WireError(f"entry {name[:40]!r}: parent {parent:x} not seen yet")
                if kind == stat.S_IFDIR:
                    if fid in dirs:
                        raise WireError(f"directory {fid:x} listed twice (a cycle)")
                    dirs.add(fid)
                append((fid, parent, mode, size, mtime, nlink, ver, name, target))
                seen += 1
                pos = end
            if seen == count:
                pos = self._trailer(pos)
        finally:
            self._seen = seen
        del buf[:pos]


class ChangesDecoder(_StreamDecoder[Upsert | Remove]):
    """Incremental, validating decoder of a changes answer: feed chunks, get records.

    ``feed`` yields ``Upsert`` and ``Remove`` records in order. It rejects unknown magic or
    version, ``from > to`` (or records when ``from == to``), unknown record types, ids
    below MIN_FILE_ID, names with ``/`` or NUL, ``.``/``..``, over-long names or targets,
    file types other than dir/file/symlink, the root id anywhere but as the root itself
    (parent 0, empty name, a directory), parent 0 for anything else, and truncated or
    over-long streams. Whether a parent exists and is a directory, and that the result
    has no cycles, depends on the spoke's namespace: its applier checks those.
    """

    _what = "changes"
    _header_size = _CHANGES_HEADER.size

    def __init__(self, max_records: int = 50_000_000) -> None:
        super().__init__(max_records)
        self.header: ChangesHeader | None = None

    def feed(self, data: bytes | memoryview) -> Iterator[Upsert | Remove]:
        return self._feed(data)

    def finish(self) -> ChangesHeader:
        """Call after the last chunk; raises WireError if the stream was cut short."""
        self._finish()
        assert self.header is not None
        return self.header

    def _parse_header(self, buf: bytearray) -> int:
        count: int
        magic, ver, since, to, root, count = _CHANGES_HEADER.unpack_from(buf, 0)
        if magic != _MAGIC_CHANGES or ver != FORMAT_VERSION:
            raise WireError(f"not v{FORMAT_VERSION} changes (magic {magic!r}, version {ver})")
        if (count > self._max_items or root < MIN_FILE_ID or since > to
                or (since == to and count)):
            raise WireError(f"absurd changes header: from={since} to={to} count={count} "
                            f"root={root}")
        self.header = ChangesHeader(since, to, root, count)
        return count

    def _parse_item(self, buf: bytearray, pos: int) -> tuple[Upsert | Remove, int] | None:
        if len(buf) - pos < 1:
            return None
        kind = buf[pos]
        if kind == CHANGE_UPSERT:
            parsed = _parse_entry(buf, pos + 1)
            if parsed is None:
                return None
            self._check_upsert(parsed[0])
            return Upsert(parsed[0]), parsed[1]
        if kind == CHANGE_REMOVE:
            if len(buf) - pos < _REMOVE.size:
                return None
            _, parent, nlen = _REMOVE.unpack_from(buf, pos)
            if nlen > NAME_MAX:
                raise WireError(f"over-long name ({nlen})")
            end = pos + _REMOVE.size + nlen
            if end > len(buf):
                return None
            name = bytes(buf[pos + _REMOVE.size : end])
            validate_name(name)
            if parent < MIN_FILE_ID:
                raise WireError(f"remove {name[:40]!r}: parent id {parent} below {MIN_FILE_ID}")
            return Remove(parent, name), end
        raise WireError(f"unknown change record type {kind}")

    def _check_upsert(self, e: Entry) -> None:
        assert self.header is not None
        _check_attrs(e)
        if e.file_id == self.header.root_id or e.parent_id == 0:
            if e.file_id != self.header.root_id or e.parent_id != 0 or e.name or not e.is_dir:
                raise WireError("only the root directory has parent 0 and no name")
            return
        validate_name(e.name)
        if e.parent_id < MIN_FILE_ID:
            raise WireError(f"entry {e.name[:40]!r}: parent id {e.parent_id} below {MIN_FILE_ID}")
