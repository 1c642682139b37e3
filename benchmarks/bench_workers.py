#!/usr/bin/env python3
"""One mount served on every core (``spokefs mount --workers N``: N threads of the native
read loop in one worker process; 0: the mount's own process alone): warm files/s and MB/s
with cheap native readers, local disk and the C ceilings beside them, with the spoke held to
one core and to two (issue 22, deliverable 5).

Two workloads, each read by shell commands a user would type (the readers are never pinned):

- **small**: ``--files`` ImageNet-like files (train.py's data set, ``data_sets.ensure_dataset``:
  lognormal sizes, median 110 KiB, in ``--dirs`` class directories; 6,000 files ~800 MB),
  read by ``find ROOT -type f | xargs -P 8 -n 64 cat > /dev/null`` (8 readers);
- **seq**: ``--shards`` files of ``--shard-mib`` MiB of random bytes (8 x 256 MiB), read by
  ``find ROOT -type f -name 'shard-*' | xargs -P 4 -n 1 cat > /dev/null`` (4 readers, one
  shard each at a time);
- **paced** (asked for by name): the first ``--paced-files`` of the small files (2,400) read
  by one reader at ``--paced-rate`` files/s (300: ``paced_read.py``), as a job that decodes
  each sample takes them. The files/s are the pace; the figure is the spoke's CPU per file
  when its hits come slowly (each message from the worker to the coordinator then carries
  few).

One hubd per workload on loopback (no link emulator: once the cache holds everything the
hub is not asked for a byte; every pass checks that the spoke fetched no block). Per
invocation, each workload's cache dir is filled once by a cold pass that checks every byte
(the small files' xxh3 against the manifest, the shards with ``cmp``), then unmounted. Then
``--runs`` times, side by side in one run, each configuration of ``--configs``:

- ``local``: drop the page cache (``sync; echo 3 > /proc/sys/vm/drop_caches``), run the
  command over the source directory;
- ``wN`` / ``wN-cpu0`` / ``wN-cpu01`` / ``wN-qPCT``: a fresh ``spokefs mount --workers N
  --open-mode kernel`` on the filled cache dir (``taskset -c 0`` or ``-c 0,1`` in front of
  it for the cpu variants; for ``-qPCT`` it joins a cgroup whose CFS quota gives the spoke
  PCT % of a core per worker, N x PCT in all: the worker inherits both), wait until
  ``/metrics`` says ``spokefs_workers`` == N (its threads serve), drop the page cache, run
  the command over the mount, wait until the reads counted settle (the worker's last hits);
  then, untimed, drop again and check the bytes of a sample through the mount (64 small
  files by 8 threads; the first 8 MiB of every shard), unmount (``fusermount3 -u``, lazily
  if busy) and require a clean exit 0;
- ``w2-split`` (small files only): as ``w2``, but the mount's own process (the coordinator)
  is stopped (``SIGSTOP``) while the readers run, so its worker answers every request; then
  ``SIGCONT``, and the coordinator takes the worker's queued hits until ``/metrics`` stops
  moving. Figures: the worker alone (files/s, CPU per file, and of it its Python thread's)
  and what the coordinator pays per worker hit (its CPU over the catch-up / reads counted),
  which bounds how many files/s one coordinator can take (the model in docs/design.md);
- ``nativeN`` / ``passthroughN``: ``ceiling_native.c`` (C on libfuse, N threads) serving the
  same files from its memory, or by a ``pread`` of the source file per READ (what any FUSE
  server reading its own disk pays here); page cache dropped first.

Figures per pass: files/s (small) or MB/s (10^6 B/s, seq); the ratio to the same run's
local pass; the spoke's CPU (utime + stime from /proc of the mount's process and of its
worker, before and after the pass: a worker's CPU is not in its parent's while it lives) per
file (ms) or per GB (s); the spoke's busy cores (CPU-s / wall s); the machine's busy share;
the spoke's counters over the pass (FUSE reads, blocks fetched: 0 when warm, FUSE errors,
worker restarts). Tables give medians (min-max) over runs; scaling is w2 / w1 run by run.
Graded against issue 22's goals (``GOALS``, on w8: what ``--workers auto`` gives this 2-core
machine) and appended as one JSON line to benchmarks/results/workers.jsonl (commit, dirty
flag, kernel, CPUs, argv, open mode).

    python benchmarks/bench_workers.py [--runs 3] [--files 6000] [--dirs 100] [--shards 8]
        [--shard-mib 256] [--configs local,w0,w1,w2,w8,w1-cpu0,w2-cpu0,w1-cpu01,w2-cpu01,
        w1-q45,w2-q45,w2-split,native8,passthrough8] [--workloads small,seq]
        [--work-dir /var/tmp/spokefs-workers] [--keep] [--max-seconds 3600] [--results FILE]
        [--smoke]

Needs root (FUSE allow_other, drop_caches), fusermount3, taskset, the cpu cgroup controller
(v1 or v2, for ``-qPCT``), the patched pyfuse3 (``--open-mode kernel``), the native read
loop, and for the C ceilings cc and libfuse3's headers. ``--smoke``: 200 files, 2 x 8 MiB, 1
run, configurations local, w0, w1, w2, w2-cpu0, w1-cpu01, w2-cpu01, w1-q45, w2-q45, w2-split
(tests/benchmarks runs it, ~30 s).

**Why quotas beside taskset.** Issue 22 grades scaling "with the spoke the bottleneck". On
2 CPUs, ``taskset`` cannot make it so: the 8 readers and the kernel's side of FUSE run on
the same two CPUs, and the spoke held to both used ~1 core while the machine was busy (at
ce869cf: w2-cpu01 / w1-cpu01 1.10, 0.99-1.11). A CFS quota of 0.45 of a core per worker
holds the spoke below what it would take, leaves the readers the rest of the machine (1.55
cores with w1, 1.1 with w2), and the spoke then uses its whole quota: the bottleneck is the
spoke, and ``w2-q45 / w1-q45`` says whether a second worker's share turns into files/s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import benchlib as bl  # noqa: E402
import xxhash  # noqa: E402
from bench_cold_cpu import ensure_shards  # noqa: E402
from data_sets import DataSet, ensure_dataset  # noqa: E402

RESULTS = HERE / "results" / "workers.jsonl"
MIB, GB = 1024 * 1024, 1e9
ALL_CONFIGS = ("local,w0,w1,w2,w8,w1-cpu0,w2-cpu0,w1-cpu01,w2-cpu01,w1-q45,w2-q45,w2-split,"
               "native8,passthrough8")
SMOKE_CONFIGS = "local,w0,w1,w2,w2-cpu0,w1-cpu01,w2-cpu01,w1-q45,w2-q45,w2-split"
SMALL_CMD = "find {root} -type f | xargs -P 8 -n 64 cat > /dev/null"
SEQ_CMD = "find {root} -type f -name 'shard-*' | xargs -P 4 -n 1 cat > /dev/null"
PACED_CMD = ("find {root} -type f | LC_ALL=C sort | "
             f"{sys.executable} {HERE / 'paced_read.py'} --rate {{rate}} --limit {{files}}")
SAMPLE_FILES, SAMPLE_SHARD_BYTES = 64, 8 * MIB
SCALE_LABELS = {"scale-any": "any CPU", "scale-cpu0": "CPU 0", "scale-cpu01": "CPUs 0,1",
                "scale-q45": "0.45 of a core per worker (CFS quota)"}
CGROUP_PREFIX = "spokefs-bench-"
SETTLE_S = 0.5  # after the workers are up: the remount's first namespace poll

ISSUE = "issue 22: Every core of a training node: one mount served by several workers"
G_SMALL = ("Warm small files, 8 native readers, after a remount: >= 0.9 of local disk "
           "(today 0.28).")
G_SEQ = ("Warm sequential (8 x 256 MiB shards, 4 readers) after a remount: >= 0.9 of local "
         "disk's own rate.")
G_CPU = ("Spoke CPU per warm cached file <= 0.15 ms (today 0.57 after a remount with 8 `cat` "
         "readers, 1.72 with PIL's reads; the minimal pyfuse3 filesystem's with OPEN and "
         "RELEASE: 0.12-0.16).")
G_SCALE = "Scaling: with the spoke the bottleneck, 2 workers serve >= 1.7 x what 1 serves."
GOALS = (  # w8: what --workers auto gives this 2-core machine (4 threads per core, >= 8)
    bl.Goal(G_SMALL, "small/w8/ratio", "small: spoke w8 (the default here) files/s / local's",
            ">=", 0.9),
    bl.Goal(G_SMALL, "small/w2/ratio", "small: spoke w2 files/s / local's", "", 0),
    bl.Goal(G_SEQ, "seq/w8/ratio", "seq: spoke w8 (the default here) MB/s / local's", ">=", 0.9),
    bl.Goal(G_SEQ, "seq/w2/ratio", "seq: spoke w2 MB/s / local's", "", 0),
    bl.Goal(G_CPU, "small/w8/cpu_ms_per_file",
            "small: spoke w8 CPU ms per file (mount process + worker)", "<=", 0.15),
    bl.Goal(G_CPU, "small/w2/cpu_ms_per_file",
            "small: spoke w2 CPU ms per file (mount process + worker)", "<=", 0.15),
    bl.Goal(G_SCALE, "small/scale-cpu01",
            "small: files/s of w2-cpu01 / w1-cpu01 (spoke on both cores), run by run",
            ">=", 1.7),
    bl.Goal(G_SCALE, "small/scale-cpu0",
            "small: files/s of w2-cpu0 / w1-cpu0 (spoke on one core: cannot scale), run by run",
            "", 0),
    bl.Goal(G_SCALE, "seq/scale-cpu01",
            "seq: MB/s of w2-cpu01 / w1-cpu01, run by run", "", 0),
    bl.Goal(G_SCALE, "small/scale-q45",
            "small: files/s of w2-q45 / w1-q45 (the spoke given 0.45 of a core per worker, "
            "the readers the rest), run by run", ">=", 1.7),
)


# -- configurations -----------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    key: str  # local, w2, w1-cpu0, w2-split, ...
    # threads of the native read loop (0: the mount's own process alone); None: local disk;
    # for ``native``: the C ceiling's threads
    workers: int | None
    cpus: str | None  # taskset's list ("0", "0,1") or None
    split: bool = False  # the coordinator stopped during the pass (see the docstring)
    quota: float | None = None  # cores of CPU time the spoke's processes get (CFS quota)
    native: bool = False  # ceiling_native.c serving the files from memory ...
    passthrough: bool = False  # ... or from the source's disk (--passthrough)

    @property
    def name(self) -> str:
        if self.workers is None:
            return "local"
        if self.native:
            return (f"ceiling_native{' passthrough' if self.passthrough else ''}, "
                    f"{self.workers} thread{'s' if self.workers > 1 else ''}")
        if self.split:
            return f"spoke w{self.workers} split"
        if self.quota:
            return f"spoke w{self.workers} quota {self.quota:.2f} core"
        return f"spoke w{self.workers}" + (f" cpu{self.cpus.replace(',', '')}"
                                           if self.cpus else "")

    def wrapper(self) -> list[str]:
        if self.quota:  # the mount's process joins the group, then execs: its worker too
            procs = quota_cgroup(self.key, self.quota) / "cgroup.procs"
            return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs)]
        return ["taskset", "-c", self.cpus] if self.cpus else []


def quota_cgroup(key: str, cores: float) -> Path:
    """A cgroup whose processes get ``cores`` of CPU time per 100 ms (cgroup v2's
    ``cpu.max``, or v1's CFS quota): the spoke held to a share of the machine that is not a
    whole core, so that it, not the readers beside it, is the bottleneck on 2 cores."""
    period = 100_000
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists():
        if "cpu" not in (v2 / "cgroup.subtree_control").read_text().split():
            (v2 / "cgroup.subtree_control").write_text("+cpu")
        group = v2 / f"{CGROUP_PREFIX}{key}"
        group.mkdir(exist_ok=True)
        (group / "cpu.max").write_text(f"{round(cores * period)} {period}")
        return group
    v1 = Path("/sys/fs/cgroup/cpu")
    if not (v1 / "cpu.cfs_quota_us").exists():
        raise bl.BenchError("quota configurations need the cpu cgroup controller")
    group = v1 / f"{CGROUP_PREFIX}{key}"
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text(str(period))
    (group / "cpu.cfs_quota_us").write_text(str(round(cores * period)))
    return group


def remove_quota_cgroups() -> None:
    """The groups ``quota_cgroup`` made (empty once their spokes exited)."""
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")):
        for group in root.glob(f"{CGROUP_PREFIX}*"):
            with contextlib.suppress(OSError):
                group.rmdir()


def parse_configs(text: str) -> list[Config]:
    out = []
    for key in [k.strip() for k in text.split(",") if k.strip()]:
        if key == "local":
            out.append(Config(key, None, None))
            continue
        if key == "w2-split":
            out.append(Config(key, 2, None, split=True))
            continue
        m = re.fullmatch(r"(native|passthrough)(\d*)", key)
        if m:
            out.append(Config(key, int(m.group(2) or 1), None, native=True,
                              passthrough=m.group(1) == "passthrough"))
            continue
        m = re.fullmatch(r"w(\d+)(?:-cpu(\d+)|-q(\d+))?", key)
        if m is None:
            raise SystemExit(f"--configs: {key!r} is not local, wN, wN-cpuLIST (w2-cpu01), "
                             "wN-qPCT (w2-q45), w2-split, nativeN or passthroughN")
        if m.group(3):  # PCT of a core per worker
            workers = int(m.group(1))
            out.append(Config(key, workers, None, quota=max(1, workers) * int(m.group(3)) / 100))
            continue
        cpus = ",".join(m.group(2)) if m.group(2) else None
        if cpus and max(int(c) for c in cpus.split(",")) >= (os.cpu_count() or 1):
            raise SystemExit(f"--configs: {key!r}: this machine has {os.cpu_count()} CPUs")
        out.append(Config(key, int(m.group(1)), cpus))
    if not out or out[0].key != "local":
        raise SystemExit("--configs: start with local (every ratio is to it)")
    return out


# -- data ---------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str  # small, seq, paced
    root: Path
    rels: list[str]
    sizes: list[int]
    command: str
    digests: list[str] | None = None  # small: xxh3 from the manifest

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def per_file(self) -> bool:
        """Figures per file (small files), not per byte (shards)."""
        return self.name != "seq"


def check_space(args: argparse.Namespace, work: Path) -> str | None:
    """Reduce --shard-mib while the data sets (not yet built) and the caches (always) would
    not fit in the work dir's free space with 2 GiB to spare; what was done, or None."""
    free = shutil.disk_usage(work).free
    small = args.files * 140 * 1024  # mean ~132 KiB
    have_small = (work / f"imagenet-{args.files}x{args.dirs}-s{args.seed}.json").exists()

    def need(mib: int) -> float:
        seq = args.shards * mib * MIB
        have_seq = (work / f"cold-shards-{args.shards}x{mib}" / ".done").exists()
        sources = (0 if have_small else small) + (0 if have_seq else seq)
        return sources + 1.2 * (small + seq) + 2 * 1024 * MIB

    asked = args.shard_mib
    while need(args.shard_mib) > free and args.shard_mib > 16:
        args.shard_mib //= 2
    if need(args.shard_mib) > free:
        raise SystemExit(f"{work}: {free / GB:.1f} GB free is too little even for "
                         f"{args.shards} x 16 MiB shards")
    if args.shard_mib != asked:
        note = (f"{work} has {free / GB:.1f} GB free: shards reduced from {asked} to "
                f"{args.shard_mib} MiB")
        print(f"note: {note}", flush=True)
        return note
    return None


def workloads(args: argparse.Namespace, work: Path) -> list[Workload]:
    out = []
    for name in [w for w in args.workloads.split(",") if w]:
        if name == "small":
            ds: DataSet = ensure_dataset(work, args.files, args.dirs, args.seed)
            print(f"small: {ds.describe()}", flush=True)
            out.append(Workload(name, ds.root, ds.rels, ds.sizes, SMALL_CMD, ds.digests))
        elif name == "paced":
            ds = ensure_dataset(work, args.files, args.dirs, args.seed)
            # the first files `find | LC_ALL=C sort` names, in that order (paced_read.py --limit)
            first = sorted(range(len(ds.rels)), key=lambda i: ds.rels[i].encode())
            first = first[:args.paced_files]
            command = PACED_CMD.format(root="{root}", files=len(first), rate=args.paced_rate)
            out.append(Workload(name, ds.root, [ds.rels[i] for i in first],
                                [ds.sizes[i] for i in first], command,
                                [ds.digests[i] for i in first]))
            print(f"paced: {len(first)} of the small files at {args.paced_rate:g} files/s",
                  flush=True)
        elif name == "seq":
            paths = ensure_shards(work, args.shards, args.shard_mib)
            root = paths[0].parent
            out.append(Workload(name, root, [p.name for p in paths],
                                [p.stat().st_size for p in paths], SEQ_CMD))
            print(f"seq: {len(paths)} x {args.shard_mib} MiB under {root}", flush=True)
        else:
            raise SystemExit(f"--workloads: unknown {name!r} (small, seq, paced)")
    return out


# -- byte checks (untimed) ----------------------------------------------------------------


def check_small(wl: Workload, mnt: Path, rels_idx: list[int]) -> list[str]:
    """xxh3 of these files through the mount (8 threads) against the manifest; the wrong."""
    assert wl.digests is not None
    digests = wl.digests

    def one(i: int) -> str | None:
        got = xxhash.xxh3_64_hexdigest((mnt / wl.rels[i]).read_bytes())
        return None if got == digests[i] else wl.rels[i]

    with ThreadPoolExecutor(8) as pool:
        return [r for r in pool.map(one, rels_idx) if r is not None]


def check_seq(wl: Workload, mnt: Path, limit: int | None) -> list[str]:
    """``cmp`` (the first ``limit`` bytes of) every shard through the mount; the wrong."""
    bad = []
    for rel in wl.rels:
        argv = ["cmp", *(["-n", str(limit)] if limit else []), str(mnt / rel),
                str(wl.root / rel)]
        if subprocess.run(argv, capture_output=True, check=False).returncode != 0:
            bad.append(rel)
    return bad


def check_bytes(wl: Workload, mnt: Path, full: bool, seed: int) -> tuple[int, list[str]]:
    """(files checked, files that differ)."""
    if wl.digests is not None:
        idx = list(range(len(wl.rels)))
        if not full:
            idx = random.Random(seed).sample(idx, min(SAMPLE_FILES, len(idx)))
        return len(idx), check_small(wl, mnt, idx)
    return len(wl.rels), check_seq(wl, mnt, None if full else SAMPLE_SHARD_BYTES)


# -- passes -------------------------------------------------------------------------------


def run_readers(command: str, root: Path, timeout_s: float) -> float:
    """The workload's shell command over root; its wall seconds (BenchError if it fails)."""
    t0 = time.perf_counter()
    done = subprocess.run(["bash", "-c", "set -o pipefail; " + command.format(root=root)],
                          capture_output=True, text=True, check=False, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise bl.BenchError(f"readers over {root} exited {done.returncode}: "
                            f"{done.stderr.strip()[-500:]}")
    return wall


COUNTERS = ("spokefs_reads_total", "spokefs_block_misses_total", "spokefs_fuse_errors_total",
            "spokefs_worker_restarts_total", "spokefs_read_bytes_total")


def cpus_allowed(pid: int) -> str | None:
    """A process's ``Cpus_allowed_list`` (``0``, ``0-1``)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("Cpus_allowed_list")), None)
    except OSError:
        return None


def cpu_cgroup(pid: int) -> str | None:
    """The cgroup whose CPU limits hold a process (v1's ``cpu`` hierarchy, else v2's)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            groups = {c: path for _, cs, path in (line.rstrip("\n").split(":", 2) for line in f)
                      for c in cs.split(",")}
    except OSError:
        return None
    return groups.get("cpu", groups.get(""))


def local_pass(wl: Workload, deadline: bl.Deadline) -> dict[str, Any]:
    bl.drop_caches()
    busy0 = bl.machine_ticks()
    wall = run_readers(wl.command, wl.root, deadline.timeout(1800))
    busy1 = bl.machine_ticks()
    return {"wall_s": wall, "machine_busy_pct": machine_pct(busy0, busy1)}


def machine_pct(m0: tuple[int, int], m1: tuple[int, int]) -> float:
    return round(100 * (m1[0] - m0[0]) / max(1, m1[1] - m0[1]), 1)


def spoke_pass(wl: Workload, cfg: Config, hub: bl.Hub, cache: Path, run_dir: Path, tag: str,
               deadline: bl.Deadline, seed: int) -> dict[str, Any]:
    mnt = run_dir / f"mnt-{wl.name}"
    extra = ["--workers", str(cfg.workers), "--open-mode", "kernel"]
    out: dict[str, Any] = {}
    with bl.spoke_mount(hub.url, mnt, cache, run_dir / "logs" / f"spokefs-{tag}.log", deadline,
                        extra_args=extra, wrapper=cfg.wrapper()) as m:
        out["workers_wait_s"] = round(bl.wait_workers(m.metrics_url, cfg.workers, m.pid,
                                                   deadline), 2)
        out["cpus_allowed"] = {str(p): cpus_allowed(p) for p in bl.tree_pids(m.pid)}
        out["cpu_cgroups"] = {str(p): cpu_cgroup(p) for p in bl.tree_pids(m.pid)}
        time.sleep(SETTLE_S)
        bl.drop_caches()
        pids0 = bl.tree_pids(m.pid)
        c0 = bl.tree_cpu_ticks(pids0)
        k0 = bl.scrape(m.metrics_url, COUNTERS, sum_labels=True)
        busy0 = bl.machine_ticks()
        if cfg.split:
            wall, out["split"] = split_readers(wl, mnt, m.pid, m.metrics_url, k0, deadline)
            busy1 = bl.machine_ticks()
        else:
            wall = run_readers(wl.command, mnt, deadline.timeout(1800))
            busy1 = bl.machine_ticks()
            # the worker's last hits reach the coordinator after the readers end: the CPU
            # that costs is the pass's too
            out["catch_up_s"] = bl.reads_settled(m.metrics_url, deadline)
        k1 = bl.scrape(m.metrics_url, COUNTERS, sum_labels=True)
        pids1 = bl.tree_pids(m.pid)
        c1 = bl.tree_cpu_ticks(pids1)
        cpu_ticks = {p: c1[p] - c0.get(p, 0) for p in pids1}
        gone = [p for p in pids0 if p not in c1]
        checked, wrong = check_bytes(wl, mnt, full=False, seed=seed)
        out |= {
            "wall_s": wall, "machine_busy_pct": machine_pct(busy0, busy1),
            "spoke_cpu_s": sum(cpu_ticks.values()) / bl.CLK_TCK,
            "coordinator_cpu_s": cpu_ticks.get(m.pid, 0) / bl.CLK_TCK,
            "workers_cpu_s": [cpu_ticks[p] / bl.CLK_TCK for p in pids1 if p != m.pid],
            "processes": len(pids1), "processes_gone_during_pass": gone,
            "counters": {k.removeprefix("spokefs_"): round(k1.get(k, 0) - k0.get(k, 0))
                         for k in COUNTERS},
            "sample_checked": checked, "sample_wrong": wrong,
        }
    out["unmount"] = {"clean": bool(m.result and m.result.clean),
                      "exit_code": m.result.exit_code if m.result else None}
    out["workers_left"] = survivors(pids1[1:])
    return out


def native_pass(wl: Workload, cfg: Config, binary: Path | str, run_dir: Path, tag: str,
                deadline: bl.Deadline) -> dict[str, Any]:
    """The C ceiling serving the workload's files from its memory, on ``cfg.workers``
    threads: what any FUSE server costs this machine's readers."""
    assert isinstance(binary, Path)
    mnt = run_dir / f"mnt-{wl.name}"
    with bl.native_mount(binary, wl.root, mnt, run_dir / "logs" / f"native-{tag}.log",
                         deadline, threads=cfg.workers or 1, passthrough=cfg.passthrough) as m:
        time.sleep(SETTLE_S)
        bl.drop_caches()
        c0 = bl.tree_cpu_ticks([m.pid])
        busy0 = bl.machine_ticks()
        wall = run_readers(wl.command, mnt, deadline.timeout(1800))
        busy1 = bl.machine_ticks()
        c1 = bl.tree_cpu_ticks([m.pid])
    return {"wall_s": wall, "machine_busy_pct": machine_pct(busy0, busy1),
            "spoke_cpu_s": (c1.get(m.pid, 0) - c0.get(m.pid, 0)) / bl.CLK_TCK,
            "unmount": {"clean": bool(m.result and m.result.clean),
                        "exit_code": m.result.exit_code if m.result else None}}


def split_readers(wl: Workload, mnt: Path, pid: int, url: str | None, k0: dict[str, float],
                  deadline: bl.Deadline) -> tuple[float, dict[str, Any]]:
    """The readers with the coordinator stopped (only the worker can answer them), then the
    coordinator's catch-up on the worker's hits: the readers' wall seconds, the worker's CPU
    over both (and of it, its Python thread's), and the coordinator's for the catch-up."""
    workers = bl.tree_pids(pid)[1:]
    w0 = bl.tree_cpu_ticks(workers)
    m0 = {p: bl.proc_cpu_ticks(p, p) for p in workers}  # the main thread: Python's pump
    os.kill(pid, signal.SIGSTOP)
    try:
        wall = run_readers(wl.command, mnt, deadline.timeout(1800))
    finally:
        os.kill(pid, signal.SIGCONT)
    c0 = bl.tree_cpu_ticks([pid])[pid]
    bl.reads_settled(url, deadline)
    c1 = bl.tree_cpu_ticks([pid])[pid]
    # the worker's too, after the catch-up: what it could not send while the coordinator
    # was stopped, it sends then
    w1 = bl.tree_cpu_ticks(workers)
    m1 = {p: bl.proc_cpu_ticks(p, p) for p in workers}
    got = bl.scrape(url, ("spokefs_reads_total",), sum_labels=True)
    reads = got.get("spokefs_reads_total", 0.0) - k0.get("spokefs_reads_total", 0.0)
    worker_s = sum(w1.get(p, 0) - w0.get(p, 0) for p in workers) / bl.CLK_TCK
    pump_s = sum(m1[p] - m0[p] for p in workers) / bl.CLK_TCK
    coord_s = (c1 - c0) / bl.CLK_TCK
    return wall, {"worker_cpu_s": worker_s, "coordinator_catch_up_cpu_s": coord_s,
                  "reads_accounted": reads,
                  "worker_ms_per_file": worker_s * 1000 / len(wl.rels),
                  # of which the worker's Python thread (events, hits to the coordinator)
                  "worker_python_ms_per_file": pump_s * 1000 / len(wl.rels),
                  "coordinator_ms_per_hit": coord_s * 1000 / max(1.0, reads)}


def survivors(pids: list[int], wait_s: float = 5.0) -> list[int]:
    """Which of these (the spoke's workers) still run once their mount is gone."""
    end = time.monotonic() + wait_s
    while True:
        alive = [p for p in pids if _running(p)]
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def fill(wl: Workload, hub: bl.Hub, cache: Path, run_dir: Path,
         deadline: bl.Deadline) -> dict[str, Any]:
    """The cold pass that fills the cache, checking every byte; then unmounted."""
    mnt = run_dir / f"mnt-{wl.name}"
    with bl.spoke_mount(hub.url, mnt, cache, run_dir / "logs" / f"spokefs-fill-{wl.name}.log",
                        deadline) as m:
        t0 = time.perf_counter()
        checked, wrong = check_bytes(wl, mnt, full=True, seed=0)
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "checked": checked, "wrong": wrong,
            "unmount": {"clean": bool(m.result and m.result.clean),
                        "exit_code": m.result.exit_code if m.result else None}}


def figures_of(wl: Workload, p: dict[str, Any], local: dict[str, Any] | None) -> dict[str, Any]:
    """Per-pass figures: rate, ratio to the same run's local, CPU per file or per GB."""
    files, nbytes = len(wl.rels), wl.total_bytes
    f: dict[str, Any] = {"files_per_s": files / p["wall_s"],
                         "mb_per_s": nbytes / 1e6 / p["wall_s"]}
    rate = "files_per_s" if wl.per_file else "mb_per_s"
    if local is not None:
        f["ratio"] = f[rate] / local[rate]
    if "spoke_cpu_s" in p:
        f["cpu_ms_per_file"] = p["spoke_cpu_s"] * 1000 / files
        f["cpu_s_per_gb"] = p["spoke_cpu_s"] / (nbytes / GB)
        f["spoke_busy_cores"] = p["spoke_cpu_s"] / p["wall_s"]
    if "split" in p:
        f["worker_ms_per_file"] = p["split"]["worker_ms_per_file"]
        f["worker_python_ms_per_file"] = p["split"]["worker_python_ms_per_file"]
        f["coordinator_ms_per_hit"] = p["split"]["coordinator_ms_per_hit"]
    return f


# -- the run ------------------------------------------------------------------------------


def run(args: argparse.Namespace, configs: list[Config], wls: list[Workload], run_dir: Path,
        record: dict[str, Any], deadline: bl.Deadline) -> None:
    record["fills"], record["passes"] = {}, []
    native: Path | str = "not asked for"
    if any(cfg.native for cfg in configs):
        native = bl.build_native(run_dir)
        if isinstance(native, str):
            record["problems"].append(f"ceiling_native not built: {native}")
            configs = [cfg for cfg in configs if not cfg.native]
    for wl in wls:
        cache = run_dir / f"cache-{wl.name}"
        with bl.run_hub(wl.root, run_dir / "logs" / f"hubd-{wl.name}.log", deadline) as hub:
            got = fill(wl, hub, cache, run_dir, deadline)
            record["fills"][wl.name] = got
            print(f"{wl.name}: cache filled in {got['wall_s']:.1f} s, {got['checked']} files "
                  f"checked, {len(got['wrong'])} wrong", flush=True)
            if got["wrong"]:
                record["problems"].append(f"{wl.name} fill: wrong bytes in {got['wrong'][:5]}")
            if not (got["unmount"]["clean"] and got["unmount"]["exit_code"] == 0):
                record["problems"].append(f"{wl.name} fill: unmount {got['unmount']}")
            for r in range(args.runs):
                local: dict[str, Any] | None = None
                for cfg in configs:
                    if cfg.split and wl.name != "small":
                        continue  # (a per-hit cost: measured on the small files)
                    tag = f"{wl.name}-{cfg.key}-{r}"
                    if cfg.native:
                        p = native_pass(wl, cfg, native, run_dir, tag, deadline)
                    elif cfg.workers is not None:
                        p = spoke_pass(wl, cfg, hub, cache, run_dir, tag, deadline,
                                       seed=args.seed + r)
                    else:
                        p = local_pass(wl, deadline)
                    p |= {"workload": wl.name, "config": cfg.key, "name": cfg.name, "run": r}
                    p["figures"] = figures_of(wl, p, local and local["figures"])
                    if cfg.workers is None:
                        local = p
                    record["passes"].append(p)
                    report_pass(wl, p, record["problems"])


def report_pass(wl: Workload, p: dict[str, Any], problems: list[str]) -> None:
    f = p["figures"]
    rate = (f"{f['files_per_s']:.0f} files/s" if wl.per_file
            else f"{f['mb_per_s']:.0f} MB/s")
    line = f"{wl.name} run {p['run']} {p['name']}: {rate} in {p['wall_s']:.2f} s"
    if "ratio" in f:
        line += f", x{f['ratio']:.2f} local"
    if "counters" not in p and "spoke_cpu_s" in p:  # the C ceiling
        line += f"; {f['cpu_ms_per_file']:.3f} ms/file of CPU"
        if not (p["unmount"]["clean"] and p["unmount"]["exit_code"] == 0):
            problems.append(f"{wl.name} run {p['run']} {p['name']}: unmount {p['unmount']}")
    elif "spoke_cpu_s" in p:
        c = p["counters"]
        line += (f"; spoke {f['cpu_ms_per_file']:.3f} ms/file, {f['cpu_s_per_gb']:.2f} s/GB, "
                 f"{f['spoke_busy_cores']:.2f} cores (workers "
                 f"{', '.join(f'{w:.2f}' for w in p['workers_cpu_s']) or '-'} s); "
                 f"{c['reads_total']} READs, {c['block_misses_total']} blocks fetched")
        where = f"{wl.name} run {p['run']} {p['name']}"
        if p["sample_wrong"]:
            problems.append(f"{where}: wrong bytes in {p['sample_wrong'][:5]}")
        if c["block_misses_total"]:
            problems.append(f"{where}: {c['block_misses_total']} blocks fetched: not warm")
        if c["fuse_errors_total"] or c["worker_restarts_total"]:
            problems.append(f"{where}: {c['fuse_errors_total']} FUSE errors, "
                            f"{c['worker_restarts_total']} worker restarts")
        if p["processes_gone_during_pass"]:
            problems.append(f"{where}: processes gone during the pass "
                            f"{p['processes_gone_during_pass']} (their CPU is missing)")
        if not (p["unmount"]["clean"] and p["unmount"]["exit_code"] == 0):
            problems.append(f"{where}: unmount {p['unmount']}")
        if p["workers_left"]:
            problems.append(f"{where}: workers still running after the unmount: "
                            f"{p['workers_left']}")
    if "split" in p:
        line += (f"; split: worker {f['worker_ms_per_file']:.3f} ms/file (Python "
                 f"{f['worker_python_ms_per_file']:.3f}), coordinator "
                 f"{f['coordinator_ms_per_hit']:.3f} ms/hit over "
                 f"{p['split']['reads_accounted']:.0f} reads")
    line += f"; machine {p['machine_busy_pct']:.0f} % busy"
    print(line, flush=True)


def summarise(record: dict[str, Any], wls: list[Workload]) -> dict[str, dict[str, bl.Figure]]:
    """Figures over runs: {workload/config: {figure: Figure}} and the scaling ratios."""
    figs: dict[str, dict[str, bl.Figure]] = {}
    for p in record["passes"]:
        d = figs.setdefault(f"{p['workload']}/{p['config']}", {})
        for k, v in p["figures"].items():
            d.setdefault(k, bl.Figure()).add(v)
    for wl in wls:
        for cpus in ("", "-cpu0", "-cpu01", "-q45"):
            fig = bl.Figure()
            for r in {p["run"] for p in record["passes"]}:
                rate = "files_per_s" if wl.per_file else "mb_per_s"
                by = {p["config"]: p["figures"][rate] for p in record["passes"]
                      if p["workload"] == wl.name and p["run"] == r}
                if f"w1{cpus}" in by and f"w2{cpus}" in by:
                    fig.add(by[f"w2{cpus}"] / by[f"w1{cpus}"])
            if fig.samples:
                figs.setdefault(f"{wl.name}/scale{cpus or '-any'}", {})["ratio"] = fig
    return figs


def tables(figs: dict[str, dict[str, bl.Figure]], configs: list[Config],
           wls: list[Workload]) -> str:
    out = []
    for wl in wls:
        small = wl.per_file
        head = (["configuration", "files/s", "x local", "spoke CPU ms/file", "spoke cores"]
                if small else ["configuration", "MB/s", "x local", "spoke CPU s/GB",
                               "spoke cores"])
        rows = []
        for cfg in configs:
            d = figs.get(f"{wl.name}/{cfg.key}")
            if not d:
                continue
            def t(k: str, fmt: str, d: dict[str, bl.Figure] = d) -> str:
                return d[k].text(fmt) if k in d else "-"
            rows.append([cfg.name, t("files_per_s" if small else "mb_per_s", "{:,.0f}"),
                         t("ratio", "{:.2f}") if cfg.workers is not None else "1.00",
                         t("cpu_ms_per_file" if small else "cpu_s_per_gb",
                           "{:.3f}" if small else "{:.2f}"),
                         t("spoke_busy_cores", "{:.2f}")])
        title = (f"{wl.name}: {len(wl.rels)} files, {wl.total_bytes / 1e6:,.0f} MB, "
                 f"`{wl.command.format(root='ROOT')}`")
        out.append(title + "\n\n" + bl.markdown_table(head, rows))
        d = figs.get(f"{wl.name}/w2-split")
        if d:
            out.append(bl.markdown_table(
                ["w2 split: the coordinator stopped during the pass", "figure"],
                [["files/s, the worker alone", d["files_per_s"].text("{:,.0f}")],
                 ["worker CPU ms per file", d["worker_ms_per_file"].text("{:.3f}")],
                 ["of which its Python thread (events, hits to the coordinator)",
                  d["worker_python_ms_per_file"].text("{:.3f}")],
                 ["coordinator CPU ms per worker hit (its catch-up after SIGCONT)",
                  d["coordinator_ms_per_hit"].text("{:.3f}")]]))
        scale = [[f"w2 / w1, spoke on {SCALE_LABELS[k.split('/', 1)[1]]}",
                  v["ratio"].text("{:.2f}")]
                 for k, v in figs.items() if k.startswith(f"{wl.name}/scale")]
        if scale:
            out.append(bl.markdown_table([f"{wl.name}: scaling, run by run", "ratio"], scale))
    return "\n\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--files", type=int, default=6000)
    ap.add_argument("--dirs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=20261203, help="train.py's data set seed")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--shard-mib", type=int, default=256)
    ap.add_argument("--configs", default=ALL_CONFIGS)
    ap.add_argument("--workloads", default="small,seq", help="small, seq, paced")
    ap.add_argument("--paced-files", type=int, default=2400)
    ap.add_argument("--paced-rate", type=float, default=300.0, help="files/s")
    ap.add_argument("--work-dir", type=Path, default=Path("/var/tmp/spokefs-workers"))
    ap.add_argument("--keep", action="store_true", help="keep the run's caches and logs")
    ap.add_argument("--max-seconds", type=float, default=3600.0)
    ap.add_argument("--results", type=Path, default=RESULTS, help="JSON lines appended here")
    ap.add_argument("--smoke", action="store_true",
                    help=f"200 files, 2 x 8 MiB, 1 run, {SMOKE_CONFIGS}")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.files, args.dirs, args.shards, args.shard_mib = 1, 200, 10, 2, 8
        if args.configs == ALL_CONFIGS:
            args.configs = SMOKE_CONFIGS
    configs = parse_configs(args.configs)
    record: dict[str, Any] = bl.run_info("bench_workers.py")
    if shutil.which("taskset") is None and any(c.cpus for c in configs):
        raise SystemExit("taskset is not installed (util-linux)")
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    note = check_space(args, work)
    wls = workloads(args, work)
    record |= {"config": {k: v for k, v in vars(args).items() if k != "results"},
               "configs": [c.key for c in configs], "notes": [note] if note else [],
               "workloads": {w.name: {"files": len(w.rels), "bytes": w.total_bytes,
                                      "command": w.command} for w in wls},
               "problems": [], "error": None}
    deadline = bl.Deadline(args.max_seconds)
    started = time.monotonic()
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    ticks0, wall0, load0 = bl.all_ticks(), time.perf_counter(), os.getloadavg()
    try:
        run(args, configs, wls, run_dir, record, deadline)
    except (bl.BenchError, subprocess.TimeoutExpired) as e:
        record["error"] = f"{type(e).__name__}: {e}"
        print(f"error: {record['error']}", file=sys.stderr, flush=True)
    finally:
        left = [str(m) for m in run_dir.glob("mnt-*") if bl.is_mounted(m)]
        for m in left:
            bl.fusermount(Path(m), lazy=True)
        if left:
            record["problems"].append(f"left mounted (now detached): {left}")
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        remove_quota_cgroups()
    record["seconds"] = round(time.monotonic() - started, 1)
    # what else ran: the busiest processes alive at the end (this run's spokes are gone)
    others = [t for t in bl.top_processes(ticks0, bl.all_ticks(), time.perf_counter() - wall0)
              if t[0] != os.getpid()]
    record["machine"] = {"loadavg_start": load0, "loadavg_end": os.getloadavg(),
                         "other_busy_processes": others}
    print(f"\nload average at the start {load0[0]:.2f}, at the end {os.getloadavg()[0]:.2f}; "
          "busiest other processes over the run (% of one core): "
          + ("; ".join(f"{c[:60]} {pct}" for _, c, pct in others[:4]) or "none"), flush=True)
    figs = summarise(record, wls)
    print("\n" + tables(figs, configs, wls))
    record["figures"] = {k: {n: f.summary() for n, f in d.items()} for k, d in figs.items()}

    def value_of(goal: bl.Goal, _rtt: int | None) -> tuple[float | None, str]:
        wl, key, *rest = goal.key.split("/")
        if key.startswith("scale"):
            fig = figs.get(f"{wl}/{key}", {}).get("ratio")
        else:
            fig = figs.get(f"{wl}/{key}", {}).get(rest[0])
        if fig is None or not fig.samples:
            return None, "not run"
        note = (f"median of {len(fig.samples)}, range {min(fig.samples):.3f}-"
                f"{max(fig.samples):.3f}")
        if args.smoke:
            note += "; smoke sizes: not a figure"
        return round(statistics.median(fig.samples), 3), note

    grades = bl.grade(GOALS, [None], value_of)
    record["grades"] = bl.grades_json(grades)
    bl.print_goals([ISSUE], [G_SMALL, G_SEQ, G_CPU, G_SCALE], grades)
    for p in record["problems"]:
        print(f"problem: {p}", flush=True)
    bl.save_record(args.results, record, f"{record['seconds']} s; ")
    return 1 if record["error"] or record["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
