#!/usr/bin/env python3
"""The Foundation figures: namespace time-to-browse and spoke-warm sequential read speed.

One command, bounded in time, cleaning up every process and mount it starts:

a. **metadata**: seconds from launching ``python3 -m spokefs mount ...`` (foreground
   subprocess, fresh cache dir) to a finished ``find MOUNT | wc -l`` over a generated tree of
   ``--entries`` entries (dirs of 100 empty-or-tiny files, built once under ``--work-dir`` and
   reused); also hubd's start-up (scan) seconds, from launch to its readiness line, with the
   kernel page cache dropped first. The entry count must equal the source's ``find | wc -l``.
b. **seqread**: ``--files`` x ``--file-mib`` MiB of random data read sequentially, one file
   after another, by Python ``readinto`` with a 1 MiB buffer. Per run, on a fresh mount with a
   fresh cache dir: cold pass (fills the spoke cache), then the local source and the mount
   again (spoke-warm), with ``sync; echo 3 > /proc/sys/vm/drop_caches`` before each of these
   reads; then one more mount read without dropping (page-cache-warm), and ``cmp`` of every
   file against the source. Reported: MB/s (10^6 B/s) of each and the ratio spoke-warm / source.

Each figure is the median of ``--runs`` runs with min and max. Without ``--delay-ms`` the spoke
talks to hubd over loopback; with it, through benchmarks/longlink.py (then the bytes carried
by the link are reported too). Prints a table and appends a JSON line to
benchmarks/results/foundation.jsonl.

    python3 benchmarks/bench_foundation.py [--entries 100000] [--runs 3] [--files 8]
        [--file-mib 64] [--only metadata|seqread] [--delay-ms 30 --rate-mbit 1000] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from longlink import LongLinkProcess  # noqa: E402

RESULTS = HERE / "results" / "foundation.jsonl"
MIB = 1024 * 1024
READ_BUFFER = MIB
FILES_PER_DIR = 100
HUB_READY_RE = re.compile(r"at (http://\S+) \(")
SPOKE_READY_RE = re.compile(r"^spokefs: mounted .* \((\d+) entries")


class BenchError(RuntimeError):
    """A step failed (a process died, timed out or printed an error); the message says which."""


class Deadline:
    """The whole benchmark's time budget: every wait takes min(step timeout, what is left)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def timeout(self, step_s: float) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise BenchError("benchmark time budget (--max-seconds) exhausted")
        return min(step_s, left)


# -- processes -----------------------------------------------------------------------------


class Proc:
    """A child process whose stdout lines are collected by a thread; stderr goes to a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, src: Path = REPO) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.started = time.perf_counter()
        self.popen = subprocess.Popen(
            argv, cwd=src, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_line(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        """Wait for a stdout line matching pattern; raise BenchError if the process exits first."""
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
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

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited within timeout_s; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()
        return self.popen.returncode


@dataclass
class Hub:
    proc: Proc
    url: str
    startup_s: float


@contextlib.contextmanager
def run_hub(root: Path, logs: Path, deadline: Deadline) -> Iterator[Hub]:
    """hubd serving root on a free loopback port; startup_s = launch -> readiness line."""
    argv = [sys.executable, "-m", "hubd", "serve", str(root), "--listen", "127.0.0.1:0",
            "--log-level", "WARNING"]
    proc = Proc("hubd", argv, logs / "hubd.log")
    try:
        url = proc.wait_line(HUB_READY_RE, deadline.timeout(600)).group(1)
        yield Hub(proc, url, time.perf_counter() - proc.started)
    finally:
        code = proc.stop()
        if code not in (0, -signal.SIGTERM):
            print(f"warning: hubd exited {code}: {proc.log_tail()}", file=sys.stderr)


@contextlib.contextmanager
def maybe_link(hub: Hub, args: argparse.Namespace) -> Iterator[tuple[str, LongLinkProcess | None]]:
    """The URL the spoke should use: hubd's own, or (with --delay-ms) a longlink in front."""
    if args.delay_ms <= 0:
        yield hub.url, None
        return
    host, port = hub.url.removeprefix("http://").rsplit(":", 1)
    with LongLinkProcess((host, int(port)), args.delay_ms, args.rate_mbit,
                         args.window_bytes) as link:
        yield f"http://127.0.0.1:{link.port}", link


