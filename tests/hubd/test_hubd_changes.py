"""The changes feed in-process: the wire format, rescans, and a reference applier.

The applier is the contract a spoke implements: records in order, REMOVE unlinks exactly
one name, UPSERT sets one name (never changing the id behind an existing name) under a
directory that exists at that moment. Applied to generation G's namespace, the answer
from G must give exactly the current namespace.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import zlib
from pathlib import Path

import pytest

from hubd import scan
from hubd.changes import ChangeFeed
from hubd.errors import BadGeneration, GenerationGone
from hubd.export_root import ExportRoot
from hubd.snapshot import Snapshot
from spokefs import protocol
from tests.helpers import wire
from tests.hubd.hubd_testlib import ODD_NAMES, Tree

Key = tuple[int, bytes]
Namespace = dict[Key, protocol.Entry]


def keyed(entries: object) -> Namespace:
    return {(e.parent_id, e.name): e for e in entries}  # type: ignore[attr-defined]


def decode_changes(body: bytes, chunk: int = 5) -> tuple[protocol.ChangesHeader,
                                                          list[protocol.Upsert | protocol.Remove]]:
    decoder = protocol.ChangesDecoder()
    records: list[protocol.Upsert | protocol.Remove] = []
    for i in range(0, len(body), chunk):
        records.extend(decoder.feed(body[i : i + chunk]))
    return decoder.finish(), records


def apply(namespace: Namespace, root_id: int, records: list[protocol.Upsert | protocol.Remove]
          ) -> Namespace:
    """The reference applier (see the module docstring); asserts the record contract."""
    ns = dict(namespace)
    for record in records:
        if isinstance(record, protocol.Remove):
            assert (record.parent_id, record.name) in ns, record
            del ns[(record.parent_id, record.name)]
            continue
        e = record.entry
        before = ns.get((e.parent_id, e.name))
        assert before is None or (before.file_id, stat.S_IFMT(before.mode)) == (
            e.file_id, stat.S_IFMT(e.mode)), (before, e)
        if e.parent_id != 0:
            assert e.parent_id == root_id or any(
                d.file_id == e.parent_id and d.is_dir for d in ns.values()), e
        ns[(e.parent_id, e.name)] = e
    return ns


def changes_since(export: ExportRoot, since: int) -> bytes:
    feed = ChangeFeed(6, 1 << 20)
    state = export.state
    try:
        return asyncio.run(feed.answer(state.history, state.snapshot.root_id, since))
    finally:
        feed.close()


def assert_changes_lead_to(export: ExportRoot,
                           old: Snapshot) -> list[protocol.Upsert | protocol.Remove]:
    new = export.state.snapshot
    header, records = decode_changes(changes_since(export, old.generation))
    assert (header.from_generation, header.to_generation) == (old.generation, new.generation)
    assert header.root_id == new.root_id and header.count == len(records)
    assert apply(keyed(old.entries), old.root_id, records) == keyed(new.entries)
    return records


def write(path: Path | bytes, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def mutate(root: Path) -> None:
    """One of every kind of change."""
    broot = os.fsencode(root)
    write(root / "new.txt", b"new")
    os.unlink(root / "plain.txt")
    os.rename(root / "empty", root / "renamed-empty")
    with open(root / "sub" / "deeper" / "data.bin", "ab") as f:  # grown
        f.write(b"more")
    os.truncate(root / "hard1", 3)  # truncated, under both of its names
    name = os.path.join(broot, ODD_NAMES[0])  # rewritten: same size, new bytes and mtime
    write(name, b"X" * len(ODD_NAMES[0]))
    os.utime(name, ns=(10**18, 10**18))
    (root / "newdir" / "a" / "b").mkdir(parents=True)
    write(root / "newdir" / "a" / "b" / "leaf", b"leaf")
    dead = os.path.join(broot, b"dir\xff\n")  # a removed directory with contents
    os.unlink(os.path.join(dead, b"inner"))
    os.rmdir(dead)
    os.rename(root / "sub" / "deeper", root / "moved-deeper")  # a moved directory
    os.unlink(os.path.join(broot, b"with space"))  # a file replaced by a directory
    os.mkdir(os.path.join(broot, b"with space"))
    write(os.path.join(broot, b"with space", b"inside"), b"in")
    os.unlink(root / "dangling")
    os.symlink("elsewhere", root / "dangling")  # a symlink with a new target
    os.chmod(root / "hard1", 0o600)
    os.link(root / "new.txt", root / "new-link")


@pytest.fixture
def export(tree: Tree) -> ExportRoot:
    return ExportRoot(str(tree.root))


def test_every_kind_of_change_is_replayed_exactly(tree: Tree, export: ExportRoot) -> None:
    first = export.rescan()
    assert export.rescan() is first  # nothing changed: same generation, same snapshot
    assert export.last_rescan is not None and not export.last_rescan.changed
    mutate(tree.root)
    second = export.rescan()
    assert second.generation > first.generation
    records = assert_changes_lead_to(export, first)
    old = keyed(first.entries)
    ids = {e.name: e.file_id for e in old.values()}
    removes = [(r.parent_id, r.name) for r in records if isinstance(r, protocol.Remove)]
    upserts = [r.entry for r in records if isinstance(r, protocol.Upsert)]
    # REMOVEs come first, a removed directory's children before it.
    assert all(isinstance(r, protocol.Remove) for r in records[: len(removes)])
    assert removes.index((ids[b"dir\xff\n"], b"inner")) < removes.index(
        (first.root_id, b"dir\xff\n"))
    # The moved directory: one REMOVE and one UPSERT, its contents not listed.
    assert (ids[b"sub"], b"deeper") in removes
    [moved] = [e for e in upserts if e.name == b"moved-deeper"]
    assert moved.file_id == ids[b"deeper"] and moved.parent_id == first.root_id
    assert not any(e.parent_id == ids[b"deeper"] for e in upserts if e.name != b"data.bin")
    # A new directory comes before its contents; a replaced name is removed first.
    names = [e.name for e in upserts]
    assert names.index(b"newdir") < names.index(b"a") < names.index(b"b") < names.index(b"leaf")
    assert (first.root_id, b"with space") in removes and b"with space" in names
    # Both names of the truncated hard-linked file are updated.
    assert [e.size for e in upserts if e.name in (b"hard1", b"hard2")] == [3, 3]
    assert export.last_rescan is not None and export.last_rescan.changed
    export.close()


def test_changes_span_several_generations(tree: Tree, export: ExportRoot) -> None:
    first = export.rescan()
    write(tree.root / "a", b"1")
    (tree.root / "d1" / "d2").mkdir(parents=True)
    second = export.rescan()
    os.rename(tree.root / "a", tree.root / "d1" / "d2" / "a")  # renamed again and again
    os.rename(tree.root / "d1", tree.root / "sub" / "d1")
    write(tree.root / "plain.txt", b"rewritten, longer")
    third = export.rescan()
    os.rename(tree.root / "sub" / "d1", tree.root / "d1")
    fourth = export.rescan()
    assert first.generation < second.generation < third.generation < fourth.generation
    for old in (first, second, third):
        assert_changes_lead_to(export, old)
    header, records = decode_changes(changes_since(export, fourth.generation))
    assert (header.from_generation, header.to_generation, records) == (
        fourth.generation, fourth.generation, [])
    export.close()


def test_old_unknown_and_future_generations(tree: Tree) -> None:
    export = ExportRoot(str(tree.root), max_change_steps=2)
    gens = []
    for i in range(4):
        write(tree.root / f"f{i}", b"x")
        gens.append(export.rescan().generation)
    history = export.state.history
    assert [s.from_generation for s in history.steps] == gens[1:3]
    assert history.oldest == gens[1]
    for gone in (gens[0], gens[1] + 1, 0):
        with pytest.raises(GenerationGone):
            changes_since(export, gone)
    with pytest.raises(BadGeneration):
        changes_since(export, gens[3] + 1)
    assert assert_changes_lead_to(export, export.state.snapshot) == []
    export.close()


def test_a_step_over_the_byte_budget_is_not_kept(tree: Tree) -> None:
    export = ExportRoot(str(tree.root), max_change_bytes=300)
    first = export.rescan()
    write(tree.root / "small", b"x")
    second = export.rescan()
    assert_changes_lead_to(export, first)
    for i in range(20):
        write(tree.root / f"many-{i}", b"x")
    third = export.rescan()
    assert export.last_rescan is not None and export.last_rescan.updated >= 1
    assert export.last_rescan.added == 20
    for gone in (first, second):
        with pytest.raises(GenerationGone):
            changes_since(export, gone.generation)
    assert export.state.history.oldest == third.generation
    export.close()


def test_reordered_listing_is_no_change(tree: Tree, export: ExportRoot,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    first = export.rescan()
    real_scandir = os.scandir

    def reversed_scandir(fd: int) -> _Listing:
        with real_scandir(fd) as it:
            return _Listing(reversed(list(it)))

    monkeypatch.setattr(os, "scandir", reversed_scandir)
    assert export.rescan() is first
    export.close()


def test_an_id_collision_is_found_and_the_second_inode_left_out(
        tree: Tree, export: ExportRoot, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    victim = os.lstat(tree.root / "plain.txt")
    intruder = os.lstat(tree.root / "sub" / "deeper")  # a directory, listed after the file
    real = scan.file_id_of

    def colliding(st: os.stat_result, mount: bytes = b"") -> int:
        if (st.st_dev, st.st_ino) == (intruder.st_dev, intruder.st_ino):
            return real(victim)
        return real(st, mount)

    monkeypatch.setattr(scan, "file_id_of", colliding)
    with caplog.at_level(logging.WARNING, logger="hubd"):
        snap = export.rescan()
    names = [e.name for e in snap.entries]
    assert b"plain.txt" in names and b"deeper" not in names and b"data.bin" not in names
    assert snap.lookup(real(victim)).name == b"plain.txt"  # type: ignore[union-attr]
    assert any("scanning again" in m for m in caplog.messages)
    assert any("file id collision: sub/deeper skipped" in m for m in caplog.messages)
    export.close()


def test_a_reused_inode_of_another_type_is_removed_first(
        tree: Tree, export: ExportRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deleted file's inode number reused by a new directory: same id, another type."""
    first = export.rescan()
    old_id = scan.file_id_of(os.lstat(tree.root / "empty"))
    os.unlink(tree.root / "empty")
    os.mkdir(tree.root / "empty")
    write(tree.root / "empty" / "child", b"c")
    new_dir = os.lstat(tree.root / "empty")
    real = scan.file_id_of

    def reused(st: os.stat_result, mount: bytes = b"") -> int:
        same = (st.st_dev, st.st_ino) == (new_dir.st_dev, new_dir.st_ino)
        return old_id if same else real(st, mount)

    monkeypatch.setattr(scan, "file_id_of", reused)
    export.rescan()
    records = assert_changes_lead_to(export, first)
    mine = [r for r in records if getattr(r, "name", None) == b"empty"
            or (isinstance(r, protocol.Upsert) and r.entry.name == b"empty")]
    assert [type(r) for r in mine] == [protocol.Remove, protocol.Upsert]
    assert mine[1].entry.file_id == old_id and mine[1].entry.is_dir  # type: ignore[union-attr]
    export.close()


