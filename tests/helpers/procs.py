"""Subprocess wrappers for a real hubd and a real spokefs FUSE mount.

Both daemons run as child processes (``sys.executable -m hubd|spokefs``) so a crash cannot take
pytest down, and their stdout/stderr go to files (never pipes: a chatty daemon cannot block on a
full pipe, and the text is still there to quote when something fails).

Every ``start`` is paired with a ``stop``/``unmount`` that is safe to call twice and on a
half-started process; fixtures call them from ``finally`` blocks.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
HUB_READY_RE = re.compile(r"at (http://\S+) \(")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


def child_env() -> dict[str, str]:
    """The environment for the daemons: the repo root importable, unbuffered output."""
    env = dict(os.environ)
    parts = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _terminate(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM, wait, then SIGKILL. Returns the exit code (negative for a signal)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    return proc.returncode


class HubProcess:
    """One ``python -m hubd serve ROOT`` child.

    Attributes:
        root: the exported directory.
        port: the port to listen on (0 until the first start picks one; kept for restarts).
        url: ``http://127.0.0.1:PORT`` once ready.
        proc: the current Popen (None before start).
        log_dir: where ``hub-<n>.out``/``.err`` go.
    """

    def __init__(self, root: Path | str, log_dir: Path, port: int = 0, args: tuple[str, ...] = ()):
        self.root = Path(os.fsdecode(root))
        self.port = port
        self.args = args
        self.log_dir = log_dir
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self.returncodes: list[int] = []
        self._n = 0

    @property
    def stdout_path(self) -> Path:
        return self.log_dir / f"hub-{self._n}.out"

    @property
    def stderr_path(self) -> Path:
        return self.log_dir / f"hub-{self._n}.err"

    def stderr(self) -> str:
        return _read(self.stderr_path)

    def start(self) -> HubProcess:
        """Start hubd and wait for its readiness line; restarts reuse the first bound port."""
        assert self.proc is None or self.proc.poll() is not None, "hub already running"
        self._n += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "hubd", "serve", str(self.root),
               "--listen", f"127.0.0.1:{self.port}", *self.args]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         cwd=REPO_ROOT, env=child_env())
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            m = HUB_READY_RE.search(_read(self.stdout_path))
            if m:
                self.url = m.group(1).rstrip("/")
                self.port = int(self.url.rsplit(":", 1)[1])
                return self
            if self.proc.poll() is not None:
                pytest.fail(f"hubd exited with {self.proc.returncode} before it was ready\n"
                            f"cmd: {cmd}\nstdout:\n{_read(self.stdout_path)}\n"
                            f"stderr:\n{self.stderr()}", pytrace=False)
            if time.monotonic() > deadline:
                _terminate(self.proc)
                pytest.fail(f"hubd printed no readiness line in {START_TIMEOUT_S}s\ncmd: {cmd}\n"
                            f"stdout:\n{_read(self.stdout_path)}\nstderr:\n{self.stderr()}",
                            pytrace=False)
            time.sleep(0.05)

    def stop(self) -> int | None:
        """SIGTERM (then SIGKILL); returns the exit code, None if it was not running."""
        if self.proc is None or self.proc.returncode is not None:
            return None
        rc = _terminate(self.proc)
        self.returncodes.append(rc)
        return rc


def _mounts() -> list[bytes]:
    with open("/proc/self/mounts", "rb") as f:
        # Fields are space separated with octal escapes (\040 for a space) in the mountpoint.
        return [line.split(b" ")[1] for line in f]


def is_mounted(mnt: Path | str) -> bool:
    """True when ``mnt`` is a mountpoint (per /proc/self/mounts, which never blocks on FUSE)."""
    target = os.fsencode(os.path.abspath(mnt))
    escaped = (target.replace(b"\\", b"\\134").replace(b" ", b"\\040")
               .replace(b"\t", b"\\011").replace(b"\n", b"\\012"))
    return escaped in _mounts()


def fusermount_unmount(mnt: Path | str) -> bool:
    """``fusermount3 -u``; on failure ``fusermount3 -uz`` (lazy). True if the first worked."""
    r = subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, check=False)
    if r.returncode == 0:
        return True
    if is_mounted(mnt):
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True, check=False)
    return False


class SpokeMount:
    """One foreground ``python -m spokefs mount`` child.

    Attributes:
        url, mnt, cache_dir: what it mounts, where, and its cache.
        args: extra command line arguments.
        proc: the Popen.
        returncode: its exit code after ``unmount`` (None before).
    """

    def __init__(self, url: str, mnt: Path, cache_dir: Path, log_dir: Path,
                 args: tuple[str, ...] = (), cache_size: str = "1G"):
        self.url = url
        self.mnt = mnt
        self.cache_dir = cache_dir
        self.log_dir = log_dir
        self.args = args
        self.cache_size = cache_size
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.clean_unmount: bool | None = None
        self._n = 0

    @property
    def cmd(self) -> list[str]:
        return [sys.executable, "-m", "spokefs", "mount", self.url, str(self.mnt),
                "--cache-dir", str(self.cache_dir), "--cache-size", self.cache_size,
                "--metrics-port", "0", *self.args]

    @property
    def stdout_path(self) -> Path:
        return self.log_dir / f"spoke-{self._n}.out"

    @property
    def stderr_path(self) -> Path:
        return self.log_dir / f"spoke-{self._n}.err"

    def stderr(self) -> str:
        return _read(self.stderr_path)

    def stdout(self) -> str:
        return _read(self.stdout_path)

    def start(self) -> SpokeMount:
        """Mount and wait until the mountpoint is mounted; fail fast if the process exits."""
        self._n += 1
        self.returncode = None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                                         env=child_env())
        deadline = time.monotonic() + START_TIMEOUT_S
        while not is_mounted(self.mnt):
            if self.proc.poll() is not None:
                pytest.fail(f"spokefs exited with {self.proc.returncode} before mounting\n"
                            f"cmd: {self.cmd}\nstdout:\n{self.stdout()}\n"
                            f"stderr:\n{self.stderr()}", pytrace=False)
            if time.monotonic() > deadline:
                self.unmount()
                pytest.fail(f"{self.mnt} not mounted after {START_TIMEOUT_S}s\ncmd: {self.cmd}\n"
                            f"stderr:\n{self.stderr()}", pytrace=False)
            time.sleep(0.05)
        return self

    def unmount(self) -> int | None:
        """Unmount (lazily and with SIGKILL if need be) and reap; returns the exit code.

        ``clean_unmount`` records whether a plain ``fusermount3 -u`` worked.
        """
        if self.proc is None:
            return None
        if self.proc.poll() is not None:  # it exited on its own (a test signalled it, or a crash)
            if is_mounted(self.mnt):  # ... and left a dead mount behind
                fusermount_unmount(self.mnt)
                self.clean_unmount = False
            elif self.clean_unmount is None:
                self.clean_unmount = True
            self.returncode = self.proc.returncode
            return self.returncode
        self.clean_unmount = True
        if is_mounted(self.mnt):
            self.clean_unmount = fusermount_unmount(self.mnt)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.clean_unmount = False
            _terminate(self.proc)
        if is_mounted(self.mnt):
            fusermount_unmount(self.mnt)
        self.returncode = self.proc.returncode
        return self.returncode

    def assert_clean_exit(self) -> None:
        """After ``unmount``: the unmount was clean and spokefs exited 0."""
        assert self.clean_unmount, (
            f"fusermount3 -u {self.mnt} failed or spokefs did not exit after it\n"
            f"stderr:\n{self.stderr()}")
        assert self.returncode == 0, (
            f"spokefs exited with {self.returncode} after a clean unmount\n"
            f"stderr:\n{self.stderr()}")
        assert not is_mounted(self.mnt)


def run_spokefs(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``python -m spokefs ARGS`` to completion, capturing text output."""
    return subprocess.run([sys.executable, "-m", "spokefs", *args], capture_output=True,
                          text=True, errors="replace", timeout=timeout_s, cwd=REPO_ROOT,
                          env=child_env(), stdin=subprocess.DEVNULL, check=False)


