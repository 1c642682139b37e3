"""The hubd <-> spokefs wire protocol, version 2: paths, headers, the framed blob
representation, deterministic packs, and the snapshot, pack and changes formats.

This module uses the standard library only and is the one hubd module spokefs imports.

Routes (every route but /healthz and /metrics needs the bearer token when one is set):

| request                                   | answer                                              |
| ----------------------------------------- | --------------------------------------------------- |
| GET /v2/snapshot                          | 200, the namespace (below), ``SNAPSHOT_MEDIA_TYPE`` |
| GET /v2/changes?since=G                   | 200, the changes from generation G to the current   |
|                                           | one (below), ``CHANGES_MEDIA_TYPE``; 410            |
|                                           | ``generation-gone`` if G is unknown or too old      |
|                                           | (take a snapshot), 400 ``bad-generation`` if G is   |
|                                           | malformed or newer than the current generation      |
| GET /v2/blob/{file_id}/{version}          | the file's *framed* representation (below): 206 +   |
|                                           | Content-Range with ``Range``, 200 whole without,    |
|                                           | whatever the size; 404 unknown file, 412 that       |
|                                           | version is not on disk (any more, or yet), 416      |
|                                           | range outside the representation                    |
| GET /v2/pack/{dir_id}/{index}/{digest}    | 200, pack ``index`` of the directory (below); 404   |
|                                           | unknown directory, 412 ``stale-version`` when the   |
|                                           | directory's packs no longer match ``digest``        |
| GET /v1/... (any path)                    | 400 ``protocol-version``: this hub speaks v2 only   |
| GET /healthz                              | 200 ``ok``                                          |

``file_id``, ``version`` and ``dir_id`` are unsigned 64-bit numbers written as 16 lowercase
hex digits; ``index`` is decimal; ``digest`` is 16 lowercase hex digits.

Protocol versions: every data route carries the version in its path. A v1 spoke against
this hub gets 400 ``protocol-version`` ("hub speaks protocol v2 ...") for every v1 route; a
v2 spoke against a v1 hub gets 404 for ``/v2/snapshot`` and fails its mount with one line
naming both versions. Neither side can read the other's bytes as its own.

Why a version 2 (a regional HTTP cache between spokes and the hub)
------------------------------------------------------------------

v1 put the xxh3 of each *answer's body* in a header. An HTTP cache with nginx's slice module
answers a range from slices it fetched for other ranges and replays the header of one of
them, so the checksum never matched and the spoke failed the read. v2 makes every byte of
every answer a pure function of its URL and offset, so any cache may store, split and join
them, and the spoke still verifies every byte before it stores it:

- **Framed blobs.** A blob URL serves the file as frames: each ``FRAME_DATA_BYTES`` (4 KiB,
  the spoke cache's block) of data followed by ``FRAME_SUM`` (8 bytes): the xxh3_64 of that
  data seeded with ``frame_seed(file_id, version, frame index)``; the last frame holds the
  rest of the file (1 to 4096 bytes) and its sum. A file of ``size`` bytes is
  ``framed_size(size)`` bytes framed (0.2 % more). The sum travels with its frame, so the
  first verified byte costs no extra round trip (a separate sums URL would need one, or a
  hub that reads a whole multi-GiB file before answering), the hub computes the sums while
  it streams, and a slice that lands at the wrong offset or under the wrong URL fails its
  seeded sum. The alternative that lost: an immutable per-file sums URL fetched beside the
  first range (one more request per file, and a whole-file read on the hub before its
  first answer).
- **Why 4 KiB frames.** Frames of 64 KiB (the spoke's chunk) would make every random 4 KiB
  read move 64 KiB, 16 times what it asked for: the cache's per-block presence map exists
  to avoid exactly that. 4 KiB frames cost 0.2 % of the bytes, and checking them in Python
  (one seeded xxh3 and one slice per frame) runs at ~3.9 GB/s on one core of the CI
  machine (framing on the hub at ~2 GB/s): 3 % of a core at 1 Gbit/s.
- **Slices.** ``SLICE_BYTES`` (256 frames, 1,050,624 bytes of representation, 1 MiB of
  data) is the grid a tier's cache is configured with (nginx: ``slice 1050624;``). Spokes
  that read through a tier start and end every range on that grid (or at the end of the
  representation), so a slice cache serves them from whole cached slices; straight to the
  hub they use the frame grid (a random 4 KiB read moves 4 KiB, not 1 MiB).
- **Any size whole.** A blob GET without ``Range`` streams the whole representation (the
  hub reads and frames it a slice at a time, within one read slot), so a cache can fill
  itself from a plain GET.
- **Immutable answers.** Blob and pack answers carry ``Cache-Control: public,
  max-age=31536000, immutable`` and an ETag (``etag``, ``pack_etag``) that names the
  content: the URL names one file version (or one list of file versions), so its bytes
  never change. nginx's slice module refuses slices whose ETags disagree.
- **Deterministic packs.** Small files are fetched many to a request, as ``GET`` of a URL
  that every spoke computes alike from the namespace: ``plan_packs`` cuts a directory's
  regular files of 1 byte to ``PACK_FILE_MAX_BYTES``, in name order (bytes), greedily into
  packs of at most ``PACK_MAX_BYTES`` and ``MAX_PACK_FILES`` files (a file listed under
  two names in one directory counts once, under its first name). A pack's URL names the
  directory, the pack's place in it and ``pack_digest`` of its members' (id, version), so
  it is immutable; the hub recomputes the directory's packs from its own snapshot and
  answers 412 when the digest no longer matches (the spoke's namespace is behind or
  ahead). A spoke fetches a small file through its pack, not alone (only with read-ahead
  off, ``--no-prefetch``, does a miss fetch just its file, as a blob), so a region's caches
  see each small file under one URL.
- **Snapshot and changes** stay uncacheable (``no-cache``: their URLs name no generation);
  spokes ask the hub itself for them even when they read data through a tier.

Errors are ``{"error": "<machine-readable reason>", "detail": "<one line>"}`` as JSON with a
4xx status; the reason is also in the ``X-Spokefs-Error`` header.

Snapshot format: one zlib stream (RFC 1950) whose plain bytes are
``HEADER, ENTRY * count, TRAILER`` (all little endian):

- HEADER  ``<4sHQQQ``: magic ``SPKS``, format version 1 (``FORMAT_VERSION``), generation,
  root id, entry count.
- ENTRY   ``<QQIQqIQHH`` then name bytes then target bytes: id, parent id, st_mode, size,
  mtime_ns, nlink, version, name length, target length. The root comes first with parent 0
  and an empty name; every other entry's parent is a directory that came before it, so the
  tree has no cycles. A file with several hard links appears once per link, with one id.
- TRAILER ``<4sQ``: magic ``SPKE``, entry count again (detects a truncated stream).

Pack answer (many small files in one round trip; a shuffled pass over small files would
otherwise cost one RTT per file): per member of the pack, in ``plan_packs`` order,
``PACK_RECORD`` (file id, version, length, xxh3_64 of the bytes) then ``length`` bytes;
length ``PACK_GONE`` (-1) means that version is no longer readable on the hub (the file
changed or went away on disk since the hub's snapshot) and no bytes follow. A member's
version names its bytes, so a gone version stays gone: the answer may be cached.

Snapshot and changes answers carry ``X-Spokefs-Generation``: the generation they describe.

Changes format (``GET /v2/changes?since=G``, G in decimal): one zlib stream whose plain
bytes are ``HEADER, RECORD * count, TRAILER`` (little endian):

- HEADER  ``<4sHQQQQ``: magic ``SPKC``, format version 1 (``FORMAT_VERSION``), from
  generation (G), to generation (the current one), root id, record count. ``from == to``
  has no records.
- RECORD  a type byte, then:
  - ``CHANGE_UPSERT`` (1): one ENTRY exactly as in a snapshot (fixed part, name, target).
    It sets the directory entry (parent id, name) to that entry: it creates the name, or
    updates the attributes of the same id under that name. The root's attributes come as
    an UPSERT with parent 0 and an empty name.
  - ``CHANGE_REMOVE`` (2): ``<QH`` parent id, name length, then the name. It unlinks
    exactly that one directory entry and nothing else: it is never recursive.
- TRAILER ``<4sQ``: magic ``SPKE``, record count again.

Applying the records in order to the namespace of generation ``from`` gives exactly the
namespace of generation ``to``:

- One generation step lists its REMOVEs first, children before their parents, then its
  UPSERTs, parents before children (a new directory before its contents). An answer that
  spans several generations is those steps back to back, so a later step may UPSERT what
  an earlier one removed: apply the records strictly in order.
- A directory's contents are keyed by its id. A renamed or moved directory (same id) is
  one REMOVE of the old name and one UPSERT of the new one; its contents are not listed.
  A deleted directory is a REMOVE of every entry below it, deepest first, then of its own
  name: so a spoke must NOT drop a subtree on a REMOVE (that would empty renamed
  directories); once the records are applied, a directory id that no name refers to is
  empty and can be forgotten.
- A name whose entry was replaced by another id or another file type (a file replaced
  by a directory, a file swapped in by rename) is a REMOVE then an UPSERT: an UPSERT never
  changes the id or the file type behind an existing name. Ids are inode hashes, and
  filesystems reuse the numbers of deleted inodes: a file deleted and another created may
  look like a rename or a rewrite in place (always with a new version, so no cached byte
  is reused); a directory's id may come back as a file's after a REMOVE, and vice versa.
- A file whose bytes or attributes changed (size, mtime, version, mode, nlink) is an
  UPSERT of each of its names.

Replicas: several hubd processes may export one tree (the same directory, or one NFS export
mounted on several machines: any POSIX filesystem a site shares). They do not talk to each
other; these rules make them interchangeable for a spoke:

- Ids and versions depend only on what every replica sees alike. A file id is the xxh64 of
  the inode number and of the path below ROOT where the inode's filesystem is mounted
  (empty for ROOT's own filesystem), never ``st_dev``, which differs between machines for
  one NFS export; so hard links share an id on every replica, and equal inode numbers on
  two filesystems below ROOT get different ids. A version is the xxh64 of (size, mtime_ns,
  inode). (hubd/scan.py.)
- A generation is a function of the snapshot's entries: the newest mtime among them in
  milliseconds, shifted left 20 bits, plus 20 bits of the xxh3_64 of the entries' encoding
  (hubd/export_root.py, ``generation_of``). Two replicas, or one hub before and after a
  restart, that list the same entries give them the same generation whenever each scanned,
  and an unchanged tree keeps its generation across restarts. Generations still only grow:
  a change that does not move the newest mtime forward (a chmod, an mtime set into the
  past) gets the previous generation's millisecond plus one, with the new entries' 20 bits;
  a replica that did not scan the same sequence of trees may then number that tree
  differently, until the next ordinary change. So one number names one tree on every
  replica, except that two different trees of the same newest millisecond may share their
  20 hash bits (about 1 in 10^6).
- ``/v2/changes?since=G`` is answered only from a generation this hub itself numbered and
  keeps: a replica that never saw G answers 410 (take a snapshot), never a guess. G newer
  than the hub's own generation is 400 ``bad-generation``: this replica is behind the one
  the spoke last polled (or numbered a tree differently, as above).
- A blob is served when the file on disk has the asked version, whether or not the hub's
  snapshot lists that version yet (the disk check, before and after the read, is what
  makes every answer right): a replica one rescan behind its peer serves the versions its
  peer listed, for every file whose path it knows. A file it does not list yet is 404
  until its next rescan. (A pack is named by its directory's digest, which depends on the
  listing: a replica whose listing of that directory differs answers 412, and the spoke
  asks the other hubs, or reads the files alone.)
- A spoke with several hub URLs (spokefs/hub_origins.py) sends each request to the one in
  use, moves to the next on a connection failure, 5xx or timeout, and probes the first one
  until it can move back; its namespace goes on from the same generation on the new hub.
  A 400 to ``/v2/changes`` does not take it back in time: it keeps its newer namespace
  (for up to 300 s, then that hub's snapshot). A 404/412 is asked again of every other
  reachable hub, and while a hub is unreachable it is retried within the read's deadline
  (the hub that is up may rescan, the other may return) before it becomes ESTALE.
"""

