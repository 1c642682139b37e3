"""What the benchmarks do to a mount (or the local source): the readers, timed by the caller.

- ``read_sequential``: files in order, Python ``readinto`` with a 1 MiB buffer, up to a byte
  count or a time budget; ``verify_prefix``: ``cmp -n`` of what was read against the source.
- ``run_fio``: fio 4 KiB random reads (psync, page cache on, ``--norandommap``, a fixed seed),
  exact percentiles from fio's per-I/O latency logs.
- ``read_small``: a shuffled list of whole small files taken by worker processes (fork),
  each checking the file's xxh3; killed at the budget.
- ``find_count``: ``find PATH | wc -l`` in a shell, as a user types it.

A reader killed at its budget while the FUSE daemon holds its request cannot be reaped until
the daemon dies: such processes go to ``STUCK``; the caller marks the mount stuck (benchlib
kills the daemon at teardown) and then calls ``reap_stuck()``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash
from benchlib import BenchError

MIB = 1024 * 1024
READ_BUFFER = MIB
FIO_SEED = 20261202
SMALL_WORKERS = 4
STUCK: list[Any] = []  # readers killed inside a FUSE request (see the module docstring)


def reap_stuck() -> int:
    """Wait for the stuck readers (their daemon has been killed); how many there were."""
    n = len(STUCK)
    for w in STUCK:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.join(timeout=10) if hasattr(w, "join") else w.wait(timeout=10)
    STUCK.clear()
    return n


# -- sequential ---------------------------------------------------------------------------


class Progress:
    """Bytes read so far by read_sequential (a sampler thread reads it)."""

    def __init__(self) -> None:
        self.bytes = 0


def read_sequential(root: Path, rels: list[str], max_bytes: float = float("inf"),
                    budget_s: float = float("inf"), progress: Progress | None = None,
                    ) -> tuple[int, float, list[tuple[str, int]], float]:
    """Read files in order with 1 MiB readinto until max_bytes or the budget.

    Returns (bytes, seconds, [(relpath, bytes read of it)], seconds to read the first half
    of max_bytes, 0.0 if unbounded or not reached).
    """
    view = memoryview(bytearray(READ_BUFFER))
    progress = progress or Progress()
    total, done, t0 = 0, [], time.perf_counter()
    end, half_at = t0 + budget_s, 0.0
    for rel in rels:
        got = 0
        with (root / rel).open("rb", buffering=0) as f:
            while total < max_bytes and time.perf_counter() < end:
                n = f.readinto(view[: int(min(READ_BUFFER, max_bytes - total))])
                if not n:
                    break
                got += n
                total += n
                progress.bytes = total
                if not half_at and total >= max_bytes / 2:
                    half_at = time.perf_counter() - t0
        done.append((rel, got))
        if total >= max_bytes or time.perf_counter() >= end:
            break
    return total, time.perf_counter() - t0, done, half_at


def verify_prefix(a: Path, b: Path, parts: list[tuple[str, int]]) -> None:
    """``cmp -n`` what was read (untimed); BenchError on a difference."""
    for rel, n in parts:
        if n:
            done = subprocess.run(["cmp", "-n", str(n), str(a / rel), str(b / rel)],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise BenchError(f"{a / rel} differs from the source: {done.stdout}{done.stderr}")


# -- random 4 KiB ---------------------------------------------------------------------------


def percentile(sorted_vals: list[float], q: float) -> float:
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
            "p50_ms": percentile(lat_ms, 50), "p99_ms": percentile(lat_ms, 99),
            "max_ms": lat_ms[-1] if lat_ms else 0.0,
            "mean_ms": statistics.fmean(lat_ms) if lat_ms else 0.0,
            "planned_reads": per_job * jobs, "command": shlex.join(argv)}


# -- small files by worker processes ---------------------------------------------------------


_SMALL: dict[str, Any] = {}  # inherited by the forked workers
_CTX = mp.get_context("fork")


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


def small_stats() -> Any:
    """Shared progress of the small-file workers: per worker files, bytes, bad, last time."""
    return _CTX.Array("d", 4 * SMALL_WORKERS)


def small_bytes(stats: Any) -> Callable[[], float]:
    """Bytes read so far by the small-file workers (for a time series)."""
    return lambda: float(sum(stats[1::4]))


def read_small(root: Path, rels: list[str], sizes: dict[str, tuple[int, str]], budget_s: float,
               stats: Any) -> dict[str, Any]:
    """SMALL_WORKERS processes read whole files from one shared list (in its order), until it
    is done or the budget is over (then the workers are killed, even inside a read).
    ``sizes``: relpath -> (size, xxh3_64 hex digest)."""
    _SMALL["paths"] = [str(root / r) for r in rels]
    _SMALL["digests"] = [sizes[r][1] for r in rels]
    counter, go = _CTX.Value("l", 0), _CTX.Event()
    workers = [_CTX.Process(target=_small_worker, args=(k, counter, stats, go))
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
    stuck = [w for w in workers if w.is_alive()]
    STUCK.extend(stuck)
    with stats.get_lock():
        vals = list(stats)
    files, nbytes = int(sum(vals[0::4])), int(sum(vals[1::4]))
    seconds = budget_s if capped else max(vals[3::4]) - t0
    return {"files": files, "bytes": nbytes, "bad": int(sum(vals[2::4])), "seconds": seconds,
            "files_per_s": files / seconds, "capped": capped, "stuck_workers": len(stuck),
            "mean_file_bytes": nbytes / files if files else statistics.fmean(
                sizes[r][0] for r in rels)}


# -- metadata ------------------------------------------------------------------------------


def find_count(path: Path, timeout_s: float) -> int | None:
    """``find PATH | wc -l`` in a shell; None on timeout (the find then goes to STUCK: the
    mount's daemon must be killed to free it)."""
    cmd = f"find {shlex.quote(str(path))} | wc -l"
    p = subprocess.Popen(cmd, shell=True, stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.communicate(timeout=5)
        STUCK.append(p)
        return None
    if p.returncode != 0:
        raise BenchError(f"find {path} | wc -l exited {p.returncode}")
    return int(out)