@dataclass
class Spoke:
    proc: Proc
    mountpoint: Path
    ready_s: float
    entries_reported: int


@contextlib.contextmanager
def run_spoke(url: str, work: Path, cache_size: str, args: argparse.Namespace,
              deadline: Deadline, *, src: Path = REPO, keep_cache: bool = False,
              fresh: bool = True) -> Iterator[Spoke]:
    """A foreground ``spokefs mount`` (of the checkout ``src``); always unmounted afterwards.

    ``fresh``: start from an empty cache dir (else remount the one a previous mount left);
    ``keep_cache``: leave the cache dir for a remount.
    """
    mnt, cache = Path(tempfile.mkdtemp(dir=work, prefix="mnt-")), work / "cache"
    if fresh:
        shutil.rmtree(cache, ignore_errors=True)
    argv = [sys.executable, "-m", "spokefs", "mount", url, str(mnt), "--cache-dir", str(cache),
            "--cache-size", cache_size, "--metrics-port", "0", *args.spoke_arg]
    proc = Proc("spokefs", argv, work / "spokefs.log", src)
    try:
        match = proc.wait_line(SPOKE_READY_RE, deadline.timeout(args.step_timeout))
        if not is_mounted(mnt):
            raise BenchError(f"spokefs said mounted but {mnt} is not a mount point")
        yield Spoke(proc, mnt, time.perf_counter() - proc.started, int(match.group(1)))
    finally:
        unmount(mnt, proc)
        with contextlib.suppress(OSError):
            mnt.rmdir()
        if not args.keep and not keep_cache:
            shutil.rmtree(cache, ignore_errors=True)


def rss_mib(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of a process in MiB (RssFile: mapped file pages, here
    LMDB's, which the kernel can reclaim)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


def browse(mnt: Path) -> None:
    """What a user does first on a mount: list the root and its first directory."""
    first = sorted(os.listdir(mnt))[0]
    os.listdir(mnt / first)


def is_mounted(mnt: Path) -> bool:
    """Whether mnt is in the mount table (os.path.ismount says no for a dead FUSE mount)."""
    target = os.path.realpath(mnt).replace(" ", "\\040")
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f)


def unmount(mnt: Path, proc: Proc) -> None:
    """fusermount3 -u (lazy if busy); the foreground spokefs should then exit 0."""
    if is_mounted(mnt):
        done = subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, check=False)
        if done.returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)
    try:
        code = proc.popen.wait(timeout=15)
    except subprocess.TimeoutExpired:
        code = proc.stop()
    proc.stop()
    if code != 0:
        print(f"warning: spokefs exited {code} after unmount: {proc.log_tail()}", file=sys.stderr)


# -- data sets -----------------------------------------------------------------------------


def count_entries(root: Path) -> int:
    """``find ROOT | wc -l``, run by the shell as a user would."""
    cmd = f"find {shlex.quote(str(root))} | wc -l"
    return int(subprocess.run(cmd, shell=True, capture_output=True, text=True, check=True).stdout)


def ensure_tree(work: Path, entries: int) -> tuple[Path, int]:
    """A tree of `entries` entries (dirs of 100 files; every 10th file 1-100 bytes), built once.

    Returns the root and its ``find | wc -l`` count (entries + 1 for the root itself).
    """
    root, marker = work / f"tree-{entries}", work / f"tree-{entries}.count"
    if marker.exists():
        return root, int(marker.read_text())
    shutil.rmtree(root, ignore_errors=True)
    made, d = 0, 0
    while made < entries:
        sub = root / f"d{d:05d}"
        sub.mkdir(parents=True)
        made, d = made + 1, d + 1
        for i in range(min(FILES_PER_DIR, entries - made)):
            (sub / f"f{i:03d}").write_bytes(b"x" * (i % 100 + 1) if i % 10 == 0 else b"")
            made += 1
    count = count_entries(root)
    marker.write_text(str(count))
    return root, count


def ensure_files(work: Path, files: int, file_mib: int) -> Path:
    """`files` files of `file_mib` MiB of random data, built once."""
    root, marker = work / f"seq-{files}x{file_mib}M", work / f"seq-{files}x{file_mib}M.done"
    if marker.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for i in range(files):
        with (root / f"shard-{i:03d}.bin").open("wb") as f:
            for _ in range(file_mib):
                f.write(os.urandom(MIB))
    subprocess.run(["sync"], check=True)
    marker.touch()
    return root