from __future__ import annotations

import hashlib
import stat
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

API_VERSION = 2
FORMAT_VERSION = 1  # of the snapshot and changes streams, unchanged since protocol v1
SNAPSHOT_PATH = "/v2/snapshot"
BLOB_PATH = "/v2/blob/{file_id}/{version}"
PACK_PATH = "/v2/pack/{dir_id}/{index}/{digest}"
CHANGES_PATH = "/v2/changes"
OLD_PATHS = "/v1/{tail:.*}"  # protocol v1's routes, all answered 400 ``protocol-version``
HEALTH_PATH = "/healthz"
METRICS_PATH = "/metrics"

SNAPSHOT_MEDIA_TYPE = "application/vnd.spokefs.snapshot.v1+zlib"
HEADER_ERROR = "X-Spokefs-Error"
HEADER_GENERATION = "X-Spokefs-Generation"
ERROR_PROTOCOL_VERSION = "protocol-version"

# A spoke asks for at most this many bytes of data in one range (hubd streams any range,
# a slice at a time, so this bounds only the spoke's own request and RAM).
MAX_RANGE_BYTES = 16 * 1024 * 1024

CHANGES_MEDIA_TYPE = "application/vnd.spokefs.changes.v1+zlib"
CHANGE_UPSERT = 1
CHANGE_REMOVE = 2

