"""How the block cache lays chunks out in LMDB: keys, chunk headers, the page-exact data split.

Four named databases in one environment (``block_cache`` explains why each exists):

    data   chunk key -> the chunk's present blocks, in slot order, minus the last ``tail`` bytes
    head   chunk key -> ChunkHead: presence bitmap, origin, segment, order seq, stored tick,
                        xxh3_64 of all the chunk's data, one xxh3_64 per present block,
                        then the ``tail`` bytes of the data
    order  (segment u8, seq u64) -> chunk key: each segment's order (insertion or promotion)
    meta   b"state" -> CacheState (totals and counters), b"layout" -> LAYOUT

Chunk key: file id, version, chunk index, big-endian u64 each (a file's chunks are adjacent).

**Why a tail.** LMDB stores a value larger than about half a page in *overflow pages*, a run
of whole pages that starts with a 16-byte page header (measured: a 65,536-byte value takes 17
pages, a 65,520-byte one 16). So 16 blocks in one value cost 17 pages (1.06x) whatever else is
in it, and one 4 KiB block costs 2 pages (2x). Keeping the checksums in ``head`` and moving the
last ``tail_len`` bytes of the data there too makes every data value fit its pages exactly:
16 blocks take 16 pages and one block one page; the header (60-190 bytes) sits in a shared
leaf page. Reads join ``value + tail``: one extra copy of the last block.

**Why two kinds of checksum.** A read that takes most of a chunk (a small file, a sequential
read) verifies it with one xxh3 over the whole stored data (``chunk_sum``): one call instead
of sixteen, and no Python object per block. A read of one or two blocks (random 4 KiB reads)
verifies only those, with the per-block sums, rather than hashing 64 KiB for 4; the
per-block sums also let a corrupt chunk keep its good blocks.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import xxhash

from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS

try:  # C, optional: the same records, built in one call (layout_c.c says why)
    import spokefs.cache.layout_c as layout_c

    NATIVE = True
except ImportError:  # pragma: no cover - the package was installed without its C part
    NATIVE = False

BOUND_RATIO = 1.10
"""``blocks/`` (data.mdb, lock.mdb and the side files) stays within this times ``max_bytes``,
or ``max_bytes + _MIN_SLACK_BYTES`` if more (a tiny cache); the LMDB map is that bound less
the other files (``block_cache``, "Invariants")."""
_MIN_SLACK_BYTES = 1 << 20  # a few batches and the side files: a cache under 10 MiB needs it


def bound_bytes(max_bytes: int) -> int:
    """The most ``blocks/`` holds for a quota of ``max_bytes`` (see ``BOUND_RATIO``). Here,
    not in ``block_cache``: a serving worker needs it to open the cache read-only, and
    ``block_cache``'s imports (the metrics) cost its start 20-30 ms of CPU."""
    return max_bytes + max(int(max_bytes * (BOUND_RATIO - 1)), _MIN_SLACK_BYTES)

LAYOUT = 3
"""1: one "chunks" db with the header inside the value (1.06x, 2x for lone blocks); 2: no
whole-chunk checksum (a read verified every 4 KiB block on its own)."""

PROBATION = 0  # stored, not (yet) re-used
PROTECTED = 1  # re-used, warmed, or back soon after an eviction
PINNED = 2  # ``spokefs pin``: no eviction walk ever reaches this segment (see ``eviction``)
"""A third segment rather than a flag: every eviction walk seeks within one segment's range
of the ``order`` db and stops at its end, so pinned chunks are never even looked at, and no
walk pays for them. Layout 3 is kept: older code reads a pinned header as undecodable and
drops the chunk (a downgrade loses the pins' bytes, never the cache's consistency)."""

KEY = struct.Struct(">QQQ")
ORDER_KEY = struct.Struct(">BQ")
_HEAD = struct.Struct("<HBBQQQ")  # bitmap, origin, segment, seq, stored tick, chunk sum
_SUMS = [struct.Struct(f"<{n}Q") for n in range(CHUNK_BLOCKS + 1)]
_STATE = struct.Struct("<8Q")
_OVERFLOW_PAGE_HEADER = 16  # LMDB's PAGEHDRSZ on 64-bit builds


