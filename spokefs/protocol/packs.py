"""Deterministic packs: the small files of a directory in packs that every hub plans alike
and names by a digest of their members, so one pack has one URL for a regional cache; picks,
the packs of an ordered list (a job's epoch order, a trace), named by their members; the
pack answer's records, and their decoder (docs/protocol.md, "Pack answer", "Picks")."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from spokefs.protocol.base import WireError, format_id, parse_id
from spokefs.protocol.routes import PACK_PATH, PICK_PATH

MAX_PACK_FILES = 4096
# File bytes per pack: as spokefs's PrefetchConfig.request_bytes, a little under 4 MiB so a
# pack and its headers fit one 4 MiB TCP window (one round trip even at 900 ms; 2 MiB packs
# needed twice the connections, each 1.5 RTT to open). A reader waiting for one member gets
# it as it streams in, not at the pack's end.
PACK_MAX_BYTES = 4 * 1024 * 1024 - 256 * 1024
PACK_FILE_MAX_BYTES = 1024 * 1024  # larger files are read as blobs
PICK_MAX_FILES = 64  # members a pick names (34 URL characters each: the URL stays near 2 KiB)
PACK_GONE = -1
PACK_ITEM = struct.Struct("<QQ")
PACK_RECORD = struct.Struct("<QQqQ")
_PACK_DIGEST_BYTES = 8


@dataclass(frozen=True, slots=True)
class PackPlan:
    """One pack of a directory, or a pick (``dir_id`` 0: the members are named in the URL).

    Attributes:
        dir_id: the directory (0 for a pick).
        index: the pack's place among the directory's packs (among the list's, for a pick).
        members: ``(file_id, version, size)`` of each file, in name order (in the list's
            order, for a pick).
        digest: ``pack_digest`` of the members.
    """

    dir_id: int
    index: int
    members: tuple[tuple[int, int, int], ...]
    digest: str

    @property
    def path(self) -> str:
        if not self.dir_id:
            return PICK_PATH.format(members=".".join(
                f"{format_id(fid)}-{format_id(ver)}" for fid, ver, _ in self.members))
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
    packs = _cut(((fid, ver, size) for _name, fid, ver, size in sorted(files)), MAX_PACK_FILES)
    return [PackPlan(dir_id, i, tuple(m), pack_digest(m)) for i, m in enumerate(packs)]


def _cut(files: Iterable[tuple[int, int, int]],
         max_files: int) -> list[list[tuple[int, int, int]]]:
    """The packable files of ``(file_id, version, size)``, each once, in the given order, cut
    greedily at ``PACK_MAX_BYTES`` and ``max_files``."""
    seen: set[int] = set()
    packs: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    nbytes = 0
    for fid, ver, size in files:
        if not packable(size) or fid in seen:
            continue
        seen.add(fid)
        if current and (nbytes + size > PACK_MAX_BYTES or len(current) == max_files):
            packs.append(current)
            current, nbytes = [], 0
        current.append((fid, ver, size))
        nbytes += size
    if current:
        packs.append(current)
    return packs


def plan_picks(files: Iterable[tuple[int, int, int]]) -> list[PackPlan]:
    """The picks of an ordered list, from ``(file_id, version, size)`` in the order a job
    will read them: the packable files, each once, in that order, cut greedily at
    ``PACK_MAX_BYTES`` and ``PICK_MAX_FILES``. Every node that plans the same list gets the
    same URLs (a regional tier keeps each pick once), and a reader waiting for the next
    file of the list finds it in the first pick in flight, not in a directory's pack that
    holds it among thirty others."""
    picks = _cut(files, PICK_MAX_FILES)
    return [PackPlan(0, i, tuple(m), pack_digest(m)) for i, m in enumerate(picks)]


def parse_pick(text: str) -> list[tuple[int, int]]:
    """The ``(file_id, version)`` members a pick URL names: ``ID-VERSION`` joined by ``.``,
    1 to ``PICK_MAX_FILES`` of them, each file once; raises WireError otherwise."""
    parts = text.split(".")
    if not text or len(parts) > PICK_MAX_FILES:
        raise WireError(f"a pick names 1 to {PICK_MAX_FILES} files, not {len(parts)}")
    members: list[tuple[int, int]] = []
    for part in parts:
        fid, dash, ver = part.partition("-")
        if not dash:
            raise WireError(f"bad pick member {part[:40]!r}: want ID-VERSION")
        members.append((parse_id(fid), parse_id(ver)))
    if len({fid for fid, _ in members}) != len(members):
        raise WireError("a pick names a file twice")
    return members


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


def encode_pack_record(file_id: int, version: int, data: bytes | None, digest: int) -> bytes:
    if data is None:
        return PACK_RECORD.pack(file_id, version, PACK_GONE, 0)
    return PACK_RECORD.pack(file_id, version, len(data), digest) + data


Member = tuple[tuple[int, int], tuple[memoryview, int] | None]


class PackDecoder:
    """Decodes a pack answer as it streams in: each file is complete as soon as its last
    byte has arrived, so a reader waiting for it need not wait for the rest of the pack.

    The answer is received in place into one buffer, and ``scan`` returns the members
    completed so far as views of it (no copy: the spoke's hub client, whose staged members
    keep the buffer alive until they are stored). ``finish`` checks that the answer was
    whole; both raise ``WireError`` on a malformed answer.
    """

    def __init__(self, items: list[tuple[int, int]]) -> None:
        self._items = items
        self._next = 0  # index of the item whose record comes next
        self._pos = 0  # ``scan``: where the next record starts in the answer's buffer
        self._record: tuple[int, int, int, int] | None = None  # header of the file under way

    def scan(self, view: memoryview, end: int) -> list[Member]:
        """The records completed in ``view[:end]`` since the last scan (``view`` holds the
        answer from its first byte; the bytes before ``end`` must not change while the
        members returned, views of them, are in use)."""
        done: list[Member] = []
        pos = self._pos
        while True:
            if self._record is None:
                if end - pos < PACK_RECORD.size:
                    break
                if self._next >= len(self._items):
                    raise WireError("data after the pack answer")
                rfid, rver, length, digest = PACK_RECORD.unpack_from(view, pos)
                pos += PACK_RECORD.size
                if (rfid, rver) != self._items[self._next]:
                    raise WireError("pack answer out of order")
                if length != PACK_GONE and length < 0:
                    raise WireError("pack answer with a negative length")
                self._record = (rfid, rver, length, digest)
            rfid, rver, length, digest = self._record
            if length == PACK_GONE:
                done.append(((rfid, rver), None))
            elif end - pos >= length:
                done.append(((rfid, rver), (view[pos : pos + length], digest)))
                pos += length
            else:
                break
            self._record = None
            self._next += 1
        self._pos = pos
        return done

    def finish(self, end: int) -> None:
        """Check that the answer was whole; ``end``: its length."""
        if end > self._pos and self._next >= len(self._items):
            raise WireError("data after the pack answer")
        if self._next < len(self._items):
            raise WireError("pack answer cut short")
