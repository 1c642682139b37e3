#!/usr/bin/env python3
"""The Foundation figures: namespace time-to-browse and warm sequential read speed.

One command, bounded in time, cleaning up every process and mount it starts:

a. **metadata**: seconds from launching ``python3 -m spokefs mount ...`` (foreground
   subprocess, fresh cache dir) to a finished ``find MOUNT | wc -l`` over a generated tree of
   ``--entries`` entries (dirs of 100 empty-or-tiny files, built once under ``--work-dir`` and
   reused); also hubd's start-up (scan) seconds, from launch to its readiness line, with the
   kernel page cache dropped first. The entry count must equal the source's ``find | wc -l``.
   Then the spoke's resident memory, and (``--remount``, on by default) remounts on the cache
   dir the first mount left, with the hub up, 900 ms away and blackholed: launch -> browsed.
b. **seqread**: ``--files`` x ``--file-mib`` MiB of random data read sequentially, one file
   after another, by Python ``readinto`` with a 1 MiB buffer. Per run, on a fresh mount with a
   fresh cache dir: cold pass (fills the spoke cache), then the local source, the in-memory
   pyfuse3 ceiling (benchmarks/ceiling_fs.py, mounted once) and the mount again (same-mount
   warm), with ``sync; echo 3 > /proc/sys/vm/drop_caches`` before each of these reads; then
   one more mount read without dropping (page-cache-warm) and ``cmp`` of every file against
   the source; then the spoke is unmounted and mounted again on the same cache dir (a fresh
   spoke process) and, page cache dropped, the files are read once more (**warm after a
   remount**). Reported: MB/s (10^6 B/s) of each and the ratios to source and ceiling.
   Graded: the warm read after a remount only. The same-mount read keeps whatever LMDB
   pages the spoke has mapped (``drop_caches`` cannot evict them), so it is reported
   (``warm_samemount_*``), never graded.

Each figure is the median of ``--runs`` runs with min and max. Without ``--delay-ms`` the spoke
talks to hubd over loopback; with it, through benchmarks/longlink.py (then the bytes the link
carried, counted by the emulator, are reported too). Prints a table per part, then the goals
of "Foundation" (item 5: figures without a number) and of "Large files and the namespace" (the
warm-read ratio to the ceiling; the 1M-entry goals, graded when run with ``--entries 1000000
--delay-ms 30``), word for word, each PASS / MISS / REPORTED / NOT MEASURED; appends a JSON line
(with the commit and whether the tree was dirty) to benchmarks/results/foundation.jsonl. Exits
1 on an error or when a spoke did not exit 0 after a clean unmount.

    python3 benchmarks/bench_foundation.py [--entries 100000] [--runs 3] [--files 8]
        [--file-mib 64] [--only metadata|seqread] [--delay-ms 30 --rate-mbit 1000] [--keep]
        [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
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
from data_sets import ensure_files, ensure_tree  # noqa: E402
from longlink import LongLinkProcess  # noqa: E402
from workloads import READ_BUFFER, find_count, read_sequential, verify_prefix  # noqa: E402

RESULTS = HERE / "results" / "foundation.jsonl"
MIB = bl.MIB
REMOUNT_SLOW_DELAY_MS = 450.0  # one way: a 900 ms round trip
FIND_TIMEOUT_S = 600.0

# -- the goals, word for word --------------------------------------------------------------

FOUNDATION = ("First figures, by a script in `benchmarks/` (not a timed test): seconds from "
              "`spokefs mount` to a finished `find MOUNT | wc -l` for a 100,000-entry tree; warm "
              "sequential read MB/s through the mount with the kernel page cache dropped, as a "
              "ratio to reading the same files from the local source directory.")
WARM = ("Warm sequential through the mount (page cache dropped): >= 0.8 of the in-memory pyfuse3 "
        "ceiling measured in the same run (about 1.5 GB/s here).")
MILLION = ("1M entries: mount to finished `find` <= 10 s at 60 ms; remount browses <= 1 s with "
           "the hub up, at 900 ms, and down; RSS <= 300 MB.")
SENTENCES = (f"{FOUNDATION} (issue \"Foundation\", item 5)",
             f"{WARM} (issue \"Large files and the namespace\")",
             f"{MILLION} (issue \"Large files and the namespace\")")
G = bl.Goal
GOALS = (
    G(FOUNDATION, "find100k", "launch -> `find` done, 100,000 entries, s", "", 0.0),
    G(FOUNDATION, "warm_remount_over_source", "warm after a remount: MB/s / source MB/s", "",
      0.0),
    G(WARM, "warm_remount_over_ceiling", "warm after a remount: MB/s / ceiling MB/s", ">=", 0.8),
    G(MILLION, "find1M", "launch -> `find` done, 1,000,000 entries, s", "<=", 10.0, (60,)),
    G(MILLION, "remount_up_browse_s", "1M remount, hub up: launch -> browsed, s", "<=", 1.0,
      (60,)),
    G(MILLION, "remount_slow_browse_s", "1M remount, hub 900 ms away: launch -> browsed, s",
      "<=", 1.0, (60,)),
    G(MILLION, "remount_down_browse_s", "1M remount, hub down: launch -> browsed, s", "<=", 1.0,
      (60,)),
    G(MILLION, "rss_after_find_mb", "1M: spoke VmRSS after the find, MB (10^6 B)", "<=", 300.0,
      (60,)),
)


@dataclass
class Run:
    """One invocation: its options, where its logs and caches go, what it measured."""

    args: argparse.Namespace
    work: Path
    deadline: bl.Deadline
    results: dict[str, dict[str, bl.Figure]] = field(default_factory=dict)
    unmounts: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def figures(self, part: str, **units: str) -> dict[str, bl.Figure]:
        """Empty figures (name -> unit), registered at once so a failed run keeps them."""
        figs = self.results[part] = {name: bl.Figure(unit=unit) for name, unit in units.items()}
        return figs

    def check_unmount(self, m: bl.Mount, what: str) -> None:
        assert m.result is not None
        self.unmounts.append({"what": what, "clean": m.result.clean,
                              "exit_code": m.result.exit_code})
        if not m.result.clean or m.result.exit_code != 0:
            self.problems.append(f"{what}: unmount clean={m.result.clean}, exit code "
                                 f"{m.result.exit_code}: {m.proc.log_tail()}")


# -- mounts ---------------------------------------------------------------------------------


@contextlib.contextmanager
def maybe_link(hub: bl.Hub, args: argparse.Namespace,
               delay_ms: float | None = None) -> Iterator[tuple[str, LongLinkProcess | None]]:
    """The URL the spoke should use: hubd's own, or (with --delay-ms, or ``delay_ms``) a
    longlink in front."""
    delay = args.delay_ms if delay_ms is None else delay_ms
    if delay <= 0:
        yield hub.url, None
        return
    with bl.open_link(hub.port, bl.LinkSpec(2 * delay, args.rate_mbit, args.window_bytes)) as link:
        yield f"http://127.0.0.1:{link.port}", link


@contextlib.contextmanager
def run_spoke(run: Run, url: str, cache_size: str, what: str, *, src: Path = bl.REPO,
              keep_cache: bool = False, fresh: bool = True) -> Iterator[bl.Mount]:
    """A foreground ``spokefs mount`` (of the checkout ``src``); always unmounted afterwards.

    ``fresh``: start from an empty cache dir (else remount the one a previous mount left);
    ``keep_cache``: leave the cache dir for a remount.
    """
    mnt, cache = Path(tempfile.mkdtemp(dir=run.work, prefix="mnt-")), run.work / "cache"
    if fresh:
        shutil.rmtree(cache, ignore_errors=True)
    try:
        with bl.spoke_mount(url, mnt, cache, run.work / "spokefs.log", run.deadline,
                            cache_size=cache_size, extra_args=run.args.spoke_arg, src=src,
                            start_timeout_s=run.args.step_timeout) as m:
            yield m
        run.check_unmount(m, what)
    finally:
        with contextlib.suppress(OSError):
            mnt.rmdir()
        if not run.args.keep and not keep_cache:
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


def count_entries(path: Path) -> int:
    found = find_count(path, FIND_TIMEOUT_S)
    if found is None:
        raise bl.BenchError(f"find {path} | wc -l took more than {FIND_TIMEOUT_S:.0f} s")
    return found


# -- metadata -------------------------------------------------------------------------------


def bench_metadata(run: Run) -> None:
    """Hub scan seconds; per spokefs checkout (this one, and ``--baseline-src`` side by side
    in the same run): mount-ready and mount-launch -> finished find seconds, the spoke's
    RSS after the find, and (``--remount``) remounts on the cache dir that mount left."""
    args = run.args
    root, expected = ensure_tree(args.work_dir, args.entries)
    systems = [("", bl.REPO)] + ([("baseline_", args.baseline_src)] if args.baseline_src else [])
    units = {"mount_ready_s": "s", "mount_to_find_done_s": "s", "find_count": "entries",
             "rss_after_find_mib": "MiB", "rss_after_find_mb": "MB",
             "rss_anon_after_find_mib": "MiB", "rss_file_after_find_mib": "MiB",
             "link_mib_down": "MiB"}
    if args.remount:
        for how in ("up", "slow", "down"):
            units |= {f"remount_{how}_ready_s": "s", f"remount_{how}_browse_s": "s"}
        units["remount_up_find_done_s"] = "s"
    figs = run.figures("metadata", hub_startup_s="s",
                       **{prefix + k: u for prefix, _ in systems for k, u in units.items()})
    print(f"metadata: tree {root} ({expected} lines from find)", flush=True)
    for i in range(args.runs):
        bl.drop_caches()
        with bl.run_hub(root, run.work / "hubd.log", run.deadline) as hub:
            figs["hub_startup_s"].add(hub.startup_s)
            for prefix, src in systems:
                sample = _metadata_run(run, hub, src, expected)
                for key, value in sample.items():
                    figs[prefix + key].add(value)
                print(f"  run {i + 1} {prefix or 'spokefs_'}{src.name}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in sample.items()), flush=True)


def _metadata_run(run: Run, hub: bl.Hub, src: Path, expected: int) -> dict[str, float]:
    """One checkout's figures: first mount and find, RSS, then the remounts."""
    args, out = run.args, {}
    with maybe_link(hub, args) as (url, link):
        with run_spoke(run, url, "1G", f"spokefs {src.name} first mount", src=src,
                       keep_cache=args.remount) as spoke:
            found = count_entries(spoke.path)
            out["mount_to_find_done_s"] = time.perf_counter() - spoke.proc.started
            rss = rss_mib(spoke.pid)
        if found != expected:
            raise bl.BenchError(f"find through the mount counted {found}, source {expected}")
        out |= {"mount_ready_s": spoke.ready_s, "find_count": found,
                "rss_after_find_mib": rss["VmRSS"], "rss_after_find_mb": rss["VmRSS"] * MIB / 1e6,
                "rss_anon_after_find_mib": rss["RssAnon"],
                "rss_file_after_find_mib": rss["RssFile"]}
        if link is not None:
            out["link_mib_down"] = bl.link_counters(link).bytes_down / MIB
        if args.remount:  # the hub up, behind the same link as the first mount
            with run_spoke(run, url, "1G", f"spokefs {src.name} remount, hub up", src=src,
                           keep_cache=True, fresh=False) as spoke:
                browse(spoke.path)
                out["remount_up_browse_s"] = time.perf_counter() - spoke.proc.started
                out["remount_up_ready_s"] = spoke.ready_s
                if count_entries(spoke.path) != expected:
                    raise bl.BenchError("find after a remount counted another number")
                out["remount_up_find_done_s"] = time.perf_counter() - spoke.proc.started
    if args.remount:
        for how in ("slow", "down"):
            out |= _remount(run, hub, src, how)
    return out


