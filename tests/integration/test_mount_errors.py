"""spokefs mount failures are one clean error line, exit 1 and no mount left behind;
``--daemon`` and ``spokefs umount`` work."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import procs, treegen

pytestmark = pytest.mark.fuse

FAIL_TIMEOUT_S = 90  # a mount that should fail but blocks in the foreground is ended after this


def mount_expecting_failure(url: str, mnt: Path | str, cache: Path, *extra: str
                            ) -> tuple[int, str]:
    """Run a foreground mount that must fail; returns (exit code, stderr).

    If it mounts anyway it would block forever in the foreground: unmount and fail.
    """
    cmd = [sys.executable, "-m", "spokefs", "mount", url, str(mnt), "--cache-dir", str(cache),
           "--cache-size", "1G", "--metrics-port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, cwd=procs.REPO_ROOT, env=procs.child_env())
    try:
        _out, err = proc.communicate(timeout=FAIL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        if os.path.isdir(mnt) and procs.is_mounted(mnt):
            procs.fusermount_unmount(mnt)
        proc.kill()
        _out, err = proc.communicate()
        pytest.fail(f"{cmd} did not fail within {FAIL_TIMEOUT_S}s (it mounted or hung)\n"
                    f"stderr:\n{err.decode(errors='replace')}")
    return proc.returncode, err.decode(errors="replace")


def assert_one_error_line(rc: int, stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert rc == 1, f"exit {rc}, want 1\nstderr:\n{stderr}"
    errors = [line for line in stderr.splitlines() if line.startswith("spokefs: error:")]
    assert len(errors) == 1, f"want one 'spokefs: error:' line\nstderr:\n{stderr}"


def test_unreachable_hub(tmp_path: Path, make_mountpoint, free_port: int) -> None:
    mnt = make_mountpoint("unreachable")
    rc, err = mount_expecting_failure(f"http://127.0.0.1:{free_port}", mnt, tmp_path / "cache",
                                      "--hub-deadline", "3")
    assert_one_error_line(rc, err)
    assert not procs.is_mounted(mnt)


@pytest.mark.parametrize("url", ["not-a-url", "ftp://x"])
def test_bad_hub_url(url: str, tmp_path: Path, make_mountpoint) -> None:
    mnt = make_mountpoint("badurl")
    rc, err = mount_expecting_failure(url, mnt, tmp_path / "cache", "--hub-deadline", "3")
    assert_one_error_line(rc, err)
    assert not procs.is_mounted(mnt)


def test_missing_mountpoint(tmp_path: Path, hub) -> None:
    mnt = tmp_path / "does-not-exist"
    rc, err = mount_expecting_failure(hub.url, mnt, tmp_path / "cache")
    assert_one_error_line(rc, err)
    assert not mnt.exists()


@pytest.mark.parametrize("kind", ["missing", "not-a-trace", "directory"])
def test_bad_replay_trace(kind: str, tmp_path: Path, hub, make_mountpoint) -> None:
    """The trace is read while the namespace downloads: a bad one still fails the mount with
    one line naming it, before anything is mounted."""
    mnt = make_mountpoint(f"badtrace-{kind}")
    trace = tmp_path / "t.trace"
    if kind == "not-a-trace":
        trace.write_bytes(b"this is not a trace\n")
    elif kind == "directory":
        trace.mkdir()
    rc, err = mount_expecting_failure(hub.url, mnt, tmp_path / "cache", "--replay", str(trace))
    assert_one_error_line(rc, err)
    assert "t.trace" in err, err
    assert not procs.is_mounted(mnt)


def test_mountpoint_already_mounted(tmp_path: Path, hub, mount_factory,
                                    source_tree: treegen.Tree) -> None:
    first = mount_factory(hub.url)
    rc, err = mount_expecting_failure(hub.url, first.mnt, tmp_path / "cache2")
    assert_one_error_line(rc, err)
    # the first mount is untouched and still serves
    rel = source_tree.sized[4097]
    with open(os.path.join(os.fsencode(first.mnt), rel), "rb") as f:
        assert f.read() == source_tree.read(rel)
    assert first.proc.poll() is None


def _wait_until(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def test_daemon_and_umount(tmp_path: Path, hub, make_mountpoint,
                           source_tree: treegen.Tree) -> None:
    mnt = make_mountpoint("daemon")
    out, err = tmp_path / "daemon.out", tmp_path / "daemon.err"
    cmd = [sys.executable, "-m", "spokefs", "mount", hub.url, str(mnt),
           "--cache-dir", str(tmp_path / "cache"), "--cache-size", "1G", "--metrics-port", "0",
           "--daemon"]
    try:
        # Files, not pipes: a daemon that kept our pipe open would make run() wait for it.
        with open(out, "wb") as fo, open(err, "wb") as fe:
            rc = subprocess.run(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                cwd=procs.REPO_ROOT, env=procs.child_env(), timeout=60,
                                check=False).returncode
        assert rc == 0, err.read_text(errors="replace")
        assert procs.is_mounted(mnt), "--daemon returned before the mount was ready"
        assert f"spokefs: mounted {hub.url}" in out.read_text(errors="replace")
        pids = procs.pids_mentioning(str(mnt))
        assert pids, "no daemon process found"
        rel = source_tree.sized[8193]
        with open(os.path.join(os.fsencode(mnt), rel), "rb") as f:
            assert f.read() == source_tree.read(rel)

        r = procs.run_spokefs("umount", str(mnt))
        assert r.returncode == 0, r.stderr
        assert not procs.is_mounted(mnt)
        assert _wait_until(lambda: not procs.pids_mentioning(str(mnt)), 15), \
            "the daemon did not exit after umount"
    finally:
        if procs.is_mounted(mnt):
            procs.fusermount_unmount(mnt)
        for pid in procs.pids_mentioning(str(mnt)):  # our daemon, found by its unique mountpoint
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 15)
