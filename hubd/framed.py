"""Blob answers in the framed representation (docs/protocol.md, "Why a version 2"), streamed a
slice, then three slices, at a time, and the deterministic packs of a directory.

- ``FramedBlob``: one open file version and the byte range of its framed representation
  to answer. ``RangeReader.open_framed`` opens the file (confined, version-checked) and
  resolves the ``Range`` (``range_reader.resolve_range``) against ``protocol.framed_size``
  before any byte is sent, so a missing or changed file is a clean 404/412.
  ``piece(i)`` then reads, checks and frames the i-th piece of the answer in one executor
  hop (the first slice it touches, then up to ``_PIECE_SLICES`` slices at a time): data
  read into its frames and one seeded xxh3 per 4 KiB frame
  (``protocol.read_frames``: one native call), an ``fstat`` after it (a write during the
  answer changes the version: the answer stops short, and the spoke, which knows the length
  it asked for, refuses it).
  Any range of any size is answered this way, the whole file included, with at most
  ``_PIECE_SLICES`` slices (``protocol.SLICE_BYTES`` each) in memory per request, less than
  a pack.
- ``PackPlans``: ``protocol.plan_packs`` of a directory of the current snapshot, computed once
  per snapshot and directory (a few hundred kept), so a pack URL costs one dict lookup.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

from hubd.errors import StaleVersion, UnknownFile
from hubd.export_root import version_of
from hubd.snapshot import Snapshot
from spokefs import protocol

_PLANS_KEPT = 512  # directories whose packs are kept per snapshot
# Slices per piece after the first. The first piece is one slice, read before the answer's
# head goes out (a changed file is a clean 412), so a reader waits for no more than that;
# the rest go three at a time: each piece costs the event loop an executor hop and a write
# (a 3.75 MiB request was four pieces). Three slices (3.2 MB) stay under a pack's bytes,
# the bound on a read slot's memory (``hubd.config``).
_PIECE_SLICES = 3
_SHRANK = "the file shrank while being read"


@dataclass(frozen=True, slots=True)
class FramedRange:
    """Bytes ``[start, stop)`` of a representation of ``total`` bytes; ``partial``: 206."""

    start: int
    stop: int
    total: int
    partial: bool

    def cut(self, framed: bytes, base: int) -> bytes | memoryview:
        """The part of ``framed`` (framed bytes from offset ``base`` on) inside this range:
        ``framed`` itself, or a view of it where the range starts or ends inside (not
        copied again)."""
        lo = max(self.start - base, 0)
        hi = min(self.stop - base, len(framed))
        return framed if (lo, hi) == (0, len(framed)) else memoryview(framed)[lo:hi]


class FramedBlob:
    """An open file version and the framed range to answer (see the module docstring).

    Attributes:
        range: the framed bytes to send.
        pieces: how many ``piece`` calls send them (the first slice touched, then
            ``_PIECE_SLICES`` slices each).
    """

    def __init__(self, fd: int, file_id: int, version: int, size: int,
                 rng: FramedRange) -> None:
        self._fd = fd
        self._file_id = file_id
        self._version = version
        self._size = size
        self.range = rng
        self._first_slice = rng.start // protocol.SLICE_BYTES
        last_slice = (rng.stop - 1) // protocol.SLICE_BYTES if rng.stop > rng.start else -1
        self._last_slice = last_slice
        slices = last_slice - self._first_slice + 1
        self.pieces = 0 if slices <= 0 else 1 + -(-(slices - 1) // _PIECE_SLICES)

    def close(self) -> None:
        os.close(self._fd)

    def piece(self, i: int) -> bytes | memoryview:
        """The framed bytes of the answer in its ``i``-th piece: its first slice, then
        ``_PIECE_SLICES`` at a time (blocking: run in a thread); a view where the answer
        starts or ends inside it (not copied again).

        Raises:
            StaleVersion: the file changed or shrank since it was opened.
        """
        s = self._first_slice if i == 0 else self._first_slice + 1 + (i - 1) * _PIECE_SLICES
        n = 1 if i == 0 else min(_PIECE_SLICES, self._last_slice - s + 1)
        first_frame = s * protocol.SLICE_FRAMES
        data_start = first_frame * protocol.FRAME_DATA_BYTES
        data_stop = min(data_start + n * protocol.SLICE_DATA_BYTES, self._size)
        # the data read straight into its frames: one copy
        framed = protocol.read_frames(self._fd, data_start, data_stop - data_start,
                                      self._file_id, self._version, first_frame)
        if framed is None:
            raise StaleVersion(_SHRANK)
        st = os.fstat(self._fd)
        if version_of(st) != self._version:  # the same fd: the same inode, so the same id
            raise StaleVersion(f"file {self._file_id:016x} changed while being read")
        return self.range.cut(framed, s * protocol.SLICE_BYTES)


class PackPlans:
    """The packs of directories of the current snapshot, computed on first use."""

    def __init__(self) -> None:
        self._snap: Snapshot | None = None
        self._blocks: dict[int, range] = {}
        self._plans: OrderedDict[int, list[protocol.PackPlan]] = OrderedDict()

    def find(self, snap: Snapshot, dir_id: int, index: int, digest: str) -> protocol.PackPlan:
        """Pack ``index`` of directory ``dir_id`` if its digest is ``digest`` (blocking:
        the first call per snapshot lists every directory; run it in a thread).

        Raises:
            UnknownFile: no such directory in the snapshot.
            StaleVersion: no such pack, or its members differ (another generation).
        """
        plans = self._of(snap, dir_id)
        if index >= len(plans) or plans[index].digest != digest:
            raise StaleVersion(f"pack {index} of {dir_id:016x} is not {digest} in this "
                               f"generation: list the directory again")
        return plans[index]

    def _of(self, snap: Snapshot, dir_id: int) -> list[protocol.PackPlan]:
        if snap is not self._snap:
            self._snap, self._blocks = snap, snap.table.blocks()
            self._plans.clear()
        plans = self._plans.get(dir_id)
        if plans is None:
            children = self._blocks.get(dir_id)
            entry = snap.lookup(dir_id)
            if entry is None or not entry.is_dir:
                raise UnknownFile(f"no directory {dir_id:016x}")
            files = []
            for i in children or ():
                e = snap.table.entry(i)
                if e.mode & 0o170000 == 0o100000:
                    files.append((e.name, e.file_id, e.version, e.size))
            plans = self._plans[dir_id] = protocol.plan_packs(dir_id, files)
            if len(self._plans) > _PLANS_KEPT:
                self._plans.popitem(last=False)
        self._plans.move_to_end(dir_id)
        return plans
