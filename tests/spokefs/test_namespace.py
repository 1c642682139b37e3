from __future__ import annotations

import stat

import pytest

from hubd import wire
from hubd.wire import Entry
from spokefs.errors import NotFound
from spokefs.namespace import ROOT_INODE, Namespace

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
    info = ns.load_snapshot(wire.encode_snapshot(7, ROOT, tree()))
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
    good = ns.load_snapshot(wire.encode_snapshot(7, ROOT, tree()))
    with pytest.raises(wire.WireError):
        ns.load_snapshot(wire.encode_snapshot(8, ROOT, [*tree(), bad]))
    assert ns.info == good
    assert ns.lookup(ROOT_INODE, b"a\nb").ino == 0x300
    ns.close()


def test_truncated_snapshot_is_rejected(tmp_path):
    ns = Namespace(tmp_path)
    blob = wire.encode_snapshot(7, ROOT, tree())
    with pytest.raises(wire.WireError):
        ns.load_snapshot(blob[: len(blob) // 2])
    assert ns.info is None
    ns.close()