def drop_caches() -> None:
    """Empty the kernel page cache (and dentries/inodes), so reads go to disk or the spoke."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def read_sequential(root: Path) -> tuple[int, float]:
    """Read every regular file under root in name order with 1 MiB readinto; (bytes, seconds)."""
    buf = bytearray(READ_BUFFER)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for path in sorted(p for p in root.iterdir() if p.is_file()):
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - t0


def compare_trees(a: Path, b: Path) -> list[str]:
    """``cmp`` every file under a with its namesake under b (not timed); the differences."""
    diffs = []
    for p in sorted(a.iterdir()):
        if p.is_file():
            done = subprocess.run(["cmp", str(p), str(b / p.name)], capture_output=True,
                                  text=True, check=False)
            if done.returncode != 0:
                diffs.append((done.stdout + done.stderr).strip())
    return diffs


# -- figures ------------------------------------------------------------------------------


@dataclass
class Figure:
    """Samples of one measurement; summarised as median (min - max)."""

    unit: str
    samples: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        s = self.samples
        if not s:
            return {"unit": self.unit, "samples": []}
        return {"unit": self.unit, "median": statistics.median(s), "min": min(s), "max": max(s),
                "samples": s}

    def text(self) -> str:
        if not self.samples:
            return "-"
        s = self.samples
        fmt = "{:.0f}" if all(float(x).is_integer() for x in s) else "{:.2f}"
        return f"{fmt.format(statistics.median(s))} ({fmt.format(min(s))} - {fmt.format(max(s))})"


def new_figures(results: dict[str, dict[str, Figure]], part: str,
                **units: str) -> dict[str, Figure]:
    """Empty figures (name -> unit), registered in results at once so a failed run keeps them."""
    figs = results[part] = {name: Figure(unit) for name, unit in units.items()}
    return figs


def _link_mib(link: LongLinkProcess | None) -> float:
    """MiB the link has carried towards the spoke so far (0 without a link)."""
    if link is None:
        return 0.0
    time.sleep(0.5)  # the status file is rewritten every 0.2 s
    return float(link.statistics().get("bytes_down", 0)) / MIB


REMOUNT_SLOW_DELAY_MS = 450.0  # one way: a 900 ms round trip


def bench_metadata(args: argparse.Namespace, work: Path, deadline: Deadline,
                   results: dict[str, dict[str, Figure]]) -> None:
    """Hub scan seconds; per spokefs checkout (this one, and ``--baseline-src`` side by side
    in the same run): mount-ready and mount-launch -> finished find seconds, the spoke's
    RSS after the find, and (``--remount``) remounts on the cache dir that mount left.

    Data sets live in ``args.work_dir``; logs, caches and mount points in ``work``.
    """
    root, expected = ensure_tree(args.work_dir, args.entries)
    systems = [("", REPO)] + ([("baseline_", args.baseline_src)] if args.baseline_src else [])
    units = {"mount_ready_s": "s", "mount_to_find_done_s": "s", "find_count": "entries",
             "rss_after_find_mib": "MiB", "rss_anon_after_find_mib": "MiB",
             "rss_file_after_find_mib": "MiB", "link_mib_down": "MiB"}
    if args.remount:
        for how in ("up", "slow", "down"):
            units |= {f"remount_{how}_ready_s": "s", f"remount_{how}_browse_s": "s"}
        units["remount_up_find_done_s"] = "s"
    figs = new_figures(results, "metadata", hub_startup_s="s",
                       **{prefix + k: u for prefix, _ in systems for k, u in units.items()})
    print(f"metadata: tree {root} ({expected} lines from find)", flush=True)
    for run in range(args.runs):
        drop_caches()
        with run_hub(root, work, deadline) as hub:
            figs["hub_startup_s"].samples.append(hub.startup_s)
            for prefix, src in systems:
                sample = _metadata_run(args, work, deadline, hub, src, expected)
                for key, value in sample.items():
                    figs[prefix + key].samples.append(value)
                print(f"  run {run + 1} {prefix or 'spokefs_'}{src.name}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in sample.items()), flush=True)


def _metadata_run(args: argparse.Namespace, work: Path, deadline: Deadline, hub: Hub,
                  src: Path, expected: int) -> dict[str, float]:
    """One checkout's figures: first mount and find, RSS, then the remounts."""
    out: dict[str, float] = {}
    with maybe_link(hub, args) as (url, link):
        with run_spoke(url, work, "1G", args, deadline, src=src,
                       keep_cache=args.remount) as spoke:
            found = count_entries(spoke.mountpoint)
            out["mount_to_find_done_s"] = time.perf_counter() - spoke.proc.started
            rss = rss_mib(spoke.proc.popen.pid)
        if found != expected:
            raise BenchError(f"find through the mount counted {found}, source {expected}")
        out |= {"mount_ready_s": spoke.ready_s, "find_count": found,
                "rss_after_find_mib": rss["VmRSS"], "rss_anon_after_find_mib": rss["RssAnon"],
                "rss_file_after_find_mib": rss["RssFile"]}
        if link is not None:
            out["link_mib_down"] = _link_mib(link)
        if args.remount:  # the hub up, behind the same link as the first mount
            with run_spoke(url, work, "1G", args, deadline, src=src, keep_cache=True,
                           fresh=False) as spoke:
                browse(spoke.mountpoint)
                out["remount_up_browse_s"] = time.perf_counter() - spoke.proc.started
                out["remount_up_ready_s"] = spoke.ready_s
                if count_entries(spoke.mountpoint) != expected:
                    raise BenchError("find after a remount counted another number")
                out["remount_up_find_done_s"] = time.perf_counter() - spoke.proc.started
    if args.remount:
        for how in ("slow", "down"):
            out |= _remount(args, work, deadline, hub, src, how)
    return out


