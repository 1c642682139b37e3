"""The block cache: 4 KiB blocks of ``(file_id, version)`` in an LMDB environment on local disk.

Storage unit: a *chunk* of ``CHUNK_BLOCKS`` consecutive blocks of one file version, stored as
one LMDB value (see ``config.CHUNK_BLOCKS`` for why not one block per value)::

    key   = file_id, version, chunk index        (big-endian u64 x 3: a file's chunks adjacent)
    value = _HEAD (presence bitmap, insertion seq, one xxh3_64 per slot) + present blocks' bytes

Only present blocks are stored, in slot order, each 4 KiB except a file's last block, which
is last in its chunk; so block j starts at ``rank(j) * BLOCK_SIZE`` of the data. Keys carry
the version, so a changed file gets new keys and old bytes are never mixed with new ones.

Invariants:
- Every block returned by ``get_blocks`` matched its checksum; a block that does not is
  dropped (and counted) and reported missing, so the reader fetches it again.
- ``bytes_used`` (the sum of value sizes, kept in the ``meta`` db in the same transaction as
  every change) never exceeds ``max_bytes`` after a commit: a fill that crosses it evicts,
  oldest chunk first, down to the low-water mark, in the same transaction. A full cache
  evicts; it never fails a read.
- A crash (``kill -9``) leaves the last committed state: each fill is one transaction.

Concurrency: LMDB transactions begin and end inside one synchronous function run by
``trio.to_thread`` (a read may page-fault on a cold disk); reads share a limiter of 8 threads,
writes go through a limiter of 1 (LMDB has one writer per environment anyway). Nothing here
is awaited while a transaction is open. Before adding an ``await``: keep transactions inside
the ``_sync`` functions, and re-check any state read before the await.

Durability: the environment is opened with ``sync=False``: a process crash loses nothing
(committed pages are in the OS page cache); a machine crash may lose recent fills, and the
checksums catch anything torn.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import lmdb
import trio
import xxhash

from spokefs import metrics
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

_KEY = struct.Struct(">QQQ")
_SEQ = struct.Struct(">Q")
_HEAD = struct.Struct(f"<HQ{CHUNK_BLOCKS}Q")
_U64 = struct.Struct("<Q")
_LOW_WATER = 0.9  # evict down to 90% of the quota, so evictions come in batches
_READ_THREADS = 8


@dataclass(frozen=True, slots=True)
class CacheStats:
    bytes_used: int
    max_bytes: int
    chunks: int


@dataclass(slots=True)
class _Chunk:
    """A decoded value: block slot -> bytes, checksums, and when it was first stored."""

    seq: int
    blocks: dict[int, bytes]
    sums: dict[int, int]

    @classmethod
    def decode(cls, raw: bytes) -> _Chunk:
        bitmap, seq, *sums = _HEAD.unpack_from(raw)
        data = memoryview(raw)[_HEAD.size :]
        blocks: dict[int, bytes] = {}
        checks: dict[int, int] = {}
        off = 0
        for slot in range(CHUNK_BLOCKS):
            if bitmap >> slot & 1:
                blocks[slot] = bytes(data[off : off + BLOCK_SIZE])
                checks[slot] = sums[slot]
                off += BLOCK_SIZE
        return cls(seq, blocks, checks)

    def encode(self) -> bytes:
        bitmap = 0
        sums = [0] * CHUNK_BLOCKS
        for slot in self.blocks:
            bitmap |= 1 << slot
            sums[slot] = self.sums[slot]
        body = b"".join(self.blocks[s] for s in sorted(self.blocks))
        return _HEAD.pack(bitmap, self.seq, *sums) + body


class BlockCache:
    """Get and put verified blocks; bounded by ``max_bytes``."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        # Headroom: values cost ~1.06x in pages, and LMDB reuses freed pages only after
        # older readers end; the map is address space, the file grows only as used.
        self._env = lmdb.open(
            str(path), map_size=max_bytes * 2 + (256 << 20), max_dbs=3,
            sync=False, metasync=False,
        )
        self._chunks = self._env.open_db(b"chunks")
        self._fifo = self._env.open_db(b"fifo")
        self._meta = self._env.open_db(b"meta")
        self._read_limiter = trio.CapacityLimiter(_READ_THREADS)
        self._write_limiter = trio.CapacityLimiter(1)
        with self._env.begin() as txn:
            self._bytes = self._meta_get(txn, b"bytes")
            self._chunk_count = txn.stat(self._chunks)["entries"]
        metrics.CACHE_CAPACITY.set(max_bytes)
        metrics.CACHE_BYTES.set(self._bytes)

    def close(self) -> None:
        self._env.close()

    def statistics(self) -> CacheStats:
        return CacheStats(self._bytes, self.max_bytes, self._chunk_count)

    async def get_blocks(self, file_id: int, version: int, first: int, last: int) -> dict[int, bytes]:
        """The verified cached blocks among ``first..last`` (inclusive), by block index."""
        found, corrupt = await trio.to_thread.run_sync(
            self._get_sync, file_id, version, first, last, limiter=self._read_limiter
        )
        if corrupt:
            log.warning(
                "dropping %d cached blocks of file %x that failed their checksum",
                len(corrupt), file_id,
            )
            metrics.CHECKSUM_FAILURES.inc(len(corrupt))
            await trio.to_thread.run_sync(
                self._drop_sync, file_id, version, corrupt, limiter=self._write_limiter
            )
        return found

    async def present_chunks(self, fv: FileVersion, first: int, last: int) -> set[int]:
        """Chunk indexes among ``first..last`` whose blocks are all cached (headers only)."""
        return await trio.to_thread.run_sync(
            self._present_sync, fv, first, last, limiter=self._read_limiter
        )

    async def complete_files(self, files: list[FileVersion]) -> set[FileVersion]:
        """Those of ``files`` that are cached whole."""
        return await trio.to_thread.run_sync(
            self._complete_sync, files, limiter=self._read_limiter
        )

    async def cached_bytes(self, files: list[FileVersion]) -> int:
        """Bytes of these file versions held in the cache (headers only, one thread hop)."""
        return await trio.to_thread.run_sync(
            self._cached_bytes_sync, files, limiter=self._read_limiter
        )

    async def put_runs(self, file_id: int, version: int, runs: list[tuple[int, bytes]]) -> None:
        """Store runs of blocks: ``(first block index, contiguous bytes)``, one transaction.

        Each run's bytes are whole blocks, except that the file's last block may be short.
        """
        try:
            await trio.to_thread.run_sync(
                self._put_sync, file_id, version, runs, limiter=self._write_limiter
            )
        except lmdb.Error as exc:  # e.g. disk full: the read is still served from memory
            metrics.CACHE_WRITE_ERRORS.inc()
            log.warning("could not store blocks of file %x: %s", file_id, exc)

    # -- synchronous parts, one transaction each --------------------------------------

    def _get_sync(
        self, file_id: int, version: int, first: int, last: int
    ) -> tuple[dict[int, bytes], list[int]]:
        found: dict[int, bytes] = {}
        corrupt: list[int] = []
        with self._env.begin(buffers=True) as txn:
            for ci in range(first // CHUNK_BLOCKS, last // CHUNK_BLOCKS + 1):
                raw = txn.get(_KEY.pack(file_id, version, ci), db=self._chunks)
                if raw is None:
                    continue
                chunk = _Chunk.decode(raw)
                for slot, data in chunk.blocks.items():
                    idx = ci * CHUNK_BLOCKS + slot
                    if first <= idx <= last:
                        if xxhash.xxh3_64_intdigest(data) == chunk.sums[slot]:
                            found[idx] = data
                        else:
                            corrupt.append(idx)
        return found, corrupt

    def _present_sync(self, fv: FileVersion, first: int, last: int) -> set[int]:
        with self._env.begin(buffers=True) as txn:
            return {ci for ci in range(first, last + 1) if self._chunk_full(txn, fv, ci)}

    def _complete_sync(self, files: list[FileVersion]) -> set[FileVersion]:
        with self._env.begin(buffers=True) as txn:
            return {
                f for f in files
                if all(self._chunk_full(txn, f, ci) for ci in range(f.chunks()))
            }

    def _cached_bytes_sync(self, files: list[FileVersion]) -> int:
        total = 0
        with self._env.begin(buffers=True) as txn:
            for f in files:
                last_ci, last_slot = divmod(f.blocks() - 1, CHUNK_BLOCKS)
                for ci in range(f.chunks()):
                    raw = txn.get(_KEY.pack(f.file_id, f.version, ci), db=self._chunks)
                    if raw is None:
                        continue
                    bitmap = _HEAD.unpack_from(raw)[0]
                    total += bitmap.bit_count() * BLOCK_SIZE
                    if ci == last_ci and bitmap >> last_slot & 1:
                        total -= f.blocks() * BLOCK_SIZE - f.size  # the short last block
        return total

    def _chunk_full(self, txn: lmdb.Transaction, fv: FileVersion, ci: int) -> bool:
        want = min(CHUNK_BLOCKS, fv.blocks() - ci * CHUNK_BLOCKS)
        if want <= 0:
            return True
        raw = txn.get(_KEY.pack(fv.file_id, fv.version, ci), db=self._chunks)
        return raw is not None and (_HEAD.unpack_from(raw)[0] & ((1 << want) - 1)).bit_count() == want

    def _put_sync(self, file_id: int, version: int, runs: list[tuple[int, bytes]]) -> None:
        with self._env.begin(write=True) as txn:
            total = self._meta_get(txn, b"bytes")
            seq = self._meta_get(txn, b"seq")
            for first, data in runs:
                view = memoryview(data)
                nblocks = -(-len(data) // BLOCK_SIZE)
                idx = first
                while idx < first + nblocks:
                    ci, slot = divmod(idx, CHUNK_BLOCKS)
                    count = min(CHUNK_BLOCKS - slot, first + nblocks - idx)
                    off = (idx - first) * BLOCK_SIZE
                    piece = view[off : off + count * BLOCK_SIZE]
                    total, seq = self._put_piece(txn, (file_id, version, ci), slot, piece, total, seq)
                    idx += count
            if total > self.max_bytes:
                total = self._evict(txn, total, int(self.max_bytes * _LOW_WATER))
            txn.put(b"bytes", _U64.pack(total), db=self._meta)
            txn.put(b"seq", _U64.pack(seq), db=self._meta)
        self._bytes = total
        metrics.CACHE_BYTES.set(total)

    def _put_piece(
        self, txn: lmdb.Transaction, key3: tuple[int, int, int], slot: int, piece: memoryview,
        total: int, seq: int,
    ) -> tuple[int, int]:
        """Store contiguous blocks from ``slot`` on into one chunk; returns (total, seq)."""
        key = _KEY.pack(*key3)
        sums = [
            xxhash.xxh3_64_intdigest(piece[o : o + BLOCK_SIZE])
            for o in range(0, len(piece), BLOCK_SIZE)
        ]
        raw = txn.get(key, db=self._chunks)
        if raw is None:  # the common case: a new chunk, stored with one copy of the bytes
            seq += 1
            txn.put(_SEQ.pack(seq), key, db=self._fifo)
            self._chunk_count += 1
            bitmap = ((1 << len(sums)) - 1) << slot
            all_sums = [0] * slot + sums + [0] * (CHUNK_BLOCKS - slot - len(sums))
            value = _HEAD.pack(bitmap, seq, *all_sums) + piece
        else:
            total -= len(raw)
            chunk = _Chunk.decode(raw)
            for n, digest in enumerate(sums):
                chunk.blocks[slot + n] = bytes(piece[n * BLOCK_SIZE : (n + 1) * BLOCK_SIZE])
                chunk.sums[slot + n] = digest
            value = chunk.encode()
        txn.put(key, value, db=self._chunks)
        return total + len(value), seq

    def _evict(self, txn: lmdb.Transaction, total: int, target: int) -> int:
        """Drop the oldest chunks until ``total <= target``; returns the new total."""
        evicted = 0
        cur = txn.cursor(db=self._fifo)
        while total > target and cur.first():
            key = cur.value()
            cur.delete()
            raw = txn.pop(key, db=self._chunks)
            if raw is not None:
                total -= len(raw)
                evicted += len(raw)
                self._chunk_count -= 1
        metrics.CACHE_EVICTIONS.inc(evicted)
        log.debug("evicted %d bytes", evicted)
        return total

    def _drop_sync(self, file_id: int, version: int, indexes: list[int]) -> None:
        with self._env.begin(write=True) as txn:
            total = self._meta_get(txn, b"bytes")
            for idx in indexes:
                key = _KEY.pack(file_id, version, idx // CHUNK_BLOCKS)
                raw = txn.get(key, db=self._chunks)
                if raw is None:
                    continue
                chunk = _Chunk.decode(raw)
                chunk.blocks.pop(idx % CHUNK_BLOCKS, None)
                total -= len(raw)
                if chunk.blocks:
                    value = chunk.encode()
                    txn.put(key, value, db=self._chunks)
                    total += len(value)
                else:  # its fifo entry goes when eviction reaches it
                    txn.delete(key, db=self._chunks)
                    self._chunk_count -= 1
            txn.put(b"bytes", _U64.pack(total), db=self._meta)
        self._bytes = total
        metrics.CACHE_BYTES.set(total)

    def _meta_get(self, txn: lmdb.Transaction, key: bytes) -> int:
        raw = txn.get(key, db=self._meta)
        return 0 if raw is None else _U64.unpack(raw)[0]
