from __future__ import annotations

import stat

import pytest

from spokefs import protocol
from spokefs.errors import NotFound
from spokefs.namespace.replica import ROOT_INODE, Namespace
from spokefs.protocol import Entry
from tests.helpers import wire

ROOT = 0x100
DIR = stat.S_IFDIR | 0o755
REG = stat.S_IFREG | 0o644
LNK = stat.S_IFLNK | 0o777


def tree(gen: int = 1) -> list[Entry]:
    return [
        Entry(ROOT, 0, DIR, 0, 1, 3, 0, b""),
        Entry(0x200, ROOT, DIR, 0, 2, 2, 0, b"sub dir"),
        Entry(0x300, ROOT, REG, 5, 3, 2, 0xAA, b"a\nb"),
        Entry(0x300, 0x200, REG, 5, 3, 2, 0xAA, b"hardlink"),
        Entry(0x400, 0x200, LNK, 6, 4, 1, 0, b"\xff\xfe", b"../a\nb"),
        *[Entry(0x1000 + i, 0x200, REG, i, 5, 1, i, f"f{i:05}".encode()) for i in range(500)],
    ]


def test_load_lookup_getattr_readdir(tmp_path):
    ns = Namespace(tmp_path)
    info = ns.reload_snapshot(wire.snapshot(7, ROOT, tree())).info
    assert (info.generation, info.entries) == (7, 505)
    root = ns.getattr(ROOT_INODE)
    assert root.ino == ROOT_INODE and stat.S_ISDIR(root.mode) and root.nlink == 3
    sub = ns.lookup(ROOT_INODE, b"sub dir")
    assert sub.ino == 0x200
    assert ns.lookup(sub.ino, b"hardlink").ino == ns.lookup(ROOT_INODE, b"a\nb").ino == 0x300
    assert ns.lookup(sub.ino, b"\xff\xfe").target == b"../a\nb"
    with pytest.raises(NotFound):
        ns.lookup(ROOT_INODE, b"nope")
    names = [n for _, n, _ in ns.readdir(sub.ino, 0)]
    assert len(names) == 502 and len(set(names)) == 502
    # resuming at any position continues without gaps or repeats
    pos, *_ = list(ns.readdir(sub.ino, 0))[99]
    assert [n for _, n, _ in ns.readdir(sub.ino, pos)] == names[100:]
    ns.close()
    assert Namespace(tmp_path).info == info  # it persists


@pytest.mark.parametrize(
    "bad",
    [
        Entry(0x500, ROOT, REG, 1, 1, 1, 1, b"a/b"),
        Entry(0x500, ROOT, REG, 1, 1, 1, 1, b".."),
        Entry(0x500, ROOT, REG, 1, 1, 1, 1, b"a\0"),
        Entry(0x500, 0x999, REG, 1, 1, 1, 1, b"orphan"),
        Entry(ROOT, 0x200, DIR, 0, 1, 1, 1, b"cycle"),
        Entry(1, ROOT, REG, 1, 1, 1, 1, b"lowid"),
        Entry(0x500, ROOT, stat.S_IFIFO | 0o644, 0, 1, 1, 1, b"fifo"),
        Entry(0x500, ROOT, REG, 1, 1, 1, 1, b"a\nb"),  # a duplicate name
    ],
)
def test_hostile_snapshot_is_rejected_and_old_namespace_kept(tmp_path, bad):
    ns = Namespace(tmp_path)
    good = ns.reload_snapshot(wire.snapshot(7, ROOT, tree())).info
    with pytest.raises(protocol.WireError):
        ns.reload_snapshot(wire.snapshot(8, ROOT, [*tree(), bad]))
    assert ns.info == good
    assert ns.lookup(ROOT_INODE, b"a\nb").ino == 0x300
    ns.close()


