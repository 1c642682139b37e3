#!/usr/bin/env python3
"""The figures of "Prefetch and the long link": spokefs vs rclone vs local disk over a long link.

For each RTT of ``--rtts`` (one-way delay = RTT / 2), a 1 Gbit/s cap and a 4 MiB window per
connection (benchmarks/longlink.py), side by side in one run on the same data:

- **spokefs**: hubd -> longlink -> ``spokefs mount`` (foreground, fresh cache dir per mount);
- **rclone**: ``rclone serve http SRC`` -> its own longlink (same settings) ->
  ``rclone mount :http: MNT --http-url ... --vfs-cache-mode full --cache-dir D`` (fresh D);
- **local**: the source directory itself.

Each pass gets a fresh mount behind a fresh emulator (so its counters are the pass's; rand's
warm pass: a remount on the cold pass's cache dir), and the kernel page cache is dropped
before every cold and warm pass. Workloads (benchmarks/workloads.py):

1. **seq**: cold sequential read of large files, one reader, Python ``readinto`` with a 1 MiB
   buffer: the link's MB/s (10^6 B/s) as a fraction of the cap, link bytes per byte read.
2. **rand**: fio 4 KiB random reads (psync, page cache on, ``--norandommap``, fixed
   ``--randseed``) over one 1 GiB file, ``--fio-jobs`` jobs: cold p50/p99 and link bytes per
   byte read; then the system is unmounted and mounted again on the same cache dir (a fresh
   process behind a fresh emulator), and, page cache dropped, the same offsets again: warm
   p50/p99 after a remount. Warm is never read on the mount that read cold: a live process
   keeps the cache pages it has mapped (LMDB's) through ``drop_caches``.
3. **small**: one shuffled pass over 10,000 files of 16-128 KiB (10 dirs of 1,000) by 4 worker
   processes taking whole files from a shared list: files/s vs the link bound
   (cap / mean file size).
4. **meta** (only at the RTTs of ``--meta-rtts``): seconds from launching the mount to a
   finished ``find MNT | wc -l`` over 10,000 and 1,000,000 entries (rclone only on 10,000).

Link figures are read at the link, never at the reader: the emulator's byte counters, stamped
with the time it wrote them (benchlib.LinkSeries). seq's MB/s is the bytes the link delivered
between the start of the pass and the reader's last byte, over that time (the reader's own
MB/s is shown next to it); link bytes per byte read count from the start of the pass to 1 s
after its end (HTTP headers included). The JSON line keeps each pass's series.

Runs: ``--runs`` (3) of rand, small and meta 10k; ``--heavy-runs`` (1) of seq, meta 1M and
rclone's find. Every pass is bounded (``--budget-s`` 60 s: fio's runtime and the small-file
pass; ``--seq-budget-s`` 120 s; ``--meta-timeout-s`` 300 s); a pass cut at its budget reports
MB/s or files/s over what it did, is marked ``*``, and that system is not run again for that
workload and RTT. The warm fio pass re-reads, per job, as many of the job's offsets as the
slowest job read cold, so every warm read was read before. Per pass the JSON line also holds
each process's CPU, the machine's busy CPU and busiest processes, spokefs's and hubd's counter
deltas and a 0.5 s series of the spoke's in-flight limit (for the diagnosis).

Prints one table per RTT (workload | spokefs | rclone | local; benchmarks/longlink_report.py),
then the goals of "Prefetch
and the long link" (item 5) and, for warm random reads and the 1M-entry find, of "Large files
and the namespace", word for word, each graded PASS / MISS / NOT MEASURED; appends one JSON
line (with the commit and whether the tree was dirty) to benchmarks/results/longlink.jsonl
(check_longlink.py writes its own records to the same file). Exits 1 on an error or when a
spoke did not exit 0 after a clean unmount.

    python3 benchmarks/bench_longlink.py [--quick | --smoke] [--rtts 60,900] [--runs 3]
        [--heavy-runs 1] [--only seq,rand,small,meta] [--systems spokefs,rclone,local]
        [--budget-s 60] [--fio-jobs 4] [--spoke-arg=--flag=value] [--hub-arg=--flag=value]
        [--keep]

Default run ~20 min on a 2-core VM (the data sets, ~3.3 GiB plus a 1M-entry tree, are built
once under --work-dir, first time ~1 min); ``--quick`` ~4 min (1 run, 256/128 MiB seq,
400/60 random reads, 2,000 small files, 20 s budgets, no 1M tree, no rclone find);
``--smoke`` ~20 s (CI: a 4 ms RTT, tiny data sets, spokefs and local only).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import benchlib as bl  # noqa: E402
import workloads as wl  # noqa: E402
from data_sets import FULL, SMOKE, Data, ensure_data, ensure_tree  # noqa: E402
from longlink_report import (  # noqa: E402
    GOALS,
    ISSUE,
    SENTENCES,
    SYSTEMS,
    Results,
    goal_value,
    print_table,
    table_rows,
)
from probe import Probe, Target  # noqa: E402

RESULTS = HERE / "results" / "longlink.jsonl"
MIB = bl.MIB
WORKLOADS = ("seq", "rand", "small", "meta")

# -- the servers and the mounts ------------------------------------------------------------


@dataclass
class Env:
    """What a whole run needs: the servers, the run dir, the options, what went wrong."""

    args: argparse.Namespace
    run_dir: Path
    deadline: bl.Deadline
    hub: bl.Hub | None = None
    rclone: tuple[bl.Proc, int] | None = None  # rclone serve http, its port
    mounts: list[Path] = field(default_factory=list)  # every mountpoint made (final sweep)
    capped: set[tuple[int, str, str]] = field(default_factory=set)  # (rtt, workload, system)
    unmounts: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def systems(self, rtt: int, workload: str) -> list[str]:
        """The systems to run: one whose pass hit its budget is not run again (one capped
        sample says what it can do, and more would cost minutes each)."""
        return [s for s in self.args.systems if (rtt, workload, s) not in self.capped]


@contextlib.contextmanager
def mount(env: Env, system: str, rtt: int, local_root: Path, where: Path | None = None,
          keep_cache: bool = False) -> Iterator[Target]:
    """The system's view of the data: the local source, or a fresh mount behind a fresh
    emulator (spokefs: in front of hubd; rclone: in front of ``rclone serve http``).
    ``where``: the dir of a previous mount whose cache to mount again (a remount: a fresh
    process on that cache); ``keep_cache``: leave the cache for such a remount."""
    if system == "local":
        yield Target("local", local_root, launched=time.perf_counter())
        return
    args = env.args
    where = where or Path(tempfile.mkdtemp(dir=env.run_dir, prefix=f"{system}-"))
    env.mounts.append(where / "mnt")
    if system == "spokefs":
        assert env.hub is not None
        server_pid, port = env.hub.proc.pid, env.hub.port
        daemon, server, hub_metrics = "spokefs", "hubd", f"{env.hub.url}/metrics"
    else:
        assert env.rclone is not None
        server_pid, port = env.rclone[0].pid, env.rclone[1]
        daemon, server, hub_metrics = "rclone-mount", "rclone-serve", None
    log = "remount.log" if (where / "cache").exists() else "mount.log"
    try:
        with bl.open_link(port, bl.LinkSpec(rtt, args.rate_mbit, args.window_bytes)) as link:
            url = f"http://127.0.0.1:{link.port}"
            if system == "spokefs":
                cm = bl.spoke_mount(url, where / "mnt", where / "cache",
                                    where / f"spokefs-{log}", env.deadline,
                                    extra_args=args.spoke_arg, start_timeout_s=600)
            else:
                cm = bl.rclone_mount(url, where / "mnt", where / "cache", where / f"rclone-{log}",
                                     env.deadline, extra_args=args.rclone_arg)
            assert link.proc is not None
            with cm as m:
                pids = {daemon: m.pid, server: server_pid, "proxy": link.proc.pid}
                try:
                    yield Target(system, m.path, link, pids, m.metrics_url, hub_metrics,
                                 m.proc.started, m.ready_s, m)
                finally:
                    if wl.STUCK:
                        print(f"  ({len(wl.STUCK)} readers stuck in {system} at the budget: "
                              "killing it)", flush=True)
                        m.stuck = True
            _note_unmount(env, m, rtt)
    finally:
        wl.reap_stuck()
        with contextlib.suppress(OSError):
            if not bl.is_mounted(where / "mnt"):
                (where / "mnt").rmdir()
        if not args.keep and not keep_cache:
            shutil.rmtree(where / "cache", ignore_errors=True)


def _note_unmount(env: Env, m: bl.Mount, rtt: int) -> None:
    assert m.result is not None
    env.unmounts.append({"system": m.name, "rtt_ms": rtt, "clean": m.result.clean,
                         "exit_code": m.result.exit_code, "stuck": m.stuck})
    if m.name == "spokefs" and not m.stuck and (not m.result.clean or m.result.exit_code != 0):
        env.problems.append(f"spokefs at {rtt} ms: unmount clean={m.result.clean}, exit code "
                            f"{m.result.exit_code}: {m.proc.log_tail()}")


# -- the workloads, per system ------------------------------------------------------------


_T0 = time.monotonic()


def _stamp() -> str:
    return f"[{time.monotonic() - _T0:5.0f} s]"


def _per_byte(info: dict[str, Any], nbytes: int) -> float | None:
    return info["link_bytes_down"] / nbytes if "link_bytes_down" in info and nbytes else None


def _r(value: float | None, digits: int) -> float | None:
    return value if value is None else round(value, digits)


def bench_seq(env: Env, data: Data, rtt: int, res: Results) -> None:
    args = env.args
    max_bytes = (args.seq_mib[0] if rtt <= 100 else args.seq_mib[1]) * MIB
    cap = args.rate_mbit * 1e6 / 8
    for run in range(args.heavy_runs):
        for system in env.systems(rtt, "seq"):
            with mount(env, system, rtt, data.root) as t:
                bl.drop_caches()
                progress = wl.Progress()
                probe = Probe(t, series=True, progress=lambda p=progress: float(p.bytes))
                probe.start()
                files = data.seq_quick if args.quick else data.seq
                nbytes, secs, parts, half = wl.read_sequential(t.path, files, max_bytes,
                                                               args.seq_budget_s, progress)
                info = probe.stop()
                wl.verify_prefix(t.path, data.root, parts)
            capped = nbytes < max_bytes
            if capped:
                env.capped.add((rtt, "seq", system))
            link_mbps = link_2nd = None
            if probe.link is not None:
                link_mbps = info["link_rate_bps"] / 1e6
                if half:
                    link_2nd = probe.link.rate(probe.t0 + half, probe.t1) / 1e6
            res.add(rtt, "seq", system, reader_mbps=nbytes / secs / 1e6,
                    reader_frac_cap=nbytes / secs / cap, link_mbps=link_mbps,
                    link_frac_cap=None if link_mbps is None else link_mbps * 1e6 / cap,
                    link_mbps_2nd_half=link_2nd, link_per_byte=_per_byte(info, nbytes),
                    mib_read=nbytes / MIB, seconds=secs, capped=float(capped))
            res.record(rtt, "seq", system, run, mib_read=nbytes / MIB, seconds=secs,
                       first_half_s=half, link_mbps=link_mbps, link_mbps_2nd_half=link_2nd,
                       capped=capped, ready_s=t.ready_s, **info)
            shown = "" if link_mbps is None else (
                f"link {link_mbps:.1f} MB/s ({link_mbps * 1e6 / cap:.2f} of cap; 2nd half "
                f"{link_2nd or 0:.1f}), ")
            print(f"{_stamp()} seq {system:8s} run {run + 1}: {nbytes / MIB:.0f} MiB in "
                  f"{secs:.1f} s: {shown}reader {nbytes / secs / 1e6:.1f} MB/s, link/byte "
                  f"{_r(_per_byte(info, nbytes), 3)}, cpu {info['cpu_pct']}", flush=True)


def bench_rand(env: Env, data: Data, rtt: int, res: Results) -> None:
    args = env.args
    reads = args.rand_reads[0] if rtt <= 100 else args.rand_reads[1]
    for run in range(args.runs):
        for system in env.systems(rtt, "rand"):
            where = (None if system == "local"
                     else Path(tempfile.mkdtemp(dir=env.run_dir, prefix=f"{system}-")))
            logs, per_job = env.run_dir / "fio", max(1, reads // args.fio_jobs)
            with mount(env, system, rtt, data.root, where, keep_cache=True) as t:
                bl.drop_caches()
                probe = Probe(t).start()
                cold = wl.run_fio(t.path / data.rand, per_job, args.fio_jobs, args.budget_s,
                                  logs)
                cinfo = probe.stop()
            # warm, after a remount (a fresh process on the same cache, page cache dropped):
            # the same offsets again, as many per job as the slowest job did cold
            with mount(env, system, rtt, data.root, where) as t:
                bl.drop_caches()
                probe = Probe(t).start()
                warm = wl.run_fio(t.path / data.rand, max(1, min(cold["per_job_done"])),
                                  args.fio_jobs, args.budget_s, logs)
                winfo = probe.stop(settle_s=0.5)
            lpb = _per_byte(cinfo, cold["bytes"])
            capped = cold["reads"] < cold["planned_reads"]
            if capped:
                env.capped.add((rtt, "rand", system))
            res.add(rtt, "rand", system, cold_p50_ms=cold["p50_ms"], cold_p99_ms=cold["p99_ms"],
                    capped=float(capped), cold_link_per_byte=lpb, cold_reads=cold["reads"],
                    warm_remount_p50_ms=warm["p50_ms"], warm_remount_p99_ms=warm["p99_ms"],
                    warm_remount_link_bytes=winfo.get("link_bytes_down"))
            res.record(rtt, "rand", system, run, cold=cold, cold_probe=cinfo, warm_remount=warm,
                       warm_remount_probe=winfo)
            print(f"{_stamp()} rand {system:8s} run {run + 1}: cold {cold['reads']} reads p50 "
                  f"{cold['p50_ms']:.2f} p99 {cold['p99_ms']:.2f} ms, link/byte {_r(lpb, 2)}; "
                  f"warm after a remount p50 {warm['p50_ms']:.3f} p99 {warm['p99_ms']:.3f} ms, "
                  f"warm link bytes "
                  f"{winfo.get('link_bytes_down')}; cpu {cinfo['cpu_pct']}", flush=True)


def bench_small(env: Env, data: Data, rtt: int, res: Results) -> None:
    args = env.args
    dirs = {f"small/d{d:02d}/" for d in range(args.small_dirs)}
    rels = sorted(r for r in data.small if r[: len("small/d00/")] in dirs)
    cap = args.rate_mbit * 1e6 / 8
    for run in range(args.runs):
        order = rels[:]
        random.Random(run).shuffle(order)  # the same order for every system in a run
        for system in env.systems(rtt, "small"):
            with mount(env, system, rtt, data.root) as t:
                bl.drop_caches()
                stats = wl.small_stats()
                probe = Probe(t, series=True, progress=wl.small_bytes(stats)).start()
                out = wl.read_small(t.path, order, data.small, args.budget_s, stats)
                info = probe.stop()
            if out["capped"]:
                env.capped.add((rtt, "small", system))
            if out["bad"]:
                raise bl.BenchError(f"{system}: {out['bad']} small files differ from the source")
            bound = cap / out["mean_file_bytes"]
            lpb = _per_byte(info, out["bytes"])
            res.add(rtt, "small", system, files_per_s=out["files_per_s"],
                    frac_bound=out["files_per_s"] / bound, link_per_byte=lpb,
                    files=out["files"], bound=bound, capped=float(out["capped"]))
            res.record(rtt, "small", system, run, **out, bound_files_per_s=bound, **info)
            rate = out["files_per_s"]
            print(f"{_stamp()} small {system:8s} run {run + 1}: {out['files']} files in "
                  f"{out['seconds']:.1f} s = {rate:.0f}/s ({rate / bound:.2f} of bound "
                  f"{bound:.0f}/s), link/byte {_r(lpb, 3)}, cpu {info['cpu_pct']}", flush=True)


def meta_name(entries: int) -> str:
    return f"meta{entries // 1000}k" if entries < 1_000_000 else f"meta{entries // 1_000_000}M"


def bench_meta(env: Env, rtt: int, res: Results) -> None:
    """Mount launch -> finished ``find | wc -l`` on 10k and 1M entries (servers per tree)."""
    args = env.args
    for entries in args.meta_entries:
        root, expected = ensure_tree(args.work_dir, entries)
        runs = args.runs if entries <= 100_000 else args.heavy_runs
        systems = [s for s in args.systems if s != "rclone" or entries <= args.rclone_meta_max]
        name = meta_name(entries)
        saved = env.hub, env.rclone
        with contextlib.ExitStack() as stack:
            if "spokefs" in systems:
                env.hub = stack.enter_context(bl.run_hub(
                    root, env.run_dir / f"hubd-{name}.log", env.deadline, args.hub_arg))
            if "rclone" in systems:
                env.rclone = stack.enter_context(bl.rclone_serve(
                    root, env.run_dir / f"rclone-serve-{name}.log", env.deadline))
            for run in range(runs):
                for system in systems:
                    if system == "rclone" and run >= args.heavy_runs:
                        continue  # ~90 s a pass at 60 ms: heavy
                    _meta_pass(env, system, rtt, root, expected, name, run, res)
        env.hub, env.rclone = saved


def _meta_pass(env: Env, system: str, rtt: int, root: Path, expected: int, name: str, run: int,
               res: Results) -> None:
    bl.drop_caches()
    timeout = env.deadline.timeout(env.args.meta_timeout_s)
    if system == "local":
        t0 = time.perf_counter()
        found = wl.find_count(root, timeout)
        total, ready, info = time.perf_counter() - t0, 0.0, {}
    else:
        with mount(env, system, rtt, root) as t:
            # nothing between the mount and the find: the clock runs from the mount command
            at_mount = bl.link_counters(t.link, fresh=False)
            cpu = bl.CpuMeter(t.pids)
            found = wl.find_count(t.path, timeout)
            total, ready = time.perf_counter() - t.launched, t.ready_s
            find_cpu = cpu.stop()
            info = {"mount_link_bytes_down": at_mount.bytes_down,
                    "link_bytes_down": bl.link_counters(t.link).bytes_down,
                    "find_cpu_s": find_cpu["cpu_s"],
                    "machine_busy_pct": find_cpu["machine_busy_pct"]}
    if found is not None and found != expected:
        raise bl.BenchError(f"{system}: find counted {found} entries, the source {expected}")
    res.add(rtt, name, system, seconds=total if found is not None else timeout,
            mount_ready_s=ready, capped=float(found is None))
    res.record(rtt, name, system, run, seconds=total, found=found, expected=expected,
               mount_ready_s=ready, **info)
    shown = f"{total:.2f} s" if found is not None else f"> {timeout:.0f} s (timed out)"
    print(f"{_stamp()} {name} {system:8s} run {run + 1}: mount -> find done {shown} "
          f"(ready {ready:.2f} s, {found} entries)", flush=True)


# -- main ---------------------------------------------------------------------------------


def _pair(text: str) -> tuple[int, int]:
    parts = [int(x) for x in text.split(",")]
    return (parts[0], parts[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true",
                   help="1 run, small sizes, no 1M tree, no rclone find, 20 s budgets (<= 5 min)")
    p.add_argument("--smoke", action="store_true",
                   help="CI: 4 ms RTT, tiny data sets, 1 run, spokefs and local unless "
                        "--systems says otherwise (~25 s)")
    p.add_argument("--rtts", default="60,900", help="RTTs in ms (60,900)")
    p.add_argument("--meta-rtts", default="60", help="RTTs at which to run meta (60)")
    p.add_argument("--runs", type=int, default=3, help="runs of rand, small, meta 10k (3)")
    p.add_argument("--heavy-runs", type=int, default=1, help="runs of seq and meta 1M (1)")
    p.add_argument("--only", default=",".join(WORKLOADS), help="workloads (seq,rand,small,meta)")
    p.add_argument("--systems", help="spokefs,rclone,local (all; --smoke: spokefs,local)")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="link cap (1000)")
    p.add_argument("--window-bytes", type=int, default=4 * MIB, help="window per conn (4 MiB)")
    p.add_argument("--seq-mib", type=_pair, default=(1024, 512),
                   help="MiB read sequentially at <= 100 ms, > 100 ms RTT (1024,512)")
    p.add_argument("--seq-budget-s", type=float, default=120.0, help="seq pass cap (120 s)")
    p.add_argument("--rand-reads", type=_pair, default=(2000, 200),
                   help="4 KiB reads at <= 100 ms, > 100 ms RTT (2000,200)")
    p.add_argument("--fio-jobs", type=int, default=4, help="fio jobs (4)")
    p.add_argument("--small-dirs", type=int, default=FULL.small_dirs,
                   help=f"dirs of {FULL.small_per_dir} small files in the pass "
                        f"({FULL.small_dirs})")
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
    if args.quick and args.smoke:
        p.error("--quick and --smoke exclude each other")
    if args.quick:
        args.runs = args.heavy_runs = 1
        args.seq_mib, args.rand_reads = (256, 128), (400, 60)
        args.small_dirs, args.budget_s, args.seq_budget_s = 2, 20.0, 30.0
        args.meta_entries = "10000"
        args.rclone_meta_max = 0
        args.max_seconds = min(args.max_seconds, 600.0)
    if args.smoke:
        args.rtts = args.meta_rtts = "4"
        args.runs = args.heavy_runs = 1
        args.seq_mib, args.rand_reads = (16, 16), (40, 40)
        args.small_dirs, args.budget_s, args.seq_budget_s = SMOKE.small_dirs, 20.0, 20.0
        args.meta_entries, args.rclone_meta_max, args.meta_timeout_s = "1000", 0, 60.0
        args.systems = args.systems or "spokefs,local"
        args.max_seconds = min(args.max_seconds, 180.0)
    args.rtts = [int(x) for x in args.rtts.split(",")]
    args.meta_rtts = [int(x) for x in args.meta_rtts.split(",") if x]
    args.only = [w for w in args.only.split(",") if w]
    args.systems = [s for s in (args.systems or ",".join(SYSTEMS)).split(",") if s]
    args.meta_entries = [int(x) for x in args.meta_entries.split(",") if x]
    bad = set(args.only) - set(WORKLOADS) | set(args.systems) - set(SYSTEMS)
    if bad:
        p.error(f"unknown workload or system: {sorted(bad)}")
    return args


def _sweep(env: Env) -> None:
    """Last resort: nothing we mounted stays mounted."""
    for mnt in env.mounts:
        if bl.is_mounted(mnt):
            print(f"warning: {mnt} still mounted; lazy unmount", file=sys.stderr)
            bl.fusermount(mnt, lazy=True)


def run_all(env: Env, data: Data | None, res: Results) -> None:
    args = env.args
    with contextlib.ExitStack() as stack:
        if data is not None and "spokefs" in args.systems:
            env.hub = stack.enter_context(bl.run_hub(
                data.root, env.run_dir / "hubd-data.log", env.deadline, args.hub_arg))
        if data is not None and "rclone" in args.systems:
            env.rclone = stack.enter_context(bl.rclone_serve(
                data.root, env.run_dir / "rclone-serve-data.log", env.deadline))
        for rtt in args.rtts:
            print(f"\n== RTT {rtt} ms ==", flush=True)
            if data is not None:
                for name, fn in (("seq", bench_seq), ("rand", bench_rand), ("small", bench_small)):
                    if name in args.only:
                        fn(env, data, rtt, res)
            if "meta" in args.only and rtt in args.meta_rtts:
                bench_meta(env, rtt, res)


def report(env: Env, res: Results, head: dict[str, Any], error: str | None,
           started: float) -> dict[str, Any]:
    """Print the tables and the grades; the JSON line."""
    args = env.args
    tables = {str(rtt): print_table(table_rows(res, rtt), rtt, args)
              for rtt in args.rtts if rtt in res.figs}
    grades = bl.grade(GOALS, args.rtts, lambda g, rtt: goal_value(res, args, g, rtt))
    graded = bl.print_goals([ISSUE, "Large files and the namespace"], SENTENCES, grades)
    return head | {
        "wall_s": round(time.monotonic() - started, 1), "config": vars(args),
        "figures": {str(rtt): {w: {s: {f: fig.summary() for f, fig in figs.items()}
                                   for s, figs in sys_.items()}
                               for w, sys_ in work.items()}
                    for rtt, work in res.figs.items()},
        "tables": tables, "graded": graded, "grades": bl.grades_json(grades),
        "passes": res.passes, "unmounts": env.unmounts, "problems": env.problems,
        "error": error,
    }


def preflight(args: argparse.Namespace) -> str | None:
    """Why this run cannot start, or None."""
    if os.geteuid() != 0:
        return "needs root (FUSE allow_other, drop_caches)"
    if "rclone" in args.systems and shutil.which("rclone") is None:
        return "rclone not found: apt-get install rclone (or --systems spokefs,local)"
    if "rand" in args.only and shutil.which("fio") is None:
        return "fio not found: apt-get install fio (or --only seq,small,meta)"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if why := preflight(args):
        print(f"bench_longlink: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    started = time.monotonic()
    head = bl.run_info("bench_longlink.py")  # before anything is written into the tree
    args.work_dir.mkdir(parents=True, exist_ok=True)
    env = Env(args, Path(tempfile.mkdtemp(dir=args.work_dir, prefix="run-ll-")),
              bl.Deadline(args.max_seconds))
    res, error = Results(), None
    try:
        sizes = SMOKE if args.smoke else FULL
        data = ensure_data(args.work_dir, sizes) if set(args.only) - {"meta"} else None
        run_all(env, data, res)
    except (bl.BenchError, subprocess.SubprocessError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        print(f"bench_longlink: error: {error}", file=sys.stderr)
    finally:
        _sweep(env)
        bl.save_record(args.results, report(env, res, head, error, started),
                       f"{time.monotonic() - started:.0f} s; ")
        if args.keep:
            print(f"kept logs and caches in {env.run_dir}")
        else:
            shutil.rmtree(env.run_dir, ignore_errors=True)
    for problem in env.problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if error or env.problems else 0


if __name__ == "__main__":
    sys.exit(main())