# -- framed blobs (see "Why a version 2") --
FRAME_DATA_BYTES = 4096  # = the spoke cache's block (see "Why 4 KiB frames")
FRAME_SUM = struct.Struct("<Q")
FRAME_BYTES = FRAME_DATA_BYTES + FRAME_SUM.size
SLICE_FRAMES = 256
SLICE_BYTES = SLICE_FRAMES * FRAME_BYTES  # 1,050,624: a tier's cache slice (nginx `slice`)
SLICE_DATA_BYTES = SLICE_FRAMES * FRAME_DATA_BYTES  # 1 MiB of file data per slice

# -- deterministic packs --
MAX_PACK_FILES = 4096
# File bytes per pack: as spokefs's PrefetchConfig.request_bytes, a little under 4 MiB so a
# pack and its headers fit one 4 MiB TCP window (one round trip even at 900 ms; 2 MiB packs
# needed twice the connections, each 1.5 RTT to open). A reader waiting for one member gets
# it as it streams in, not at the pack's end.
PACK_MAX_BYTES = 4 * 1024 * 1024 - 256 * 1024
PACK_FILE_MAX_BYTES = 1024 * 1024  # larger files are read as blobs
PACK_GONE = -1
PACK_ITEM = struct.Struct("<QQ")
PACK_RECORD = struct.Struct("<QQqQ")
_PACK_DIGEST_BYTES = 8