def _remount(args: argparse.Namespace, work: Path, deadline: Deadline, hub: Hub, src: Path,
             how: str) -> dict[str, float]:
    """Remount on the stored namespace with the hub 900 ms away (``slow``) or behind a
    blackholed link (``down``: nothing gets through, connections hang)."""
    host, port = hub.url.removeprefix("http://").rsplit(":", 1)
    with LongLinkProcess((host, int(port)), REMOUNT_SLOW_DELAY_MS, args.rate_mbit,
                         args.window_bytes) as link:
        if how == "down":
            link.set_blackhole(True)
            time.sleep(0.3)
        url = f"http://127.0.0.1:{link.port}"
        with run_spoke(url, work, "1G", args, deadline, src=src, keep_cache=True,
                       fresh=False) as spoke:
            browse(spoke.mountpoint)
            browse_s = time.perf_counter() - spoke.proc.started
    return {f"remount_{how}_ready_s": spoke.ready_s, f"remount_{how}_browse_s": browse_s}


def _timed_read(root: Path, drop: bool) -> float:
    if drop:
        drop_caches()
    nbytes, seconds = read_sequential(root)
    return nbytes / seconds / 1e6


def bench_seqread(args: argparse.Namespace, work: Path, deadline: Deadline,
                  results: dict[str, dict[str, Figure]]) -> None:
    """MB/s of the local source, the mount cold, spoke-warm and page-cache-warm."""
    src = ensure_files(args.work_dir, args.files, args.file_mib)
    size_mib = args.files * args.file_mib
    figs = new_figures(results, "seqread", source_mbps="MB/s", cold_mbps="MB/s",
                       warm_mbps="MB/s", warm_over_source="ratio", pagecache_mbps="MB/s",
                       cold_link_mib="MiB", warm_link_mib="MiB", link_connections="conns")
    cache_size = f"{max(1024, 2 * size_mib)}M"
    print(f"seqread: {args.files} x {args.file_mib} MiB in {src}, "
          f"Python readinto, {READ_BUFFER // MIB} MiB buffer", flush=True)
    with run_hub(src, work, deadline) as hub:
        for run in range(args.runs):  # a fresh link per run, so its counters are per run
            with maybe_link(hub, args) as (url, link), \
                run_spoke(url, work, cache_size, args, deadline) as spoke:
                link0 = _link_mib(link)
                cold = _timed_read(spoke.mountpoint, drop=True)
                link1 = _link_mib(link)
                source = _timed_read(src, drop=True)
                warm = _timed_read(spoke.mountpoint, drop=True)
                link2 = _link_mib(link)
                if link is not None:
                    figs["cold_link_mib"].samples.append(link1 - link0)
                    figs["warm_link_mib"].samples.append(link2 - link1)
                    figs["link_connections"].samples.append(
                        float(link.statistics().get("connections_accepted", 0)))
                pagecache = _timed_read(spoke.mountpoint, drop=False)
                if diffs := compare_trees(src, spoke.mountpoint):
                    raise BenchError(f"mount differs from the source: {'; '.join(diffs)}")
            for key, value in [("cold_mbps", cold), ("source_mbps", source), ("warm_mbps", warm),
                               ("warm_over_source", warm / source),
                               ("pagecache_mbps", pagecache)]:
                figs[key].samples.append(value)
            print(f"  run {run + 1}: cold {cold:.0f}, source {source:.0f}, spoke-warm {warm:.0f}, "
                  f"page-cache-warm {pagecache:.0f} MB/s", flush=True)