def test_lookups_and_paths_in_the_compact_table(tree: Tree, export: ExportRoot) -> None:
    snap = export.rescan()
    entries = list(snap.entries)
    assert len(snap.entries) == snap.count == len(entries)
    assert snap.entries[-1] == entries[-1] and snap.entries[1:3] == entries[1:3]
    with pytest.raises(IndexError):
        snap.entries[len(entries)]
    for e in entries:
        first = snap.lookup(e.file_id)
        assert first is not None and first.file_id == e.file_id
        parts = snap.path_parts(e.file_id)
        assert parts is not None
        if e.name not in (b"hard1", b"hard2"):
            assert first == e
            path = os.path.join(tree.broot, *parts) if parts else tree.broot
            assert os.lstat(path).st_ino == os.lstat(path).st_ino
            assert stat.S_IFMT(os.lstat(path).st_mode) == stat.S_IFMT(e.mode)
    assert snap.lookup(12345) is None and snap.path_parts(12345) is None
    export.close()


# -- the wire format -----------------------------------------------------------------


ROOT = 0x1234
DIR = protocol.Entry(0x2000, ROOT, stat.S_IFDIR | 0o755, 4096, 5, 2, 7, b"d")
FILE = protocol.Entry(0x3000, 0x2000, stat.S_IFREG | 0o644, 10, 5, 1, 8, b"f\xff")
LINK = protocol.Entry(0x4000, ROOT, stat.S_IFLNK | 0o777, 3, 5, 1, 9, b"l", b"a/b")
ROOT_ENTRY = protocol.Entry(ROOT, 0, stat.S_IFDIR | 0o755, 4096, 5, 3, 1, b"")