MIN_FILE_ID = 2  # FUSE reserves inode 1 for the root, 0 is invalid
U64_MAX = 2**64 - 1
NAME_MAX = 255  # bytes, as on Linux filesystems
TARGET_MAX = 4095  # PATH_MAX - 1

_HEADER = struct.Struct("<4sHQQQ")
_ENTRY = struct.Struct("<QQIQqIQHH")
_TRAILER = struct.Struct("<4sQ")
_CHANGES_HEADER = struct.Struct("<4sHQQQQ")
_REMOVE = struct.Struct("<BQH")  # type, parent id, name length
_MAGIC_HEAD = b"SPKS"
_MAGIC_CHANGES = b"SPKC"
_MAGIC_TAIL = b"SPKE"
_ALLOWED_TYPES = (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK)
# Plain bytes inflated per step while decoding: zlib expands up to ~1000:1, so a hostile
# stream could otherwise turn one 1 MiB chunk into 1 GiB in one call.
_PLAIN_STEP = 1 << 20


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
    """The ETag of a blob answer: one file version in the v2 (framed) representation."""
    return f'"{format_id(file_id)}-{format_id(version)}-f{API_VERSION}"'


# -- framed blobs ------------------------------------------------------------------------


def framed_size(size: int) -> int:
    """The length of the framed representation of ``size`` bytes of data; also the framed
    offset of a data offset that lies on a frame boundary."""
    return size + -(-size // FRAME_DATA_BYTES) * FRAME_SUM.size


def frame_seed(file_id: int, version: int, index: int) -> int:
    """The xxh3 seed of frame ``index`` of a file version: a frame served at another offset
    or for another file fails its sum (odd multipliers keep distinct inputs apart)."""
    return (file_id * 0x9E3779B97F4A7C15 + version * 0xC2B2AE3D27D4EB4F + index) & U64_MAX


def frames(framed: bytes | memoryview) -> Iterator[tuple[memoryview, int]]:
    """``(data, sum)`` of each frame of a framed body that starts on a frame boundary;
    the last frame may be short (the end of the file).

    Raises:
        WireError: a frame with no data byte (the body was cut inside a sum).
    """
    view = memoryview(framed)
    unpack = FRAME_SUM.unpack_from
    for pos in range(0, len(view), FRAME_BYTES):
        frame = view[pos : pos + FRAME_BYTES]
        if len(frame) <= FRAME_SUM.size:
            raise WireError(f"a frame of {len(frame)} bytes has no data")
        yield frame[: -FRAME_SUM.size], unpack(frame, len(frame) - FRAME_SUM.size)[0]


# -- deterministic packs -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PackPlan:
    """One pack of a directory.

    Attributes:
        dir_id: the directory.
        index: the pack's place among the directory's packs.
        members: ``(file_id, version, size)`` of each file, in name order.
        digest: ``pack_digest`` of the members.
    """

    dir_id: int
    index: int
    members: tuple[tuple[int, int, int], ...]
    digest: str

    @property
    def path(self) -> str:
        return PACK_PATH.format(dir_id=format_id(self.dir_id), index=self.index,
                                digest=self.digest)

    @property
    def file_bytes(self) -> int:
        return sum(m[2] for m in self.members)

    @property
    def items(self) -> list[tuple[int, int]]:
        return [(fid, ver) for fid, ver, _ in self.members]


def packable(size: int) -> bool:
    """Whether a regular file of ``size`` bytes is read through its directory's packs."""
    return 0 < size <= PACK_FILE_MAX_BYTES


def pack_digest(members: Iterable[tuple[int, int, int]]) -> str:
    data = b"".join(PACK_ITEM.pack(fid, ver) for fid, ver, _ in members)
    return hashlib.blake2b(data, digest_size=_PACK_DIGEST_BYTES).hexdigest()


def pack_etag(digest: str) -> str:
    return f'"pack-{digest}"'


def plan_packs(dir_id: int, files: Iterable[tuple[bytes, int, int, int]]) -> list[PackPlan]:
    """The packs of a directory, from ``(name, file_id, version, size)`` of its regular files
    (any order): the packable ones in name order, cut greedily at ``PACK_MAX_BYTES`` and
    ``MAX_PACK_FILES``. Hub and spokes call this on the same namespace and get the same
    packs, hence the same URLs."""
    seen: set[int] = set()
    packs: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    nbytes = 0
    for _name, fid, ver, size in sorted(files):
        if not packable(size) or fid in seen:
            continue
        seen.add(fid)
        if current and (nbytes + size > PACK_MAX_BYTES or len(current) == MAX_PACK_FILES):
            packs.append(current)
            current, nbytes = [], 0
        current.append((fid, ver, size))
        nbytes += size
    if current:
        packs.append(current)
    return [PackPlan(dir_id, i, tuple(m), pack_digest(m)) for i, m in enumerate(packs)]


def parse_pack_index(text: str) -> int:
    """A pack index from a URL; raises WireError unless it is canonical decimal (no leading
    zero: one pack, one URL) of at most 10 digits."""
    if not text.isascii() or not text.isdigit() or len(text) > 10 or text != str(int(text)):
        raise WireError(f"bad pack index {text[:40]!r}: want a decimal number")
    return int(text)


def parse_digest(text: str) -> str:
    if len(text) != 2 * _PACK_DIGEST_BYTES or text.strip("0123456789abcdef"):
        raise WireError(f"bad pack digest {text[:40]!r}: want 16 lowercase hex digits")
    return text


# -- encoding (hubd) ---------------------------------------------------------------------


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


def encode_snapshot(generation: int, root_id: int, entries: list[Entry], level: int = 6) -> bytes:
    """The whole compressed snapshot; entries must be in parent-before-child order."""
    comp = zlib.compressobj(level)
    parts = [comp.compress(encode_header(generation, root_id, len(entries)))]
    parts.extend(comp.compress(encode_entry(e)) for e in entries)
    parts.append(comp.compress(encode_trailer(len(entries))))
    parts.append(comp.flush())
    return b"".join(parts)


def encode_upsert(e: Entry) -> bytes:
    """One UPSERT change record."""
    return bytes((CHANGE_UPSERT,)) + encode_entry(e)


def encode_remove(parent_id: int, name: bytes) -> bytes:
    """One REMOVE change record."""
    return _REMOVE.pack(CHANGE_REMOVE, parent_id, len(name)) + name


def encode_changes(from_generation: int, to_generation: int, root_id: int,
                   records: list[bytes], count: int, level: int = 6) -> bytes:
    """The whole compressed changes answer.

    Args:
        records: encoded change records (``encode_upsert``/``encode_remove``), in order,
            possibly several records per item; ``count`` records in all.
    """
    comp = zlib.compressobj(level)
    head = _CHANGES_HEADER.pack(_MAGIC_CHANGES, FORMAT_VERSION, from_generation, to_generation,
                                root_id, count)
    parts = [comp.compress(head)]
    parts.extend(comp.compress(r) for r in records)
    parts.append(comp.compress(encode_trailer(count)))
    parts.append(comp.flush())
    return b"".join(parts)


def encode_pack_record(file_id: int, version: int, data: bytes | None, digest: int) -> bytes:
    if data is None:
        return PACK_RECORD.pack(file_id, version, PACK_GONE, 0)
    return PACK_RECORD.pack(file_id, version, len(data), digest) + data


def decode_pack(
    body: bytes, items: list[tuple[int, int]]
) -> dict[tuple[int, int], tuple[bytes, int] | None]:
    """Split a whole pack answer into ``(file id, version) -> (bytes, xxh3_64)``; None: gone.

    Checksums are not verified here (wire.py is stdlib-only; the caller does, with xxhash);
    the structure is: every asked item once, in order, nothing extra.
    """
    decoder = PackDecoder(items)
    out = dict(decoder.feed(body))
    decoder.finish()
    return out


class PackDecoder:
    """Decodes a pack answer as it streams in: each file is complete as soon as its last
    byte has arrived, so a reader waiting for it need not wait for the rest of the pack.

    ``feed`` returns the records completed by a piece of the body, ``finish`` checks that
    the answer was whole; both raise ``WireError`` on a malformed answer.
    """

    def __init__(self, items: list[tuple[int, int]]) -> None:
        self._items = items
        self._next = 0  # index of the item whose record comes next
        self._buf = bytearray()
        self._record: tuple[int, int, int, int] | None = None  # header of the file under way

    def feed(self, piece: bytes) -> list[tuple[tuple[int, int], tuple[bytes, int] | None]]:
        self._buf += piece
        done: list[tuple[tuple[int, int], tuple[bytes, int] | None]] = []
        while True:
            if self._record is None:
                if len(self._buf) < PACK_RECORD.size:
                    break
                if self._next >= len(self._items):
                    raise WireError("data after the pack answer")
                rfid, rver, length, digest = PACK_RECORD.unpack_from(self._buf)
                del self._buf[: PACK_RECORD.size]
                if (rfid, rver) != self._items[self._next]:
                    raise WireError("pack answer out of order")
                if length != PACK_GONE and length < 0:
                    raise WireError("pack answer with a negative length")
                self._record = (rfid, rver, length, digest)
            rfid, rver, length, digest = self._record
            if length == PACK_GONE:
                done.append(((rfid, rver), None))
            elif len(self._buf) >= length:
                done.append(((rfid, rver), (bytes(self._buf[:length]), digest)))
                del self._buf[:length]
            else:
                break
            self._record = None
            self._next += 1
        return done

    def finish(self) -> None:
        if self._buf and self._next >= len(self._items):
            raise WireError("data after the pack answer")
        if self._next < len(self._items):
            raise WireError("pack answer cut short")


# -- decoding (spokefs) ------------------------------------------------------------------


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

    Two ways to take the entries: ``feed`` yields ``Entry`` objects; ``feed_rows`` returns
    plain tuples in ``Entry``'s field order (``Row``), about twice as fast, for loaders of
    millions of entries. Both run the same validation (``_drain_rows``).
    """

    _what = "snapshot"
    _header_size = _HEADER.size

    def __init__(self, max_entries: int = 50_000_000) -> None:
        super().__init__(max_entries)
        self.header: SnapshotHeader | None = None
        self._dirs: set[int] = set()

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

    def finish(self) -> SnapshotHeader:
        """Call after the last chunk; raises WireError if the stream was cut short."""
        self._finish()
        assert self.header is not None
        return self.header

    def _drain_rest(self) -> None:
        rows: list[Row] = []
        self._drain_rows(rows)
        if rows:  # zlib held output back after the last chunk: it cannot be returned now
            raise WireError("snapshot entries after the last chunk")

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
