"""Reading the block cache's LMDB environment: one read transaction and one copy per read,
every block's checksum checked before its bytes are returned.

``ChunkReader`` is the read half of ``store.ChunkStore`` (which adds the fills, promotions
and drops on top of it). A serving worker of the mount reads the same records in C
(``spokefs/fuse/read_loop.c``), in a process of its own: the layout is ``layout``'s, and a
change to it is a change to that file too.
Nothing here awaits or touches trio; it may raise any ``lmdb.Error``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import lmdb
import xxhash

from spokefs.cache.layout import KEY, PROTECTED, BadHead, ChunkHead, head_bitmap, split_blocks
from spokefs.cache.residency import resident
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS, CHUNK_SIZE
from spokefs.types import FileVersion

ORIGIN_DEMAND = 0
ORIGIN_PREFETCH = 1
ORIGIN_WARM = 2
ORIGIN_REPLAY = 3  # fetched by a trace replay (``replay``); kept like prefetched data
ORIGINS = ("demand", "prefetch", "warm", "replay")


class ChunkReader:
    """Read transactions on the block cache's environment (see the module docstring)."""

    _env: lmdb.Environment
    _data: lmdb._Database
    _head: lmdb._Database

    def close(self) -> None:
        self._env.close()


    def read(
        self, file_id: int, version: int, offset: int, end: int,
        staged: Callable[[bytes], list[Staged] | None], *, inline: bool = False,
    ) -> ReadResult:
        """The bytes ``[offset, end)`` of a file version, in one read transaction and one copy,
        or which blocks are missing.

        Each chunk of the range comes whole from one place when it can: a piece ``staged``
        for writing (fetched, verified, not yet committed) or the stored chunk, verified with
        its chunk checksum (most of a chunk read) or its block checksums (one or two blocks).
        A chunk whose blocks are spread over both is assembled block by block.

        Raises:
            NotResident: ``inline`` and a stored chunk's bytes are not in RAM (nothing has
                touched them yet): read again from a worker thread.
        """
        res = ReadResult()
        parts: list[memoryview | bytes] = []
        with self._env.begin(buffers=True) as txn:
            for ci in range(offset // CHUNK_SIZE, (end - 1) // CHUNK_SIZE + 1):
                base = ci * CHUNK_SIZE
                a, b = max(offset, base) - base, min(end, base + CHUNK_SIZE) - base
                key = KEY.pack(file_id, version, ci)
                got: list[memoryview | bytes] | None = _from_staged(staged(key), a, b, res)
                if got is None:
                    got = self._from_store(txn, key, a, b, staged(key), res, inline)
                else:
                    res.seen.append((key, None))
                if got is None:
                    first, last = (base + a) // BLOCK_SIZE, (base + b - 1) // BLOCK_SIZE
                    res.missing.extend(range(first, last + 1))
                elif not res.missing:
                    parts.extend(got)
            if not res.missing:
                res.data = b"".join(parts)  # the one copy, inside the transaction
        return res

    def _from_store(
        self, txn: lmdb.Transaction, key: bytes, a: int, b: int, staged: list[Staged] | None,
        res: ReadResult, inline: bool,
    ) -> list[memoryview | bytes] | None:
        """Bytes ``[a, b)`` of a stored chunk, verified; None if any block is not there."""
        lo, hi = a // BLOCK_SIZE, (b - 1) // BLOCK_SIZE
        base_block = KEY.unpack(key)[2] * CHUNK_BLOCKS
        try:
            head, value = self._stored(txn, key)
        except BadHead:
            res.corrupt.extend(range(base_block + lo, base_block + hi + 1))
            res.seen.append((key, None))
            return None
        res.seen.append((key, head))
        if head is None or value is None:
            return _assemble(None, None, staged, a, b, res) if staged else None
        need = ((1 << (hi - lo + 1)) - 1) << lo
        if head.bitmap & need != need:
            return _assemble(head, value, staged, a, b, res)
        view = memoryview(value)
        if inline and not resident(view):
            raise NotResident
        bad = _verify(head, view, lo, hi)
        if bad:
            res.corrupt.extend(base_block + s for s in bad)
            return None
        rank_lo = (head.bitmap & ((1 << lo) - 1)).bit_count()
        da = rank_lo * BLOCK_SIZE + a - lo * BLOCK_SIZE
        res.by_origin[min(head.origin, len(ORIGINS) - 1)] += hi - lo + 1
        return _span(view, head.tail, da, da + b - a)

    def _stored(
        self, txn: lmdb.Transaction, key: bytes
    ) -> tuple[ChunkHead | None, memoryview | bytes | None]:
        """A chunk's header and data value, (None, None) if absent; raises BadHead if the
        header cannot be decoded or has no data."""
        head = self.get_head(txn, key)
        value = None if head is None else txn.get(key, db=self._data)
        if head is not None and value is None:
            raise BadHead("a header without data")
        return head, value

    def get_head(self, txn: lmdb.Transaction, key: bytes) -> ChunkHead | None:
        """The chunk's header, None if absent; raises BadHead if it cannot be decoded."""
        raw = txn.get(key, db=self._head)
        return None if raw is None else ChunkHead.decode(raw)

    def read_head(self, txn: lmdb.Transaction, key: bytes) -> ChunkHead | None:
        try:
            return self.get_head(txn, key)
        except BadHead:
            return None

    # -- headers only ---------------------------------------------------------------

    def present(self, fv: FileVersion, first: int, last: int) -> set[int]:
        """Chunk indexes among ``first..last`` with all their blocks (headers only)."""
        with self._env.begin(buffers=True) as txn:
            return {ci for ci in range(first, last + 1) if self._chunk_full(txn, fv, ci)}

    def holds(self, ranges: list[tuple[FileVersion, int, int]],
              elsewhere: Callable[[FileVersion, int], bool]) -> list[bool]:
        """For each ``(file version, first, last)``: whether every chunk among
        ``first..last`` has all its blocks, here or ``elsewhere(fv, ci)``; one read
        transaction, headers only. Each stops at its first chunk that has not: for a range
        not fetched yet, one lookup rather than one per chunk."""
        with self._env.begin(buffers=True) as txn:
            return [all(self._chunk_full(txn, fv, ci) or elsewhere(fv, ci)
                        for ci in range(first, last + 1))
                    for fv, first, last in ranges]

    def complete(self, files: list[FileVersion]) -> set[FileVersion]:
        """The files cached whole (headers only)."""
        with self._env.begin(buffers=True) as txn:
            return {
                f for f in files
                if all(self._chunk_full(txn, f, ci) for ci in range(f.chunks()))
            }

    def _chunk_full(self, txn: lmdb.Transaction, fv: FileVersion, ci: int) -> bool:
        want = min(CHUNK_BLOCKS, fv.blocks() - ci * CHUNK_BLOCKS)
        if want <= 0:
            return True
        bitmap = self._bitmap(txn, fv, ci)
        return bitmap is not None and (bitmap & ((1 << want) - 1)).bit_count() == want

    def _bitmap(self, txn: lmdb.Transaction, fv: FileVersion, ci: int) -> int | None:
        """Chunk ``ci``'s block bitmap from its header alone; None if absent or undecodable."""
        raw = txn.get(KEY.pack(fv.file_id, fv.version, ci), db=self._head)
        return None if raw is None else head_bitmap(raw)

    def cached_bytes(self, files: list[FileVersion]) -> int:
        """Bytes of these files held (headers only)."""
        total = 0
        with self._env.begin(buffers=True) as txn:
            for f in files:
                last_ci, last_slot = divmod(f.blocks() - 1, CHUNK_BLOCKS)
                for ci in range(f.chunks()):
                    bitmap = self._bitmap(txn, f, ci)
                    if bitmap is None:
                        continue
                    total += bitmap.bit_count() * BLOCK_SIZE
                    if ci == last_ci and bitmap >> last_slot & 1:
                        total -= f.blocks() * BLOCK_SIZE - f.size  # the short last block
        return total


class NotResident(Exception):
    """An inline read would wait for the disk (see ``residency``)."""


@dataclass(slots=True)
class Staged:
    """Blocks fetched and verified, waiting for the writer: ``data`` holds whole blocks of one
    chunk from ``slot`` on (the file's last block may be short)."""

    slot: int
    data: memoryview
    origin: int


@dataclass(slots=True)
class ReadResult:
    """What ``ChunkStore.read`` found.

    Attributes:
        data: the bytes asked for, or None when blocks are missing.
        on_disk: an inline read stopped before touching stored bytes that are not in RAM.
        missing: block indexes not cached (or corrupt), in order.
        corrupt: block indexes whose stored bytes failed their checksum.
        seen: each stored chunk looked at, with its header (None: not stored or staged).
        by_origin: blocks found, by the origin they arrived by.
    """

    data: bytes | None = None
    on_disk: bool = False
    missing: list[int] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    seen: list[tuple[bytes, ChunkHead | None]] = field(default_factory=list)
    by_origin: list[int] = field(default_factory=lambda: [0] * len(ORIGINS))

    def visits(self) -> list[Visit]:
        """``seen`` as the access clock takes it (and a worker sends it, ``fuse.workers``)."""
        return [(key, None, 0) if head is None else
                (key, head.segment == PROTECTED, head.stored_tick) for key, head in self.seen]


# A chunk a read looked at: its key, whether it is protected (None: not stored), and the
# tick it was stored at.
Visit = tuple[bytes, bool | None, int]



def _span(value: memoryview, tail: bytes, start: int, stop: int) -> list[memoryview | bytes]:
    """``(value + tail)[start:stop]`` without joining them."""
    lv = len(value)
    if stop <= lv:
        return [value[start:stop]]
    if start >= lv:
        return [tail[start - lv : stop - lv]]
    return [value[start:], tail[: stop - lv]]


def _verify(head: ChunkHead, view: memoryview, lo: int, hi: int) -> list[int]:
    """Slots among ``lo..hi`` (all present) whose bytes fail their checksum."""
    if hi - lo >= 2:  # most of a chunk: one hash over all of it
        h = xxhash.xxh3_64()
        h.update(view)
        h.update(head.tail)
        if h.intdigest() == head.chunk_sum:
            return []
    bad: list[int] = []
    rank = (head.bitmap & ((1 << lo) - 1)).bit_count()
    for slot in range(lo, hi + 1):
        start = rank * BLOCK_SIZE
        parts = _span(view, head.tail, start, start + BLOCK_SIZE)
        block = parts[0] if len(parts) == 1 else b"".join(parts)
        if xxhash.xxh3_64_intdigest(block) != head.sums[rank]:
            bad.append(slot)
        rank += 1
    return bad


def _from_staged(
    staged: list[Staged] | None, a: int, b: int, res: ReadResult
) -> list[memoryview | bytes] | None:
    """Bytes ``[a, b)`` of a chunk from one staged piece that holds them all, if any."""
    if not staged:
        return None
    for piece in staged:
        start = piece.slot * BLOCK_SIZE
        if start <= a and b <= start + len(piece.data):
            res.by_origin[min(piece.origin, len(ORIGINS) - 1)] += (
                (b - 1) // BLOCK_SIZE - a // BLOCK_SIZE + 1
            )
            return [piece.data[a - start : b - start]]
    return None


def _assemble(
    head: ChunkHead | None, value: memoryview | bytes | None, staged: list[Staged] | None,
    a: int, b: int, res: ReadResult,
) -> list[memoryview | bytes] | None:
    """Bytes ``[a, b)`` of a chunk whose blocks are partly stored, partly staged (rare)."""
    lo, hi = a // BLOCK_SIZE, (b - 1) // BLOCK_SIZE
    blocks: dict[int, bytes] = {}
    origins: dict[int, int] = {}
    if head is not None and value is not None:
        view = memoryview(value)
        good = {s for s in head.slots() if lo <= s <= hi}
        for slot, data in split_blocks(head, view).items():
            if slot in good and xxhash.xxh3_64_intdigest(data) == head.sums[
                    head.slots().index(slot)]:
                blocks[slot], origins[slot] = data, head.origin
    for piece in staged or ():
        for n in range(nblocks(piece.data)):
            blocks[piece.slot + n] = bytes(piece.data[n * BLOCK_SIZE : (n + 1) * BLOCK_SIZE])
            origins[piece.slot + n] = piece.origin
    if any(s not in blocks for s in range(lo, hi + 1)):
        return None
    for s in range(lo, hi + 1):
        res.by_origin[min(origins[s], len(ORIGINS) - 1)] += 1
    body = b"".join(blocks[s] for s in range(lo, hi + 1))
    return [body[a - lo * BLOCK_SIZE : b - lo * BLOCK_SIZE]]


def nblocks(data: bytes | memoryview) -> int:
    return -(-len(data) // BLOCK_SIZE)