def encoded(records: list[bytes], since: int = 1, to: int = 2, count: int | None = None,
            root: int = ROOT) -> bytes:
    return protocol.encode_changes(since, to, root, records,
                               len(records) if count is None else count)


def test_changes_round_trip() -> None:
    records = [protocol.encode_remove(ROOT, b"old"), wire.upsert(ROOT_ENTRY), wire.upsert(DIR),
               wire.upsert(FILE), wire.upsert(LINK)]
    header, got = decode_changes(encoded(records), chunk=3)
    assert header == protocol.ChangesHeader(1, 2, ROOT, 5)
    assert got == [protocol.Remove(ROOT, b"old"), protocol.Upsert(ROOT_ENTRY), protocol.Upsert(DIR),
                   protocol.Upsert(FILE), protocol.Upsert(LINK)]
    assert decode_changes(encoded([], 5, 5)) == (protocol.ChangesHeader(5, 5, ROOT, 0), [])


def _raw(plain: bytes) -> bytes:
    return zlib.compress(plain)


@pytest.mark.parametrize("body", [
    pytest.param(encoded([], 3, 2), id="from-after-to"),
    pytest.param(encoded([protocol.encode_remove(ROOT, b"x")], 2, 2), id="records-at-same-gen"),
    pytest.param(encoded([], root=1), id="root-below-min"),
    pytest.param(encoded([b"\x03" + bytes(20)]), id="unknown-type"),
    pytest.param(encoded([protocol.encode_remove(ROOT, b"a/b")]), id="slash"),
    pytest.param(encoded([protocol.encode_remove(ROOT, b"a\0")]), id="nul"),
    pytest.param(encoded([protocol.encode_remove(ROOT, b"..")]), id="dotdot"),
    pytest.param(encoded([protocol.encode_remove(ROOT, b".")]), id="dot"),
    pytest.param(encoded([protocol.encode_remove(ROOT, b"")]), id="empty-name"),
    pytest.param(encoded([protocol.encode_remove(1, b"x")]), id="remove-parent-below-min"),
    pytest.param(encoded([protocol.encode_remove(ROOT, b"x" * 256)]), id="long-name"),
    pytest.param(encoded([wire.upsert(protocol.Entry(1, ROOT, stat.S_IFREG, 0, 0, 1, 1,
                                                     b"x"))]), id="id-below-min"),
    pytest.param(encoded([wire.upsert(protocol.Entry(9, 0, stat.S_IFREG, 0, 0, 1, 1,
                                                     b"x"))]), id="parent-zero"),
    pytest.param(encoded([wire.upsert(protocol.Entry(ROOT, 0x2000, stat.S_IFDIR, 0, 0, 1,
                                                     1, b"x"))]), id="root-elsewhere"),
    pytest.param(encoded([wire.upsert(protocol.Entry(ROOT, 0, stat.S_IFREG, 0, 0, 1, 1,
                                                     b""))]), id="root-not-a-dir"),
    pytest.param(encoded([wire.upsert(protocol.Entry(9, ROOT, stat.S_IFIFO, 0, 0, 1, 1,
                                                     b"x"))]), id="fifo"),
    pytest.param(encoded([wire.upsert(protocol.Entry(9, ROOT, stat.S_IFREG, 0, 0, 1, 1,
                                                     b"x", b"t"))]), id="target-on-file"),
    pytest.param(encoded([wire.upsert(protocol.Entry(9, ROOT, stat.S_IFREG, 2**63, 0,
                                                     1, 1, b"x"))]),
                 id="absurd-size"),
    pytest.param(encoded([wire.upsert(FILE)], count=2), id="count-too-high"),
    pytest.param(encoded([wire.upsert(FILE)], count=0), id="count-too-low"),
    pytest.param(encoded([wire.upsert(FILE)])[:-6], id="truncated"),
    pytest.param(encoded([wire.upsert(FILE)]) + b"x", id="trailing-garbage"),
    pytest.param(_raw(b"SPKS" + bytes(40)), id="snapshot-magic"),
    pytest.param(_raw(b"SPKC\x02\x00" + bytes(40)), id="version-2"),
    pytest.param(_raw(zlib.decompress(encoded([]))[:-12] + b"SPKX" + bytes(8)), id="bad-trailer"),
    pytest.param(b"", id="empty"),
])
def test_changes_decoder_rejects(body: bytes) -> None:
    with pytest.raises(protocol.WireError):
        decode_changes(body, chunk=7)


class _Listing(list):  # type: ignore[type-arg]
    """A list that works as ``with os.scandir(...) as it``."""

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
