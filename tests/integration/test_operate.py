"""Operating a spoke: safe defaults, clear refusals, fstab and systemd readiness.

A real hubd on 127.0.0.1 and real FUSE mounts:

- the cache dir ends up 0700 and every file in it 0600 (also one made 0755/0644 before);
- a second mount on a cache dir in use, and a metrics port in use, fail with one line;
- ``/metrics`` listens on 127.0.0.1 unless told otherwise;
- ``--daemon`` without ``--log-file`` logs to ``CACHE_DIR/spokefs.log``;
- ``Type=notify``: ``READY=1`` reaches ``$NOTIFY_SOCKET`` once the mount serves;
- an fstab line of type ``fuse.spokefs`` mounts with ``mount -T FSTAB DIR`` and
  ``mount -a -T FSTAB`` (twice: the second sees it mounted) and unmounts with ``umount``,
  through ``/sbin/mount.fuse.spokefs`` (installed for the test if it is not there).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import procs

pytestmark = pytest.mark.fuse

HELPER = Path("/sbin/mount.fuse.spokefs")
TOKEN = "operate-token-0123456789abcdef"


@pytest.fixture
def export(tmp_path: Path) -> Path:
    root = tmp_path / "export"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(os.urandom(300_000))
    (root / "sub" / "b.txt").write_text("hello\n")
    return root


def _modes(cache: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(cache.stat().st_mode)}
    for path in cache.rglob("*"):
        out[str(path.relative_to(cache))] = stat.S_IMODE(path.lstat().st_mode)
    return out


def _assert_private(cache: Path) -> None:
    modes = _modes(cache)
    for name, mode in modes.items():
        want = 0o700 if (cache / name).is_dir() else 0o600
        assert mode == want, f"{name} has mode {mode:04o}, want {want:04o}: {modes}"


def test_cache_dir_is_private(export: Path, tmp_path: Path, hub_factory, mount_factory) -> None:
    hub = hub_factory(root=export)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    cache.chmod(0o755)
    (cache / "left-over").write_text("x")
    (cache / "left-over").chmod(0o644)
    spoke = mount_factory(hub.url, cache_dir=cache)
    assert (spoke.mnt / "a.bin").read_bytes() == (export / "a.bin").read_bytes()
    _assert_private(cache)
    assert {"namespace", "blocks", "spokefs.lock"} <= set(_modes(cache))


def test_second_mount_on_a_cache_dir_in_use_is_refused(export: Path, tmp_path: Path,
                                                       hub_factory, mount_factory,
                                                       make_mountpoint) -> None:
    hub = hub_factory(root=export)
    cache = tmp_path / "cache"
    first = mount_factory(hub.url, cache_dir=cache)
    line = procs.mount_fails(hub.url, make_mountpoint("second"), cache)
    assert line == (f"spokefs: error: --cache-dir {cache} is in use by another mount "
                    f"(pid {first.proc.pid}, mounted at {first.mnt}): give each mount its "
                    "own --cache-dir")
    assert (first.mnt / "sub" / "b.txt").read_text() == "hello\n"


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, _, port_hex = local.partition(":")
                if state == "0A" and int(port_hex, 16) == port:
                    found.add(addr)
    return found


def test_metrics_on_loopback_and_a_taken_port_fails(export: Path, tmp_path: Path, hub_factory,
                                                    mount_factory, make_mountpoint) -> None:
    hub = hub_factory(root=export)
    port = procs.free_port()
    mount_factory(hub.url, "--metrics-port", str(port))
    assert _listening(port) == {"0100007F"}, "metrics should listen on 127.0.0.1 only"
    assert procs.scrape_metrics(port)["spokefs_cache_capacity_bytes"] > 0
    line = procs.mount_fails(hub.url, make_mountpoint("taken"), tmp_path / "c2",
                             "--metrics-port", str(port))
    assert line == (f"spokefs: error: --metrics-port {port} is in use on 127.0.0.1 (another "
                    "spokefs mount?): give this mount its own --metrics-port, or 0 to turn "
                    "metrics off")


def _daemons(mnt: Path) -> list[int]:
    """Pids of spokefs processes (``-m spokefs`` or the ``mount.spokefs`` helper) with
    ``mnt`` in their argv."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if os.fsencode(mnt) in argv and any(b"spokefs" in arg for arg in argv):
            found.append(int(entry))
    return found


@contextlib.contextmanager
def _cleanup_daemons(mnt: Path) -> Iterator[None]:
    """Unmount ``mnt`` and end the daemons mounted there, whatever the test did."""
    try:
        yield
    finally:
        if procs.is_mounted(mnt):
            procs.fusermount_unmount(mnt)
        for pid in _daemons(mnt):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 15)


