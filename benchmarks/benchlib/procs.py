"""Processes: a child with its stdout lines and a stderr log (``Proc``), hubd, ``rclone serve``,
and FUSE daemons (spokefs, rclone, ceiling_fs, any other) as context managers that always
unmount and stop what they started, recording how the teardown went (``Mount.result``)."""

from __future__ import annotations

import compileall
import contextlib
import functools
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .common import HERE, REPO, BenchError, Deadline
from .meters import wait_workers

HUB_READY_RE = re.compile(r"at (http://\S+) \(")
SPOKE_READY_RE = re.compile(r"^spokefs: mounted .* \((\d+) entries")
STOP_TIMEOUT_S = 15.0


def child_env(src: Path = REPO) -> dict[str, str]:
    """The environment for children: the checkout ``src`` (this repository unless a baseline
    is being measured side by side) importable first, unbuffered output."""
    env = dict(os.environ)
    parts = [str(src)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@functools.cache
def compile_packages(src: Path) -> None:
    """The bytecode of checkout ``src``'s packages, compiled as ``deploy/setup.sh`` does at
    install (once per checkout and benchmark process; unchanged modules are skipped). Without
    it every daemon started under ``PYTHONDONTWRITEBYTECODE=1`` (this machine's environment)
    compiles ~100 modules from source first: 0.12 s of CPU a mount, which an installed
    spokefs does not pay."""
    for package in ("spokefs", "hubd"):
        if (src / package).is_dir():
            compileall.compile_dir(src / package, quiet=2)


class Proc:
    """A child process whose stdout lines are collected by a thread; stderr goes to a log."""

    def __init__(self, name: str, argv: list[str], log_path: Path, src: Path = REPO) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = log_path.open("wb")
        compile_packages(src)
        self.started = time.perf_counter()
        self.popen = subprocess.Popen(argv, cwd=src, env=child_env(src), stdout=subprocess.PIPE,
                                      stderr=self._log, stdin=subprocess.DEVNULL, text=True,
                                      errors="replace")
        self.stdout_lines: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True, name=f"pump-{name}").start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.stdout_lines.append(line.rstrip("\n"))
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_line(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        """Wait for a stdout line matching pattern; BenchError if the process exits first."""
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout=10)
                raise BenchError(f"{self.name} exited {self.popen.returncode}: {self.log_tail()}")
            if match := pattern.search(line):
                return match
        raise BenchError(f"{self.name}: no readiness line in {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) or "(stderr empty)"

    def wait(self, timeout_s: float) -> int | None:
        """The exit code once it has exited within timeout_s, else None."""
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then SIGKILL if it has not exited within timeout_s; the exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            if self.wait(timeout_s) is None:
                self.popen.kill()
                self.popen.wait()
        if not self._log.closed:
            self._log.close()
        return self.popen.returncode


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: Proc, timeout_s: float) -> None:
    """Wait until something accepts on 127.0.0.1:port; BenchError if proc exits first."""
    end = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        if proc.popen.poll() is not None or time.monotonic() > end:
            raise BenchError(f"{proc.name} is not listening on {port}: {proc.log_tail()}")
        time.sleep(0.1)


def is_mounted(mnt: Path) -> bool:
    """Whether mnt is in the mount table (os.path.ismount says no for a dead FUSE mount)."""
    target = os.path.realpath(mnt).replace(" ", "\\040")
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f)


