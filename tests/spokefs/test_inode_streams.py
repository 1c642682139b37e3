"""InodeStreams: the read stream of each inode when the kernel opens files itself, and the
streams a serving worker's reads are noted on (``stream_read``), against a real namespace."""

from __future__ import annotations

import stat
from pathlib import Path

from spokefs import protocol
from spokefs.fuse.inode_streams import InodeStreams
from spokefs.namespace.replica import Namespace
from spokefs.protocol import Entry
from spokefs.read.stream import Stream
from spokefs.types import FileVersion
from tests.helpers import wire

ROOT, FILE = 0x100, 0x200
REG = stat.S_IFREG | 0o644


class Streams:
    """The read path's side: opens and closes, remembered."""

    def __init__(self) -> None:
        self.opened: list[Stream] = []
        self.closed: list[Stream] = []

    def open(self, fv: FileVersion, parent_id: int) -> Stream:
        self.opened.append(Stream(fv, parent_id))
        return self.opened[-1]

    def close(self, stream: Stream) -> None:
        self.closed.append(stream)


def namespace(tmp_path: Path) -> Namespace:
    ns = Namespace(tmp_path / "ns")
    ns.reload_snapshot(wire.snapshot(3, ROOT, [
        Entry(ROOT, 0, stat.S_IFDIR | 0o755, 0, 10, 2, 0, b""),
        Entry(FILE, ROOT, REG, 100, 10, 1, 9, b"f"),
    ]))
    return ns


def grow(ns: Namespace) -> None:
    """Generation 3 -> 4: the file's version 9 becomes 10."""
    ns.apply_changes(protocol.encode_changes(3, 4, ROOT, [
        wire.upsert(Entry(FILE, ROOT, REG, 200, 11, 1, 10, b"f"))], 1))


def test_a_workers_read_reuses_the_stream_of_its_version(tmp_path: Path) -> None:
    ns = namespace(tmp_path)
    try:
        reads = Streams()
        streams = InodeStreams(ns, reads)
        own = streams.stream(FILE)
        assert own.fv == FileVersion(FILE, 9, 100) and own.parent_id == ROOT
        # the worker read the same version: the same stream (its access pattern goes on)
        assert streams.stream_read(FILE, FileVersion(FILE, 9, 100), ROOT) is own
        assert streams.stream(FILE) is own and reads.opened == [own] and reads.closed == []
    finally:
        ns.close()


def test_a_stream_from_a_workers_read_is_checked_against_the_namespace_again(
        tmp_path: Path) -> None:
    ns = namespace(tmp_path)
    try:
        reads = Streams()
        streams = InodeStreams(ns, reads)
        first = streams.stream_read(FILE, FileVersion(FILE, 9, 100), ROOT)  # no look
        assert reads.opened == [first]
        assert streams.stream(FILE) is first  # looked at: the same version, kept
        grow(ns)
        # a worker's read of the old version, noted after the change: on the old stream...
        assert streams.stream_read(FILE, FileVersion(FILE, 9, 100), ROOT) is first
        # ...but the mount's own next read is at the namespace's version, never the worker's
        now = streams.stream(FILE)
        assert now.fv == FileVersion(FILE, 10, 200) and reads.closed == [first]
        # and a worker's read of the new version goes on that stream
        assert streams.stream_read(FILE, FileVersion(FILE, 10, 200), ROOT) is now
    finally:
        ns.close()
