"""One mount served by the threads of a native read loop in a worker process (``--workers N``),
on real mounts with a real hub: bytes, metrics, namespace changes, every kind of answer the
same as the mount's own process gives, and the kill cases (the worker, the coordinator)."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import procs
from tests.helpers.procs import SpokeMount, is_mounted, mount_fails, scrape_metrics
from tests.integration.test_lifecycle import generation, make_tree, refreshed, snapshot_of, write

pytestmark = pytest.mark.fuse

MiB = 1 << 20


@pytest.fixture
def src(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    make_tree(root)
    return root


def drop_page_cache() -> None:
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s:g}s: {what}")
        time.sleep(0.05)


def worker_pids(spoke: SpokeMount) -> list[int]:
    assert spoke.proc is not None
    pid = spoke.proc.pid
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = []
    for child in children:
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"spokefs.fuse.worker" in argv:
            out.append(int(child))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def mounted_with_workers(mount_factory, url: str, workers: int, port: int,
                         *args: str, cache_dir: Path | None = None) -> SpokeMount:
    spoke = mount_factory(url, "--workers", str(workers), "--metrics-port", str(port), *args,
                          cache_dir=cache_dir)
    wait_for(f"{workers} threads serving",
             lambda: scrape_metrics(port)["spokefs_workers"] == workers
             and len(worker_pids(spoke)) == (1 if workers else 0))
    return spoke


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_every_byte_and_every_read_counted_whichever_process_serves(
        src, hub_factory, mount_factory, free_port, workers):
    hub = hub_factory(root=src)
    spoke = mounted_with_workers(mount_factory, hub.url, workers, free_port)
    want = snapshot_of(src)
    assert snapshot_of(spoke.mnt) == want  # cold: misses go to the coordinator
    drop_page_cache()
    assert snapshot_of(spoke.mnt) == want  # warm: served from the cache by any process
    total = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    # /metrics has the totals of every process: each pass read every byte once, and the
    # second one from the cache (worker hits come to the coordinator as events)
    wait_for("every read counted", lambda: scrape_metrics(free_port)["spokefs_read_bytes_total"]
             >= 2 * total, timeout_s=5)
    m = scrape_metrics(free_port)
    assert m["spokefs_read_bytes_total"] == 2 * total
    assert m["spokefs_worker_restarts_total"] == 0


@pytest.mark.parametrize("xxh3", ["default", "baseline"])
def test_workers_serve_cached_reads_while_the_coordinator_is_stopped(
        src, hub_factory, mount_factory, free_port, monkeypatch, xxh3):
    # every byte the worker serves passed its checksum in C (a failed one would go to the
    # stopped coordinator and time out), on AVX2 where the CPU has it and on the baseline
    monkeypatch.setenv("SPOKEFS_XXH3", xxh3)
    hub = hub_factory(root=src)
    spoke = mounted_with_workers(mount_factory, hub.url, 3, free_port)
    want = files_of(src)
    assert files_of(spoke.mnt) == want  # now cached
    drop_page_cache()
    assert spoke.proc is not None
    spoke.proc.send_signal(signal.SIGSTOP)
    try:  # lookups and reads of cached files need nothing of the coordinator
        done = subprocess.run(["timeout", "30", "sh", "-c",
                               f"cd {spoke.mnt} && find . -type f | sort | xargs sha256sum"],
                              capture_output=True, text=True, check=False)
    finally:
        spoke.proc.send_signal(signal.SIGCONT)
    assert done.returncode == 0, done.stderr
    expected = subprocess.run(["sh", "-c", f"cd {src} && find . -type f | sort | xargs sha256sum"],
                              capture_output=True, text=True, check=True)
    assert done.stdout == expected.stdout


def test_a_killed_worker_is_replaced_and_its_held_read_does_not_hang(
        src, hub_factory, mount_factory, free_port):
    hub = hub_factory(root=src)
    spoke = mounted_with_workers(mount_factory, hub.url, 3, free_port)
    assert spoke.proc is not None
    # hold a read in the worker: with the coordinator stopped, a miss it forwards waits
    spoke.proc.send_signal(signal.SIGSTOP)
    result: list[object] = []
    reader = threading.Thread(
        target=lambda: result.append(_read_or_error(spoke.mnt / "shards" / "s1.bin")),
        daemon=True)
    try:
        reader.start()
        time.sleep(1.0)
        victims = worker_pids(spoke)
        assert len(victims) == 1
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        wait_for("the worker gone", lambda: not any(alive(p) for p in victims))
    finally:
        spoke.proc.send_signal(signal.SIGCONT)
    reader.join(timeout=30)
    assert not reader.is_alive(), "a read held by a killed worker hung"
    assert result and (result[0] == (src / "shards" / "s1.bin").read_bytes()
                       or isinstance(result[0], OSError)), result
    wait_for("the worker replaced", lambda: len(worker_pids(spoke)) == 1
             and scrape_metrics(free_port)["spokefs_workers"] == 3)
    assert scrape_metrics(free_port)["spokefs_worker_restarts_total"] == 1
    assert set(worker_pids(spoke)).isdisjoint(victims)
    drop_page_cache()
    assert snapshot_of(spoke.mnt) == snapshot_of(src)  # and the mount serves on


def test_the_mount_serves_while_its_worker_is_down(src, hub_factory, mount_factory, free_port):
    """Between a worker's death and its replacement the coordinator reads the requests."""
    hub = hub_factory(root=src)
    spoke = mounted_with_workers(mount_factory, hub.url, 2, free_port)
    want = files_of(src)
    assert files_of(spoke.mnt) == want
    (victim,) = worker_pids(spoke)
    os.kill(victim, signal.SIGSTOP)  # a worker that serves nothing (stuck on a dead disk, say)
    try:
        os.kill(victim, signal.SIGKILL)
        wait_for("the worker gone", lambda: not alive(victim))
        drop_page_cache()
        assert files_of(spoke.mnt) == want  # whoever serves: the coordinator or the next one
    finally:
        if alive(victim):
            os.kill(victim, signal.SIGKILL)
    wait_for("the worker replaced", lambda: len(worker_pids(spoke)) == 1)


