"""Two hubs over one export agree exactly: ids, versions, generations, changes.

"The same export on two machines" is stood in for two ways: two hubd processes over one
directory, started at different times (same ``st_dev``); and two hubd processes over two
read-only mounts of one ext4 image through two loop devices, which give the same inode
numbers under another ``st_dev`` each (as one NFS export does on two machines), with a
second image mounted below the root, whose inode numbers repeat the first's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hubd.export_root import ExportRoot
from spokefs import protocol
from tests.hubd.hubd_testlib import Hub, Tree, decode_snapshot, paths_of, unframed
from tests.hubd.test_hubd_changes import decode_changes
from tests.hubd.test_hubd_rescan import assert_error, snapshot

StartHub = Callable[..., Hub]


def _changes(hub: Hub, since: int) -> tuple[int, bytes]:
    answer = hub.request(f"{protocol.CHANGES_PATH}?since={since}")
    return answer.status, answer.body


def test_two_hubs_over_one_directory_serve_identical_snapshots(
        tree: Tree, start_hub: StartHub) -> None:
    a = start_hub(tree.root)
    time.sleep(0.05)  # a different start, a different scan time: nothing may depend on it
    b = start_hub(tree.root)
    assert a.request(protocol.SNAPSHOT_PATH).body == b.request(protocol.SNAPSHOT_PATH).body
    first, _ = snapshot(a)
    (tree.root / "new.txt").write_bytes(b"new")
    os.unlink(tree.root / "plain.txt")
    _rescan(a)
    time.sleep(0.05)
    _rescan(b)
    after_a = a.request(protocol.SNAPSHOT_PATH).body
    after_b = b.request(protocol.SNAPSHOT_PATH).body
    assert after_a == after_b
    second, entries = decode_snapshot(after_a)
    assert second.generation > first.generation
    # A spoke that got `first` from A asks B: the same changes, byte for byte.
    assert _changes(a, first.generation) == _changes(b, first.generation)
    header, _ = decode_changes(_changes(b, first.generation)[1])
    assert (header.from_generation, header.to_generation) == (first.generation, second.generation)
    new = paths_of(entries)[b"new.txt"]
    for hub in (a, b):
        assert unframed(hub.request(protocol.blob_path(new.file_id, new.version)).body) == b"new"


def test_a_hub_never_answers_changes_from_a_generation_it_did_not_number(
        tree: Tree, start_hub: StartHub) -> None:
    """B started after the change: it never saw A's first tree, so `since` A's first
    generation is 410 (take a snapshot), never a guess."""
    a = start_hub(tree.root)
    first, _ = snapshot(a)
    (tree.root / "new.txt").write_bytes(b"new")
    b = start_hub(tree.root)
    _rescan(a)
    assert snapshot(a)[0].generation == snapshot(b)[0].generation
    assert _changes(a, first.generation)[0] == 200
    assert_error(b.request(f"{protocol.CHANGES_PATH}?since={first.generation}"), 410,
                 "generation-gone")


def test_a_restarted_hub_keeps_its_generation(tree: Tree, start_hub: StartHub) -> None:
    a = start_hub(tree.root)
    before = a.request(protocol.SNAPSHOT_PATH).body
    assert a.stop() == 0
    again = start_hub(tree.root)
    assert again.request(protocol.SNAPSHOT_PATH).body == before


def _rescan(hub: Hub) -> None:
    """SIGHUP and wait for the rescan's log line."""
    done = hub.stderr().count("rescanned ")
    hub.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while hub.stderr().count("rescanned ") <= done:
        assert time.monotonic() < deadline, hub.stderr()
        time.sleep(0.02)


# -- another st_dev: one image through two loop devices --------------------------------


def _loop_usable() -> str | None:
    if os.geteuid() != 0:
        return "loop mounts need root"
    if not os.path.exists("/dev/loop-control") or shutil.which("losetup") is None:
        return "no loop devices here"
    if shutil.which("mkfs.ext4") is None:
        return "mkfs.ext4 (e2fsprogs) is missing"
    return None


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout


@contextlib.contextmanager
def _loop_mount(image: Path, at: Path) -> Iterator[None]:
    """Mount ``image`` read-only at ``at`` through a loop device of its own."""
    dev = _run("losetup", "--find", "--show", "--read-only", str(image)).strip()
    try:
        _run("mount", "-t", "ext4", "-o", "ro,noload", dev, str(at))
        try:
            yield
        finally:
            _run("umount", str(at))
    finally:
        _run("losetup", "--detach", dev)


def _image(tmp: Path, name: str, files: dict[str, bytes], dirs: tuple[str, ...] = ()) -> Path:
    src = tmp / f"{name}-src"
    for d in dirs:
        (src / d).mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    image = tmp / f"{name}.img"
    with open(image, "wb") as f:
        f.truncate(8 << 20)
    _run("mkfs.ext4", "-q", "-F", "-d", str(src), str(image))
    return image


