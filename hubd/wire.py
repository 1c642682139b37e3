"""The hubd <-> spokefs wire protocol, version 1: paths, headers and the snapshot format.

This module uses the standard library only and is the one hubd module spokefs imports.

Routes (every route but /healthz and /metrics needs the bearer token when one is set):

| request                              | answer                                                    |
| ------------------------------------ | --------------------------------------------------------- |
| GET /v1/snapshot                     | 200, the namespace (format below), ``SNAPSHOT_MEDIA_TYPE`` |
| GET /v1/blob/{file_id}/{version}     | 206 + Content-Range (with ``Range``) or 200 (without);     |
|                                      | 404 unknown file, 412 version not current, 416 bad range   |
| POST /v1/pack                        | 200, whole small files in one answer (format below)        |
| GET /healthz                         | 200 ``ok``                                                 |

``file_id`` and ``version`` are unsigned 64-bit numbers written as 16 lowercase hex digits.
Blob answers carry ``ETag: "<file_id>-<version>"``, an immutable ``Cache-Control`` (the URL
names one version, so its bytes never change) and ``X-Spokefs-XXH3``: the xxh3_64 of the
body, so a spoke can verify bytes end to end before it caches them.

Errors are ``{"error": "<machine-readable reason>", "detail": "<one line>"}`` as JSON with a
4xx status; the reason is also in the ``X-Spokefs-Error`` header.

Snapshot format: one zlib stream (RFC 1950) whose plain bytes are
``HEADER, ENTRY * count, TRAILER`` (all little endian):

- HEADER  ``<4sHQQQ``: magic ``SPKS``, format version 1, generation, root id, entry count.
- ENTRY   ``<QQIQqIQHH`` then name bytes then target bytes: id, parent id, st_mode, size,
  mtime_ns, nlink, version, name length, target length. The root comes first with parent 0
  and an empty name; every other entry's parent is a directory that came before it, so the
  tree has no cycles. A file with several hard links appears once per link, with one id.
- TRAILER ``<4sQ``: magic ``SPKE``, entry count again (detects a truncated stream).

Pack (many small files in one round trip; a shuffled pass over small files would otherwise
cost one RTT per file): the request body is ``<QQ`` (file id, version) per file, at most
``MAX_PACK_FILES`` of them, ``Content-Type: application/octet-stream``. The answer is, per
requested file in request order, ``PACK_RECORD`` (file id, version, length, xxh3_64 of the
bytes) then ``length`` bytes; length ``PACK_GONE`` (-1) means that version is no longer
current (or the id is unknown) and no bytes follow. The files' sizes must add up to at most
``MAX_RANGE_BYTES``, else 413 ``pack-too-large``; a malformed body is 400 ``bad-pack``.
"""

from __future__ import annotations

import stat
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

API_VERSION = 1
SNAPSHOT_PATH = "/v1/snapshot"
BLOB_PATH = "/v1/blob/{file_id}/{version}"
HEALTH_PATH = "/healthz"
METRICS_PATH = "/metrics"

SNAPSHOT_MEDIA_TYPE = "application/vnd.spokefs.snapshot.v1+zlib"
HEADER_CHECKSUM = "X-Spokefs-XXH3"
HEADER_ERROR = "X-Spokefs-Error"
HEADER_GENERATION = "X-Spokefs-Generation"

# A spoke asks for at most this many bytes in one range; hubd answers 416 above it, which
# bounds hubd's memory to max_concurrent_reads x MAX_RANGE_BYTES.
MAX_RANGE_BYTES = 16 * 1024 * 1024

PACK_PATH = "/v1/pack"
MAX_PACK_FILES = 4096
PACK_GONE = -1
PACK_ITEM = struct.Struct("<QQ")
PACK_RECORD = struct.Struct("<QQqQ")

MIN_FILE_ID = 2  # FUSE reserves inode 1 for the root, 0 is invalid
U64_MAX = 2**64 - 1
NAME_MAX = 255  # bytes, as on Linux filesystems
TARGET_MAX = 4095  # PATH_MAX - 1

_HEADER = struct.Struct("<4sHQQQ")
_ENTRY = struct.Struct("<QQIQqIQHH")
_TRAILER = struct.Struct("<4sQ")
_MAGIC_HEAD = b"SPKS"
_MAGIC_TAIL = b"SPKE"
_ALLOWED_TYPES = (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK)


