"""export_root in-process: the scan (ids, versions, order, odd entries) and confined opens."""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from pathlib import Path

import pytest

from hubd.errors import StaleVersion, UnknownFile
from hubd.export_root import (
    ExportRoot,
    Snapshot,
    file_id_of,
    generation_of,
    next_generation,
    version_of,
)
from spokefs import protocol
from tests.hubd.hubd_testlib import DATA, ODD_NAMES, Tree, decode_snapshot, paths_of


def _scan(tree: Tree, caplog: pytest.LogCaptureFixture) -> tuple[ExportRoot, Snapshot]:
    export = ExportRoot(str(tree.root))
    with caplog.at_level(logging.WARNING, logger="hubd"):
        snap = export.rescan()
    return export, snap


def _expected(root: bytes) -> dict[bytes, os.stat_result]:
    """Relative path -> lstat for everything a snapshot must list (fifos left out)."""
    out = {b"": os.lstat(root)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_IFMT(st.st_mode) in (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK):
                out[os.path.relpath(path, root)] = st
    return out


def test_snapshot_lists_the_tree_exactly(tree: Tree, caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() == 0:  # mknod needs root
        os.mknod(tree.root / "sub" / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    export, snap = _scan(tree, caplog)
    header, entries = decode_snapshot(snap.encoded)
    assert header.generation == snap.generation and header.root_id == snap.root_id
    assert entries == list(snap.entries)
    got = paths_of(entries)
    want = _expected(tree.broot)
    assert got.keys() == want.keys()
    for path, st in want.items():
        e = got[path]
        assert (e.mode, e.mtime_ns, e.nlink) == (st.st_mode, st.st_mtime_ns, st.st_nlink), path
        assert e.size == st.st_size and e.file_id == file_id_of(st) and e.version == version_of(st)
        if stat.S_ISLNK(st.st_mode):
            assert e.target == os.readlink(os.path.join(tree.broot, path))
    for name in ODD_NAMES:
        assert got[name].size == len(name)
    assert got[os.path.join(b"dir\xff\n", b"inner")].size == 5
    assert got[b"sub/deeper/data.bin"].size == len(DATA)
    assert got[b"empty"].size == 0
    assert got[b"link_out"].target == os.fsencode(tree.outside / "secret.txt")
    assert b"fifo" not in got and b"sub/null" not in got
    skipped = sorted(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert len(caplog.records) == len(skipped)
    assert skipped == (["skipping character device sub/null", "skipping fifo fifo"]
                       if os.geteuid() == 0 else ["skipping fifo fifo"])
    export.close()


def test_hard_links_share_one_id_and_are_listed_per_link(
        tree: Tree, caplog: pytest.LogCaptureFixture) -> None:
    export, snap = _scan(tree, caplog)
    got = paths_of(list(snap.entries))
    one, two = got[b"hard1"], got[b"sub/hard2"]
    assert one.file_id == two.file_id and one.version == two.version and one.nlink == 2
    assert one.parent_id != two.parent_id
    ids = [e.file_id for e in snap.entries if e.name not in (b"hard1", b"hard2")]
    assert len(set(ids)) == len(ids)  # everything else is distinct
    assert all(e.file_id >= protocol.MIN_FILE_ID for e in snap.entries)
    assert all(e.file_id < 2**63 for e in snap.entries)
    export.close()


def test_ids_survive_rename_and_restart_versions_follow_content(
        tree: Tree, caplog: pytest.LogCaptureFixture) -> None:
    export, first = _scan(tree, caplog)
    before = paths_of(list(first.entries))[b"plain.txt"]
    # A restarted hub numbers its generation from the newest mtime (in ms) it finds; file
    # times come from the kernel's coarse clock (a tick: up to 4 ms), so a change in the
    # tick of the tree's last write could number it lower (one run in ~20 did): a later tick
    time.sleep(0.01)
    os.rename(tree.root / "plain.txt", tree.root / "sub" / "moved.txt")
    with open(tree.root / "sub" / "moved.txt", "ab") as f:
        f.write(b"more")
    export.close()
    export, second = _scan(tree, caplog)  # a new ExportRoot: as after a restart
    after = paths_of(list(second.entries))[b"sub/moved.txt"]
    assert after.file_id == before.file_id
    assert after.version != before.version
    assert second.generation > first.generation
    assert second.path_parts(after.file_id) == [b"sub", b"moved.txt"]
    assert second.path_parts(second.root_id) == []
    assert second.path_parts(12345) is None
    export.close()


def test_unreadable_directories_are_listed_empty(
        tree: Tree, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """EACCES on a directory (simulated: the tests run as root) skips only its contents."""
    real_open = os.open

    def guarded_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if path == b"deeper":
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    export = ExportRoot(str(tree.root))
    monkeypatch.setattr(os, "open", guarded_open)
    with caplog.at_level(logging.WARNING, logger="hubd"):
        snap = export.rescan()
    monkeypatch.undo()
    got = paths_of(list(snap.entries))
    assert b"sub/deeper" in got and b"sub/deeper/data.bin" not in got and b"sub/hard2" in got
    assert "cannot open sub/deeper: Permission denied (not listed)" in caplog.messages
    export.close()


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
def test_out_of_descriptors_fails_the_scan_instead_of_dropping_a_directory(
        tree: Tree, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """A directory that cannot be opened for want of descriptors is no reason to publish a
    snapshot without it: the rescan fails and the previous snapshot stays."""
    export = ExportRoot(str(tree.root))
    first = export.rescan()
    (tree.root / "sub" / "deeper" / "new.txt").write_bytes(b"new")  # something to rescan
    real_open = os.open

    def exhausted_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if path == b"deeper":
            raise OSError(code, os.strerror(code))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", exhausted_open)
    with pytest.raises(OSError) as err:
        export.rescan()
    monkeypatch.undo()
    assert err.value.errno == code
    assert export.snapshot is first  # unchanged, sub/deeper/data.bin still in it
    assert b"sub/deeper/data.bin" in paths_of(list(export.snapshot.entries))
    assert b"sub/deeper/new.txt" in paths_of(list(export.rescan().entries))  # recovered
    export.close()


def test_generation_is_a_function_of_the_table_and_always_grows(
        tree: Tree, caplog: pytest.LogCaptureFixture) -> None:
    export, snap = _scan(tree, caplog)
    table = snap.table
    derived = generation_of(table)
    assert snap.generation == derived  # the first scan: nothing to grow past
    assert derived >> 20 == max(e.mtime_ns for e in snap.entries) // 1_000_000
    assert next_generation(derived - 1, table) == derived  # any hub, any earlier generation
    # A tree whose newest mtime did not move (a chmod, touch -d): still above the previous,
    # by one millisecond, with the tree's own hash bits.
    later = next_generation(derived + 5, table)
    assert later == (((derived >> 20) + 1) << 20) | (derived & 0xFFFFF) and later > derived + 5
    top = (1 << 63) - 1
    assert next_generation(top - 1, table) == top  # no room for a millisecond more
    export.close()


def test_open_file_checks_kind_and_version(tree: Tree, caplog: pytest.LogCaptureFixture) -> None:
    export, snap = _scan(tree, caplog)
    got = paths_of(list(snap.entries))
    data = got[b"sub/deeper/data.bin"]
    fd, size = export.open_file(snap, data.file_id, data.version)
    assert size == len(DATA) and os.pread(fd, 4, 256) == bytes(range(4))
    os.close(fd)
    with pytest.raises(UnknownFile):
        export.open_file(snap, got[b"sub"].file_id, got[b"sub"].version)  # a directory
    with pytest.raises(UnknownFile):
        export.open_file(snap, got[b"link_in"].file_id, got[b"link_in"].version)
    with pytest.raises(StaleVersion):
        export.open_file(snap, data.file_id, data.version ^ 1)
    export.close()


def test_symlink_swapped_in_for_a_directory_is_never_followed(
        tree: Tree, caplog: pytest.LogCaptureFixture) -> None:
    """The swapped path leads to the very same inode (a hard link outside ROOT), so the id
    and version checks would pass: only the O_NOFOLLOW walk keeps hubd inside ROOT."""
    export, snap = _scan(tree, caplog)
    data = paths_of(list(snap.entries))[b"sub/deeper/data.bin"]
    escape = tree.outside / "deeper"
    escape.mkdir()
    os.link(tree.root / "sub" / "deeper" / "data.bin", escape / "data.bin")
    os.rename(tree.root / "sub" / "deeper", tree.root / "sub" / "moved-away")
    os.symlink(escape, tree.root / "sub" / "deeper")
    with pytest.raises(StaleVersion):
        export.open_file(snap, data.file_id, data.version)
    os.unlink(tree.root / "sub" / "deeper")
    with pytest.raises(UnknownFile):  # simply gone
        export.open_file(snap, data.file_id, data.version)
    export.close()


def test_symlink_swapped_in_for_the_file_is_never_followed(
        tree: Tree, caplog: pytest.LogCaptureFixture) -> None:
    export, snap = _scan(tree, caplog)
    plain = paths_of(list(snap.entries))[b"plain.txt"]
    os.link(tree.root / "plain.txt", tree.outside / "plain.txt")
    os.unlink(tree.root / "plain.txt")
    os.symlink(tree.outside / "plain.txt", tree.root / "plain.txt")
    with pytest.raises(StaleVersion):
        export.open_file(snap, plain.file_id, plain.version)
    export.close()


def test_a_directory_swapped_for_a_symlink_during_the_scan_is_not_listed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated race: the scan has stat-ed "d" as a directory, then "d" becomes a symlink
    before the scan opens it: the O_NOFOLLOW open refuses it and nothing outside is listed."""
    root = tmp_path / "r"
    (root / "d").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "leak").write_bytes(b"x")
    export = ExportRoot(str(root))
    real_scandir = os.scandir

    def racing_scandir(fd: int) -> _Listing:
        listing = _Listing(real_scandir(fd))
        for de in listing:
            de.stat(follow_symlinks=False)  # cached in the DirEntry, as if just scanned
        if (root / "d").is_dir() and not (root / "d").is_symlink():
            (root / "d").rmdir()
            (root / "d").symlink_to(tmp_path / "elsewhere")
        return listing

    monkeypatch.setattr(os, "scandir", racing_scandir)
    with caplog.at_level(logging.WARNING, logger="hubd"):
        snap = export.rescan()
    monkeypatch.undo()
    names = [e.name for e in snap.entries]
    assert b"leak" not in names and b"d" in names
    [record] = caplog.records
    assert record.getMessage().startswith("cannot open d: ")
    export.close()


class _Listing(list):  # type: ignore[type-arg]
    """A list that works as ``with os.scandir(...) as it``."""

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