@pytest.fixture
def two_views(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """One export seen through two mounts (other st_dev, same inodes), each with a second
    filesystem mounted at ``inner``."""
    if (why := _loop_usable()) is not None:
        pytest.skip(why)
    outer = _image(tmp_path, "outer", {"a.bin": b"A" * 5000, "dir/b.txt": b"bee"},
                   dirs=("inner",))
    # The same layout: mkfs gives the same inode numbers to the same paths.
    inner = _image(tmp_path, "inner", {"a.bin": b"other a", "dir/b.txt": b"other b"})
    views = (tmp_path / "view1", tmp_path / "view2")
    with contextlib.ExitStack() as stack:
        for view in views:
            view.mkdir()
            stack.enter_context(_loop_mount(outer, view))
            stack.enter_context(_loop_mount(inner, view / "inner"))
        yield views


def test_two_st_devs_give_the_same_ids_and_mounts_below_root_do_not_collide(
        two_views: tuple[Path, Path], start_hub: StartHub) -> None:
    v1, v2 = two_views
    assert os.stat(v1).st_dev != os.stat(v2).st_dev
    assert os.stat(v1 / "a.bin").st_ino == os.stat(v1 / "inner" / "a.bin").st_ino
    a, b = start_hub(v1), start_hub(v2)
    body = a.request(protocol.SNAPSHOT_PATH).body
    assert body == b.request(protocol.SNAPSHOT_PATH).body  # ids, versions, generation: all equal
    _, entries = decode_snapshot(body)
    got = paths_of(entries)
    outer_a, inner_a = got[b"a.bin"], got[b"inner/a.bin"]
    assert outer_a.file_id != inner_a.file_id  # equal inode numbers, two filesystems
    assert len({e.file_id for e in entries}) == len(entries)
    for hub in (a, b):
        for entry, want in ((outer_a, b"A" * 5000), (inner_a, b"other a")):
            answer = hub.request(protocol.blob_path(entry.file_id, entry.version))
            assert unframed(answer.body) == want


def test_hard_links_share_an_id_through_either_view(
        tmp_path: Path, start_hub: StartHub) -> None:
    if (why := _loop_usable()) is not None:
        pytest.skip(why)
    src = tmp_path / "linked-src"
    src.mkdir()
    (src / "one").write_bytes(b"linked bytes")
    os.link(src / "one", src / "two")
    image = tmp_path / "linked.img"
    with open(image, "wb") as f:
        f.truncate(8 << 20)
    _run("mkfs.ext4", "-q", "-F", "-d", str(src), str(image))
    views = (tmp_path / "l1", tmp_path / "l2")
    with contextlib.ExitStack() as stack:
        for view in views:
            view.mkdir()
            stack.enter_context(_loop_mount(image, view))
        hubs = [start_hub(view) for view in views]
        ids = []
        for hub in hubs:
            got = paths_of(decode_snapshot(hub.request(protocol.SNAPSHOT_PATH).body)[1])
            assert got[b"one"].file_id == got[b"two"].file_id
            ids.append(got[b"one"].file_id)
        assert ids[0] == ids[1]
        for hub in hubs:  # unmounted views would fail the hubs' stop: stop them first
            assert hub.stop() == 0


def test_in_process_scans_agree_across_views(two_views: tuple[Path, Path]) -> None:
    exports = [ExportRoot(str(view)) for view in two_views]
    try:
        snaps = [export.rescan() for export in exports]
        assert snaps[0].encoded == snaps[1].encoded
        for export, snap in zip(exports, snaps, strict=True):
            entry = paths_of(list(snap.entries))[b"inner/dir/b.txt"]
            fd, size = export.open_file(snap, entry.file_id, entry.version)
            os.close(fd)
            assert size == 7
    finally:
        for export in exports:
            export.close()


def test_a_bind_mount_of_the_root_below_another_filesystem_is_not_a_cycle(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """ROOT bind-mounted inside a filesystem mounted below ROOT: the bind mount's entry has
    another mount path (so another id) than ROOT, yet it is ROOT: skipped by its real
    st_dev and inode, not walked until MAX_DEPTH."""
    if (why := _loop_usable()) is not None:
        pytest.skip(why)
    root = tmp_path / "root"
    (root / "img").mkdir(parents=True)
    (root / "f.txt").write_bytes(b"f")
    image = _image(tmp_path, "img", {"g.txt": b"g"}, dirs=("inner",))
    with _loop_mount(image, root / "img"):
        _run("mount", "--bind", str(root), str(root / "img" / "inner"))
        try:
            export = ExportRoot(str(root))
            with caplog.at_level("WARNING", logger="hubd"):
                snap = export.rescan()
            export.close()
        finally:
            _run("umount", str(root / "img" / "inner"))
    got = paths_of(list(snap.entries))
    assert set(got) == {b"", b"f.txt", b"img", b"img/g.txt", b"img/lost+found"}, set(got)
    assert "directory img/inner seen twice (bind mount?): skipped" in caplog.messages