class WireError(ValueError):
    """Data from the other side breaks the protocol (truncated, hostile or malformed)."""


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


@dataclass(frozen=True, slots=True)
class SnapshotHeader:
    generation: int
    root_id: int
    count: int


def format_id(value: int) -> str:
    """A file id or version as it appears in a URL."""
    return f"{value:016x}"


def parse_id(text: str) -> int:
    """Parse a URL id; raises WireError unless it is exactly 16 lowercase hex digits."""
    if len(text) != 16 or text.strip("0123456789abcdef"):
        raise WireError(f"bad id {text[:40]!r}: want 16 lowercase hex digits")
    return int(text, 16)


def blob_path(file_id: int, version: int) -> str:
    return BLOB_PATH.format(file_id=format_id(file_id), version=format_id(version))


def etag(file_id: int, version: int) -> str:
    return f'"{format_id(file_id)}-{format_id(version)}"'


# -- encoding (hubd) ---------------------------------------------------------------------


def encode_header(generation: int, root_id: int, count: int) -> bytes:
    return _HEADER.pack(_MAGIC_HEAD, API_VERSION, generation, root_id, count)


def encode_entry(e: Entry) -> bytes:
    fixed = _ENTRY.pack(
        e.file_id, e.parent_id, e.mode, e.size, e.mtime_ns, e.nlink, e.version,
        len(e.name), len(e.target),
    )
    return fixed + e.name + e.target


def encode_trailer(count: int) -> bytes:
    return _TRAILER.pack(_MAGIC_TAIL, count)


def encode_snapshot(generation: int, root_id: int, entries: list[Entry], level: int = 6) -> bytes:
    """The whole compressed snapshot; entries must be in parent-before-child order."""
    comp = zlib.compressobj(level)
    parts = [comp.compress(encode_header(generation, root_id, len(entries)))]
    parts.extend(comp.compress(encode_entry(e)) for e in entries)
    parts.append(comp.compress(encode_trailer(len(entries))))
    parts.append(comp.flush())
    return b"".join(parts)


def encode_pack_record(file_id: int, version: int, data: bytes | None, digest: int) -> bytes:
    if data is None:
        return PACK_RECORD.pack(file_id, version, PACK_GONE, 0)
    return PACK_RECORD.pack(file_id, version, len(data), digest) + data


def encode_pack_request(items: list[tuple[int, int]]) -> bytes:
    return b"".join(PACK_ITEM.pack(fid, ver) for fid, ver in items)


def decode_pack_request(body: bytes) -> list[tuple[int, int]]:
    """The (file id, version) pairs of a pack request; raises WireError if malformed."""
    if not body or len(body) % PACK_ITEM.size or len(body) // PACK_ITEM.size > MAX_PACK_FILES:
        raise WireError(f"a pack body is 1 to {MAX_PACK_FILES} records of {PACK_ITEM.size} bytes")
    return [PACK_ITEM.unpack_from(body, off) for off in range(0, len(body), PACK_ITEM.size)]


def decode_pack(
    body: bytes, items: list[tuple[int, int]]
) -> dict[tuple[int, int], tuple[bytes, int] | None]:
    """Split a pack answer into ``(file id, version) -> (bytes, xxh3_64)``; None: gone.

    Checksums are not verified here (wire.py is stdlib-only; the caller does, with xxhash);
    the structure is: every asked item once, in order, nothing extra.
    """
    out: dict[tuple[int, int], tuple[bytes, int] | None] = {}
    pos = 0
    for fid, ver in items:
        if len(body) - pos < PACK_RECORD.size:
            raise WireError("pack answer cut short")
        rfid, rver, length, digest = PACK_RECORD.unpack_from(body, pos)
        pos += PACK_RECORD.size
        if (rfid, rver) != (fid, ver):
            raise WireError("pack answer out of order")
        if length == PACK_GONE:
            out[(fid, ver)] = None
            continue
        if length < 0 or pos + length > len(body):
            raise WireError("pack answer cut short")
        out[(fid, ver)] = (body[pos : pos + length], digest)
        pos += length
    if pos != len(body):
        raise WireError("data after the pack answer")
    return out


