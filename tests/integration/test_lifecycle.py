"""Cache lifecycle with a real hub and real mounts: restarts, kills, dataset changes, one
version per open file, warm and status."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import procs
from tests.helpers.procs import SpokeMount, is_mounted, run_spokefs

pytestmark = pytest.mark.fuse

MiB = 1 << 20


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def make_tree(root: Path) -> None:
    rnd = __import__("random").Random(7)
    for i in range(6):
        write(root / "shards" / f"s{i}.bin", rnd.randbytes(3 * MiB + i))
    for i in range(20):
        write(root / "small" / f"f{i:02}", rnd.randbytes(rnd.randrange(1, 70_000)))
    write(root / "labels.csv", b"a,1\nb,2\n")
    (root / "gone-dir" / "sub").mkdir(parents=True)
    write(root / "gone-dir" / "sub" / "x", b"x" * 5000)
    write(root / "moved-dir" / "y", b"y" * 7000)


def snapshot_of(root: Path) -> dict[str, tuple[int, int, str]]:
    """rel path -> (mode, size, sha256 or '') for every entry, symlinks not followed."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath, name)
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, digest)
    return out


def names_of(root: Path) -> set[str]:
    return {str(Path(d, n).relative_to(root)) for d, ds, fs in os.walk(root) for n in ds + fs}


def refreshed(mnt: Path, after: int, timeout_s: float = 20.0) -> int:
    """``spokefs refresh`` until the namespace generation passes ``after``."""
    deadline = time.monotonic() + timeout_s
    while True:
        res = run_spokefs("refresh", str(mnt))
        assert res.returncode == 0, res.stderr
        gen = int(res.stdout.split()[-1])
        if gen > after or time.monotonic() > deadline:
            return gen
        time.sleep(0.2)


def generation(mnt: Path) -> int:
    res = run_spokefs("refresh", str(mnt))
    assert res.returncode == 0, res.stderr
    return int(res.stdout.split()[-1])


@pytest.fixture
def src(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    make_tree(root)
    return root


def test_restart_browses_at_once_and_serves_cached_blocks_offline(src, tmp_path, hub_factory,
                                                                  mount_factory):
    hub = hub_factory(root=src)
    cache = tmp_path / "cache"
    first = mount_factory(hub.url, cache_dir=cache)
    shard = (first.mnt / "shards" / "s1.bin").read_bytes()
    first.unmount()
    first.assert_clean_exit()
    hub.stop()
    again = mount_factory(hub.url, "--hub-deadline", "2", "--mount-deadline", "1",
                          cache_dir=cache)
    assert names_of(again.mnt) == names_of(src)  # the stored namespace, no hub needed
    assert (again.mnt / "shards" / "s1.bin").read_bytes() == shard == (
        src / "shards" / "s1.bin").read_bytes()
    # never fetched (s2 may be: reading s1 reads ahead across its end), and the hub is away
    with pytest.raises(OSError) as info:
        (again.mnt / "shards" / "s0.bin").read_bytes()
    assert info.value.errno == errno.EIO


def test_kill9_then_remount_is_consistent(src, tmp_path, hub_factory, mount_factory,
                                          make_mountpoint):
    hub = hub_factory(root=src)
    cache = tmp_path / "cache"
    spoke = SpokeMount(hub.url, make_mountpoint("killed"), cache, tmp_path / "killed")
    try:
        spoke.start()
        for p in sorted((spoke.mnt / "shards").iterdir())[:3]:
            p.read_bytes()
        assert spoke.proc is not None
        spoke.proc.send_signal(signal.SIGKILL)
        spoke.proc.wait(timeout=10)
        res = run_spokefs("umount", str(spoke.mnt))  # clears the dead mount
        assert res.returncode == 0, res.stderr
        assert not is_mounted(spoke.mnt)
    finally:
        spoke.unmount()
    again = mount_factory(hub.url, cache_dir=cache)
    assert snapshot_of(again.mnt) == {
        k: (m, s, d) for k, (m, s, d) in snapshot_of(src).items()
    }


def test_dataset_changes_show_up_after_refresh(src, hub_factory, mount_factory):
    hub = hub_factory(root=src, args=("--rescan-interval", "0"))
    spoke = mount_factory(hub.url, "--refresh-interval", "0")
    mnt = spoke.mnt
    snapshot_of(mnt)  # read everything once: the kernel and the cache know the old tree
    before = generation(mnt)
    write(src / "new-file", b"new" * 1000)                                  # new
    (src / "small" / "f00").unlink()                                        # removed
    os.rename(src / "small" / "f01", src / "small" / "f01-renamed")         # renamed
    with open(src / "small" / "f02", "ab") as f:                            # grown
        f.write(b"more" * 5000)
    os.truncate(src / "shards" / "s0.bin", 12345)                           # truncated
    data = bytearray((src / "shards" / "s3.bin").read_bytes())              # rewritten
    data[100:200] = b"\0" * 100
    write(src / "shards" / "s3.bin", bytes(data))
    os.utime(src / "shards" / "s3.bin", ns=(1, 2_000_000_000_000_000_000))
    write(src / "new-dir" / "inner" / "z", b"z" * 100)                     # new dir
    for p in (src / "gone-dir" / "sub" / "x", ):                            # removed dir
        p.unlink()
    (src / "gone-dir" / "sub").rmdir()
    (src / "gone-dir").rmdir()
    os.rename(src / "moved-dir", src / "small" / "moved-here")              # renamed dir
    hub.proc.send_signal(signal.SIGHUP)
    assert refreshed(mnt, before) > before
    assert snapshot_of(mnt) == snapshot_of(src)


def test_open_file_reads_one_version_and_new_opens_see_new_bytes(src, hub_factory,
                                                                  mount_factory):
    hub = hub_factory(root=src, args=("--rescan-interval", "0"))
    spoke = mount_factory(hub.url, "--refresh-interval", "0", "--log-level", "DEBUG",
                          "--open-mode", "handle")
    path = spoke.mnt / "shards" / "s4.bin"
    old = (src / "shards" / "s4.bin").read_bytes()
    before = generation(spoke.mnt)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 65536, 0) == old[:65536]
        new = bytes(b ^ 0xFF for b in old[: 4 * MiB])
        write(src / "shards" / "s4.bin", new)
        hub.proc.send_signal(signal.SIGHUP)
        assert refreshed(spoke.mnt, before) > before
        assert os.pread(fd, 65536, 0) == old[:65536]  # cached: still the old version
        with pytest.raises(OSError) as info:  # not cached, and gone on the hub
            os.pread(fd, 4096, 3 * MiB)
        assert info.value.errno == errno.ESTALE
    finally:
        os.close(fd)
    assert path.read_bytes() == new  # a new open sees the new version


