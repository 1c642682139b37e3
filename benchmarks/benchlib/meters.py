"""Meters around a pass: CPU of given processes and of the machine (``CpuMeter``,
``proc_cpu_ticks``, ``machine_ticks``, ``all_ticks``/``top_processes``), a sampler thread for
any columns (``Series``), and Prometheus text endpoints (``scrape``, ``wait_workers``)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from .common import BenchError, Deadline

CLK_TCK = os.sysconf("SC_CLK_TCK")
WORKERS_WAIT_S = 60.0


def _stat_fields(pid: int, tid: int | None, *at: int) -> list[int]:
    """Fields ``at`` (counted after the command's closing parenthesis) of pid's
    ``/proc/PID/stat`` (all its threads, exited ones included), or of its thread ``tid``
    alone; zeros if it is gone."""
    stat = Path(f"/proc/{pid}/stat") if tid is None else Path(f"/proc/{pid}/task/{tid}/stat")
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return [int(fields[i]) for i in at]
    except (OSError, IndexError, ValueError):
        return [0] * len(at)


def proc_cpu_ticks(pid: int, tid: int | None = None) -> int:
    """utime + stime of pid (all its threads), or of its thread ``tid`` alone, in clock
    ticks; 0 if it is gone."""
    return sum(_stat_fields(pid, tid, 11, 12))


def tree_minor_faults(pids: list[int]) -> dict[int, int]:
    """pid -> minor page faults of all its threads so far (``minflt``: fresh pages the
    kernel zeroed), for each of pids (0 for one that is gone)."""
    return {p: _stat_fields(p, None, 7)[0] for p in pids}


def tree_pids(pid: int) -> list[int]:
    """pid and its descendants now (``/proc/PID/task/*/children``, recursively): a spoke and
    its ``--workers`` processes, whose CPU is not in the parent's until they are reaped."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError, ValueError):
                    text = Path(f"/proc/{p}/task/{task}/children").read_text()
                    todo += [int(c) for c in text.split()]
    return out


def tree_cpu_ticks(pids: list[int]) -> dict[int, int]:
    """pid -> utime + stime in clock ticks, for each of pids (0 for one that is gone)."""
    return {p: proc_cpu_ticks(p) for p in pids}


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat (idle = idle + iowait)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def all_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (command, utime + stime) of every process (a ``top`` snapshot)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                head, tail = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)
                f = tail.split()
                out[int(d)] = (head.split("(", 1)[1], int(f[11]) + int(f[12]))
    return out


def top_processes(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]],
                  wall_s: float, n: int = 8) -> list[tuple[int, str, float]]:
    """The n busiest processes between two ``all_ticks()``: (pid, command, % of one core)."""
    busy = []
    for pid, (comm, ticks) in after.items():
        used = ticks - before[pid][1] if pid in before else ticks
        if used > 0:
            cmdline = ""
            with contextlib.suppress(OSError):
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()[:90]
                cmdline = raw.replace(b"\0", b" ").decode(errors="replace").strip()
            busy.append((pid, cmdline or comm, round(used / CLK_TCK / wall_s * 100, 1)))
    return sorted(busy, key=lambda x: -x[2])[:n]


class CpuMeter:
    """CPU seconds of named pids, each with its descendants (a spoke's ``--workers`` process
    is a child whose CPU is not in the spoke's own until it is reaped), and the machine's busy
    share, between start() and stop(). A descendant that ends between the two is not counted."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0 = time.perf_counter()
        self.c0 = {k: tree_cpu_ticks(tree_pids(p)) for k, p in pids.items()}
        self.m0 = machine_ticks()

    def _used(self, name: str) -> int:
        now = tree_cpu_ticks(tree_pids(self.pids[name]))
        return sum(t - self.c0[name].get(p, 0) for p, t in now.items())

    def stop(self) -> dict[str, Any]:
        """{"cpu_s": {name: seconds}, "machine_busy_pct": % of all cores (100 = all busy),
        "machine_busy_cores": cores busy on average, "wall_s": seconds}."""
        wall = time.perf_counter() - self.t0
        m1 = machine_ticks()
        busy = (m1[0] - self.m0[0]) / max(1, m1[1] - self.m0[1])
        return {
            "cpu_s": {k: self._used(k) / CLK_TCK for k in self.pids},
            "machine_busy_pct": round(busy * 100, 1),
            "machine_busy_cores": round(busy * (os.cpu_count() or 1), 2),
            "wall_s": wall,
        }


class Series:
    """Named columns sampled every ``period_s`` in a thread between ``start()`` and
    ``stop()``; the first column, ``t_s``, is seconds since start()."""

    def __init__(self, columns: dict[str, Any], period_s: float = 0.5) -> None:
        self.columns = columns  # name -> callable returning a number
        self.period_s = period_s
        self.rows: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="series")
        self._t0 = 0.0

    def _sample(self) -> None:
        self.rows.append([round(time.perf_counter() - self._t0, 2),
                          *(float(f()) for f in self.columns.values())])

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def start(self) -> Series:
        self._t0 = time.perf_counter()
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        """{"cols": [...], "rows": [...]}."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sample()
        return {"cols": ["t_s", *self.columns], "rows": self.rows}





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
        with contextlib.suppress(ValueError):
            out[key] = float(value)
    return summed_over_labels(out) if sum_labels else out


def summed_over_labels(samples: dict[str, float]) -> dict[str, float]:
    """A scrape's samples keyed by the bare metric name, each summed over its labels."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        name = key.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + value
    return out


def scrape_counted(path: Path, url: str | None, prefixes: tuple[str, ...] = ("",),
                   sum_labels: bool = False) -> dict[str, float]:
    """``scrape`` once every read a spoke answered before the call is counted: a control
    attribute of ``path`` (on the mount) is answered by the mount's own process, and its
    serving worker sends every hit it gathered ahead of it (they go in batches otherwise,
    up to a few ms late)."""
    os.getxattr(path, "user.spokefs.cached")
    return scrape(url, prefixes, sum_labels)


def reads_settled(url: str | None, deadline: Deadline) -> float:
    """Wait until the reads a spoke counts (``spokefs_reads_total``) stop moving for 0.6 s: its
    coordinator has taken every hit its worker sent (they go in batches, up to 5 ms late, and
    the coordinator may be behind); the seconds waited. Raises BenchError after 120 s."""
    t0 = time.monotonic()
    reads, still = -1.0, 0
    while still < 3:
        time.sleep(0.2)
        now = scrape(url, ("spokefs_reads_total",), sum_labels=True).get(
            "spokefs_reads_total", 0.0)
        still = still + 1 if now == reads else 0
        reads = now
        if time.monotonic() - t0 > deadline.timeout(120):
            raise BenchError("the reads counted did not settle within 120 s")
    return round(time.monotonic() - t0 - 0.6, 2)


def wait_workers(url: str | None, want: int, pid: int, deadline: Deadline) -> float:
    """Wait until a spoke's ``spokefs_workers`` gauge reads ``want`` (its ``--workers``
    threads serve); the seconds waited. Raises BenchError after ``WORKERS_WAIT_S``."""
    t0 = time.monotonic()
    end = t0 + deadline.timeout(WORKERS_WAIT_S)
    while True:
        got = scrape(url, ("spokefs_workers",)).get("spokefs_workers")
        if got == want:
            return time.monotonic() - t0
        if time.monotonic() > end:
            raise BenchError(f"spokefs_workers is {got}, not {want}, after "
                             f"{WORKERS_WAIT_S:.0f} s (children: {tree_pids(pid)[1:]})")
        time.sleep(0.05)