# -- decoding (spokefs) ------------------------------------------------------------------


def validate_name(name: bytes) -> None:
    if not name or len(name) > NAME_MAX:
        raise WireError(f"bad name length {len(name)}")
    if b"/" in name or b"\0" in name or name in (b".", b".."):
        raise WireError(f"bad name {name[:40]!r}")


class SnapshotDecoder:
    """Incremental, validating decoder: feed compressed chunks, get entries.

    It rejects what a hostile or broken hub could send: unknown magic or version, ids below
    MIN_FILE_ID, names with ``/`` or NUL, ``.``/``..``, over-long names or targets, file
    types other than dir/file/symlink, a parent that is not an earlier directory (which
    rules out cycles), a directory listed twice, and truncated or over-long streams.
    A name listed twice in one directory is caught by the spoke's namespace loader.
    """

    def __init__(self, max_entries: int = 50_000_000) -> None:
        self._z = zlib.decompressobj()
        self._buf = bytearray()
        self._max_entries = max_entries
        self.header: SnapshotHeader | None = None
        self._seen = 0
        self._dirs: set[int] = set()
        self.done = False

    def feed(self, data: bytes) -> Iterator[Entry]:
        plain = self._z.decompress(data)
        if self.done:
            if plain or self._z.unused_data:
                raise WireError("data after the snapshot trailer")
            return
        self._buf += plain
        yield from self._drain()

    def finish(self) -> SnapshotHeader:
        """Call after the last chunk; raises WireError if the stream was cut short."""
        self._buf += self._z.flush()
        list(self._drain())
        if not self.done or not self._z.eof or self.header is None:
            raise WireError("snapshot stream ended early (truncated)")
        if self._z.unused_data:
            raise WireError("data after the snapshot stream")
        return self.header

    def _drain(self) -> Iterator[Entry]:
        pos = 0
        buf = self._buf
        if self.header is None:
            if len(buf) < _HEADER.size:
                return
            magic, ver, gen, root, count = _HEADER.unpack_from(buf, 0)
            if magic != _MAGIC_HEAD or ver != API_VERSION:
                raise WireError(f"not a v{API_VERSION} snapshot (magic {magic!r}, version {ver})")
            if count < 1 or count > self._max_entries or root < MIN_FILE_ID:
                raise WireError(f"absurd snapshot header: count={count} root={root}")
            self.header = SnapshotHeader(gen, root, count)
            pos = _HEADER.size
        count = self.header.count
        while not self.done:
            if self._seen == count:
                if len(buf) - pos < _TRAILER.size:
                    break
                magic, n = _TRAILER.unpack_from(buf, pos)
                if magic != _MAGIC_TAIL or n != count:
                    raise WireError("bad snapshot trailer")
                pos += _TRAILER.size
                self.done = True
                if pos != len(buf):
                    raise WireError("data after the snapshot trailer")
                break
            if len(buf) - pos < _ENTRY.size:
                break
            fid, parent, mode, size, mtime, nlink, ver, nlen, tlen = _ENTRY.unpack_from(buf, pos)
            end = pos + _ENTRY.size + nlen + tlen
            if end > len(buf):
                if nlen > NAME_MAX or tlen > TARGET_MAX:
                    raise WireError(f"over-long name ({nlen}) or target ({tlen})")
                break
            name = bytes(buf[pos + _ENTRY.size : pos + _ENTRY.size + nlen])
            target = bytes(buf[pos + _ENTRY.size + nlen : end])
            pos = end
            entry = Entry(fid, parent, mode, size, mtime, nlink, ver, name, target)
            self._check(entry)
            self._seen += 1
            yield entry
        del buf[:pos]

    def _check(self, e: Entry) -> None:
        assert self.header is not None
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
        if self._seen == 0:
            if e.file_id != self.header.root_id or e.parent_id != 0 or e.name or not e.is_dir:
                raise WireError("the first entry must be the root directory")
        else:
            validate_name(e.name)
            if e.parent_id not in self._dirs:
                raise WireError(f"entry {e.name[:40]!r}: parent {e.parent_id:x} not seen yet")
        if e.is_dir:
            if e.file_id in self._dirs:
                raise WireError(f"directory {e.file_id:x} listed twice (a cycle)")
            self._dirs.add(e.file_id)
