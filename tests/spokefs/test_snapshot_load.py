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


def tree(extra: int = 0) -> list[Entry]:
    entries = [Entry(ROOT, 0, DIR, 0, 1, 2, 0, b"", b"")]
    entries += [Entry(0x200 + i, ROOT, REG, 10 + i, 1, 1, 5 + i, f"f{i}".encode(), b"")
                for i in range(50 + extra)]
    return entries


async def test_a_child_load_gives_the_same_namespace_and_the_parent_sees_it(tmp_path):
    ns = Namespace(tmp_path / "ns")
    try:
        applied = await snapshot_load.reload_snapshot_apart(
            ns, wire.snapshot(7, ROOT, tree()))
        assert ns.info is not None and ns.info.generation == 7 and ns.info.entries == 51
        assert applied.info == ns.info
        assert len(ns.dir_files_named(ROOT)) == 50
        # a second load (the hub's generation is gone): what the kernel must forget comes back
        applied = await snapshot_load.reload_snapshot_apart(
            ns, wire.snapshot(9, ROOT, tree(extra=1)))
        assert ns.info.generation == 9 and len(ns.dir_files_named(ROOT)) == 51
        assert applied.names  # the root's old names are forgotten wholesale
    finally:
        ns.close()


async def test_a_hostile_snapshot_is_refused_and_nothing_changes(tmp_path):
    ns = Namespace(tmp_path / "ns")
    try:
        await snapshot_load.reload_snapshot_apart(ns, wire.snapshot(7, ROOT, tree()))
        blob = wire.snapshot(8, ROOT, tree())
        with pytest.raises(protocol.WireError):
            await snapshot_load.reload_snapshot_apart(ns, blob[: len(blob) // 2])
        assert ns.info.generation == 7 and len(ns.dir_files_named(ROOT)) == 50
    finally:
        ns.close()


async def test_a_child_that_cannot_load_is_a_clear_error(tmp_path):
    ns = Namespace(tmp_path / "ns")
    try:
        ns.path = tmp_path / "missing" / "file-not-dir"  # the child cannot open it
        (tmp_path / "missing").write_text("a file where a directory should be")
        with pytest.raises(snapshot_load.LoadFailed, match="exited"):
            await snapshot_load.reload_snapshot_apart(ns, wire.snapshot(7, ROOT, tree()))
    finally:
        ns.close()