def test_truncated_snapshot_is_rejected(tmp_path):
    ns = Namespace(tmp_path)
    blob = wire.snapshot(7, ROOT, tree())
    with pytest.raises(protocol.WireError):
        ns.reload_snapshot(blob[: len(blob) // 2])
    assert ns.info is None
    ns.close()


def changes(frm: int, to: int, records: list[bytes]) -> bytes:
    return protocol.encode_changes(frm, to, ROOT, records, len(records))


def loaded(tmp_path) -> Namespace:
    ns = Namespace(tmp_path)
    ns.reload_snapshot(wire.snapshot(7, ROOT, tree()))
    return ns


def test_changes_rename_grow_remove_and_new_dir(tmp_path):
    ns = loaded(tmp_path)
    before = [n for _, n, _ in ns.readdir(0x200, 0)]
    applied = ns.apply_changes(changes(7, 9, [
        protocol.encode_remove(ROOT, b"a\nb"),                        # rename a\nb -> renamed
        wire.upsert(Entry(0x300, ROOT, REG, 5, 3, 2, 0xAA, b"renamed")),
        wire.upsert(Entry(0x1001, 0x200, REG, 99, 6, 1, 0xBB, b"f00001")),  # grown
        protocol.encode_remove(0x200, b"f00002"),                     # removed
        wire.upsert(Entry(0x900, ROOT, DIR, 0, 7, 2, 0, b"new")),     # new dir + child
        wire.upsert(Entry(0x901, 0x900, REG, 1, 7, 1, 1, b"x")),
    ]))
    assert applied.info.generation == 9 and applied.records == 6
    with pytest.raises(NotFound):
        ns.lookup(ROOT_INODE, b"a\nb")
    assert ns.lookup(ROOT_INODE, b"renamed").ino == 0x300
    grown = ns.lookup(0x200, b"f00001")
    assert (grown.size, grown.version) == (99, 0xBB)
    with pytest.raises(NotFound):
        ns.lookup(0x200, b"f00002")
    assert ns.lookup(ns.lookup(ROOT_INODE, b"new").ino, b"x").size == 1
    # readdir positions of the untouched entries are stable; the removed one is gone
    after = [n for _, n, _ in ns.readdir(0x200, 0)]
    assert after == [n for n in before if n != b"f00002"]
    assert (ROOT_INODE, b"a\nb") in applied.names and 0x1001 in applied.inodes
    # the kernel caches listings: every directory whose names changed is invalidated
    assert {ROOT_INODE, 0x200, 0x900} <= set(applied.inodes)
    assert applied.info.entries == 505 - 1 + 1 - 1 + 2  # renamed, removed, new dir + child
    ns.close()
    assert Namespace(tmp_path).info == applied.info  # persisted


@pytest.mark.parametrize(
    "records",
    [
        [protocol.encode_remove(ROOT, b"nope")],                                   # unknown name
        [wire.upsert(Entry(0x950, 0x300, REG, 1, 1, 1, 1, b"under-a-file"))],
        [wire.upsert(Entry(0x950, 0x999, REG, 1, 1, 1, 1, b"orphan"))],
        [protocol.encode_remove(ROOT, b"sub dir"),                             # a cycle
         wire.upsert(Entry(0x960, 0x200, DIR, 0, 1, 2, 0, b"inner")),
         wire.upsert(Entry(0x200, 0x960, DIR, 0, 1, 2, 0, b"loop"))],
    ],
)
def test_bad_changes_are_rejected_whole(tmp_path, records):
    ns = loaded(tmp_path)
    info = ns.info
    with pytest.raises(protocol.WireError):
        ns.apply_changes(changes(7, 8, records))
    assert ns.info == info
    assert ns.lookup(ROOT_INODE, b"a\nb").ino == 0x300
    ns.close()


def test_changes_from_another_generation_are_rejected(tmp_path):
    ns = loaded(tmp_path)
    with pytest.raises(protocol.WireError):
        ns.apply_changes(changes(6, 8, [protocol.encode_remove(ROOT, b"a\nb")]))
    assert ns.lookup(ROOT_INODE, b"a\nb").ino == 0x300
    ns.close()


@pytest.mark.parametrize("step", [7, 4096, 1 << 20])
def test_bulk_load_in_any_step_size_gives_the_same_namespace(tmp_path, monkeypatch, step):
    from spokefs.namespace import replica as namespace
    monkeypatch.setattr(namespace._BulkLoader, "_STEP", step)
    ns = Namespace(tmp_path)
    info = ns.reload_snapshot(wire.snapshot(7, ROOT, tree())).info
    assert (info.entries, info.total_bytes) == (505, 5 + 5 + 6 + sum(range(500)))  # per name
    sub = ns.lookup(ROOT_INODE, b"sub dir")
    assert [n for _, n, _ in ns.readdir(sub.ino, 0)][:3] == [b"hardlink", b"\xff\xfe", b"f00000"]
    assert ns.getattr(0x300).parent_id == ROOT  # a hard link: the first entry's attributes


def test_a_name_twice_across_load_steps_is_rejected(tmp_path, monkeypatch):
    from spokefs.namespace import replica as namespace
    monkeypatch.setattr(namespace._BulkLoader, "_STEP", 5)
    ns = Namespace(tmp_path)
    twice = [*tree(), Entry(0x9000, 0x200, REG, 1, 1, 1, 1, b"f00003")]
    with pytest.raises(protocol.WireError, match="listed twice"):
        ns.reload_snapshot(wire.snapshot(7, ROOT, twice))
    assert ns.info is None


def test_a_reload_invalidates_every_old_directory(tmp_path):
    ns = loaded(tmp_path)
    applied = ns.reload_snapshot(wire.snapshot(8, ROOT, tree()[:3]))
    assert {ROOT_INODE, 0x200} <= set(applied.inodes)  # listings the kernel may hold


def test_readdir_types_match_readdir(tmp_path):
    ns = Namespace(tmp_path)
    ns.reload_snapshot(wire.snapshot(7, ROOT, tree()))
    for ino in (ROOT_INODE, 0x200):
        want = [(pos, name, a.ino, a.mode) for pos, name, a in ns.readdir(ino, 0)]
        assert list(ns.readdir_types(ino, 0)) == want and want
        assert list(ns.readdir_types(ino, want[1][0])) == want[2:]


def test_readdir_rows_match_readdir(tmp_path):
    ns = Namespace(tmp_path)
    ns.reload_snapshot(wire.snapshot(7, ROOT, tree()))
    for ino in (ROOT_INODE, 0x200):
        rows = list(ns.readdir_rows(ino, 0))
        want = [
            (pos, name, a.ino, a.mode, len(a.target) if stat.S_ISLNK(a.mode) else a.size,
             a.mtime_ns, a.nlink)
            for pos, name, a in ns.readdir(ino, 0)
        ]
        assert rows == want and rows
        assert list(ns.readdir_rows(ino, rows[-1][0])) == []
    assert list(ns.readdir_rows(0x200, 100)) == list(ns.readdir_rows(0x200, 0))[100:]


def test_subdirs_parent_and_files(tmp_path):
    ns = Namespace(tmp_path)
    ns.reload_snapshot(wire.snapshot(7, ROOT, [*tree(), Entry(0x600, ROOT, DIR, 0, 1, 2, 0,
                                                              b"other")]))
    assert ns.subdirs(ROOT) == [0x200, 0x600] and ns.subdirs(0x200) == []
    assert (ns.parent_of(ROOT), ns.parent_of(0x600)) == (0, ROOT)
    files = ns.dir_files_named(0x200)  # regular files only: not the symlink
    assert len(files) == 501 and (b"hardlink", 0x300, 0xAA, 5) in files
    assert sorted(f[1:] for f in files)[:2] == [(0x300, 0xAA, 5), (0x1000, 0, 0)]
    assert ns.dir_files_named(ROOT) == [(b"a\nb", 0x300, 0xAA, 5)]


async def test_dir_lister_keeps_a_parents_subdirs_per_generation(tmp_path):
    from spokefs.fuse.mount import _DirLister
    ns = Namespace(tmp_path)
    ns.reload_snapshot(wire.snapshot(7, ROOT, tree()))
    lister = _DirLister(ns)
    assert await lister.siblings(0x200) == (ROOT, [0x200])  # the whole list, itself included
    assert await lister.siblings(ROOT) == (0, [])
    extra = Entry(0x600, ROOT, DIR, 0, 1, 2, 0, b"other")
    ns.reload_snapshot(wire.snapshot(8, ROOT, [*tree(), extra]))  # a new generation
    assert await lister.siblings(0x200) == (ROOT, [0x200, 0x600])


async def test_dir_lister_packs_match_the_hubs_per_generation(tmp_path):
    """The spoke cuts a directory's packs exactly as the hub does from the same snapshot
    entries (same URLs), and again when a new generation changes the directory."""
    from spokefs.fuse.mount import _DirLister
    from spokefs.types import FileVersion
    ns = Namespace(tmp_path)
    ns.reload_snapshot(wire.snapshot(7, ROOT, tree()))
    lister = _DirLister(ns)

    def hubs(entries: list[Entry], dir_id: int) -> list[protocol.PackPlan]:
        return protocol.plan_packs(dir_id, [(e.name, e.file_id, e.version, e.size)
                                        for e in entries if e.parent_id == dir_id
                                        and stat.S_ISREG(e.mode)])

    assert await lister.packs(0x200) == hubs(tree(), 0x200)
    assert await lister.packs(ROOT) == hubs(tree(), ROOT)
    (plan,) = await lister.packs(0x200)  # 499 files of 1..499 bytes, the hard link once
    assert len(plan.members) == 500 and (0x300, 0xAA, 5) in plan.members
    assert await lister.pack_of(0x200, FileVersion(0x1005, 5, 5)) == plan
    assert await lister.pack_of(0x200, FileVersion(0x1005, 6, 5)) is None  # another version
    assert await lister.pack_of(ROOT, FileVersion(0x1005, 5, 5)) is None  # not listed there
    changed = [e if e.file_id != 0x1005 else Entry(0x1005, 0x200, REG, 7, 9, 1, 99, e.name)
               for e in tree()]
    ns.reload_snapshot(wire.snapshot(8, ROOT, changed))  # a new generation
    (new,) = await lister.packs(0x200)
    assert [new] == hubs(changed, 0x200) and new.digest != plan.digest