def _wait(pred: Callable[[], bool], timeout_s: float = 15) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_daemon_logs_to_the_cache_dir(export: Path, tmp_path: Path, hub_factory,
                                      make_mountpoint) -> None:
    hub = hub_factory(root=export)
    mnt, cache = make_mountpoint("daemon-log"), tmp_path / "cache"
    with _cleanup_daemons(mnt):
        r = procs.run_spokefs("mount", hub.url, str(mnt), "--cache-dir", str(cache),
                              "--cache-size", "64M", "--metrics-port", "0", "--daemon")
        assert r.returncode == 0, r.stderr
        assert (mnt / "sub" / "b.txt").read_text() == "hello\n"
        assert procs.run_spokefs("umount", str(mnt)).returncode == 0
        assert _wait(lambda: not _daemons(mnt)), "daemon still running"
    log = (cache / "spokefs.log").read_text()
    assert f"mounted {hub.url} at {mnt}" in log and f"unmounted {mnt} (clean)" in log
    _assert_private(cache)


def test_systemd_notify_ready(export: Path, tmp_path: Path, hub_factory,
                              make_mountpoint) -> None:
    hub = hub_factory(root=export)
    mnt = make_mountpoint("notify")
    sock_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, _cleanup_daemons(mnt):
        sock.bind(str(sock_path))
        sock.settimeout(30)
        env = procs.child_env() | {"NOTIFY_SOCKET": str(sock_path)}
        cmd = [sys.executable, "-m", "spokefs", "mount", hub.url, str(mnt), "--cache-dir",
               str(tmp_path / "cache"), "--cache-size", "64M", "--metrics-port", "0"]
        with open(tmp_path / "spoke.err", "wb") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                    stdin=subprocess.DEVNULL, env=env, cwd=procs.REPO_ROOT)
        try:
            assert sock.recv(256) == b"READY=1"
            assert procs.is_mounted(mnt), "READY=1 came before the mount"
            procs.fusermount_unmount(mnt)
            assert proc.wait(timeout=15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def mount_helper() -> Iterator[Path]:
    """``/sbin/mount.fuse.spokefs`` -> this venv's ``mount.spokefs`` for the test's length
    (a symlink left by an earlier run is replaced and put back; a real file is used as is)."""
    ours = Path(sys.executable).parent / "mount.spokefs"
    assert ours.exists(), f"{ours} is missing: pip install -e '.[spoke]' makes it"
    if HELPER.exists() and not HELPER.is_symlink():
        yield HELPER
        return
    previous = os.readlink(HELPER) if HELPER.is_symlink() else None
    with contextlib.suppress(FileNotFoundError):
        HELPER.unlink()
    HELPER.symlink_to(ours)
    try:
        yield HELPER
    finally:
        HELPER.unlink()
        if previous is not None:
            HELPER.symlink_to(previous)


def _mount_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=90,
                          check=False, env=procs.child_env(), stdin=subprocess.DEVNULL)


def test_fstab_mount_and_umount(export: Path, tmp_path: Path, hub_factory, make_mountpoint,
                                mount_helper: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    hub = hub_factory(root=export, args=("--token-file", str(token)))
    mnt, cache = make_mountpoint("fstab"), tmp_path / "cache"
    fstab = tmp_path / "fstab"
    fstab.write_text(f"# a test fstab\n{hub.url} {mnt} fuse.spokefs cache_dir={cache},"
                     f"cache_size=64M,token_file={token},metrics_port=0,_netdev,nofail 0 0\n")
    with _cleanup_daemons(mnt):
        r = _mount_cmd("-T", str(fstab), str(mnt))
        assert r.returncode == 0, r.stderr
        assert procs.is_mounted(mnt)
        assert (mnt / "a.bin").read_bytes() == (export / "a.bin").read_bytes()
        r = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, timeout=30,
                           check=False)
        assert r.returncode == 0, r.stderr
        assert not procs.is_mounted(mnt)
        assert _wait(lambda: not _daemons(mnt)), "daemon still running"

        for _ in range(2):  # the second `mount -a` finds the line mounted and does nothing
            r = _mount_cmd("-a", "-T", str(fstab))
            assert r.returncode == 0, r.stderr
            assert procs.is_mounted(mnt)
        assert len(_daemons(mnt)) == 1
        assert (mnt / "sub" / "b.txt").read_text() == "hello\n"
        assert subprocess.run(["umount", str(mnt)], timeout=30, check=False).returncode == 0
        assert _wait(lambda: not _daemons(mnt)), "daemon still running"
    assert "unmounted" in (cache / "spokefs.log").read_text()


def test_fstab_bad_option_is_one_line(tmp_path: Path, make_mountpoint,
                                      mount_helper: Path) -> None:
    mnt = make_mountpoint("fstab-bad")
    fstab = tmp_path / "fstab"
    fstab.write_text(f"http://127.0.0.1:9 {mnt} fuse.spokefs cache_dir={tmp_path / 'c'},"
                     "cache_sise=1G 0 0\n")
    r = _mount_cmd("-T", str(fstab), str(mnt))
    assert r.returncode != 0 and not procs.is_mounted(mnt)
    assert r.stderr.startswith("mount.spokefs: error: unknown option 'cache_sise'"), r.stderr
    assert "Traceback" not in r.stderr