def wait_mounted(mnt: Path, proc: Proc, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not is_mounted(mnt):
        if proc.popen.poll() is not None or time.monotonic() > end:
            raise BenchError(f"{proc.name} did not mount {mnt}: {proc.log_tail()}")
        time.sleep(0.02)


def fusermount(mnt: Path, lazy: bool = False) -> bool:
    """``fusermount3 -u [-z] MNT``; whether it succeeded."""
    argv = ["fusermount3", "-u", *(["-z"] if lazy else []), str(mnt)]
    return subprocess.run(argv, capture_output=True, check=False, timeout=60).returncode == 0


@dataclass
class Unmounted:
    """How a FUSE daemon's teardown went: ``clean`` when a plain ``fusermount3 -u`` worked and
    the daemon exited by itself; ``exit_code`` is the daemon's."""

    clean: bool
    exit_code: int


def unmount(mnt: Path, proc: Proc, timeout_s: float = STOP_TIMEOUT_S) -> Unmounted:
    """fusermount3 -u (lazily if busy), wait for the daemon, SIGTERM/SIGKILL if it lingers,
    and never leave the mount behind."""
    clean = True
    if is_mounted(mnt) and not fusermount(mnt):
        clean = False
        fusermount(mnt, lazy=True)
    code = proc.wait(timeout_s)
    if code is None:
        clean = False
        code = proc.stop()
    proc.stop()
    if is_mounted(mnt):
        clean = False
        fusermount(mnt, lazy=True)
    return Unmounted(clean, code)


def kill_mount(mnt: Path, proc: Proc) -> None:
    """For readers stuck in the mount: kill the daemon (which aborts the FUSE connection and
    ends their requests), then detach the dead mount."""
    if proc.popen.poll() is None:
        proc.popen.kill()
        proc.popen.wait()
    if is_mounted(mnt):
        fusermount(mnt, lazy=True)


def drop_caches() -> None:
    """Empty the kernel page cache (and dentries/inodes): ``sync; echo 3 > drop_caches``."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


@dataclass
class Hub:
    proc: Proc
    url: str
    port: int
    startup_s: float


@contextlib.contextmanager
def run_hub(root: Path | str, log_path: Path, deadline: Deadline,
            extra_args: Sequence[str] = (), src: Path = REPO) -> Iterator[Hub]:
    """hubd (the code of checkout ``src``) serving root on a free loopback port; stopped with
    SIGTERM at the end."""
    argv = [sys.executable, "-m", "hubd", "serve", str(root), "--listen", "127.0.0.1:0",
            "--log-level", "WARNING", *extra_args]
    proc = Proc("hubd", argv, log_path, src)
    try:
        url = proc.wait_line(HUB_READY_RE, deadline.timeout(600)).group(1).rstrip("/")
        yield Hub(proc, url, int(url.rsplit(":", 1)[1]), time.perf_counter() - proc.started)
    finally:
        code = proc.stop()
        if code not in (0, -signal.SIGTERM):
            print(f"warning: hubd exited {code}: {proc.log_tail()}", file=sys.stderr)


@contextlib.contextmanager
def rclone_serve(root: Path, log_path: Path, deadline: Deadline) -> Iterator[tuple[Proc, int]]:
    """``rclone serve http ROOT`` on a free loopback port; yields (proc, port)."""
    port = free_port()
    proc = Proc("rclone-serve", ["rclone", "serve", "http", str(root), "--addr",
                                 f"127.0.0.1:{port}"], log_path)
    try:
        wait_port(port, proc, deadline.timeout(30))
        yield proc, port
    finally:
        proc.stop()


@dataclass
class Mount:
    """A FUSE daemon and its mountpoint; ``result`` is set once it has been unmounted."""

    name: str
    proc: Proc
    path: Path
    ready_s: float
    metrics_url: str | None = None
    result: Unmounted | None = None
    stuck: bool = False  # a reader was abandoned inside it: kill it instead of unmounting

    @property
    def pid(self) -> int:
        return self.proc.pid


@contextlib.contextmanager
def _mounted(mount: Mount) -> Iterator[Mount]:
    try:
        yield mount
    finally:
        if mount.stuck:
            kill_mount(mount.path, mount.proc)
        mount.result = unmount(mount.path, mount.proc)


@contextlib.contextmanager
def spoke_mount(url: str, mnt: Path, cache_dir: Path, log_path: Path, deadline: Deadline,
                cache_size: str = "8G", extra_args: Sequence[str] = (),
                src: Path = REPO, start_timeout_s: float = 300,
                wrapper: Sequence[str] = ()) -> Iterator[Mount]:
    """A foreground ``spokefs mount URL MNT`` (the code of checkout ``src``) with /metrics on
    a free loopback port; always unmounted at the end (``mount.result`` says whether cleanly
    and the exit code). ``start_timeout_s`` bounds the wait for its readiness line.
    ``wrapper`` is a command that execs the rest in the same process, put in front of the
    spoke's argv (e.g. ``taskset -c 0``: the pid is still the spoke's)."""
    mnt.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [*wrapper, sys.executable, "-m", "spokefs", "mount", url, str(mnt), "--cache-dir",
            str(cache_dir), "--cache-size", cache_size, "--metrics-port", str(port),
            "--metrics-addr", "127.0.0.1", *extra_args]
    proc = Proc("spokefs", argv, log_path, src)
    try:
        proc.wait_line(SPOKE_READY_RE, deadline.timeout(start_timeout_s))
        wait_mounted(mnt, proc, deadline.timeout(10))
    except BaseException:
        unmount(mnt, proc)
        raise
    mount = Mount("spokefs", proc, mnt, time.perf_counter() - proc.started,
                  f"http://127.0.0.1:{port}/metrics")
    with _mounted(mount) as m:
        yield m


def fill_cache(url: str, data: Path, rels: Sequence[Path], cache: Path, mnt: Path,
               log_path: Path, deadline: Deadline) -> None:
    """A cold pass that fills ``cache``: a fresh spoke, every file of ``rels`` read through it
    and its bytes checked against ``data``, then unmounted (BenchError on a wrong byte or an
    unclean unmount)."""
    with spoke_mount(url, mnt, cache, log_path, deadline) as m:
        for rel in rels:
            if (mnt / rel).read_bytes() != (data / rel).read_bytes():
                raise BenchError(f"{rel}: wrong bytes through the spoke")
    if not (m.result and m.result.clean):
        raise BenchError("the filling spoke did not unmount cleanly")


@contextlib.contextmanager
def warm_spoke(url: str, mnt: Path, cache: Path, log_path: Path, deadline: Deadline,
               workers: int, settle_s: float = 0.5) -> Iterator[Mount]:
    """``spoke_mount`` on a filled cache (a remount) with ``--workers N --open-mode kernel``,
    once its worker's N threads serve and its first namespace poll is over, with the page
    cache dropped: where a warm pass after a remount starts. Unmounted at the end as
    ``spoke_mount`` does (``Mount.result``)."""
    with spoke_mount(url, mnt, cache, log_path, deadline,
                     extra_args=["--workers", str(workers), "--open-mode", "kernel"]) as m:
        wait_workers(m.metrics_url, workers, m.pid, deadline)
        time.sleep(settle_s)
        drop_caches()
        yield m


@contextlib.contextmanager
def rclone_mount(url: str, mnt: Path, cache_dir: Path, log_path: Path, deadline: Deadline,
                 extra_args: Sequence[str] = ()) -> Iterator[Mount]:
    """A foreground ``rclone mount :http: MNT --http-url URL --vfs-cache-mode full``."""
    mnt.mkdir(parents=True, exist_ok=True)
    argv = ["rclone", "mount", ":http:", str(mnt), "--http-url", url, "--vfs-cache-mode",
            "full", "--cache-dir", str(cache_dir), *extra_args]
    proc = Proc("rclone", argv, log_path)
    try:
        wait_mounted(mnt, proc, deadline.timeout(60))
    except BaseException:
        unmount(mnt, proc)
        raise
    with _mounted(Mount("rclone", proc, mnt, time.perf_counter() - proc.started)) as m:
        yield m


@contextlib.contextmanager
def fuse_process(name: str, argv: list[str], mnt: Path, log_path: Path, ready: re.Pattern[str],
                 deadline: Deadline, start_timeout_s: float = 300) -> Iterator[Mount]:
    """Any foreground FUSE daemon that prints a readiness line once mounted."""
    mnt.mkdir(parents=True, exist_ok=True)
    proc = Proc(name, argv, log_path)
    try:
        proc.wait_line(ready, deadline.timeout(start_timeout_s))
        wait_mounted(mnt, proc, deadline.timeout(10))
    except BaseException:
        unmount(mnt, proc)
        raise
    with _mounted(Mount(name, proc, mnt, time.perf_counter() - proc.started)) as m:
        yield m


CEILING_READY_RE = re.compile(r"^ceiling_fs: mounted (\d+) files")


@contextlib.contextmanager
def ceiling_mount(root: Path, mnt: Path, log_path: Path, deadline: Deadline) -> Iterator[Mount]:
    """benchmarks/ceiling_fs.py serving ``root`` from memory at ``mnt``: the ceiling of FUSE
    served by a Python process on this machine."""
    argv = [sys.executable, str(HERE / "ceiling_fs.py"), str(root), str(mnt)]
    with fuse_process("ceiling_fs", argv, mnt, log_path, CEILING_READY_RE, deadline) as m:
        yield m


NATIVE_READY_RE = re.compile(r"^ceiling_native: mounted (\d+) files")


def build_native(work: Path) -> Path | str:
    """``ceiling_native.c`` compiled into ``work``: its path, or why it could not be."""
    if shutil.which("cc") is None:
        return "no C compiler (cc)"
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True,
                           text=True, check=False)
    if flags.returncode != 0:
        return "no libfuse3 development files (pkg-config fuse3)"
    out = work / "ceiling_native"
    done = subprocess.run(["cc", "-O2", "-o", str(out), str(HERE / "ceiling_native.c"),
                           *flags.stdout.split()], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"cc failed: {done.stderr.strip()[-300:]}"
    return out



@contextlib.contextmanager
def native_mount(binary: Path, root: Path, mnt: Path, log_path: Path, deadline: Deadline,
                 threads: int = 1, passthrough: bool = False) -> Iterator[Mount]:
    """benchmarks/ceiling_native.c (built by ``build_native``) serving ``root`` at ``mnt`` on
    ``threads`` threads, from memory (the ceiling of FUSE on this machine) or, with
    ``passthrough``, by a pread of the file under ``root`` per READ (the ceiling of a FUSE
    server whose bytes come from its disk)."""
    argv = [str(binary), *(["--passthrough"] if passthrough else []), str(root), str(mnt),
            str(threads)]
    with fuse_process("ceiling_native", argv, mnt, log_path, NATIVE_READY_RE, deadline,
                      start_timeout_s=600) as m:
        yield m


def which(program: str) -> str | None:
    return shutil.which(program)
