"""One generation of the exported namespace, stored compactly: no Python object per entry.

Held as ``protocol.Entry`` objects plus an id dict, a 1M-entry tree cost ~540 MB resident in
hubd; packed as below it costs about 120 MB, so the old and the new snapshot both fit
while a rescan runs.

A ``Table`` holds the entries of one scan:

- ``records``: every entry's wire encoding (``protocol.encode_entry``) back to back, in
  snapshot order (root first, parent before child): the plain body of the snapshot stream.
- ``offsets``: ``array('Q')`` of n + 1 positions: entry i is
  ``records[offsets[i]:offsets[i + 1]]``.
- ``_ids`` and ``_slots``: every entry's id, and an open-addressing hash table of entry
  indexes by id (at most half full): ``lookup`` and ``path_parts`` for reads.
- blocks: the children of each listed directory are contiguous; ``_block_dirs`` and
  ``_block_starts`` say where each directory's children start (``changes.diff`` compares
  directory by directory, so an unchanged directory costs one ``memcmp``).

A ``Snapshot`` is a ``Table`` with a generation, its zlib stream (``encoded``, exactly what
``GET /v2/snapshot`` sends) and timings. Both are immutable once built.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Iterator, Sequence
from typing import overload

from spokefs import protocol

MAX_ENTRIES = 2**32 - 2  # entry indexes + 1 are stored as uint32


class IdCollision(Exception):
    """Two different inodes of one scan hash to the same file id (the scan must be redone
    with per-entry checks, which leave the second one out)."""


class TableBuilder:
    """Collects the entries of one scan, directory by directory; ``build`` makes the Table.

    Call ``open_block(dir_id)`` before adding the entries of a directory: each directory's
    children are contiguous ("blocks"), which is what makes ``changes.diff`` cheap.
    """

    def __init__(self) -> None:
        self._records = bytearray()
        self._offsets = array("Q", [0])
        self._ids = array("Q")
        self._devs = array("Q")  # st_dev and st_ino: hard link or id collision?
        self._inos = array("Q")
        self._block_dirs = array("Q")
        self._block_starts = array("I")
        self.max_mtime_ns = 0  # the newest mtime listed (the root's at least), for generations

    def __len__(self) -> int:
        return len(self._ids)

    def open_block(self, dir_id: int) -> None:
        """The entries added next are the children of directory ``dir_id``."""
        self._block_dirs.append(dir_id)
        self._block_starts.append(len(self._ids))

    def add(self, entry: protocol.Entry, dev: int, ino: int) -> None:
        if len(self._ids) >= MAX_ENTRIES:
            raise OverflowError(f"more than {MAX_ENTRIES} entries")
        self._records += protocol.encode_entry(entry)
        self._offsets.append(len(self._records))
        self._ids.append(entry.file_id)
        if entry.mtime_ns > self.max_mtime_ns:
            self.max_mtime_ns = entry.mtime_ns
        self._devs.append(dev)
        self._inos.append(ino)

    def same_as(self, table: Table) -> bool:
        """Whether this scan found exactly ``table``'s entries, in the same order."""
        return self._records == table.records

    def build(self, root_id: int) -> Table:
        """The table; the builder must not be used afterwards.

        Raises:
            IdCollision: two entries share an id but not an inode.
        """
        slots = _id_slots(self._ids, self._devs, self._inos)
        self._devs = self._inos = array("Q")
        return Table(root_id, self._records, self._offsets, self._ids, slots,
                     self._block_dirs, self._block_starts, self.max_mtime_ns)


def _id_slots(ids: array[int], devs: array[int], inos: array[int]) -> array[int]:
    """An open-addressing hash table (linear probing, at most half full) of entry
    index + 1 by id (0: empty); ids are hashes already, so their low bits are the slot."""
    size = 1 << max(4, (2 * len(ids)).bit_length())
    mask = size - 1
    slots = array("I", [0]) * size
    for index, file_id in enumerate(ids):
        slot = file_id & mask
        while k := slots[slot]:
            if ids[k - 1] == file_id:
                if devs[k - 1] != devs[index] or inos[k - 1] != inos[index]:
                    raise IdCollision(f"id {file_id:016x}")
                break  # a hard link: its first entry stays the one found by id
            slot = (slot + 1) & mask
        else:
            slots[slot] = index + 1
    return slots


