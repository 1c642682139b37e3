#!/usr/bin/env python3
"""The figures of "Prefetch and the long link": spokefs vs rclone vs local disk over a long link.

For each RTT of ``--rtts`` (one-way delay = RTT / 2), a 1 Gbit/s cap and a 4 MiB window per
connection (benchmarks/longlink.py), side by side in one run on the same data:

- **spokefs**: hubd -> longlink -> ``spokefs mount`` (foreground, fresh cache dir per mount);
- **rclone**: ``rclone serve http SRC`` -> its own longlink (same settings) ->
  ``rclone mount :http: MNT --http-url ... --vfs-cache-mode full --cache-dir D`` (fresh D);
- **local**: the source directory itself.

Each pass gets a fresh mount behind a fresh proxy (so its counters are the pass's), and the
kernel page cache is dropped before every cold pass. Workloads:

1. **seq**: cold sequential read of large files, one reader, Python ``readinto`` with a 1 MiB
   buffer: MB/s (10^6 B/s) as a fraction of the cap, link bytes per byte read.
2. **rand**: fio 4 KiB random reads (psync, page cache on, ``--norandommap``, fixed
   ``--randseed``) over one 1 GiB file, ``--fio-jobs`` jobs: cold p50/p99 and link bytes per
   byte read, then, page cache dropped, the same offsets again: warm p50/p99.
3. **small**: one shuffled pass over 10,000 files of 16-128 KiB (10 dirs of 1,000) by 4 worker
   processes taking whole files from a shared list: files/s vs the link bound
   (cap / mean file size).
4. **meta** (only at the RTTs of ``--meta-rtts``): seconds from launching the mount to a
   finished ``find MNT | wc -l`` over 10,000 and 1,000,000 entries (rclone only on 10,000).

Runs: ``--runs`` (3) of rand, small and meta 10k; ``--heavy-runs`` (1) of seq, meta 1M and
rclone's find. Every pass is bounded (``--budget-s`` 60 s: fio's runtime and the small-file
pass; ``--seq-budget-s`` 120 s; ``--meta-timeout-s`` 300 s); a pass cut at its budget reports
MB/s or files/s over what it did, is marked ``*``, and that system is not run again for that
workload and RTT (one capped sample says enough; more would cost minutes each). The warm fio
pass re-reads, per job, as many of the job's offsets as the slowest job read cold, so every
warm read was read before. Link bytes are counted at the
proxy (bytes delivered towards the mount, HTTP headers included). Per pass the benchmark also
records each process's CPU (user+sys over wall, 100 % = one core), the whole machine's busy
CPU, and for spokefs the deltas of its Prometheus counters and of hubd's, plus a time series of
link bytes and ``spokefs_prefetch_inflight_requests_limit`` (for the diagnosis).

Prints one table per RTT (workload | spokefs | rclone | local | goal | met?) and appends one
JSON line per invocation to benchmarks/results/longlink.jsonl (``"script": "bench_longlink.py"``;
check_longlink.py writes its own records to the same file).

    python3 benchmarks/bench_longlink.py [--quick] [--rtts 60,900] [--runs 3] [--heavy-runs 1]
        [--only seq,rand,small,meta] [--systems spokefs,rclone,local] [--budget-s 60]
        [--fio-jobs 4] [--spoke-arg=--flag=value] [--hub-arg=--flag=value] [--keep]

Default run ~20 min on a 2-core VM (the data sets, ~3.3 GiB plus a 1M-entry tree, are built
once under --work-dir, first time ~1 min); ``--quick`` ~4 min (1 run, 256/128 MiB seq,
400/60 random reads, 2,000 small files, 20 s budgets, no 1M tree, no rclone find).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from bench_foundation import (  # noqa: E402
    HUB_READY_RE,
    SPOKE_READY_RE,
    BenchError,
    Deadline,
    Proc,
    drop_caches,
    ensure_tree,
    git_sha,
    is_mounted,
    unmount,
)
from longlink import LongLinkProcess  # noqa: E402

RESULTS = HERE / "results" / "longlink.jsonl"
KIB, MIB = 1024, 1024 * 1024
READ_BUFFER = MIB
SEQ_FILES, SEQ_FILE_MIB, SEQ_QUICK_MIB = 2, 512, 128
RAND_FILE_MIB = 1024
SMALL_DIRS, SMALL_PER_DIR = 10, 1000
SMALL_MIN, SMALL_MAX = 16 * KIB, 128 * KIB
SMALL_WORKERS = 4
FIO_SEED = 20261202
CLK_TCK = os.sysconf("SC_CLK_TCK")
SYSTEMS = ("spokefs", "rclone", "local")
WORKLOADS = ("seq", "rand", "small", "meta")


# -- data sets (built once under --work-dir, reused) ----------------------------------------


@dataclass
class Data:
    root: Path
    seq: list[str]  # relative paths of the large files, in read order
    seq_quick: list[str]  # smaller ones for --quick (whole files, so link bytes stay honest)
    rand: str  # the 1 GiB file
    small: dict[str, tuple[int, str]]  # relative path -> (size, xxh3_64 hex digest)


def _write_random(path: Path, mib: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for _ in range(mib):
            f.write(os.urandom(MIB))


def _build_small(root: Path) -> dict[str, tuple[int, str]]:
    rng = random.Random(1234)
    small: dict[str, tuple[int, str]] = {}
    for d in range(SMALL_DIRS):
        (root / "small" / f"d{d:02d}").mkdir(parents=True, exist_ok=True)
        for i in range(SMALL_PER_DIR):
            rel = f"small/d{d:02d}/f{i:04d}.bin"
            data = os.urandom(rng.randint(SMALL_MIN, SMALL_MAX))
            (root / rel).write_bytes(data)
            small[rel] = (len(data), xxhash.xxh3_64_hexdigest(data))
    return small


def ensure_data(work: Path) -> Data:
    """Built once, part by part, under work/longlink-data (manifest: longlink-data.json):
    seq/ 2 x 512 MiB, seq-quick/ 2 x 128 MiB, rand/ 1 x 1 GiB, small/ 10 dirs x 1,000 files
    of 16-128 KiB (uniform; mean ~72 KiB); all random bytes."""
    root, manifest = work / "longlink-data", work / "longlink-data.json"
    m = json.loads(manifest.read_text()) if manifest.exists() else {}
    parts = {
        "seq": lambda: [_write_random(root / f"seq/shard-{i}.bin", SEQ_FILE_MIB)
                        or f"seq/shard-{i}.bin" for i in range(SEQ_FILES)],
        "seq_quick": lambda: [_write_random(root / f"seq-quick/shard-{i}.bin", SEQ_QUICK_MIB)
                              or f"seq-quick/shard-{i}.bin" for i in range(SEQ_FILES)],
        "rand": lambda: _write_random(root / "rand/file-1G.bin", RAND_FILE_MIB)
        or "rand/file-1G.bin",
        "small": lambda: _build_small(root),
    }
    for name, build in parts.items():
        if name not in m:
            print(f"building {name} under {root} (once)", flush=True)
            m[name] = build()
            subprocess.run(["sync"], check=True)
            manifest.write_text(json.dumps(m))
    return Data(root, m["seq"], m["seq_quick"], m["rand"],
                {k: tuple(v) for k, v in m["small"].items()})


# -- processes: hub, rclone serve, mounts ---------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def run_hub(root: Path, logs: Path, args: argparse.Namespace, deadline: Deadline,
            tag: str) -> Iterator[tuple[Proc, str]]:
    """hubd serving root on loopback; yields (proc, url)."""
    argv = [sys.executable, "-m", "hubd", "serve", str(root), "--listen", "127.0.0.1:0",
            "--log-level", "WARNING", *args.hub_arg]
    proc = Proc("hubd", argv, logs / f"hubd-{tag}.log")
    try:
        yield proc, proc.wait_line(HUB_READY_RE, deadline.timeout(600)).group(1)
    finally:
        proc.stop()


@contextlib.contextmanager
def run_rclone_serve(root: Path, logs: Path, deadline: Deadline,
                     tag: str) -> Iterator[tuple[Proc, int]]:
    """``rclone serve http root`` on a free loopback port; yields (proc, port)."""
    port = free_port()
    argv = ["rclone", "serve", "http", str(root), "--addr", f"127.0.0.1:{port}"]
    proc = Proc("rclone-serve", argv, logs / f"rclone-serve-{tag}.log")
    try:
        end = time.monotonic() + deadline.timeout(30)
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if proc.popen.poll() is not None or time.monotonic() > end:
                raise BenchError(f"rclone serve did not start: {proc.log_tail()}")
            time.sleep(0.1)
        yield proc, port
    finally:
        proc.stop()


@dataclass
class Mounted:
    """Where a system's data is visible, and what to watch while a pass runs."""

    system: str
    path: Path
    link: LongLinkProcess | None = None
    pids: dict[str, int] = field(default_factory=dict)
    metrics_url: str | None = None  # spokefs /metrics
    hub_metrics_url: str | None = None  # hubd /metrics
    launched: float = 0.0  # perf_counter() at the mount command
    ready_s: float = 0.0


