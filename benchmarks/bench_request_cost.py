#!/usr/bin/env python3
"""CPU per FUSE request, by operation: the spoke (its own process alone, and its native read
loop's threads) beside the minimal pyfuse3 filesystem (``ceiling_fs.py``) with the same open
mode (issue 22, deliverable 4), and the same filesystem in C on libfuse (``ceiling_native.c``:
what a request costs when no Python runs, the floor of a native read loop).

Data: ``--files`` files of 128 KiB of random bytes in ``--dirs`` directories (default 4,000
in 40), under ``--work-dir``, served by a hubd on loopback. The spoke's cache is filled once
per invocation by a cold pass that checks every byte. Then ``--runs`` times, each server of
``--servers`` in turn (``ceiling``, ``native``: ``ceiling_native.c`` compiled with ``cc`` into
the work dir, skipped with a note where it cannot be built; ``w0``: the spoke's own process
alone, ``wN``: the spoke with N threads of its native read loop),
each on a fresh mount (for the spoke a remount of the filled cache, ``--open-mode kernel``),
page cache, dentries and inodes dropped, these phases, each one syscall per name:

- ``readdir``: ``os.listdir`` of every directory (after an untimed ``stat`` of each): plain
  READDIR, as both serve it;
- ``lookup``: ``os.stat`` of every file, not seen before on this mount: one LOOKUP each;
- ``getattr``: ``statx(AT_STATX_FORCE_SYNC)`` of every file: one GETATTR each, however long
  the attribute timeout;
- ``read``: open, ``pread`` of 128 KiB, close: one READ of a whole cached 128 KiB file (the
  kernel opens files itself: no OPEN, FLUSH or RELEASE);
- ``read-again``: the same after ``posix_fadvise(DONTNEED)`` of the file: the kernel's copy
  is gone, so the READ reaches the server again, whose own bytes (the spoke's LMDB pages) are
  in RAM now: the READ's cost without the disk.

The requests of a phase are counted by the ceiling (``--count-requests``: what the kernel sent
it) and checked against what the phase asks; the spoke's mount has the same options and
timeouts, so the kernel sends it the same (its READs are checked with ``spokefs_reads_total``).
CPU per request = the server's CPU over the phase (every thread of every process of it alive
at the phase's end, from ``/proc/PID/task/TID/schedstat``: nanoseconds, not clock ticks; a
thread that leaves a thread cache mid-phase was idle) / the requests. Medians
(min-max) over runs; one JSON line to benchmarks/results/request_cost.jsonl.

    python benchmarks/bench_request_cost.py [--runs 3] [--files 4000] [--dirs 40]
        [--servers ceiling,native,w0,w1,w2] [--work-dir /var/tmp/spokefs-request-cost]
        [--results FILE] [--smoke]

Needs root (drop_caches, allow_other), fusermount3, the patched pyfuse3. ``--smoke``: 200
files in 4 directories, 1 run (tests/benchmarks runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import benchlib as bl  # noqa: E402

RESULTS = HERE / "results" / "request_cost.jsonl"
FILE_BYTES = 128 * 1024
PHASES = ("readdir", "lookup", "getattr", "read", "read-again")
SERVERS = ("ceiling", "native", "w0", "w1", "w2")  # the default; any wN may be asked
AT_FDCWD, AT_STATX_FORCE_SYNC, STATX_BASIC_STATS = -100, 0x2000, 0x7FF
WARM_FILE = Path("warm-up") / "first.bin"  # opened before the phases, outside them

_libc = ctypes.CDLL(None, use_errno=True)
_statx_buf = ctypes.create_string_buffer(256)


def statx_sync(path: bytes) -> None:
    """``statx`` with AT_STATX_FORCE_SYNC: the kernel asks the filesystem (a GETATTR)."""
    if _libc.statx(AT_FDCWD, path, AT_STATX_FORCE_SYNC, STATX_BASIC_STATS, _statx_buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)


def make_data(root: Path, files: int, dirs: int, seed: int) -> list[Path]:
    """The data set (made once, reused when its marker says it is complete)."""
    marker = root / ".complete"
    rels = [Path(f"d{i % dirs:03}") / f"{i:05}.bin" for i in range(files)]
    if not marker.exists():
        shutil.rmtree(root, ignore_errors=True)
        rnd = random.Random(seed)
        for rel in [*rels, WARM_FILE]:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(rnd.randbytes(FILE_BYTES))
        marker.write_text("")
    return rels


def cpu_ns(pids: list[int]) -> dict[tuple[int, int], int]:
    """CPU time of every thread of the processes, in ns (``schedstat``'s first field)."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError, ValueError, IndexError):
                text = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text()
                out[(pid, int(tid))] = int(text.split()[0])
    return out


def cpu_spent(before: dict[tuple[int, int], int], after: dict[tuple[int, int], int]) -> int:
    """ns spent between two ``cpu_ns``: by the threads alive at the end (one that exited
    meanwhile is an idle one leaving a thread cache: its share is lost, and ~0)."""
    return sum(ns - before.get(key, 0) for key, ns in after.items())


def phases(mnt: Path, rels: list[Path], dirs: list[str]) -> dict[str, Any]:
    """Run the phases on a mount; per phase the calls it made and a function that measures."""
    out: dict[str, Any] = {}
    # untimed: the kernel's first OPENDIR and OPEN, answered ENOSYS (it opens files and
    # directories itself from then on), on a directory and a file outside the phases
    os.close(os.open(mnt / WARM_FILE.parent, os.O_RDONLY | os.O_DIRECTORY))
    os.close(os.open(mnt / WARM_FILE, os.O_RDONLY))
    for d in dirs:  # and the directories' own LOOKUPs
        os.stat(mnt / d)
    paths = [bytes(mnt / rel) for rel in rels]
    out["readdir"] = lambda: [os.listdir(mnt / d) for d in dirs]
    out["lookup"] = lambda: [os.stat(p) for p in paths]
    def getattr_all() -> None:
        for p in paths:
            statx_sync(p)
    out["getattr"] = getattr_all

    def read_all() -> None:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                if len(os.pread(fd, FILE_BYTES, 0)) != FILE_BYTES:
                    raise bl.BenchError(f"{p!r}: short read")
            finally:
                os.close(fd)
    out["read"] = read_all

    def read_again() -> None:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:  # the kernel's copy of the file goes, the server's stays in RAM
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                if len(os.pread(fd, FILE_BYTES, 0)) != FILE_BYTES:
                    raise bl.BenchError(f"{p!r}: short read")
            finally:
                os.close(fd)
    out["read-again"] = read_again
    return out


def measure(mnt: Path, rels: list[Path], dirs: list[str], pids: list[int],
            counts: Any) -> dict[str, Any]:
    """Each phase: its CPU (ns), wall, and the requests counted (``counts()``, or None)."""
    got: dict[str, Any] = {}
    todo = phases(mnt, rels, dirs)
    before = counts()
    for name in PHASES:
        c0, t0 = cpu_ns(pids), time.perf_counter()
        todo[name]()
        wall = time.perf_counter() - t0
        time.sleep(0.3)  # what the server still does for the phase (a worker's hits)
        c1 = cpu_ns(pids)
        after = counts()
        got[name] = {"cpu_ns": cpu_spent(c0, c1), "wall_s": wall,
                     "counted": None if after is None else
                     {k: v - before.get(k, 0) for k, v in after.items()
                      if v - before.get(k, 0)}}
        before = after
    return got


def ceiling_pass(data: Path, rels: list[Path], dirs: list[str], run_dir: Path,
                 deadline: bl.Deadline) -> dict[str, Any]:
    mnt, counts_file = run_dir / "mnt-ceiling", run_dir / "ceiling-counts.json"
    argv = [sys.executable, str(HERE / "ceiling_fs.py"), str(data), str(mnt),
            "--open-mode", "kernel", "--count-requests", str(counts_file)]
    with bl.fuse_process("ceiling_fs", argv, mnt, run_dir / "ceiling.log",
                         bl.CEILING_READY_RE, deadline, start_timeout_s=600) as m:
        def counts() -> dict[str, int]:
            counts_file.unlink(missing_ok=True)
            os.kill(m.pid, signal.SIGUSR1)
            end = time.monotonic() + 10
            while not counts_file.exists():
                if time.monotonic() > end:
                    raise bl.BenchError("ceiling_fs wrote no counts after SIGUSR1")
                time.sleep(0.01)
            return json.loads(counts_file.read_text())
        time.sleep(0.5)  # its read-ahead setting, once INIT is answered
        bl.drop_caches()
        return measure(mnt, rels, dirs, [m.pid], counts)


def native_pass(binary: Path, data: Path, rels: list[Path], dirs: list[str], run_dir: Path,
                deadline: bl.Deadline) -> dict[str, Any]:
    mnt = run_dir / "mnt-native"
    with bl.native_mount(binary, data, mnt, run_dir / "native.log", deadline) as m:
        time.sleep(0.5)
        bl.drop_caches()
        got = measure(mnt, rels, dirs, [m.pid], lambda: None)
    if not (m.result and m.result.clean):
        raise bl.BenchError("ceiling_native did not unmount cleanly")
    return got


def spoke_pass(workers: int, hub: bl.Hub, cache: Path, rels: list[Path], dirs: list[str],
               run_dir: Path, tag: str, deadline: bl.Deadline) -> dict[str, Any]:
    mnt = run_dir / "mnt-spoke"
    with bl.warm_spoke(hub.url, mnt, cache, run_dir / f"spokefs-{tag}.log", deadline,
                       workers) as m:
        pids = bl.tree_pids(m.pid)

        def counts() -> dict[str, int]:
            k = bl.scrape(m.metrics_url, ("spokefs_reads_total", "spokefs_block_misses_total",
                                          "spokefs_fuse_errors_total"), sum_labels=True)
            return {"read": round(k.get("spokefs_reads_total", 0)),
                    "blocks_fetched": round(k.get("spokefs_block_misses_total", 0)),
                    "errors": round(k.get("spokefs_fuse_errors_total", 0))}
        got = measure(mnt, rels, dirs, pids, counts)
        got["processes"] = len(pids)
    if not (m.result and m.result.clean):
        raise bl.BenchError(f"the spoke did not unmount cleanly ({tag})")
    return got


EXPECTED = {"readdir": "readdir", "lookup": "lookup", "getattr": "getattr", "read": "read",
            "read-again": "read"}


def check_counts(server: str, got: dict[str, Any], rels: list[Path], dirs: list[str],
                 problems: list[str]) -> None:
    """What the ceiling counted is what each phase asks (one request per call, READDIR
    aside); the spoke's READs and errors likewise."""
    for name in PHASES:
        counted = got[name]["counted"] or {}
        want = {"lookup": len(rels), "getattr": len(rels), "read": len(rels),
                "read-again": len(rels)}.get(name)
        kind = EXPECTED[name]
        if server == "ceiling":
            other = {k: v for k, v in counted.items() if k != kind}
            if other or (want is not None and counted.get(kind) != want) or \
                    (name == "readdir" and counted.get("readdir", 0) < len(dirs)):
                problems.append(f"ceiling {name}: the kernel sent {counted}, not "
                                f"{want or 'a READDIR or more per directory'} {name}")
        else:
            if kind == "read" and counted.get("read") != want:
                problems.append(f"{server} read: {counted.get('read')} READs, not {want}")
            if counted.get("blocks_fetched") or counted.get("errors"):
                problems.append(f"{server} {name}: {counted}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--dirs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=20261204)
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--work-dir", type=Path, default=Path("/var/tmp/spokefs-request-cost"))
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--max-seconds", type=float, default=3600.0)
    ap.add_argument("--smoke", action="store_true", help="200 files in 4 directories, 1 run")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.files, args.dirs = 1, 200, 4
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or any(s not in ("ceiling", "native") and re.fullmatch(r"w[0-8]", s) is None
                          for s in servers):
        raise SystemExit("--servers: a list of ceiling, native and w0..w8")
    if "ceiling" not in servers:
        raise SystemExit("--servers: the ceiling counts the requests: keep it in")
    servers.sort(key=lambda s: s != "ceiling")  # first: the others take its counts
    deadline = bl.Deadline(args.max_seconds)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    data = args.work_dir / f"data-{args.files}x{args.dirs}-s{args.seed}-v2"
    rels = make_data(data, args.files, args.dirs, args.seed)
    dirs = sorted({str(r.parent) for r in rels})
    record: dict[str, Any] = bl.run_info("bench_request_cost.py")
    record |= {"config": {k: str(v) for k, v in vars(args).items() if k != "results"},
               "open_mode": "kernel", "passes": [], "problems": [], "error": None}
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=args.work_dir))
    native = bl.build_native(run_dir) if "native" in servers else None
    if isinstance(native, str):
        record["notes"] = [f"native: not run: {native}"]
        print(f"native: not run: {native}", flush=True)
        servers.remove("native")
    try:
        with bl.run_hub(data, run_dir / "hubd.log", deadline) as hub:
            cache = run_dir / "cache"
            bl.fill_cache(hub.url, data, rels, cache, run_dir / "mnt-spoke",
                          run_dir / "spokefs-fill.log", deadline)
            for r in range(args.runs):
                ceiling: dict[str, Any] | None = None
                for server in servers:
                    if server == "ceiling":
                        got = ceiling = ceiling_pass(data, rels, dirs, run_dir, deadline)
                    elif server == "native":
                        assert isinstance(native, Path) and ceiling is not None
                        got = native_pass(native, data, rels, dirs, run_dir, deadline)
                        for name in PHASES:
                            got[name]["requests"] = ceiling[name]["requests"]
                    else:
                        got = spoke_pass(int(server[1]), hub, cache, rels, dirs, run_dir,
                                         f"{server}-{r}", deadline)
                        assert ceiling is not None
                        for name in PHASES:  # the kernel sends the spoke what it sent the
                            got[name]["requests"] = ceiling[name]["requests"]  # ceiling
                    if server == "ceiling":
                        for name in PHASES:
                            got[name]["requests"] = sum(got[name]["counted"].values())
                    if server != "native":
                        check_counts(server, got, rels, dirs, record["problems"])
                    record["passes"].append({"server": server, "run": r, **got})
                    print(f"run {r} {server}: " + ", ".join(
                        f"{n} {got[n]['cpu_ns'] / 1000 / got[n]['requests']:.1f} us"
                        for n in PHASES), flush=True)
    except (bl.BenchError, OSError) as e:
        record["error"] = f"{type(e).__name__}: {e}"
        print(f"error: {record['error']}", file=sys.stderr, flush=True)
    finally:
        for m in run_dir.glob("mnt-*"):
            if bl.is_mounted(m):
                bl.fusermount(m, lazy=True)
                record["problems"].append(f"left mounted (now detached): {m}")
        shutil.rmtree(run_dir, ignore_errors=True)
    rows, figures = [], {}
    for server in servers:
        row = ["ceiling_fs (minimal pyfuse3)" if server == "ceiling" else
               "ceiling_native (the same in C, libfuse)" if server == "native" else
               "spoke, its own process alone (--workers 0)" if server == "w0" else
               f"spoke, native read loop, {server[1]} thread(s)"]
        for name in PHASES:
            fig = bl.Figure()
            for p in record["passes"]:
                if p["server"] == server:
                    fig.add(p[name]["cpu_ns"] / 1000 / p[name]["requests"])
            figures[f"{server}/{name}_us"] = fig.summary()
            row.append(fig.text("{:.1f}"))
        rows.append(row)
    print("\nCPU per request, us (median (min-max) of "
          f"{args.runs}; {args.files} files of 128 KiB, open mode kernel)\n")
    print(bl.markdown_table(["server", "READDIR", "LOOKUP", "GETATTR", "READ",
                             "READ, bytes in RAM"], rows))
    record["figures"] = figures
    for p in record["problems"]:
        print(f"problem: {p}", flush=True)
    bl.save_record(args.results, record)
    return 1 if record["error"] or record["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
