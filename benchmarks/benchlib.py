"""benchlib: what the spokefs benchmarks share: processes, the emulated link, CPU, metrics,
results and goal grading.

What it holds, and how each piece works:

- **processes** (``Proc``): a child whose stdout lines are collected by a thread (to wait for a
  readiness line) and whose stderr goes to a log file; ``stop()`` is SIGTERM then SIGKILL and
  safe to call twice. ``run_hub`` starts ``python -m hubd serve ROOT --listen 127.0.0.1:0``;
  ``spoke_mount`` a foreground ``python -m spokefs mount`` and ``rclone_mount`` a foreground
  ``rclone mount :http:``; ``rclone_serve`` an ``rclone serve http``. Each is a context
  manager whose exit stops or unmounts (``fusermount3 -u``, lazily if busy, the daemon killed
  if it does not exit) whatever happened, and records the daemon's exit code.
- **the link** (``LinkSpec``, ``open_link``, ``link_counters``): benchmarks/longlink.py as a
  subprocess (``LongLinkProcess``) in front of a server; its byte counters come from the status
  file it rewrites every 0.2 s, so they are counted at the emulator, not by the reader.
- **CPU** (``proc_cpu_ticks``, ``machine_ticks``, ``CpuMeter``): utime + stime of given pids
  from /proc/PID/stat, and the machine's busy jiffies from /proc/stat, between two points.
- **metrics** (``scrape``): a Prometheus text endpoint as {sample: value}, optionally summed
  over labels.
- **results** (``run_info``, ``append_jsonl``, ``Figure``): the JSON line's common head (time,
  git commit, whether the tree was dirty, kernel, Python, CPUs, argv) and median/min/max
  summaries.
- **goals** (``Goal``, ``grade``, ``format_grades``): a table of goals copied from an issue,
  graded PASS/MISS against measured figures (a goal with no figure is "not measured", never a
  pass).

Everything binds and connects to 127.0.0.1 only. Nothing here runs a benchmark by itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import queue
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from longlink import LongLinkProcess  # noqa: E402

KIB, MIB = 1024, 1024 * 1024
CLK_TCK = os.sysconf("SC_CLK_TCK")
HUB_READY_RE = re.compile(r"at (http://\S+) \(")
SPOKE_READY_RE = re.compile(r"^spokefs: mounted .* \((\d+) entries")
STOP_TIMEOUT_S = 15.0


class BenchError(RuntimeError):
    """A step failed (a process died, timed out or printed an error); the message says which."""


class BudgetExhausted(BenchError):
    """The whole run's time budget (``--max-seconds``) is used up: stop and report."""