def pids_mentioning(needle: str) -> list[int]:
    """Pids whose command line contains ``needle`` (used to find a ``--daemon`` spoke we
    started, by its unique mountpoint path)."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if os.fsencode(needle) in argv and b"spokefs" in argv:
            found.append(int(entry))
    return found


def mount_fails(url: str, mnt: Path, cache: Path, *args: str, timeout_s: float = 60) -> str:
    """A foreground mount that must fail: exit 1, one error line, no traceback, no mount.
    Returns the error line."""
    cmd = [sys.executable, "-m", "spokefs", "mount", url, str(mnt), "--cache-dir", str(cache),
           "--cache-size", "64M", "--metrics-port", "0", "--mount-deadline", "2", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, cwd=REPO_ROOT, env=child_env())
    try:
        _, err_b = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        if is_mounted(mnt):
            fusermount_unmount(mnt)
        proc.kill()
        proc.communicate()
        pytest.fail(f"{cmd} did not fail (it mounted or hung)")
    err = err_b.decode(errors="replace")
    assert proc.returncode == 1 and "Traceback" not in err, f"exit {proc.returncode}\n{err}"
    lines = [line for line in err.splitlines() if line.startswith("spokefs: error: ")]
    assert len(lines) == 1, err
    assert not is_mounted(mnt)
    return lines[0]


def counted_metrics(mnt: Path, port: int) -> dict[str, float]:
    """``scrape_metrics`` once every read the mount answered before this call is counted.

    A serving worker's hits reach the mount's ``/metrics`` in batches, up to 50 ms late;
    a control attribute is answered by the mount's own process, after every hit the worker
    gathered before it: the worker sends them ahead of the request it forwards, and for a
    request the mount's process read itself (as the worker took over) it asks the worker for
    them first (``SYNC``, ``fuse.worker_channel``). So reading one orders the scrape after
    them. With no worker the mount counts each read before answering it."""
    os.getxattr(mnt, "user.spokefs.cached")
    return scrape_metrics(port)


def scrape_metrics(port: int) -> dict[str, float]:
    """A spoke's /metrics on 127.0.0.1:PORT, each metric summed over its labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{", 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out