class BadHead(ValueError):
    """A chunk header that cannot be decoded (a corrupt or foreign record)."""


def head_bitmap(raw: bytes | memoryview) -> int | None:
    """The block bitmap of a ``head`` record without decoding the rest (the question "does
    it hold these blocks?" asks nothing else); None where ``ChunkHead.decode`` would raise
    BadHead."""
    n = len(raw)
    if n < _HEAD.size:
        return None
    bitmap: int = raw[0] | raw[1] << 8
    fixed = _HEAD.size + 8 * bitmap.bit_count()
    if raw[3] > PINNED or not fixed <= n <= fixed + _OVERFLOW_PAGE_HEADER:
        return None
    return bitmap


_SEQ_TICK = struct.Struct("<QQ")  # a header's seq and stored tick, after its segment byte
_SEQ_AT = 4


def promoted_head(raw: bytes | memoryview, seq: int,
                  tick: int) -> tuple[bytes, bytearray, int] | None:
    """A probation chunk's ``head`` record moved to the protected segment, made from its
    bytes (a promotion changes the segment, seq and stored tick and nothing else, so the
    sums are not decoded and packed again): ``(order key it leaves, new record, tail
    length)``; None if the record is undecodable (``head_bitmap``) or not in probation."""
    bitmap = head_bitmap(raw)
    if bitmap is None or raw[3] != PROBATION:
        return None
    new = bytearray(raw)
    old_seq, _ = _SEQ_TICK.unpack_from(new, _SEQ_AT)
    new[3] = PROTECTED
    _SEQ_TICK.pack_into(new, _SEQ_AT, seq, tick)
    return ORDER_KEY.pack(PROBATION, old_seq), new, len(new) - _HEAD.size - 8 * bitmap.bit_count()


