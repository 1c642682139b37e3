"""``Stream``: the access pattern of one open handle (or inode), the record the reader opens
and hands to the prefetcher, which acts on it. Its own module so that neither of the two
imports the other for it (the reader drives the prefetcher; the prefetcher knows no reader).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from spokefs.types import FileVersion


@dataclass(slots=True, eq=False)
class Stream:
    """Access-pattern state of one open handle (or, with kernel opens, one inode), kept by
    the prefetcher.

    Attributes:
        fv: the file version it reads.
        parent_id: the directory it was opened in.
        next_offset: where the last sequential read ended.
        sequential: sequential reads in a row.
        window: bytes read ahead of the reader.
        issued_to: read-ahead queued up to here.
        epoch: bumped on random access or close; queued jobs of older epochs are dropped.
        closed: its handle was released (or it was cut off before its reader came).
        successor: the next file in name order, read ahead into when the window passes
            this file's end (``prefetcher``, "Runs of shards").
        in_run: its reader came to it from the file before, which had read ahead into it:
            a run of files read in name order, so the read-ahead past its end may be larger.
        seeking: the successor is being looked up.
        traced_extent: the trace extent (``trace.extent_of``) of its last read that was
            noted in the access trace; a read in another extent is noted again.
    """

    fv: FileVersion
    parent_id: int
    next_offset: int = 0
    sequential: int = 0
    window: int = 0
    issued_to: int = 0
    epoch: int = 0
    closed: bool = False
    successor: Stream | None = None
    in_run: bool = False
    seeking: bool = False
    traced_extent: int = -1


class StreamReader(Protocol):
    """What the FUSE handlers ask of a read path (``reader.Reader``; the tests' fakes)."""

    def open(self, fv: FileVersion, parent_id: int) -> Stream:
        """A stream for a newly opened file version."""

    def close(self, stream: Stream) -> None:
        """The stream is closed."""

    def on_readdir(self, dir_id: int) -> None:
        """A directory is being listed."""

    async def read(self, stream: Stream, offset: int, size: int) -> bytes | memoryview:
        """Exactly ``size`` bytes from ``offset``, fewer only at end of file."""