def _remount(run: Run, hub: bl.Hub, src: Path, how: str) -> dict[str, float]:
    """Remount on the stored namespace with the hub 900 ms away (``slow``) or behind a
    blackholed link (``down``: nothing gets through, connections hang)."""
    with maybe_link(hub, run.args, REMOUNT_SLOW_DELAY_MS) as (url, link):
        assert link is not None
        if how == "down":
            link.set_blackhole(True)
            time.sleep(0.3)
        with run_spoke(run, url, "1G", f"spokefs {src.name} remount, hub {how}", src=src,
                       keep_cache=True, fresh=False) as spoke:
            browse(spoke.path)
            browse_s = time.perf_counter() - spoke.proc.started
    return {f"remount_{how}_ready_s": spoke.ready_s, f"remount_{how}_browse_s": browse_s}


# -- seqread --------------------------------------------------------------------------------


def _timed_read(root: Path, drop: bool) -> float:
    if drop:
        bl.drop_caches()
    nbytes, seconds, _, _ = read_sequential(root, sorted(p.name for p in root.iterdir()))
    return nbytes / seconds / 1e6


def bench_seqread(run: Run) -> None:
    """MB/s of the local source, the ceiling, the mount cold, same-mount warm,
    page-cache-warm, and warm after a remount (the graded one)."""
    args = run.args
    src = ensure_files(args.work_dir, args.files, args.file_mib)
    names = sorted(p.name for p in src.iterdir())
    size_mib = args.files * args.file_mib
    figs = run.figures("seqread", source_mbps="MB/s", ceiling_mbps="MB/s", cold_mbps="MB/s",
                       warm_remount_mbps="MB/s", warm_remount_over_source="ratio",
                       warm_remount_over_ceiling="ratio", warm_samemount_mbps="MB/s",
                       warm_samemount_over_source="ratio",
                       warm_samemount_over_ceiling="ratio", pagecache_mbps="MB/s",
                       cold_link_mib="MiB", warm_link_mib="MiB", link_connections="conns")
    cache_size = f"{max(1024, 2 * size_mib)}M"
    print(f"seqread: {args.files} x {args.file_mib} MiB in {src}, "
          f"Python readinto, {READ_BUFFER // MIB} MiB buffer", flush=True)
    with bl.run_hub(src, run.work / "hubd.log", run.deadline) as hub, \
            bl.ceiling_mount(src, run.work / "ceiling", run.work / "ceiling.log",
                             run.deadline) as ceiling:
        for i in range(args.runs):  # a fresh link per run, so its counters are per run
            with maybe_link(hub, args) as (url, link):
                with run_spoke(run, url, cache_size, f"spokefs seqread run {i + 1}",
                               keep_cache=True) as spoke:
                    link0 = bl.link_counters(link).bytes_down
                    cold = _timed_read(spoke.path, drop=True)
                    link1 = bl.link_counters(link).bytes_down
                    source = _timed_read(src, drop=True)
                    top = _timed_read(ceiling.path, drop=True)
                    same = _timed_read(spoke.path, drop=True)  # same mount: not graded
                    pagecache = _timed_read(spoke.path, drop=False)
                    verify_prefix(src, spoke.path, [(n, (src / n).stat().st_size) for n in names])
                # warm, graded: a fresh spoke process on the same cache dir, page cache dropped
                with run_spoke(run, url, cache_size, f"spokefs seqread run {i + 1} remount",
                               fresh=False) as spoke:
                    link2 = bl.link_counters(link).bytes_down
                    warm = _timed_read(spoke.path, drop=True)
                    link3 = bl.link_counters(link)
                if link is not None:
                    figs["cold_link_mib"].add((link1 - link0) / MIB)
                    figs["warm_link_mib"].add((link3.bytes_down - link2) / MIB)
                    figs["link_connections"].add(link3.connections)
            for key, value in [("cold_mbps", cold), ("source_mbps", source),
                               ("ceiling_mbps", top), ("warm_remount_mbps", warm),
                               ("warm_remount_over_source", warm / source),
                               ("warm_remount_over_ceiling", warm / top),
                               ("warm_samemount_mbps", same),
                               ("warm_samemount_over_source", same / source),
                               ("warm_samemount_over_ceiling", same / top),
                               ("pagecache_mbps", pagecache)]:
                figs[key].add(value)
            print(f"  run {i + 1}: cold {cold:.0f}, source {source:.0f}, ceiling {top:.0f}, "
                  f"warm after a remount {warm:.0f}, same-mount warm {same:.0f} (not graded), "
                  f"page-cache-warm {pagecache:.0f} MB/s", flush=True)
    run.check_unmount(ceiling, "ceiling_fs")