class Table:
    """The entries of one scan (see the module docstring).

    Attributes:
        root_id: the id of ROOT (entry 0).
        records, offsets: the packed entries; ``records`` is never modified.
        max_mtime_ns: the newest mtime of any entry (``export_root.generation_of``).
    """

    __slots__ = ("_block_dirs", "_block_starts", "_ids", "_slots", "max_mtime_ns", "offsets",
                 "records", "root_id")

    def __init__(self, root_id: int, records: bytearray, offsets: array[int], ids: array[int],
                 slots: array[int], block_dirs: array[int], block_starts: array[int],
                 max_mtime_ns: int = 0) -> None:
        self.root_id = root_id
        self.max_mtime_ns = max_mtime_ns
        self.records = records
        self.offsets = offsets
        self._ids = ids
        self._slots = slots
        self._block_dirs = block_dirs
        self._block_starts = block_starts

    def __len__(self) -> int:
        return len(self._ids)

    def entry(self, index: int) -> protocol.Entry:
        return protocol.decode_entry(self.records, self.offsets[index])[0]

    def record(self, index: int) -> bytearray:
        """Entry ``index`` in its wire encoding (a copy)."""
        return self.records[self.offsets[index] : self.offsets[index + 1]]

    def records_of(self, first: int, stop: int) -> bytearray:
        """Entries ``first`` to ``stop - 1`` in their wire encoding (a copy)."""
        return self.records[self.offsets[first] : self.offsets[stop]]

    def index_of(self, file_id: int) -> int | None:
        """The index of the first entry with id ``file_id``, or None."""
        mask = len(self._slots) - 1
        slot = file_id & mask
        while k := self._slots[slot]:
            if self._ids[k - 1] == file_id:
                return k - 1
            slot = (slot + 1) & mask
        return None

    def lookup(self, file_id: int) -> protocol.Entry | None:
        """The first entry with id ``file_id``, or None."""
        index = self.index_of(file_id)
        return None if index is None else self.entry(index)

    def path_parts(self, file_id: int) -> list[bytes] | None:
        """The names leading from ROOT to ``file_id`` (empty for the root), or None."""
        entry = self.lookup(file_id)
        if entry is None:
            return None
        parts: list[bytes] = []
        while entry.parent_id != 0:
            parts.append(entry.name)
            parent = self.lookup(entry.parent_id)
            assert parent is not None  # parents are listed before their children
            entry = parent
        parts.reverse()
        return parts

    def blocks(self) -> dict[int, range]:
        """Directory id -> the indexes of its children (listed directories only)."""
        stops = [*self._block_starts[1:], len(self)]
        return {d: range(first, stop)
                for d, first, stop in zip(self._block_dirs, self._block_starts, stops,
                                          strict=True)}

    def encode(self, generation: int, level: int) -> bytes:
        """The zlib snapshot stream of this table as generation ``generation``."""
        comp = zlib.compressobj(level)
        count = len(self)
        parts = [comp.compress(protocol.encode_header(generation, self.root_id, count)),
                 comp.compress(self.records),
                 comp.compress(protocol.encode_trailer(count)), comp.flush()]
        return b"".join(parts)


class Entries(Sequence[protocol.Entry]):
    """A read-only sequence view of a table's entries, decoded on access."""

    __slots__ = ("_table",)

    def __init__(self, table: Table) -> None:
        self._table = table

    def __len__(self) -> int:
        return len(self._table)

    @overload
    def __getitem__(self, index: int) -> protocol.Entry: ...
    @overload
    def __getitem__(self, index: slice) -> list[protocol.Entry]: ...
    def __getitem__(self, index: int | slice) -> protocol.Entry | list[protocol.Entry]:
        if isinstance(index, slice):
            return [self._table.entry(i) for i in range(len(self))[index]]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._table.entry(index)

    def __iter__(self) -> Iterator[protocol.Entry]:
        return (self._table.entry(i) for i in range(len(self)))


class Snapshot:
    """One generation of the namespace.

    Attributes:
        generation: grows on every change; a function of the table (see
            ``export_root.next_generation``), so replicas and restarts agree.
        table: the entries.
        encoded: the zlib snapshot stream, exactly what ``GET /v2/snapshot`` sends.
        scan_seconds, encode_seconds: how long the walk and the encoding took.
    """

    __slots__ = ("encode_seconds", "encoded", "generation", "scan_seconds", "table")

    def __init__(self, generation: int, table: Table, encoded: bytes, scan_seconds: float,
                 encode_seconds: float) -> None:
        self.generation = generation
        self.table = table
        self.encoded = encoded
        self.scan_seconds = scan_seconds
        self.encode_seconds = encode_seconds

    @property
    def root_id(self) -> int:
        return self.table.root_id

    @property
    def count(self) -> int:
        return len(self.table)

    @property
    def entries(self) -> Entries:
        """Every entry in snapshot order (decoded on access: iterate, don't keep)."""
        return Entries(self.table)

    def lookup(self, file_id: int) -> protocol.Entry | None:
        return self.table.lookup(file_id)

    def path_parts(self, file_id: int) -> list[bytes] | None:
        return self.table.path_parts(file_id)