# -- report -------------------------------------------------------------------------------


def git_sha() -> str | None:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def print_table(title: str, figs: dict[str, Figure]) -> None:
    print(f"\n{title}")
    width = max(len(k) for k in figs)
    print(f"  {'figure'.ljust(width)}  unit     median (min - max)")
    for key, fig in figs.items():
        if fig.samples:
            print(f"  {key.ljust(width)}  {fig.unit.ljust(7)}  {fig.text()}")


def write_result(args: argparse.Namespace, results: dict[str, dict[str, Figure]],
                 error: str | None) -> None:
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_sha": git_sha(),
        "kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "read_method": f"python readinto, {READ_BUFFER // MIB} MiB buffer",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "figures": {part: {k: f.summary() for k, f in figs.items()}
                    for part, figs in results.items()},
        "error": error,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--entries", type=int, default=100_000, help="metadata tree size (100000)")
    p.add_argument("--runs", type=int, default=3, help="runs per figure (3)")
    p.add_argument("--files", type=int, default=8, help="seqread files (8)")
    p.add_argument("--file-mib", type=int, default=64, help="seqread file size in MiB (64)")
    p.add_argument("--only", choices=["metadata", "seqread"], help="run one part only")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="put longlink in front of hubd with this one-way delay (0 = loopback)")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="longlink cap (1000)")
    p.add_argument("--window-bytes", type=int, default=4 * MIB, help="longlink window (4 MiB)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/spokefs-bench"),
                   help="data sets are built here once and reused (/tmp/spokefs-bench)")
    p.add_argument("--spoke-arg", action="append", default=[],
                   help="extra argument for spokefs mount (repeatable), e.g. --spoke-arg=--x=1")
    p.add_argument("--step-timeout", type=float, default=600.0, help="per-mount timeout (600 s)")
    p.add_argument("--max-seconds", type=float, default=3600.0, help="whole-run budget (3600 s)")
    p.add_argument("--keep", action="store_true", help="keep cache dirs and logs")
    p.add_argument("--remount", action=argparse.BooleanOptionalAction, default=True,
                   help="metadata: also remount on the stored namespace with the hub up, "
                        "900 ms away and blackholed (default on)")
    p.add_argument("--baseline-src", type=Path,
                   help="metadata: a checkout of another spokefs (e.g. `git archive REV`) "
                        "measured side by side, interleaved in the same run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench_foundation: needs root (FUSE allow_other, drop_caches)", file=sys.stderr)
        return 2
    args.work_dir.mkdir(parents=True, exist_ok=True)
    deadline = Deadline(args.max_seconds)
    results: dict[str, dict[str, Figure]] = {}
    error = None
    run_dir = Path(tempfile.mkdtemp(dir=args.work_dir, prefix="run-"))
    try:
        if args.only in (None, "metadata"):
            bench_metadata(args, run_dir, deadline, results)
        if args.only in (None, "seqread"):
            bench_seqread(args, run_dir, deadline, results)
    except (BenchError, subprocess.SubprocessError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        print(f"bench_foundation: error: {error}", file=sys.stderr)
    finally:
        for title, figs in results.items():
            print_table(title, figs)
        write_result(args, results, error)
        if args.keep:
            print(f"kept logs and caches in {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