def test_kernel_opens_read_the_new_version_after_a_change(src, hub_factory, mount_factory):
    # what --open-mode kernel gives up: an open file follows the hub's current version
    hub = hub_factory(root=src, args=("--rescan-interval", "0"))
    spoke = mount_factory(hub.url, "--refresh-interval", "0", "--open-mode", "kernel")
    path = spoke.mnt / "shards" / "s4.bin"
    old = (src / "shards" / "s4.bin").read_bytes()
    before = generation(spoke.mnt)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 65536, 0) == old[:65536]
        new = bytes(b ^ 0xFF for b in old[: 4 * MiB])
        write(src / "shards" / "s4.bin", new)
        hub.proc.send_signal(signal.SIGHUP)
        assert refreshed(spoke.mnt, before) > before
        # the kernel's pages of the old version were dropped: whole reads are all new
        assert os.pread(fd, 65536, 0) == new[:65536]
        assert os.pread(fd, 4096, 3 * MiB) == new[3 * MiB : 3 * MiB + 4096]
    finally:
        os.close(fd)
    assert path.read_bytes() == new  # and so does a new open


def test_warm_then_status_then_read_without_the_hub(src, hub_factory, mount_factory):
    hub = hub_factory(root=src)
    spoke = mount_factory(hub.url)
    res = run_spokefs("warm", str(spoke.mnt / "shards"), str(spoke.mnt / "labels.csv"))
    assert res.returncode == 0, res.stderr
    status = run_spokefs("status", str(spoke.mnt / "shards"))
    assert status.returncode == 0, status.stderr
    assert "(100.0%)" in status.stdout.splitlines()[-1], status.stdout
    again = run_spokefs("warm", str(spoke.mnt / "shards"))  # resumable: nothing left to do
    assert "6 were cached already" in again.stdout, again.stdout
    assert os.getxattr(spoke.mnt / "small", "user.spokefs.cached").split()[0] == b"0"
    hub.stop()
    for p in (spoke.mnt / "shards").iterdir():
        assert p.read_bytes() == (src / "shards" / p.name).read_bytes()


def test_control_commands_reject_paths_outside_a_mount(tmp_path):
    res = run_spokefs("status", str(tmp_path))
    assert res.returncode == 1 and res.stderr.startswith("spokefs: error:"), res.stderr
    assert "Traceback" not in res.stderr


def test_warmed_blocks_are_counted_as_warm_hits(src, hub_factory, mount_factory):
    hub = hub_factory(root=src)
    free_port = procs.free_port()  # after the hub bound its port 0, so it cannot be that one
    spoke = mount_factory(hub.url, "--metrics-port", str(free_port),
                          "--metrics-addr", "127.0.0.1")
    shard = spoke.mnt / "shards" / "s5.bin"
    res = run_spokefs("warm", str(shard))
    assert res.returncode == 0, res.stderr
    cached, size = os.getxattr(shard, "user.spokefs.cached").split()
    assert cached == size
    hub.stop()
    assert shard.read_bytes() == (src / "shards" / "s5.bin").read_bytes()
    os.getxattr(spoke.mnt, "user.spokefs.cached")  # a worker's hits counted (counted_metrics)
    with urllib.request.urlopen(f"http://127.0.0.1:{free_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    hits = {origin: float(v) for origin, v in re.findall(
        r'^spokefs_block_hits_total\{origin="(\w+)"\} (\S+)$', text, re.M)}
    assert hits["warm"] >= int(size) // 4096 and hits["prefetch"] == 0, hits
    assert "spokefs_prefetch_issued_bytes_total 0.0" in text  # warming is not guessing