def _read_or_error(path: Path) -> bytes | OSError:
    try:
        return path.read_bytes()
    except OSError as exc:
        return exc


def test_a_killed_coordinator_takes_the_mount_and_its_workers_with_it(
        src, tmp_path, hub_factory, make_mountpoint, mount_factory, free_port):
    hub = hub_factory(root=src)
    cache = tmp_path / "cache"
    spoke = SpokeMount(hub.url, make_mountpoint("coord"), cache, tmp_path / "coord",
                       ("--workers", "3", "--metrics-port", str(free_port)))
    try:
        spoke.start()
        wait_for("the worker", lambda: len(worker_pids(spoke)) == 1)
        workers = worker_pids(spoke)
        want = files_of(src)
        assert files_of(spoke.mnt) == want
        assert spoke.proc is not None
        spoke.proc.send_signal(signal.SIGKILL)
        spoke.proc.wait(timeout=10)
        wait_for("the workers exit", lambda: not any(alive(p) for p in workers))
        wait_for("the mount gone", lambda: not is_mounted(spoke.mnt))
    finally:
        spoke.unmount()
    again = mount_factory(hub.url, "--workers", "3", cache_dir=cache)
    assert files_of(again.mnt) == want  # a remount on the same cache dir is clean


def test_sigterm_unmounts_cleanly_and_the_workers_exit_and_log_with_it(src, tmp_path, hub_factory,
                                                        make_mountpoint, free_port):
    hub = hub_factory(root=src)
    log_file = tmp_path / "spoke.log"  # as a daemon logs: its workers log there too
    spoke = SpokeMount(hub.url, make_mountpoint("term"), tmp_path / "cache", tmp_path / "term",
                       ("--workers", "3", "--metrics-port", str(free_port),
                        "--log-file", str(log_file)))
    try:
        spoke.start()
        wait_for("the worker", lambda: len(worker_pids(spoke)) == 1)
        workers = worker_pids(spoke)
        want = files_of(src)
        assert files_of(spoke.mnt) == want  # cold: the coordinator fills the cache
        drop_page_cache()
        assert files_of(spoke.mnt) == want  # warm: the worker's threads serve it
        assert spoke.proc is not None
        spoke.proc.send_signal(signal.SIGTERM)
        assert spoke.proc.wait(timeout=30) == 0, spoke.stderr()
        assert not is_mounted(spoke.mnt)
        wait_for("the workers exit", lambda: not any(alive(p) for p in workers), timeout_s=10)
        log = log_file.read_text()
        assert "Traceback" not in log + spoke.stderr(), log + spoke.stderr()
        assert "worker1 spokefs.fuse.worker: worker 1 serving" in log, log
        assert "worker1 spokefs.fuse.worker: worker 1 stopped" in log, log
        # its threads read the cached data with pread, never from the map (the fallback)
        stopped = re.search(r"worker 1 stopped: .*'read': (\d+).*'map_reads': (\d+)", log)
        assert stopped is not None, log
        assert int(stopped[1]) > 0 and int(stopped[2]) == 0, stopped[0]
    finally:
        spoke.unmount()


def test_a_change_on_the_hub_reaches_every_worker(src, hub_factory, mount_factory, free_port):
    hub = hub_factory(root=src, args=("--rescan-interval", "0"))
    spoke = mounted_with_workers(mount_factory, hub.url, 3, free_port, "--refresh-interval", "0")
    path = spoke.mnt / "shards" / "s4.bin"
    old = (src / "shards" / "s4.bin").read_bytes()
    assert path.read_bytes() == old
    before = generation(spoke.mnt)
    new = bytes(b ^ 0xFF for b in old[: 4 * MiB])
    write(src / "shards" / "s4.bin", new)
    hub.proc.send_signal(signal.SIGHUP)
    assert refreshed(spoke.mnt, before) > before
    for _ in range(6):  # each read goes to whichever thread takes it: all must see it
        drop_page_cache()
        assert path.read_bytes() == new
    assert snapshot_of(spoke.mnt) == snapshot_of(src)