def tail_len(nbytes: int, page_size: int) -> int:
    """Bytes to move into the header so ``nbytes`` of data need no extra overflow page."""
    pages = -(-nbytes // page_size)
    return max(0, nbytes + _OVERFLOW_PAGE_HEADER - pages * page_size)


def new_chunk_record(piece: bytes | memoryview, slot: int, origin: int, segment: int,
                     seq: int, tick: int, page_size: int) -> tuple[bytes, int]:
    """The ``head`` record of a new chunk of ``piece`` (its blocks from ``slot`` on, the last
    may be short) and the length of its ``data`` value (the rest is the record's tail): what
    ``ChunkHead(...).encode()`` gives with every sum computed, in one native call
    (``layout_c``) where it is built."""
    if NATIVE:
        return layout_c.new_chunk_record(piece, slot, origin, segment, seq, tick, page_size)
    return new_chunk_record_py(piece, slot, origin, segment, seq, tick, page_size)


def new_chunk_record_py(piece: bytes | memoryview, slot: int, origin: int, segment: int,
                        seq: int, tick: int, page_size: int) -> tuple[bytes, int]:
    """``new_chunk_record`` in Python (the fallback, and what the tests hold the C part to)."""
    n = len(piece)
    blocks = -(-n // BLOCK_SIZE)
    if n <= 0 or slot < 0 or slot + blocks > CHUNK_BLOCKS:
        raise ValueError("a piece that does not fit its chunk")
    sums = [xxhash.xxh3_64_intdigest(piece[o : o + BLOCK_SIZE])
            for o in range(0, n, BLOCK_SIZE)]
    head = ChunkHead(((1 << blocks) - 1) << slot, origin, segment, seq, tick, sums, b"")
    cut = head.take(piece, page_size)
    return head.encode(), cut


@dataclass(slots=True)
class ChunkHead:
    """The decoded ``head`` record of one chunk.

    Attributes:
        bitmap: bit ``s`` set when block slot ``s`` is present.
        origin: how the chunk first arrived (``block_cache.ORIGIN_*``); merges keep it.
        segment: PROBATION, PROTECTED or PINNED.
        seq: its key in the ``order`` db within its segment.
        stored_tick: access-clock tick when it entered probation (a demand fill: the tick of
            the read that missed it) or was promoted.
        sums: xxh3_64 of each present block, in slot order.
        tail: the last bytes of the data (see the module docstring).
        chunk_sum: xxh3_64 of all present blocks' bytes in slot order (data value + tail).
    """

    bitmap: int
    origin: int
    segment: int
    seq: int
    stored_tick: int
    sums: list[int]
    tail: bytes
    chunk_sum: int = 0

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> ChunkHead:
        try:
            bitmap, origin, segment, seq, tick, chunk_sum = _HEAD.unpack_from(raw)
            sums_struct = _SUMS[bitmap.bit_count()]
            end = _HEAD.size + sums_struct.size
            sums = list(sums_struct.unpack_from(raw, _HEAD.size))
        except (struct.error, IndexError) as exc:
            raise BadHead(str(exc)) from None
        tail = bytes(raw[end:])
        if bitmap >> CHUNK_BLOCKS or segment > PINNED or len(tail) > _OVERFLOW_PAGE_HEADER:
            raise BadHead("impossible header fields")
        return cls(bitmap, origin, segment, seq, tick, sums, tail, chunk_sum)

    def take(self, body: bytes | memoryview, page_size: int) -> int:
        """Make ``body`` (the present blocks' bytes, in slot order) this chunk's data: its
        tail and chunk sum set from it. The length of the ``data`` value (the rest is the
        tail)."""
        cut = len(body) - tail_len(len(body), page_size)
        self.tail = bytes(body[cut:])
        self.chunk_sum = xxhash.xxh3_64_intdigest(body)
        return cut

    def encode(self) -> bytes:
        head = _HEAD.pack(self.bitmap, self.origin, self.segment, self.seq, self.stored_tick,
                          self.chunk_sum)
        return head + _SUMS[len(self.sums)].pack(*self.sums) + self.tail

    def slots(self) -> tuple[int, ...]:
        """Present slots in order (``sums[i]`` is the checksum of ``slots()[i]``)."""
        return _slots_of(self.bitmap)

    def order_key(self) -> bytes:
        return ORDER_KEY.pack(self.segment, self.seq)


@functools.lru_cache(maxsize=1 << CHUNK_BLOCKS)
def _slots_of(bitmap: int) -> tuple[int, ...]:
    return tuple(s for s in range(CHUNK_BLOCKS) if bitmap >> s & 1)


def split_blocks(head: ChunkHead, value: bytes | memoryview) -> dict[int, bytes]:
    """Slot -> bytes of a chunk's blocks, copied out of its ``data`` value and header."""
    view = memoryview(value)
    blocks: dict[int, bytes] = {}
    slots = head.slots()
    for rank, slot in enumerate(slots):
        start = rank * BLOCK_SIZE
        if rank == len(slots) - 1:  # the last block may be short and may reach into the tail
            blocks[slot] = bytes(view[start:]) + head.tail
        else:
            blocks[slot] = bytes(view[start : start + BLOCK_SIZE])
    return blocks


@dataclass(slots=True)
class CacheState:
    """The ``meta`` totals, read and written inside every write transaction.

    Attributes:
        nbytes, chunks: block bytes and chunks stored.
        protected_bytes, protected_chunks: the part in the PROTECTED segment.
        pinned_bytes: the part in the PINNED segment (the meta record's last field, which
            layout 3 left zero).
        seq: last order seq handed out (both segments share the counter).
        hand: seq where the PROTECTED segment's clock hand stopped.
        tick: the access clock when the transaction began (stored ticks never go back).
        evicted: bytes evicted in this transaction (not persisted).
    """

    nbytes: int = 0
    chunks: int = 0
    protected_bytes: int = 0
    protected_chunks: int = 0
    seq: int = 0
    hand: int = 0
    tick: int = 0
    pinned_bytes: int = 0
    evicted: int = 0

    @classmethod
    def decode(cls, raw: bytes | memoryview | None) -> CacheState:
        if raw is None:
            return cls()
        return cls(*_STATE.unpack(raw))

    def encode(self) -> bytes:
        return _STATE.pack(
            self.nbytes, self.chunks, self.protected_bytes, self.protected_chunks,
            self.seq, self.hand, self.tick, self.pinned_bytes,
        )