class Deadline:
    """A whole run's time budget: every wait takes min(step timeout, what is left)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def expired(self) -> bool:
        return self.left() <= 0

    def timeout(self, step_s: float) -> float:
        """min(step_s, time left); raises BudgetExhausted when nothing is left."""
        left = self.left()
        if left <= 0:
            raise BudgetExhausted("the run's time budget (--max-seconds) is exhausted")
        return min(step_s, left)


# -- processes ------------------------------------------------------------------------------


def child_env(src: Path = REPO) -> dict[str, str]:
    """The environment for children: the checkout ``src`` (this repository unless a baseline
    is being measured side by side) importable first, unbuffered output."""
    env = dict(os.environ)
    parts = [str(src)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Proc:
    """A child process whose stdout lines are collected by a thread; stderr goes to a log."""

    def __init__(self, name: str, argv: list[str], log_path: Path, src: Path = REPO) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = log_path.open("wb")
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
def run_hub(root: Path, log_path: Path, deadline: Deadline,
            extra_args: Sequence[str] = ()) -> Iterator[Hub]:
    """hubd serving root on a free loopback port; stopped with SIGTERM at the end."""
    argv = [sys.executable, "-m", "hubd", "serve", str(root), "--listen", "127.0.0.1:0",
            "--log-level", "WARNING", *extra_args]
    proc = Proc("hubd", argv, log_path)
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
                src: Path = REPO) -> Iterator[Mount]:
    """A foreground ``spokefs mount URL MNT`` (the code of checkout ``src``) with /metrics on
    a free loopback port; always unmounted at the end (``mount.result`` says whether cleanly
    and the exit code)."""
    mnt.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [sys.executable, "-m", "spokefs", "mount", url, str(mnt), "--cache-dir",
            str(cache_dir), "--cache-size", cache_size, "--metrics-port", str(port),
            "--metrics-addr", "127.0.0.1", *extra_args]
    proc = Proc("spokefs", argv, log_path, src)
    try:
        proc.wait_line(SPOKE_READY_RE, deadline.timeout(300))
        wait_mounted(mnt, proc, deadline.timeout(10))
    except BaseException:
        unmount(mnt, proc)
        raise
    mount = Mount("spokefs", proc, mnt, time.perf_counter() - proc.started,
                  f"http://127.0.0.1:{port}/metrics")
    with _mounted(mount) as m:
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


# -- the emulated link ------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkSpec:
    """A long link: RTT (one-way delay = RTT / 2), a cap shared by all connections, and a
    window per connection (see benchmarks/longlink.py)."""

    rtt_ms: float
    rate_mbit: float = 1000.0
    window_bytes: int = 4 * MIB

    @property
    def delay_ms(self) -> float:
        return self.rtt_ms / 2

    @property
    def cap_bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    def describe(self) -> str:
        return (f"RTT {self.rtt_ms:g} ms (one-way {self.delay_ms:g} ms), {self.rate_mbit:g} "
                f"Mbit/s cap, {self.window_bytes / MIB:g} MiB window per connection")


@contextlib.contextmanager
def open_link(upstream_port: int, spec: LinkSpec) -> Iterator[LongLinkProcess]:
    """longlink.py in front of 127.0.0.1:upstream_port; ``link.port`` is where to connect."""
    with LongLinkProcess(("127.0.0.1", upstream_port), spec.delay_ms, spec.rate_mbit,
                         spec.window_bytes) as link:
        yield link


@dataclass(frozen=True)
class LinkCounters:
    """The emulator's counters (bytes delivered per direction, connections accepted)."""

    bytes_down: int = 0
    bytes_up: int = 0
    connections: int = 0

    def minus(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(self.bytes_down - other.bytes_down, self.bytes_up - other.bytes_up,
                            self.connections - other.connections)


STATUS_PERIOD_S = 0.2  # longlink.py rewrites its status file this often


def link_counters(link: LongLinkProcess | None, fresh: bool = True) -> LinkCounters:
    """The link's counters from its status file; with ``fresh``, after one more rewrite
    (so bytes delivered just before the call are in)."""
    if link is None:
        return LinkCounters()
    if fresh:
        time.sleep(STATUS_PERIOD_S * 1.5)
    s = link.statistics()
    return LinkCounters(int(s.get("bytes_down", 0)), int(s.get("bytes_up", 0)),
                        int(s.get("connections_accepted", 0)))


# -- CPU --------------------------------------------------------------------------------------


def proc_cpu_ticks(pid: int) -> int:
    """utime + stime of pid (all its threads) in clock ticks; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat (idle = idle + iowait)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


class CpuMeter:
    """CPU seconds of named pids, and the machine's busy share, between start() and stop()."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0 = time.perf_counter()
        self.c0 = {k: proc_cpu_ticks(p) for k, p in pids.items()}
        self.m0 = machine_ticks()

    def stop(self) -> dict[str, Any]:
        """{"cpu_s": {name: seconds}, "machine_busy_pct": % of all cores (100 = all busy),
        "machine_busy_cores": cores busy on average, "wall_s": seconds}."""
        wall = time.perf_counter() - self.t0
        m1 = machine_ticks()
        busy = (m1[0] - self.m0[0]) / max(1, m1[1] - self.m0[1])
        return {
            "cpu_s": {k: (proc_cpu_ticks(p) - self.c0[k]) / CLK_TCK for k, p in self.pids.items()},
            "machine_busy_pct": round(busy * 100, 1),
            "machine_busy_cores": round(busy * (os.cpu_count() or 1), 2),
            "wall_s": wall,
        }


# -- metrics ----------------------------------------------------------------------------------


def scrape(url: str | None, prefixes: tuple[str, ...] = ("",), sum_labels: bool = False,
           timeout_s: float = 3.0) -> dict[str, float]:
    """Prometheus text -> {sample: value} for samples whose name starts with a prefix; with
    ``sum_labels`` the key is the bare metric name, summed over its labels. {} on failure."""
    if url is None:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(prefixes):
            continue
        key, _, value = line.rpartition(" ")
        if sum_labels:
            key = key.split("{", 1)[0]
        with contextlib.suppress(ValueError):
            out[key] = out.get(key, 0.0) + float(value) if sum_labels else float(value)
    return out


# -- results ----------------------------------------------------------------------------------


def git_info(repo: Path = REPO) -> dict[str, Any]:
    """{"commit": full SHA or None, "dirty": whether ``git status --porcelain`` lists anything}."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                  check=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    status = git("status", "--porcelain")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None
            else None, "dirty_files": status.splitlines()[:50] if status else []}


def run_info(script: str) -> dict[str, Any]:
    """The head of every benchmark's JSON line."""
    return {"script": script, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **git_info(),
            "kernel": platform.release(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "host": platform.node(), "argv": sys.argv[1:]}


def jsonable(value: Any) -> Any:
    """Paths and other odd values as strings, recursively."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(jsonable(record)) + "\n")


@dataclass
class Figure:
    """Samples of one measurement over runs; summarised as median (min-max)."""

    samples: list[float] = field(default_factory=list)

    def add(self, value: float | None) -> None:
        if value is not None:
            self.samples.append(float(value))

    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    def summary(self) -> dict[str, Any]:
        s = self.samples
        return {"median": self.median(), "min": min(s), "max": max(s), "samples": s} if s else {}

    def text(self, fmt: str = "{:.0f}") -> str:
        if not self.samples:
            return "-"
        med = fmt.format(self.median())
        if len(self.samples) == 1:
            return med
        return f"{med} ({fmt.format(min(self.samples))}-{fmt.format(max(self.samples))})"


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# -- goals ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    """One graded goal. ``issue`` is the issue's sentence, verbatim; ``key`` names the figure
    the benchmark computes for it (``what`` says how, in words); ``op`` and ``threshold`` are
    the bar; ``rtts`` the RTTs it applies at (empty: every RTT measured)."""

    issue: str
    key: str
    what: str
    op: str  # ">=" or "<="
    threshold: float
    rtts: tuple[int, ...] = ()

    def passes(self, value: float) -> bool:
        return value >= self.threshold if self.op == ">=" else value <= self.threshold


@dataclass
class Grade:
    goal: Goal
    rtt: int | None
    value: float | None
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "NOT MEASURED"
        return "PASS" if self.goal.passes(self.value) else "MISS"


def grade(goals: Sequence[Goal], rtts: Sequence[int],
          value_of: Any) -> list[Grade]:
    """One Grade per goal and RTT it applies to; ``value_of(goal, rtt)`` returns
    (value or None, note)."""
    out = []
    for goal in goals:
        for rtt in goal.rtts or tuple(rtts):
            value, note = value_of(goal, rtt)
            out.append(Grade(goal, rtt, value, note))
    return out


def format_grades(grades: Sequence[Grade]) -> str:
    rows = []
    for g in grades:
        value = "-" if g.value is None else f"{g.value:.3f}"
        rows.append([g.verdict, f"{g.rtt} ms" if g.rtt is not None else "",
                     g.goal.what, f"{g.goal.op} {g.goal.threshold:g}", value, g.note])
    return markdown_table(["verdict", "RTT", "figure", "goal", "measured", "note"], rows)


def which(program: str) -> str | None:
    return shutil.which(program)