@dataclass
class Env:
    """What a whole RTT needs: the servers, the run dir, the options."""

    args: argparse.Namespace
    run_dir: Path
    deadline: Deadline
    hub_url: str = ""
    hub_pid: int = 0
    rclone_port: int = 0
    rclone_pid: int = 0
    mounts: list[Path] = field(default_factory=list)  # every mountpoint made (final sweep)
    capped: set[tuple[int, str, str]] = field(default_factory=set)  # (rtt, workload, system)

    def systems(self, rtt: int, workload: str) -> list[str]:
        """The systems to run: one whose pass hit its budget is not run again (one capped
        sample says what it can do, and more would cost minutes each)."""
        return [s for s in self.args.systems if (rtt, workload, s) not in self.capped]


def _link(upstream_port: int, delay_ms: float, args: argparse.Namespace) -> LongLinkProcess:
    return LongLinkProcess(("127.0.0.1", upstream_port), delay_ms, args.rate_mbit,
                           args.window_bytes)


def _new_dirs(env: Env, prefix: str) -> tuple[Path, Path]:
    mnt = Path(tempfile.mkdtemp(dir=env.run_dir, prefix=f"mnt-{prefix}-"))
    cache = Path(tempfile.mkdtemp(dir=env.run_dir, prefix=f"cache-{prefix}-"))
    env.mounts.append(mnt)
    return mnt, cache


@contextlib.contextmanager
def spoke_mount(env: Env, delay_ms: float, cache_size: str = "8G") -> Iterator[Mounted]:
    """longlink in front of hubd, and a foreground ``spokefs mount`` through it."""
    port = env.hub_url.rsplit(":", 1)[1]
    with _link(int(port), delay_ms, env.args) as link:
        mnt, cache = _new_dirs(env, "spokefs")
        mport = free_port()
        argv = [sys.executable, "-m", "spokefs", "mount", f"http://127.0.0.1:{link.port}",
                str(mnt), "--cache-dir", str(cache), "--cache-size", cache_size,
                "--metrics-port", str(mport), "--metrics-addr", "127.0.0.1", *env.args.spoke_arg]
        proc = Proc("spokefs", argv, env.run_dir / f"{mnt.name}.log")
        try:
            proc.wait_line(SPOKE_READY_RE, env.deadline.timeout(600))
            if not is_mounted(mnt):
                raise BenchError(f"spokefs said mounted but {mnt} is not a mount point")
            assert link.proc is not None
            yield Mounted("spokefs", mnt, link,
                          {"spokefs": proc.popen.pid, "hubd": env.hub_pid, "proxy": link.proc.pid},
                          f"http://127.0.0.1:{mport}/metrics", f"{env.hub_url}/metrics",
                          proc.started, time.perf_counter() - proc.started)
        finally:
            _reap_stuck(mnt, proc)
            unmount(mnt, proc)
            _cleanup_dirs(env, mnt, cache)


