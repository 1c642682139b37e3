"""Loading a snapshot in a child process (``snapshot_load``): the same namespace as an
in-process load, a hostile snapshot refused with nothing changed, a dead child reported."""

from __future__ import annotations

import pytest

from spokefs import protocol
from spokefs.namespace import snapshot_load
from spokefs.namespace.replica import Namespace
from spokefs.protocol import Entry
from tests.helpers import wire

ROOT = 0x100
DIR, REG = 0o040755, 0o100644


def fed(blob: bytes, piece: int = 1 << 16):
    """What the hub client's stream_snapshot does with a snapshot: a start, then pieces."""

    async def fetch(sink: snapshot_load.ChildLoad) -> None:
        await sink.restart()
        for i in range(0, len(blob), piece):
            await sink.feed(blob[i : i + piece])

    return fetch


def tree(extra: int = 0) -> list[Entry]:
    entries = [Entry(ROOT, 0, DIR, 0, 1, 2, 0, b"", b"")]
    entries += [Entry(0x200 + i, ROOT, REG, 10 + i, 1, 1, 5 + i, f"f{i}".encode(), b"")
                for i in range(50 + extra)]
    return entries


async def test_a_child_load_gives_the_same_namespace_and_the_parent_sees_it(tmp_path):
    ns = Namespace(tmp_path / "ns")
    try:
        applied = await snapshot_load.reload_snapshot_apart(
            ns, fed(wire.snapshot(7, ROOT, tree())))
        assert ns.info is not None and ns.info.generation == 7 and ns.info.entries == 51
        assert applied.info == ns.info
        assert len(ns.dir_files_named(ROOT)) == 50
        # a second load (the hub's generation is gone): what the kernel must forget comes back
        applied = await snapshot_load.reload_snapshot_apart(
            ns, fed(wire.snapshot(9, ROOT, tree(extra=1))))
        assert ns.info.generation == 9 and len(ns.dir_files_named(ROOT)) == 51
        assert applied.names  # the root's old names are forgotten wholesale
    finally:
        ns.close()


async def test_a_hostile_snapshot_is_refused_and_nothing_changes(tmp_path):
    ns = Namespace(tmp_path / "ns")
    try:
        await snapshot_load.reload_snapshot_apart(ns, fed(wire.snapshot(7, ROOT, tree())))
        blob = wire.snapshot(8, ROOT, tree())
        with pytest.raises(protocol.WireError):
            await snapshot_load.reload_snapshot_apart(ns, fed(blob[: len(blob) // 2]))
        assert ns.info.generation == 7 and len(ns.dir_files_named(ROOT)) == 50
    finally:
        ns.close()


async def test_a_child_that_cannot_load_is_a_clear_error(tmp_path):
    ns = Namespace(tmp_path / "ns")
    try:
        ns.path = tmp_path / "missing" / "file-not-dir"  # the child cannot open it
        (tmp_path / "missing").write_text("a file where a directory should be")
        with pytest.raises(snapshot_load.LoadFailed, match="exited"):
            await snapshot_load.reload_snapshot_apart(ns, fed(wire.snapshot(7, ROOT, tree())))
    finally:
        ns.close()


async def test_an_attempt_that_fails_part_way_restarts_the_child(tmp_path):
    """The hub client restarts the sink when it tries again: the first child's half a
    snapshot is thrown away with it."""
    blob = wire.snapshot(7, ROOT, tree())
    starts = []

    async def fetch(sink: snapshot_load.ChildLoad) -> None:
        await sink.restart()
        starts.append(sink._proc)
        await sink.feed(blob[: len(blob) // 2])
        await sink.restart()  # the connection broke: a second attempt
        starts.append(sink._proc)
        await sink.feed(blob)

    ns = Namespace(tmp_path / "ns")
    try:
        applied = await snapshot_load.reload_snapshot_apart(ns, fetch)
        assert applied.info.generation == 7 and len(ns.dir_files_named(ROOT)) == 50
        assert starts[0] is not starts[1] and starts[0].returncode is not None
    finally:
        ns.close()


async def test_a_child_that_refuses_early_stops_the_download(tmp_path):
    """A hostile entry near the start: the child exits at once, and the next piece fed
    raises why, not after the whole snapshot has come."""
    bad = [*tree()[:3], Entry(0x900, ROOT, REG, 1, 1, 1, 1, b"a/b"), *tree(extra=20000)[3:]]
    blob = wire.snapshot(8, ROOT, bad, level=0)  # not compressible: many pieces
    fed_bytes = 0

    async def fetch(sink: snapshot_load.ChildLoad) -> None:
        nonlocal fed_bytes
        await sink.restart()
        for i in range(0, len(blob), 4096):
            await sink.feed(blob[i : i + 4096])
            fed_bytes += 4096

    ns = Namespace(tmp_path / "ns")
    try:
        with pytest.raises(protocol.WireError, match="bad name"):
            await snapshot_load.reload_snapshot_apart(ns, fetch)
        assert fed_bytes < len(blob) and ns.info is None
    finally:
        ns.close()


async def test_a_failed_download_stops_the_child_and_changes_nothing(tmp_path):
    procs = []

    async def fetch(sink: snapshot_load.ChildLoad) -> None:
        await sink.restart()
        procs.append(sink._proc)
        await sink.feed(wire.snapshot(7, ROOT, tree())[:100])
        raise OSError("the hub went away")

    ns = Namespace(tmp_path / "ns")
    try:
        with pytest.raises(OSError, match="went away"):
            await snapshot_load.reload_snapshot_apart(ns, fetch)
        assert procs[0].returncode is not None and ns.info is None
    finally:
        ns.close()
