#!/usr/bin/env python3
"""Failover between two hub replicas mid-epoch, over an emulated long link.

Two hubd processes export one directory, each behind its own ``longlink.py`` (``--rtt-ms``,
default 60 ms, 1 Gbit/s); one spoke mounts both (``spokefs mount LINK_A,LINK_B``). Readers
(``--readers`` threads) go through a shuffled epoch of ``--files`` files, reading each file
whole past the kernel's page cache and comparing it with the source, byte for byte. When
``--kill-at`` of the epoch is done, hub A gets SIGKILL (its link stays up, as a far
machine's network would: new connections are accepted and then closed). Measured per run:

- **stall**: the longest read among those in flight at the kill or started in the
  ``--window`` seconds after it (the failover gap a reader sees), next to the median read
  before the kill; not measured (and the run not graded on it) if the spoke never failed
  over, i.e. everything was cached before the kill;
- **failed reads** and **wrong bytes** (every byte compared with the source);
- **lost cache**: a second pass over the whole epoch after it ends: blocks fetched again
  (``spokefs_block_misses_total``) and bytes down both links (at the emulators; the epoch
  itself is shown per link, A before the kill and B after, next to the epoch's size); the
  namespace must also go on without a snapshot (``snapshot loaded`` once in the spoke's log);
- **back**: hub A restarted on its port; seconds until the spoke uses it again
  (``spokefs_hub_origin``).

Medians of ``--runs`` runs; graded against issue 11's goal. Appends one JSON line to
benchmarks/results/replicas.jsonl.

    python3 benchmarks/bench_replicas.py [--rtt-ms 60] [--runs 3] [--files 96] [--no-prefetch]
        [--work-dir /var/tmp] [--results F] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import benchlib as bl

GOAL_TEXT = ("Failover between two hubs mid-epoch: no read fails for longer than the hub "
             "deadline, no cache entry lost, 0 wrong bytes.")
HUB_DEADLINE_S = 60.0  # spokefs's default --hub-deadline: the bar for the stall
GOALS = [
    bl.Goal(GOAL_TEXT, "failed", "reads that failed", "<=", 0),
    bl.Goal(GOAL_TEXT, "stall_s", "longest read in flight at the kill or started in the window "
         "after it (s)", "<=", HUB_DEADLINE_S),
    bl.Goal(GOAL_TEXT, "refetched_blocks", "blocks fetched again in a second pass over the "
         "epoch", "<=", 0),
    bl.Goal(GOAL_TEXT, "snapshots_after_mount", "full snapshots taken after the mount", "<=", 0),
    bl.Goal(GOAL_TEXT, "wrong_bytes", "bytes that differ from the source", "<=", 0),
]


def make_export(root: Path, files: int, seed: int) -> list[str]:
    """``files`` files of 1.5 to 4 MiB of random bytes in 8 directories: above the spoke's
    small-file size (1 MiB), so directory fills do not fetch the epoch ahead of the readers
    and reads after the kill still need a hub."""
    rnd = random.Random(seed)
    names = []
    for i in range(files):
        rel = f"shard{i % 8}/sample{i:05d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rnd.randbytes(rnd.randrange(3 * bl.MIB // 2, 4 * bl.MIB)))
        names.append(rel)
    return names


@dataclass
class Epoch:
    """Reader threads over a file list; each read timed and compared with the source."""

    mnt: Path
    src: Path
    files: list[str]
    readers: int
    reads: list[tuple[float, float]] = field(default_factory=list)  # (start, end), monotonic
    failed: list[str] = field(default_factory=list)
    wrong_bytes: int = 0
    done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, at_done: int = -1, action: Any = None) -> None:
        queue = list(self.files)

        def one(rel: str) -> None:
            started = time.monotonic()
            try:
                got = read_past_page_cache(self.mnt / rel)
            except OSError as exc:
                with self.lock:
                    self.failed.append(f"{rel}: {exc}")
                return
            ended = time.monotonic()
            want = (self.src / rel).read_bytes()
            wrong = 0 if got == want else differing_bytes(got, want)
            with self.lock:
                self.reads.append((started, ended))
                self.wrong_bytes += wrong
                self.done += 1
                fire = self.done == at_done
            if fire:
                action()

        def reader() -> None:
            while True:
                with self.lock:
                    if not queue:
                        return
                    rel = queue.pop()
                one(rel)

        threads = [threading.Thread(target=reader, daemon=True) for _ in range(self.readers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
            if t.is_alive():
                raise RuntimeError("a reader hung for 600 s")


def read_past_page_cache(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        parts = []
        while chunk := os.read(fd, bl.MIB):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def differing_bytes(got: bytes, want: bytes) -> int:
    return sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))


@contextlib.contextmanager
def hub_on(root: Path, port: int, log: Path, deadline: bl.Deadline) -> Iterator[bl.Proc]:
    """hubd on a fixed loopback port (so a restart keeps the URL)."""
    proc = bl.Proc("hubd", [sys.executable, "-m", "hubd", "serve", str(root), "--listen",
                         f"127.0.0.1:{port}", "--log-level", "WARNING"], log)
    try:
        proc.wait_line(bl.HUB_READY_RE, deadline.timeout(120))
        yield proc
    finally:
        proc.stop()


def one_run(args: argparse.Namespace, work: Path, src: Path, names: list[str], run: int,
            deadline: bl.Deadline) -> dict[str, Any]:
    spec = bl.LinkSpec(args.rtt_ms)
    port_a, port_b = bl.free_port(), bl.free_port()
    order = list(names)
    random.Random(run).shuffle(order)
    with contextlib.ExitStack() as stack:
        hub_a = stack.enter_context(hub_on(src, port_a, work / f"hub-a-{run}.log", deadline))
        stack.enter_context(hub_on(src, port_b, work / f"hub-b-{run}.log", deadline))
        link_a = stack.enter_context(bl.open_link(port_a, spec))
        link_b = stack.enter_context(bl.open_link(port_b, spec))
        url_a, url_b = f"http://127.0.0.1:{link_a.port}", f"http://127.0.0.1:{link_b.port}"
        log = work / f"spoke-{run}.log"
        mount = stack.enter_context(bl.spoke_mount(
            f"{url_a},{url_b}", work / f"mnt-{run}", work / f"cache-{run}", log, deadline,
            extra_args=["--no-prefetch"] if args.no_prefetch else []))
        killed: list[float] = []

        def kill_a() -> None:
            killed.append(time.monotonic())
            hub_a.popen.kill()

        links_start = [bl.link_counters(link_a), bl.link_counters(link_b, fresh=False)]
        epoch = Epoch(mount.path, src, order, args.readers)
        epoch.run(int(len(order) * args.kill_at), kill_a)
        hub_a.wait(10)
        assert killed, "hub A was never killed"
        kill_t = killed[0]
        before = [e - s for s, e in epoch.reads if e < kill_t]
        around = [e - s for s, e in epoch.reads if s <= kill_t + args.window and e >= kill_t]

        misses_before = bl.scrape(mount.metrics_url).get("spokefs_block_misses_total", 0.0)
        links_before = [bl.link_counters(link_a), bl.link_counters(link_b, fresh=False)]
        again = Epoch(mount.path, src, order, args.readers)
        again.run()
        misses_after = bl.scrape(mount.metrics_url).get("spokefs_block_misses_total", 0.0)
        links_after = [bl.link_counters(link_a), bl.link_counters(link_b, fresh=False)]
        link_down = sum(a.minus(b).bytes_down for a, b in zip(links_after, links_before,
                                                                  strict=True))
        epoch_down = [a.minus(b).bytes_down for a, b in zip(links_before, links_start,
                                                             strict=True)]
        metrics = bl.scrape(mount.metrics_url)
        failovers = metrics.get('spokefs_hub_failovers_total{reason="failed"}', 0.0)

        back_s = None
        restarted = time.monotonic()
        stack.enter_context(hub_on(src, port_a, work / f"hub-a-{run}-again.log", deadline))
        key = f'spokefs_hub_origin{{url="{url_a}"}}'
        while time.monotonic() - restarted < 30:
            if bl.scrape(mount.metrics_url).get(key) == 1.0:
                back_s = time.monotonic() - restarted
                break
            time.sleep(0.1)
        snapshots = log.read_text(errors="replace").count("snapshot loaded")
    return {
        "run": run, "files": len(order), "reads": len(epoch.reads) + len(again.reads),
        "failed": len(epoch.failed) + len(again.failed),
        "failures": (epoch.failed + again.failed)[:5],
        "wrong_bytes": epoch.wrong_bytes + again.wrong_bytes,
        "read_p50_before_s": statistics.median(before) if before else None,
        "read_max_before_s": max(before) if before else None,
        # no failover, no gap measured: the epoch was cached before the kill
        "stall_s": max(around) if around and failovers else None,
        "reads_around_kill": len(around),
        "refetched_blocks": misses_after - misses_before, "second_pass_link_bytes": link_down,
        "epoch_link_bytes_a": epoch_down[0], "epoch_link_bytes_b": epoch_down[1],
        "epoch_file_bytes": sum((src / rel).stat().st_size for rel in order),
        "failovers": failovers, "back_s": back_s,
        "snapshots_after_mount": snapshots - 1,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt-ms", type=float, default=60.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--files", type=int, default=96)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--no-prefetch", action="store_true", help="spokefs --no-prefetch")
    ap.add_argument("--kill-at", type=float, default=0.3, help="fraction of the epoch")
    ap.add_argument("--window", type=float, default=5.0,
                    help="seconds after the kill whose reads count for the stall")
    ap.add_argument("--max-seconds", type=float, default=1800)
    ap.add_argument("--work-dir", type=Path, default=Path("/var/tmp"),
                    help="where the data set, caches and mounts go (removed afterwards)")
    ap.add_argument("--results", type=Path, default=bl.REPO / "benchmarks/results/replicas.jsonl")
    ap.add_argument("--smoke", action="store_true",
                    help="CI: 12 files, 1 run, 4 ms RTT, no prefetch (so reads after the kill "
                         "need a hub), ~20 s")
    args = ap.parse_args(argv)
    if args.smoke:
        args.files, args.runs, args.rtt_ms, args.no_prefetch = 12, 1, 4.0, True
        args.max_seconds = min(args.max_seconds, 180.0)
    return args


def main() -> None:
    args = parse_args()
    head = bl.run_info("bench_replicas.py")  # before anything is written into the tree
    deadline = bl.Deadline(args.max_seconds)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-replicas-", dir=args.work_dir))
    try:
        src = work / "export"
        names = make_export(src, args.files, seed=1)
        runs = []
        for run in range(args.runs):
            runs.append(one_run(args, work, src, names, run, deadline))
            print(f"run {run}: {runs[-1]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = ("stall_s", "read_p50_before_s", "read_max_before_s", "failed", "wrong_bytes",
            "refetched_blocks", "second_pass_link_bytes", "epoch_link_bytes_a",
            "epoch_link_bytes_b", "epoch_file_bytes", "failovers", "back_s",
            "snapshots_after_mount")
    figures = {k: bl.Figure() for k in keys}
    for r in runs:
        for k in keys:
            figures[k].add(r[k])
    for k in keys:
        print(f"{k:>24}: {figures[k].text('{:.3f}')}")

    def value_of(goal: bl.Goal, _rtt: int) -> tuple[float | None, str]:
        f = figures[goal.key]
        return (max(f.samples) if f.samples else None), "worst of the runs"

    grades = bl.grade(GOALS, [int(args.rtt_ms)], value_of)
    bl.print_goals(["issue 11"], [GOAL_TEXT], grades)
    bl.save_record(args.results, {
        **head, "rtt_ms": args.rtt_ms, "files": args.files, "prefetch": not args.no_prefetch,
        "readers": args.readers, "kill_at": args.kill_at, "window_s": args.window,
        "runs": runs, "summary": {k: f.summary() for k, f in figures.items()},
        "grades": bl.grades_json(grades),
    })


if __name__ == "__main__":
    main()