@contextlib.contextmanager
def rclone_mount(env: Env, delay_ms: float) -> Iterator[Mounted]:
    """longlink in front of ``rclone serve http``, and a foreground ``rclone mount`` through it."""
    with _link(env.rclone_port, delay_ms, env.args) as link:
        mnt, cache = _new_dirs(env, "rclone")
        argv = ["rclone", "mount", ":http:", str(mnt), "--http-url",
                f"http://127.0.0.1:{link.port}", "--vfs-cache-mode", "full", "--cache-dir",
                str(cache), *env.args.rclone_arg]
        proc = Proc("rclone", argv, env.run_dir / f"{mnt.name}.log")
        try:
            end = time.monotonic() + env.deadline.timeout(60)
            while not is_mounted(mnt):
                if proc.popen.poll() is not None or time.monotonic() > end:
                    raise BenchError(f"rclone mount did not come up: {proc.log_tail()}")
                time.sleep(0.02)
            assert link.proc is not None
            yield Mounted("rclone", mnt, link,
                          {"rclone-mount": proc.popen.pid, "rclone-serve": env.rclone_pid,
                           "proxy": link.proc.pid},
                          None, None, proc.started, time.perf_counter() - proc.started)
        finally:
            _unmount_rclone(mnt, proc)
            _cleanup_dirs(env, mnt, cache)


def _reap_stuck(mnt: Path, proc: Proc) -> None:
    """Readers killed at a budget but stuck in the mount: kill the daemon, which aborts the
    FUSE connection and ends their requests; then detach the dead mount."""
    if not _STUCK:
        return
    print(f"  ({len(_STUCK)} readers stuck in {proc.name} at the budget: killing it)", flush=True)
    proc.popen.kill()
    proc.popen.wait()
    subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)
    for w in _STUCK:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.join(timeout=10) if hasattr(w, "join") else w.wait(timeout=10)
    _STUCK.clear()


def _unmount_rclone(mnt: Path, proc: Proc) -> None:
    _reap_stuck(mnt, proc)
    if is_mounted(mnt):
        done = subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, check=False)
        if done.returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True,
                           check=False)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.popen.wait(timeout=15)
    proc.stop()
    if is_mounted(mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)


def _cleanup_dirs(env: Env, mnt: Path, cache: Path) -> None:
    with contextlib.suppress(OSError):
        if not is_mounted(mnt):
            mnt.rmdir()
    if not env.args.keep:
        shutil.rmtree(cache, ignore_errors=True)


@contextlib.contextmanager
def mount(env: Env, system: str, delay_ms: float, local_root: Path) -> Iterator[Mounted]:
    if system == "spokefs":
        with spoke_mount(env, delay_ms) as m:
            yield m
    elif system == "rclone":
        with rclone_mount(env, delay_ms) as m:
            yield m
    else:
        yield Mounted("local", local_root, launched=time.perf_counter())


# -- what a pass costs: link bytes, CPU, counters ------------------------------------------


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def _all_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (command, utime + stime) for every process (a ``top`` snapshot)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                text = Path(f"/proc/{d}/stat").read_text()
                head, tail = text.rsplit(")", 1)
                f = tail.split()
                out[int(d)] = (head.split("(", 1)[1], int(f[11]) + int(f[12]))
    return out


def _top_processes(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]],
                   wall: float, n: int = 8) -> list[tuple[int, str, float]]:
    """The n busiest processes between two snapshots: (pid, command, % of one core)."""
    busy = []
    for pid, (comm, ticks) in after.items():
        used = ticks - before.get(pid, (comm, 0))[1] if pid in before else ticks
        if used > 0:
            cmdline = ""
            with contextlib.suppress(OSError):
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()[:90]
                cmdline = raw.replace(b"\0", b" ").decode(errors="replace").strip()
            busy.append((pid, cmdline or comm, round(used / CLK_TCK / wall * 100, 1)))
    return sorted(busy, key=lambda x: -x[2])[:n]


def scrape(url: str | None, prefixes: tuple[str, ...]) -> dict[str, float]:
    """Prometheus text -> {'name{l=v,...}': value} for sample names with these prefixes."""
    if url is None:
        return {}
    try:
        text = urllib.request.urlopen(url, timeout=3).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(prefixes):
            continue
        key, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[key] = float(value)
    return out


_SPOKE_PREFIXES = ("spokefs_prefetch", "spokefs_hub_requests_total", "spokefs_link_bytes",
                   "spokefs_reads_total", "spokefs_block_", "spokefs_hub_retries",
                   "spokefs_hub_errors", "spokefs_read_bytes", "spokefs_hub_request_seconds_sum",
                   "spokefs_hub_request_seconds_count")
_HUB_PREFIXES = ("hubd_requests_total", "hubd_reads_in_flight", "hubd_bytes_served_total",
                 "hubd_pack_files_total")


