"""What the routes, the rescanner and the server need of an export, whatever serves it.

Two backends implement these protocols: a directory (``export_root.ExportRoot`` with
``range_reader.RangeReader``) and a bucket (``s3.bucket.BucketExport`` with
``s3.reader.BucketReader``). The routes and the wire protocol only see ``Export`` and
``Reader``, so neither knows which backend answers, and spokes need no change.

- ``Export``: the namespace. ``rescan`` (blocking, run in a worker thread) walks the
  directory or lists the bucket into a snapshot table and makes it current when something
  changed; ``state`` is the current snapshot with its change history, replaced in one
  assignment.
- ``Reader``: the bytes. ``open_framed`` one range of the framed representation of one
  (file id, version), then ``read_piece`` it a slice at a time; ``read_pack`` one
  deterministic pack of a directory; ``read_pick`` the files a pick names (an ordered list's
  pack); each request inside one of ``slot()``'s bounded
  read slots. A version that
  is no longer current is ``StaleVersion`` (412) on both backends: a changed file on disk
  (fstat before/after), a replaced object in the bucket (``If-Match``).
"""

from __future__ import annotations

import threading
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from hubd.export_root import ExportRoot, ExportState, Rescan
from hubd.framed import FramedRange
from hubd.range_reader import Pack, RangeReader, RangeSpec
from hubd.s3.bucket import BucketExport
from hubd.s3.reader import BucketReader
from hubd.snapshot import Snapshot


class Export(Protocol):
    """The exported namespace (see the module docstring)."""

    root: str
    last_rescan: Rescan | None

    @property
    def state(self) -> ExportState: ...

    @property
    def snapshot(self) -> Snapshot | None: ...

    def rescan(self, cancel: threading.Event | None = None) -> Snapshot: ...

    def close(self) -> None: ...


class Framed(Protocol):
    """An open framed answer (``framed.FramedBlob``, ``s3.reader.BucketBlob``)."""

    range: FramedRange
    pieces: int

    def close(self) -> None: ...


class Reader(Protocol):
    """Bounded reads of the current snapshot's files (see the module docstring)."""

    @property
    def in_flight(self) -> int:
        """How many requests hold a read slot now (both backends: ``ReadSlots.in_flight``)."""
        ...

    def slot(self) -> AbstractAsyncContextManager[None]: ...

    async def open_framed(self, file_id: int, version: int,
                          spec: RangeSpec | None) -> Framed: ...

    async def read_piece(self, blob: Any, index: int) -> bytes | memoryview: ...

    async def read_pack(self, dir_id: int, index: int, digest: str) -> Pack: ...

    async def read_pick(self, items: list[tuple[int, int]]) -> Pack: ...

    def close(self) -> None: ...


def make_reader(export: Export, max_concurrent: int, wait_s: float) -> Reader:
    """The reader of ``export``'s backend."""
    if isinstance(export, BucketExport):
        return BucketReader(export, max_concurrent, wait_s)
    assert isinstance(export, ExportRoot)
    return RangeReader(export, max_concurrent, wait_s)