# -- report ---------------------------------------------------------------------------------


FORMATS = {"s": "{:.2f}", "MB/s": "{:.0f}", "ratio": "{:.2f}", "MiB": "{:.1f}", "MB": "{:.0f}",
           "entries": "{:.0f}", "conns": "{:.0f}"}


def print_table(title: str, figs: dict[str, bl.Figure]) -> str:
    rows = [[key, fig.unit, fig.text(FORMATS.get(fig.unit, "{:.2f}"))]
            for key, fig in figs.items() if fig.samples]
    text = f"{title}\n\n" + bl.markdown_table(["figure", "unit", "median (min-max)"], rows)
    print("\n" + text, flush=True)
    return text


def goal_value(run: Run, goal: bl.Goal, rtt: int) -> tuple[float | None, str]:
    """The median a goal is graded on, if this run's settings are the goal's."""
    args = run.args
    meta, seq = run.results.get("metadata", {}), run.results.get("seqread", {})
    key = {"find100k": "mount_to_find_done_s", "find1M": "mount_to_find_done_s"}.get(goal.key,
                                                                                      goal.key)
    needs = {"find100k": 100_000}.get(goal.key, 1_000_000 if goal.rtts else None)
    if needs is not None and args.entries != needs:
        return None, f"needs --entries {needs} (ran {args.entries})"
    if goal.rtts and round(2 * args.delay_ms) != rtt:
        return None, f"needs --delay-ms {rtt / 2:g} (ran {args.delay_ms:g})"
    fig = (seq if goal.key.startswith("warm_") else meta).get(key)
    if fig is None or fig.median() is None:
        return None, ""
    base = (seq if goal.key.startswith("warm_") else meta).get(f"baseline_{key}")
    note = f"baseline {base.median():.3g}" if base and base.median() is not None else ""
    return fig.median(), note


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
    p.add_argument("--results", type=Path, default=RESULTS, help="JSON lines appended here")
    p.add_argument("--smoke", action="store_true",
                   help="CI: 300 entries, 2 x 4 MiB, 1 run, a 4 ms RTT (~15 s)")
    args = p.parse_args(argv)
    if args.smoke:
        args.entries, args.files, args.file_mib, args.runs = 300, 2, 4, 1
        args.delay_ms = args.delay_ms or 2.0
        args.max_seconds = min(args.max_seconds, 180.0)
    return args