class Probe:
    """Counters around one pass; with ``series``, samples link bytes and the spoke's in-flight
    limit every 0.5 s in a thread."""

    def __init__(self, m: Mounted, series: bool = False,
                 progress: Callable[[], float] | None = None) -> None:
        self.m = m
        self.progress = progress or (lambda: -1.0)
        self.series_on = series and m.link is not None
        self.series: list[list[float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _link(self) -> dict[str, Any]:
        return self.m.link.statistics() if self.m.link is not None else {}

    def start(self) -> None:
        if self.m.link is not None:
            time.sleep(0.3)  # the proxy rewrites its status file every 0.2 s
        self.l0 = self._link()
        self.c0 = {k: _cpu_ticks(p) for k, p in self.m.pids.items()}
        self.s0 = _machine_ticks()
        self.all0 = _all_ticks()
        self.k0 = scrape(self.m.metrics_url, _SPOKE_PREFIXES)
        self.h0 = scrape(self.m.hub_metrics_url, _HUB_PREFIXES)
        self.t0 = time.perf_counter()
        if self.series_on:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            k = scrape(self.m.metrics_url, ("spokefs_prefetch_inflight",))
            h = scrape(self.m.hub_metrics_url, ("hubd_reads_in_flight",))
            self.series.append([
                round(time.perf_counter() - self.t0, 2), self._link().get("bytes_down", 0),
                k.get("spokefs_prefetch_inflight_requests_limit", -1),
                h.get("hubd_reads_in_flight", -1),
                _cpu_ticks(self.m.pids.get("spokefs", 0)), self.progress(),
            ])

    def stop(self, settle_s: float = 1.0) -> dict[str, Any]:
        wall = time.perf_counter() - self.t0
        cpu = {k: (_cpu_ticks(p) - self.c0[k]) / CLK_TCK / wall * 100
               for k, p in self.m.pids.items()}
        s1 = _machine_ticks()
        top = _top_processes(self.all0, _all_ticks(), wall)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.m.link is not None:
            time.sleep(settle_s)  # bytes still on their way, and the status file's period
        l1 = self._link()
        k1 = scrape(self.m.metrics_url, _SPOKE_PREFIXES)
        h1 = scrape(self.m.hub_metrics_url, _HUB_PREFIXES)
        out: dict[str, Any] = {
            "wall_s": wall,
            "cpu_pct": {k: round(v, 1) for k, v in cpu.items()},
            "machine_busy_pct_of_2_cores": round(
                (s1[0] - self.s0[0]) / max(1, s1[1] - self.s0[1]) * 100 * (os.cpu_count() or 1), 1),
            "loadavg": os.getloadavg()[0],
            "top_processes_cpu_pct": top,
        }
        if self.m.link is not None:
            for key in ("bytes_down", "bytes_up", "connections_accepted"):
                out[f"link_{key}"] = l1.get(key, 0) - self.l0.get(key, 0)
        if k1:
            out["spoke"] = {k: v - self.k0.get(k, 0) for k, v in k1.items()
                            if "limit" not in k and v != self.k0.get(k, 0)}
            for kind in ("blob", "pack"):
                key = f'{{kind="{kind}"}}'
                n = out["spoke"].get(f"spokefs_hub_request_seconds_count{key}", 0)
                if n:
                    out["spoke"][f"mean_hub_{kind}_latency_s"] = round(
                        out["spoke"][f"spokefs_hub_request_seconds_sum{key}"] / n, 4)
            out["spoke"]["prefetch_inflight_requests_limit_end"] = k1.get(
                "spokefs_prefetch_inflight_requests_limit", -1)
        if h1:
            out["hub"] = {k: v - self.h0.get(k, 0) for k, v in h1.items()
                          if v != self.h0.get(k, 0)}
        if self.series:
            out["series"] = {"cols": ["t_s", "link_bytes_down", "prefetch_limit",
                                      "hub_reads_in_flight", "spokefs_cpu_ticks", "bytes_read"],
                             "rows": self.series}
        return out


# -- workloads ------------------------------------------------------------------------------


_SEQ_PROGRESS = [0]  # bytes read so far by read_sequential (the Probe's sampler reads it)


def read_sequential(root: Path, rels: list[str], max_bytes: int,
                    budget_s: float) -> tuple[int, float, list[tuple[str, int]], float]:
    """Read files in order with 1 MiB readinto until max_bytes or the budget.

    Returns (bytes, seconds, [(relpath, bytes read of it)], seconds to read the first half).
    """
    buf = bytearray(READ_BUFFER)
    view = memoryview(buf)
    total, done, t0 = 0, [], time.perf_counter()
    end, half_at = t0 + budget_s, 0.0
    _SEQ_PROGRESS[0] = 0
    for rel in rels:
        got = 0
        with (root / rel).open("rb", buffering=0) as f:
            while total < max_bytes and time.perf_counter() < end:
                n = f.readinto(view[: min(READ_BUFFER, max_bytes - total)])
                if not n:
                    break
                got += n
                total += n
                _SEQ_PROGRESS[0] = total
                if not half_at and total >= max_bytes // 2:
                    half_at = time.perf_counter() - t0
        done.append((rel, got))
        if total >= max_bytes or time.perf_counter() >= end:
            break
    return total, time.perf_counter() - t0, done, half_at


def verify_prefix(a: Path, b: Path, parts: list[tuple[str, int]]) -> None:
    """``cmp -n`` what was read (untimed); raise on a difference."""
    for rel, n in parts:
        if n:
            done = subprocess.run(["cmp", "-n", str(n), str(a / rel), str(b / rel)],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise BenchError(f"{a / rel} differs from the source: {done.stdout}{done.stderr}")


def _percentile(sorted_vals: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100) of sorted values."""
    if not sorted_vals:
        return 0.0
    rank = max(1, -(-len(sorted_vals) * q // 100))
    return sorted_vals[int(rank) - 1]


def run_fio(path: Path, per_job: int, jobs: int, runtime_s: float, logdir: Path) -> dict[str, Any]:
    """fio 4 KiB random reads, ``per_job`` each in ``jobs`` jobs (each job its own fixed
    sequence of offsets from --randseed and its job number). Latencies come from fio's
    per-I/O logs, so percentiles are exact over all jobs and ``per_job_done`` says how far
    each job got before the runtime cap."""
    shutil.rmtree(logdir, ignore_errors=True)
    logdir.mkdir(parents=True)
    argv = ["fio", "--name=randread", f"--filename={path}", "--ioengine=psync",
            "--rw=randread", "--bs=4k", "--direct=0", "--norandommap", f"--randseed={FIO_SEED}",
            f"--io_size={per_job * 4096}", f"--numjobs={jobs}",
            f"--runtime={max(1, int(runtime_s))}", "--output-format=json",
            f"--write_lat_log={logdir}/io"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False,
                          timeout=runtime_s + 120)
    if done.returncode != 0:
        raise BenchError(f"fio failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    lat_ms: list[float] = []
    per_job_done = []
    for j in range(1, jobs + 1):
        rows = (logdir / f"io_lat.{j}.log").read_text().splitlines()
        per_job_done.append(len(rows))
        lat_ms += [int(r.split(",")[1]) / 1e6 for r in rows]
    lat_ms.sort()
    return {"reads": len(lat_ms), "bytes": len(lat_ms) * 4096, "per_job_done": per_job_done,
            "p50_ms": _percentile(lat_ms, 50), "p99_ms": _percentile(lat_ms, 99),
            "max_ms": lat_ms[-1] if lat_ms else 0.0,
            "mean_ms": statistics.fmean(lat_ms) if lat_ms else 0.0,
            "planned_reads": per_job * jobs, "command": shlex.join(argv)}


_SMALL: dict[str, Any] = {}  # inherited by the forked workers
_STUCK: list[Any] = []  # killed workers still inside a FUSE request (see read_small)


def _small_worker(k: int, counter: Any, stats: Any, go: Any) -> None:
    """Whole files from the shared list; progress in stats[4k:4k+4] = files, bytes, bad, t."""
    paths, digests = _SMALL["paths"], _SMALL["digests"]
    go.wait()
    while True:
        with counter.get_lock():
            i = counter.value
            counter.value = i + 1
        if i >= len(paths):
            break
        with open(paths[i], "rb", buffering=0) as f:
            data = f.read()
        bad = xxhash.xxh3_64_hexdigest(data) != digests[i]
        with stats.get_lock():
            stats[4 * k] += 1
            stats[4 * k + 1] += len(data)
            stats[4 * k + 2] += bad
            stats[4 * k + 3] = time.time()


_CTX = mp.get_context("fork")


def small_stats() -> Any:
    """Shared progress of the small-file workers: per worker files, bytes, bad, last time."""
    return _CTX.Array("d", 4 * SMALL_WORKERS)


def _sum_bytes(stats: Any) -> Callable[[], float]:
    """Bytes read so far by the small-file workers (for the Probe's time series)."""
    return lambda: float(sum(stats[1::4]))


def read_small(root: Path, rels: list[str], data: Data, budget_s: float,
               stats: Any) -> dict[str, Any]:
    """SMALL_WORKERS processes read whole files from one shared shuffled list, until it is
    done or the budget is over (then the workers are killed, even inside a read)."""
    ctx = _CTX
    _SMALL["paths"] = [str(root / r) for r in rels]
    _SMALL["digests"] = [data.small[r][1] for r in rels]
    counter, go = ctx.Value("l", 0), ctx.Event()
    workers = [ctx.Process(target=_small_worker, args=(k, counter, stats, go))
               for k in range(SMALL_WORKERS)]
    for w in workers:
        w.start()
    time.sleep(0.2)
    t0 = time.time()
    go.set()
    capped = False
    for w in workers:
        w.join(timeout=max(0.0, t0 + budget_s - time.time()))
        capped |= w.is_alive()
    for w in workers:
        if w.is_alive():
            w.kill()
            w.join(timeout=2)
    # A worker killed inside a FUSE request that the daemon has already taken waits for its
    # answer (the kernel cannot abandon it); the mount's teardown kills the daemon first.
    stuck = [w for w in workers if w.is_alive()]
    _STUCK.extend(stuck)
    with stats.get_lock():
        vals = list(stats)
    files = int(sum(vals[0::4]))
    nbytes = int(sum(vals[1::4]))
    seconds = budget_s if capped else max(vals[3::4]) - t0
    return {"files": files, "bytes": nbytes, "bad": int(sum(vals[2::4])), "seconds": seconds,
            "files_per_s": files / seconds, "capped": capped, "stuck_workers": len(stuck),
            "mean_file_bytes": nbytes / files if files else statistics.fmean(
                data.small[r][0] for r in rels)}


def find_count(path: Path, timeout_s: float) -> int | None:
    """``find PATH | wc -l`` in a shell; None on timeout (then the mount's daemon is killed
    at teardown, which frees a find stuck inside a FUSE request)."""
    cmd = f"find {shlex.quote(str(path))} | wc -l"
    p = subprocess.Popen(cmd, shell=True, stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.communicate(timeout=5)
        _STUCK.append(p)
        return None
    return int(out)


# -- figures ------------------------------------------------------------------------------


@dataclass
class Figure:
    samples: list[float] = field(default_factory=list)

    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    def summary(self) -> dict[str, Any]:
        s = self.samples
        return {"median": self.median(), "min": min(s), "max": max(s), "samples": s} if s else {}


class Results:
    """results[rtt][workload][system][figure] -> Figure, plus per-pass diagnostics."""

    def __init__(self) -> None:
        self.figs: dict[int, dict[str, dict[str, dict[str, Figure]]]] = {}
        self.passes: list[dict[str, Any]] = []

    def add(self, rtt: int, workload: str, system: str, **values: float | None) -> None:
        d = self.figs.setdefault(rtt, {}).setdefault(workload, {}).setdefault(system, {})
        for k, v in values.items():
            if v is not None:
                d.setdefault(k, Figure()).samples.append(float(v))

    def get(self, rtt: int, workload: str, system: str, fig: str) -> Figure:
        return self.figs.get(rtt, {}).get(workload, {}).get(system, {}).get(fig, Figure())

    def record(self, rtt: int, workload: str, system: str, run: int, **info: Any) -> None:
        self.passes.append({"rtt_ms": rtt, "workload": workload, "system": system, "run": run,
                            **info})


# -- the workloads, per system ------------------------------------------------------------


_T0 = time.monotonic()


def _stamp() -> str:
    return f"[{time.monotonic() - _T0:5.0f} s]"


def _link_per_byte(probe: dict[str, Any], nbytes: int) -> float | None:
    return probe["link_bytes_down"] / nbytes if "link_bytes_down" in probe and nbytes else None


def bench_seq(env: Env, data: Data, rtt: int, res: Results) -> None:
    args = env.args
    max_bytes = (args.seq_mib[0] if rtt <= 100 else args.seq_mib[1]) * MIB
    cap = args.rate_mbit * 1e6 / 8
    for run in range(args.heavy_runs):
        for system in env.systems(rtt, "seq"):
            with mount(env, system, rtt / 2, data.root) as m:
                drop_caches()
                probe = Probe(m, series=True, progress=lambda: float(_SEQ_PROGRESS[0]))
                probe.start()
                files = data.seq_quick if args.quick else data.seq
                nbytes, secs, parts, half = read_sequential(m.path, files, max_bytes,
                                                            args.seq_budget_s)
                info = probe.stop()
                verify_prefix(m.path, data.root, parts)
            mbps = nbytes / secs / 1e6
            lpb = _link_per_byte(info, nbytes)
            capped = nbytes < max_bytes
            if capped:
                env.capped.add((rtt, "seq", system))
            second_half = (nbytes - max_bytes // 2) / (secs - half) / 1e6 if half else None
            res.add(rtt, "seq", system, mbps=mbps, frac_cap=nbytes / secs / cap,
                    link_per_byte=lpb, mib_read=nbytes / MIB, seconds=secs,
                    mbps_2nd_half=second_half, capped=float(capped))
            res.record(rtt, "seq", system, run, mib_read=nbytes / MIB, seconds=secs,
                       first_half_s=half, mbps_2nd_half=second_half, capped=capped,
                       ready_s=m.ready_s, **info)
            print(f"{_stamp()} seq {system:8s} run {run + 1}: {nbytes / MIB:.0f} MiB in "
                  f"{secs:.1f} s = "
                  f"{mbps:.1f} MB/s ({nbytes / secs / cap:.2f} of cap; 2nd half "
                  f"{second_half or 0:.1f} MB/s), link/byte "
                  f"{lpb if lpb is None else round(lpb, 3)}, cpu {info['cpu_pct']}", flush=True)


def bench_rand(env: Env, data: Data, rtt: int, res: Results) -> None:
    args = env.args
    reads = args.rand_reads[0] if rtt <= 100 else args.rand_reads[1]
    for run in range(args.runs):
        for system in env.systems(rtt, "rand"):
            with mount(env, system, rtt / 2, data.root) as m:
                target, logs = m.path / data.rand, env.run_dir / "fio"
                per_job = max(1, reads // args.fio_jobs)
                drop_caches()
                probe = Probe(m)
                probe.start()
                cold = run_fio(target, per_job, args.fio_jobs, args.budget_s, logs)
                cinfo = probe.stop()
                # the same offsets again: as many per job as the slowest job did cold
                drop_caches()
                probe = Probe(m)
                probe.start()
                warm = run_fio(target, max(1, min(cold["per_job_done"])), args.fio_jobs,
                               args.budget_s, logs)
                winfo = probe.stop(settle_s=0.5)
            lpb = _link_per_byte(cinfo, cold["bytes"])
            if cold["reads"] < cold["planned_reads"]:
                env.capped.add((rtt, "rand", system))
            res.add(rtt, "rand", system, cold_p50_ms=cold["p50_ms"], cold_p99_ms=cold["p99_ms"],
                    capped=float(cold["reads"] < cold["planned_reads"]),
                    cold_link_per_byte=lpb, cold_reads=cold["reads"],
                    warm_p50_ms=warm["p50_ms"], warm_p99_ms=warm["p99_ms"],
                    warm_link_bytes=winfo.get("link_bytes_down"))
            res.record(rtt, "rand", system, run, cold=cold, cold_probe=cinfo, warm=warm,
                       warm_probe=winfo)
            print(f"{_stamp()} rand {system:8s} run {run + 1}: cold {cold['reads']} reads p50 "
                  f"{cold['p50_ms']:.2f} p99 {cold['p99_ms']:.2f} ms, link/byte "
                  f"{lpb if lpb is None else round(lpb, 2)}; warm p50 {warm['p50_ms']:.3f} p99 "
                  f"{warm['p99_ms']:.3f} ms, warm link bytes {winfo.get('link_bytes_down')}; "
                  f"cpu {cinfo['cpu_pct']}", flush=True)


def bench_small(env: Env, data: Data, rtt: int, res: Results) -> None:
    args = env.args
    dirs = {f"small/d{d:02d}/" for d in range(args.small_dirs)}
    rels = sorted(r for r in data.small if r[: len("small/d00/")] in dirs)
    cap = args.rate_mbit * 1e6 / 8
    for run in range(args.runs):
        order = rels[:]
        random.Random(run).shuffle(order)  # the same order for every system in a run
        for system in env.systems(rtt, "small"):
            with mount(env, system, rtt / 2, data.root) as m:
                drop_caches()
                stats = small_stats()
                probe = Probe(m, series=True, progress=_sum_bytes(stats))
                probe.start()
                out = read_small(m.path, order, data, args.budget_s, stats)
                info = probe.stop()
            if out["capped"]:
                env.capped.add((rtt, "small", system))
            if out["bad"]:
                raise BenchError(f"{system}: {out['bad']} small files differ from the source")
            bound = cap / out["mean_file_bytes"]
            lpb = _link_per_byte(info, out["bytes"])
            res.add(rtt, "small", system, files_per_s=out["files_per_s"],
                    frac_bound=out["files_per_s"] / bound, link_per_byte=lpb,
                    files=out["files"], bound=bound, capped=float(out["capped"]))
            res.record(rtt, "small", system, run, **out, bound_files_per_s=bound, **info)
            rate = out["files_per_s"]
            print(f"{_stamp()} small {system:8s} run {run + 1}: {out['files']} files in "
                  f"{out['seconds']:.1f} s = {rate:.0f}/s ({rate / bound:.2f} of bound "
                  f"{bound:.0f}/s), link/byte {lpb if lpb is None else round(lpb, 3)}, "
                  f"cpu {info['cpu_pct']}", flush=True)


def bench_meta(env: Env, rtt: int, res: Results) -> None:
    """Mount launch -> finished ``find | wc -l`` on 10k and 1M entries (servers per tree)."""
    args = env.args
    for entries in args.meta_entries:
        root, expected = ensure_tree(args.work_dir, entries)
        runs = args.runs if entries <= 100_000 else args.heavy_runs
        systems = [s for s in args.systems if s != "rclone" or entries <= args.rclone_meta_max]
        name = f"meta{entries // 1000}k" if entries < 1_000_000 else f"meta{entries // 1_000_000}M"
        saved = env.hub_url, env.hub_pid, env.rclone_port, env.rclone_pid
        with contextlib.ExitStack() as stack:
            if "spokefs" in systems:
                hub, env.hub_url = stack.enter_context(run_hub(root, env.run_dir, args,
                                                               env.deadline, name))
                env.hub_pid = hub.popen.pid
            if "rclone" in systems:
                serve, env.rclone_port = stack.enter_context(
                    run_rclone_serve(root, env.run_dir, env.deadline, name))
                env.rclone_pid = serve.popen.pid
            for run in range(runs):
                for system in systems:
                    if system == "rclone" and run >= args.heavy_runs:
                        continue  # ~90 s a pass at 60 ms: heavy
                    _meta_pass(env, system, rtt, root, expected, name, run, res)
        env.hub_url, env.hub_pid, env.rclone_port, env.rclone_pid = saved


def _meta_pass(env: Env, system: str, rtt: int, root: Path, expected: int, name: str, run: int,
               res: Results) -> None:
    drop_caches()
    timeout = env.deadline.timeout(env.args.meta_timeout_s)
    if system == "local":
        t0 = time.perf_counter()
        found = find_count(root, timeout)
        total, ready, info = time.perf_counter() - t0, 0.0, {}
    else:
        with mount(env, system, rtt / 2, root) as m:
            probe = Probe(m)
            probe.start()
            mount_cost = {"mount_link_bytes_down": probe.l0.get("bytes_down"),
                          "mount_cpu_s": {k: _cpu_ticks(p) / CLK_TCK for k, p in m.pids.items()
                                          if k in ("spokefs", "rclone-mount")}}
            found = find_count(m.path, timeout)
            total, ready = time.perf_counter() - m.launched, m.ready_s
            info = {**probe.stop(settle_s=0.5), **mount_cost}
    if found is not None and found != expected:
        raise BenchError(f"{system}: find counted {found} entries, the source {expected}")
    res.add(rtt, name, system, seconds=total if found is not None else timeout,
            mount_ready_s=ready,
            capped=float(found is None))
    res.record(rtt, name, system, run, seconds=total, found=found, expected=expected,
               mount_ready_s=ready, **info)
    shown = f"{total:.2f} s" if found is not None else f"> {timeout:.0f} s (timed out)"
    print(f"{_stamp()} {name} {system:8s} run {run + 1}: mount -> find done {shown} "
          f"(ready {ready:.2f} s, {found} entries)", flush=True)


# -- the table ------------------------------------------------------------------------------


def _fmt(fig: Figure, fmt: str, scale: float = 1.0) -> str:
    if not fig.samples:
        return "-"
    med = fig.median() * scale  # type: ignore[operator]
    if len(fig.samples) == 1:
        return fmt.format(med)
    lo, hi = min(fig.samples) * scale, max(fig.samples) * scale
    return f"{fmt.format(med)} ({fmt.format(lo)}-{fmt.format(hi)})"


def table_rows(res: Results, rtt: int, args: argparse.Namespace) -> list[list[str]]:
    """[workload, spokefs, rclone, local, goal, met?] rows for one RTT; "met?" judges the
    spokefs median. A cell marked * comes from a pass cut at its budget (see the notes)."""
    rows: list[list[str]] = []
    cap_mbps = args.rate_mbit / 8

    def row(label: str, workload: str, fig: str, fmt: str, goal: str = "", ok: Any = None,
            ratio: str | None = None) -> None:
        cells = []
        for s in SYSTEMS:
            text = _fmt(res.get(rtt, workload, s, fig), fmt)
            if text != "-" and ratio:
                text += f" [{res.get(rtt, workload, s, ratio).median():.2f}x]"
            if text != "-" and (res.get(rtt, workload, s, "capped").median() or 0) > 0:
                text = f"> {text} *" if workload.startswith("meta") else f"{text} *"
            cells.append(text)
        med = res.get(rtt, workload, "spokefs", fig).median()
        met = "" if ok is None or med is None else ("yes" if ok(med) else "NO")
        if any(c != "-" for c in cells):
            rows.append([label, *cells, goal, met])

    row("seq cold MB/s [x cap]", "seq", "mbps", "{:.1f}", f">= 0.8 x cap ({0.8 * cap_mbps:.0f})",
        lambda v: v >= 0.8 * cap_mbps, ratio="frac_cap")
    row("seq cold MB/s, 2nd half of the bytes", "seq", "mbps_2nd_half", "{:.1f}")
    row("seq link bytes / byte read", "seq", "link_per_byte", "{:.3f}", "~1 (<= 1.05)",
        lambda v: v <= 1.05)
    row("rand 4K cold p50 ms", "rand", "cold_p50_ms", "{:.1f}")
    row("rand 4K cold p99 ms", "rand", "cold_p99_ms", "{:.1f}", f"<= 3 RTT ({3 * rtt} ms)",
        lambda v: v <= 3 * rtt)
    row("rand 4K cold link bytes / byte read", "rand", "cold_link_per_byte", "{:.2f}", "<= 4",
        lambda v: v <= 4)
    row("rand 4K warm p50 ms", "rand", "warm_p50_ms", "{:.3f}")
    row("rand 4K warm p99 ms", "rand", "warm_p99_ms", "{:.3f}", "< 1 ms", lambda v: v < 1)
    bound = next((b for s in SYSTEMS if (b := res.get(rtt, "small", s, "bound").median())), 0.0)
    row("small files/s cold [x bound]", "small", "files_per_s", "{:.0f}",
        f">= 0.8 x bound ({0.8 * bound:.0f}/s)", lambda v: v >= 0.8 * bound, ratio="frac_bound")
    row("small link bytes / byte read", "small", "link_per_byte", "{:.3f}")
    for name in sorted(k for k in res.figs.get(rtt, {}) if k.startswith("meta")):
        row(f"mount -> `find \\| wc -l` done, {name[4:]} entries, s", name, "seconds", "{:.2f}")
    return rows


def print_table(rows: list[list[str]], rtt: int, args: argparse.Namespace) -> str:
    head = ["workload", "spokefs", "rclone", "local", "goal", "met?"]
    lines = [f"RTT {rtt} ms (one-way {rtt / 2:g} ms), {args.rate_mbit:g} Mbit/s cap, "
             f"{args.window_bytes // MIB} MiB window per connection",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if any("*" in c for r in rows for c in r[1:4]):
        lines.append(f"\n\\* cut at the pass budget (rand/small {args.budget_s:g} s, seq "
                     f"{args.seq_budget_s:g} s, find {args.meta_timeout_s:g} s): one run, rate "
                     "over what it did (for find: did not finish).")
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    return text


# -- main ---------------------------------------------------------------------------------


def _pair(text: str) -> tuple[int, int]:
    parts = [int(x) for x in text.split(",")]
    return (parts[0], parts[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true",
                   help="1 run, small sizes, no 1M tree, no rclone find, 20 s budgets (<= 5 min)")
    p.add_argument("--rtts", default="60,900", help="RTTs in ms (60,900)")
    p.add_argument("--meta-rtts", default="60", help="RTTs at which to run meta (60)")
    p.add_argument("--runs", type=int, default=3, help="runs of rand, small, meta 10k (3)")
    p.add_argument("--heavy-runs", type=int, default=1, help="runs of seq and meta 1M (1)")
    p.add_argument("--only", default=",".join(WORKLOADS), help="workloads (seq,rand,small,meta)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="spokefs,rclone,local")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="link cap (1000)")
    p.add_argument("--window-bytes", type=int, default=4 * MIB, help="window per conn (4 MiB)")
    p.add_argument("--seq-mib", type=_pair, default=(1024, 512),
                   help="MiB read sequentially at <= 100 ms, > 100 ms RTT (1024,512)")
    p.add_argument("--seq-budget-s", type=float, default=120.0, help="seq pass cap (120 s)")
    p.add_argument("--rand-reads", type=_pair, default=(2000, 200),
                   help="4 KiB reads at <= 100 ms, > 100 ms RTT (2000,200)")
    p.add_argument("--fio-jobs", type=int, default=4, help="fio jobs (4)")
    p.add_argument("--small-dirs", type=int, default=SMALL_DIRS,
                   help=f"dirs of {SMALL_PER_DIR} small files in the pass ({SMALL_DIRS})")
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="cap of each rand (fio runtime) and small pass (60 s)")
    p.add_argument("--meta-entries", default="10000,1000000", help="trees for meta")
    p.add_argument("--rclone-meta-max", type=int, default=10_000,
                   help="largest tree rclone lists (10000)")
    p.add_argument("--meta-timeout-s", type=float, default=300.0, help="per find (300 s)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/spokefs-bench"))
    p.add_argument("--spoke-arg", action="append", default=[], help="extra spokefs mount arg")
    p.add_argument("--hub-arg", action="append", default=[], help="extra hubd serve arg")
    p.add_argument("--rclone-arg", action="append", default=[], help="extra rclone mount arg")
    p.add_argument("--max-seconds", type=float, default=2400.0, help="whole-run budget (2400)")
    p.add_argument("--keep", action="store_true", help="keep caches and logs")
    p.add_argument("--results", type=Path, default=RESULTS, help="JSON lines appended here")
    args = p.parse_args(argv)
    if args.quick:
        args.runs = args.heavy_runs = 1
        args.seq_mib, args.rand_reads = (256, 128), (400, 60)
        args.small_dirs, args.budget_s, args.seq_budget_s = 2, 20.0, 30.0
        args.meta_entries = "10000"
        args.rclone_meta_max = 0
        args.max_seconds = min(args.max_seconds, 600.0)
    args.rtts = [int(x) for x in args.rtts.split(",")]
    args.meta_rtts = [int(x) for x in args.meta_rtts.split(",") if x]
    args.only = [w for w in args.only.split(",") if w]
    args.systems = [s for s in args.systems.split(",") if s]
    args.meta_entries = [int(x) for x in args.meta_entries.split(",") if x]
    bad = set(args.only) - set(WORKLOADS) | set(args.systems) - set(SYSTEMS)
    if bad:
        p.error(f"unknown workload or system: {sorted(bad)}")
    return args


def write_result(args: argparse.Namespace, res: Results, tables: dict[int, str],
                 error: str | None, started: float) -> None:
    record = {
        "script": "bench_longlink.py", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_sha": git_sha(), "kernel": platform.release(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "argv": sys.argv[1:],
        "wall_s": round(time.monotonic() - started, 1),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "figures": {str(rtt): {w: {s: {f: fig.summary() for f, fig in figs.items()}
                                   for s, figs in sys_.items()}
                               for w, sys_ in work.items()}
                    for rtt, work in res.figs.items()},
        "tables": {str(k): v for k, v in tables.items()},
        "passes": res.passes, "error": error,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with args.results.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _sweep(env: Env) -> None:
    """Last resort: nothing we mounted stays mounted."""
    for mnt in env.mounts:
        if is_mounted(mnt):
            print(f"warning: {mnt} still mounted; lazy unmount", file=sys.stderr)
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True,
                           check=False)


def run_all(env: Env, data: Data | None, res: Results) -> None:
    args = env.args
    with contextlib.ExitStack() as stack:
        if data is not None and "spokefs" in args.systems:
            hub, env.hub_url = stack.enter_context(run_hub(data.root, env.run_dir, args,
                                                           env.deadline, "data"))
            env.hub_pid = hub.popen.pid
        if data is not None and "rclone" in args.systems:
            serve, env.rclone_port = stack.enter_context(
                run_rclone_serve(data.root, env.run_dir, env.deadline, "data"))
            env.rclone_pid = serve.popen.pid
        for rtt in args.rtts:
            print(f"\n== RTT {rtt} ms ==", flush=True)
            if data is not None:
                for name, fn in (("seq", bench_seq), ("rand", bench_rand), ("small", bench_small)):
                    if name in args.only:
                        fn(env, data, rtt, res)
            if "meta" in args.only and rtt in args.meta_rtts:
                bench_meta(env, rtt, res)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench_longlink: needs root (FUSE allow_other, drop_caches)", file=sys.stderr)
        return 2
    if "rclone" in args.systems and shutil.which("rclone") is None:
        print("bench_longlink: rclone not found: apt-get install rclone", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    started = time.monotonic()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    env = Env(args, Path(tempfile.mkdtemp(dir=args.work_dir, prefix="run-ll-")),
              Deadline(args.max_seconds))
    res, tables, error = Results(), {}, None
    try:
        data = ensure_data(args.work_dir) if set(args.only) - {"meta"} else None
        run_all(env, data, res)
    except (BenchError, subprocess.SubprocessError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        print(f"bench_longlink: error: {error}", file=sys.stderr)
    finally:
        _sweep(env)
        for rtt in args.rtts:
            if rtt in res.figs:
                tables[rtt] = print_table(table_rows(res, rtt, args), rtt, args)
        write_result(args, res, tables, error, started)
        print(f"\n{time.monotonic() - started:.0f} s; appended to {args.results}")
        if args.keep:
            print(f"kept logs and caches in {env.run_dir}")
        else:
            shutil.rmtree(env.run_dir, ignore_errors=True)
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