@pytest.mark.parametrize(("args", "says"), [
    (("--workers", "3", "--open-mode", "handle"), "needs --open-mode kernel"),
    (("--workers", "65"), "give 0 to 64"),
    (("--workers", "-1"), "give 0 to 64"),
    (("--workers", "many"), "give a number of threads"),
])
def test_bad_worker_counts_are_refused_before_mounting(tmp_path, make_mountpoint, args, says):
    line = mount_fails("http://127.0.0.1:9", make_mountpoint("bad"), tmp_path / "cache", *args)
    assert says in line


def _outcome(fn: Callable[[], object]) -> object:
    """What a call gives, or the errno it fails with."""
    try:
        return fn()
    except OSError as exc:
        return ("errno", errno.errorcode.get(exc.errno or 0, exc.errno))


def observed(mnt: Path) -> dict[str, object]:
    """Every kind of answer a mount gives, for its whole tree: attributes, listings in their
    order and with their types, link targets, statfs, attributes of ours and others', opens
    that must fail, missing and overlong names, reads at the edges and through mmap."""
    out: dict[str, object] = {}
    st = os.statvfs(mnt)
    out["statvfs"] = (st.f_bsize, st.f_frsize, st.f_blocks, st.f_bfree, st.f_files,
                      st.f_namemax)
    out["root ino"] = os.stat(mnt).st_ino
    for dirpath, dirs, files in os.walk(mnt):
        here = Path(dirpath)
        rel = str(here.relative_to(mnt))
        out[f"list {rel}"] = [(e.name, e.is_dir(follow_symlinks=False),
                               e.is_file(follow_symlinks=False), e.is_symlink(), e.inode())
                              for e in os.scandir(here)]
        out[f"missing {rel}"] = _outcome(lambda h=here: os.stat(h / "no-such-name"))
        out[f"too long {rel}"] = _outcome(lambda h=here: os.stat(h / ("n" * 256)))
        out[f"opendir as file {rel}"] = _outcome(lambda h=here: os.open(h, os.O_WRONLY))
        for name in dirs + files:
            p = here / name
            key = str(p.relative_to(mnt))
            s = p.lstat()
            out[f"lstat {key}"] = (s.st_mode, s.st_size, s.st_nlink, s.st_uid, s.st_gid,
                                   s.st_mtime_ns, s.st_ctime_ns, s.st_blocks, s.st_blksize,
                                   s.st_ino)
            out[f"readlink {key}"] = _outcome(lambda p=p: os.readlink(p))
            out[f"xattr {key}"] = _outcome(lambda p=p: os.getxattr(p, "user.spokefs.cached"))
            out[f"other xattr {key}"] = _outcome(lambda p=p: os.getxattr(p, "user.other"))
            out[f"xattr size {key}"] = _outcome(
                lambda p=p: os.getxattr(p, "user.spokefs.nonesuch"))
            out[f"listxattr {key}"] = _outcome(lambda p=p: os.listxattr(p))
            if p.is_file() and not p.is_symlink():
                out[f"write {key}"] = _outcome(lambda p=p: os.open(p, os.O_WRONLY))
                out[f"reads {key}"] = _edge_reads(p)
    return out


def _edge_reads(path: Path) -> list[object]:
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        got: list[object] = [os.pread(fd, n, off) for off, n in (
            (0, 1), (0, 4096), (4095, 2), (65535, 3), (max(size - 1, 0), 10), (size, 10),
            (size + 100, 10), (size // 3, 200_000))]
        if size:
            with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
                got.append(hashlib.sha256(m[:]).hexdigest())
        return got
    finally:
        os.close(fd)


def test_the_worker_answers_every_request_as_the_mount_itself_does(
        src, tmp_path, hub_factory, mount_factory, free_port):
    (src / "links").mkdir()
    os.symlink("../small/f01", src / "links" / "to-file")
    os.symlink("nowhere", src / "links" / "dangling")
    os.link(src / "small" / "f02", src / "small" / "hard-f02")
    write(src / "empty", b"")
    hub = hub_factory(root=src)
    own = mounted_with_workers(mount_factory, hub.url, 0, free_port,
                               cache_dir=tmp_path / "own-cache")
    port = procs.free_port()
    native = mounted_with_workers(mount_factory, hub.url, 2, port,
                                  cache_dir=tmp_path / "native-cache")
    for spoke in (own, native):
        files_of(spoke.mnt)  # everything cached: the worker answers reads itself
    drop_page_cache()
    assert observed(native.mnt) == observed(own.mnt)