def report(run: Run, head: dict[str, Any], error: str | None) -> dict[str, Any]:
    tables = {title: print_table(title, figs) for title, figs in run.results.items()}
    rtt = round(2 * run.args.delay_ms)
    grades = bl.grade(GOALS, [rtt], lambda g, r: goal_value(run, g, r))
    graded = bl.print_goals(["Foundation", "Large files and the namespace"], SENTENCES, grades)
    return head | {
        "read_method": f"python readinto, {READ_BUFFER // MIB} MiB buffer",
        "config": vars(run.args),
        "figures": {part: {k: f.summary() for k, f in figs.items()}
                    for part, figs in run.results.items()},
        "tables": tables, "graded": graded, "grades": bl.grades_json(grades),
        "unmounts": run.unmounts, "problems": run.problems, "error": error,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench_foundation: needs root (FUSE allow_other, drop_caches)", file=sys.stderr)
        return 2
    head = bl.run_info("bench_foundation.py")  # before anything is written into the tree
    args.work_dir.mkdir(parents=True, exist_ok=True)
    run = Run(args, Path(tempfile.mkdtemp(dir=args.work_dir, prefix="run-")),
              bl.Deadline(args.max_seconds))
    error = None
    try:
        if args.only in (None, "metadata"):
            bench_metadata(run)
        if args.only in (None, "seqread"):
            bench_seqread(run)
    except (bl.BenchError, subprocess.SubprocessError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        print(f"bench_foundation: error: {error}", file=sys.stderr)
    finally:
        bl.save_record(args.results, report(run, head, error))
        if args.keep:
            print(f"kept logs and caches in {run.work}")
        else:
            shutil.rmtree(run.work, ignore_errors=True)
    for problem in run.problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if error or run.problems else 0


if __name__ == "__main__":
    sys.exit(main())
