#!/usr/bin/env python3
"""Cold runs of shards over the long link: the figures of "Large files and the namespace", item 2.

A WebDataset-style dataset (``--shards`` files of ``--shard-mib`` MiB, random bytes, an xxh3
manifest) is served by hubd behind the long-link emulator (benchmarks/longlink.py: one-way delay
RTT/2, a shared ``--rate-mbit`` cap, a 4 MiB window per connection). For each RTT, side by side
in one run, each pass on a fresh mount with an empty cache behind a fresh emulator, page cache
dropped first:

- **one**: one reader reads every shard in name order (Python ``readinto``, 1 MiB buffer);
- **four**: 4 reader processes, reader i reads shards i, i+4, ... in order;
- **stop**: one reader reads the first shard whole and stops; after the link has been quiet
  for a second, the bytes the link carried beyond that shard are the overshoot. It is graded
  against a bound the benchmark computes from what it configured, never from the spoke's
  gauges: the prefetcher's documented spill rule (spokefs/read/prefetcher.py: past the end of
  the file a reader is in, at most twice the link's bandwidth-delay product, never more
  than the 256 MiB window, plus one request) with the link's cap and RTT, 2 x cap x RTT
  (at most 256 MiB) + 4 MiB, and at most the bytes after the shard read. The spoke's own
  spill gauge is recorded beside it, for information.

Every byte read is checked against the manifest. Throughput is measured at the link: the
bytes the emulator delivered between the start of the read and its last byte (its
time-stamped counters, benchlib.LinkSeries), over that time, as a fraction of the cap (the
readers' own rate is printed next to it); link bytes per byte read count until 1 s after.
With ``--baseline-src DIR`` the same passes run with the spoke of another checkout (e.g. a
worktree of an older commit) in the same run, so the two are compared on the same machine at
the same moment.

Prints a table per RTT and the goals graded, and appends one JSON line (with the commit and
whether the tree was dirty) to benchmarks/results/shards.jsonl.

    python3 benchmarks/bench_shards.py [--rtts 60,900] [--runs 3] [--shards 8]
        [--shard-mib 256] [--modes one,four,stop] [--baseline-src DIR] [--quick]

Default run on a 2-core VM: ~15 min per run of all passes with a baseline (2 GiB per pass at
1 Gbit/s is 17 s); ``--quick``: 1 run, 8 x 64 MiB.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import xxhash
from benchlib import (
    MIB,
    REPO,
    BenchError,
    CpuMeter,
    Deadline,
    Figure,
    Goal,
    Hub,
    LinkSeries,
    LinkSpec,
    append_jsonl,
    drop_caches,
    format_grades,
    grade,
    link_counters,
    markdown_table,
    open_link,
    run_hub,
    run_info,
    scrape,
    spoke_mount,
)

RESULTS = REPO / "benchmarks" / "results" / "shards.jsonl"
MODES = ("one", "four", "stop")
READERS_FOUR = 4
QUIET_S = 1.0  # the link counts no more bytes for this long: the overshoot has landed

# The issue "Large files and the namespace", its goal for cold shards word for word, and its
# item 2 ("A reader that stops early leaves at most a bounded overshoot (state the bound).
# Measure over a multi-shard dataset (e.g. 8 x 256 MiB shards read in order by one reader, and
# by 4 readers each on its own shard)"): both reader layouts are graded on the goal. The
# stated overshoot bound is the benchmark's own arithmetic (``overshoot_bound``): the
# prefetcher's documented spill rule applied to the link the benchmark configured.
COLD = ("Cold shards over the emulated link: >= 0.95 of the cap at 60 ms and >= 0.8 at 900 ms, "
        "counted at the link over the whole dataset; link bytes <= 1.02 per byte read.")
OVERSHOOT = "A reader that stops early leaves at most a bounded overshoot (state the bound)."
COLD_23 = ("One shard reader: >= 0.95 of the cap at 60 ms and >= 0.85 at 900 ms; four readers "
           "the same; link bytes <= 1.02 per byte read.")
GOALS = [
    Goal(COLD, "one_link_ratio", "one reader, shards in order: link MB/s / cap", ">=", 0.95,
         (60,)),
    Goal(COLD, "one_link_ratio", "one reader, shards in order: link MB/s / cap", ">=", 0.8,
         (900,)),
    Goal(COLD, "four_link_ratio", "4 readers, each on its own shards: link MB/s / cap",
         ">=", 0.95, (60,)),
    Goal(COLD, "four_link_ratio", "4 readers, each on its own shards: link MB/s / cap",
         ">=", 0.8, (900,)),
    Goal(COLD, "one_link_bytes_per_byte", "one reader: link bytes / bytes read", "<=", 1.02),
    Goal(COLD, "four_link_bytes_per_byte", "4 readers: link bytes / bytes read", "<=", 1.02),
    Goal(OVERSHOOT, "stop_overshoot_of_bound",
         "stop: bytes past the shard read / (2 x cap x RTT, <= 256 MiB, + 4 MiB)", "<=", 1.0),
    # issue 23 ("The cold path at 10 Gbit/s") raised the bar at 900 ms; judge it with
    # --shards 16, so that the start does not dominate
    Goal(COLD_23, "one_link_ratio", "issue 23: one reader: link MB/s / cap", ">=", 0.95,
         (60,)),
    Goal(COLD_23, "one_link_ratio", "issue 23: one reader: link MB/s / cap", ">=", 0.85,
         (900,)),
    Goal(COLD_23, "four_link_ratio", "issue 23: four readers: link MB/s / cap", ">=", 0.95,
         (60,)),
    Goal(COLD_23, "four_link_ratio", "issue 23: four readers: link MB/s / cap", ">=", 0.85,
         (900,)),
]
# The spill rule's constants, as spokefs/read/prefetcher.py's docstring and spokefs/config.py's
# PrefetchConfig state them (defaults; this script passes no prefetch flags): what is read
# past the end of the reader's file is at most twice the link's bandwidth-delay product and
# never more than the window (window_max_bytes, 256 MiB), plus one request (request_bytes,
# 3.75 MiB: counted here as 4 MiB).
SPILL_WINDOW_MAX = 256 * MIB
SPILL_REQUEST = 4 * MIB


def overshoot_bound(spec: LinkSpec, shard_bytes: int, shards: int) -> int:
    """The stated overshoot bound from the link's configured cap and RTT (never from the
    spoke's gauges): min(2 x cap x RTT, 256 MiB) + one request, and never more than the bytes
    after the shard read (the dataset's rest)."""
    bdp = spec.cap_bytes_per_s * spec.rtt_ms / 1000
    return int(min(min(2 * bdp, SPILL_WINDOW_MAX) + SPILL_REQUEST, (shards - 1) * shard_bytes))


def ensure_shards(work: Path, count: int, mib: int) -> tuple[Path, dict[str, int]]:
    """The dataset under ``work`` (made once): name -> xxh3_64 of its bytes."""
    root = work / f"shards-{count}x{mib}"
    manifest = root.parent / f"{root.name}.manifest"
    if manifest.exists():
        sums = {}
        for line in manifest.read_text().splitlines():
            name, digest = line.split()
            sums[name] = int(digest, 16)
        return root, sums
    root.mkdir(parents=True, exist_ok=True)
    sums = {}
    for i in range(count):
        name = f"shard-{i:06}.tar"
        h = xxhash.xxh3_64()
        with open(root / name, "wb") as f:
            for _ in range(mib):
                block = os.urandom(MIB)
                h.update(block)
                f.write(block)
        sums[name] = h.intdigest()
    manifest.write_text("".join(f"{n} {d:016x}\n" for n, d in sorted(sums.items())))
    return root, sums


def _read_files(paths: list[str], out: Any) -> None:
    """A reader process: each file whole, in order; (bytes, {name: xxh3}) to ``out``."""
    buf = bytearray(MIB)
    view = memoryview(buf)
    total, sums = 0, {}
    for path in paths:
        h = xxhash.xxh3_64()
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
                total += n
        sums[Path(path).name] = h.intdigest()
    out.put((total, sums))


def read_in_processes(groups: list[list[Path]]) -> tuple[int, dict[str, int]]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_read_files, args=([str(p) for p in g], out)) for g in groups]
    for p in procs:
        p.start()
    total, sums = 0, {}
    for _ in procs:
        n, s = out.get()
        total += n
        sums |= s
    for p in procs:
        p.join()
        if p.exitcode:
            raise BenchError(f"a reader process exited {p.exitcode}")
    return total, sums


def wait_quiet(link: Any, timeout_s: float) -> int:
    """The link's bytes_down once it has not moved for ``QUIET_S``."""
    end = time.monotonic() + timeout_s
    last, since = link_counters(link).bytes_down, time.monotonic()
    while time.monotonic() < end:
        now = link_counters(link).bytes_down
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= QUIET_S:
            break
    return last


def one_pass(args: argparse.Namespace, work: Path, deadline: Deadline, hub: Hub,
             spec: LinkSpec, mode: str, src: Path, names: list[str],
             sums: dict[str, int]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=work, prefix=f"{mode}-") as tmp:
        t = Path(tmp)
        with open_link(hub.port, spec) as link, \
                spoke_mount(f"http://127.0.0.1:{link.port}", t / "mnt", t / "cache",
                            t / "spoke.log", deadline, cache_size=args.cache_size,
                            src=src) as m:
            shards = [m.path / n for n in names]
            if mode == "one":
                groups = [shards]
            elif mode == "four":
                groups = [shards[i::READERS_FOUR] for i in range(READERS_FOUR)]
            else:
                groups = [shards[:1]]
            drop_caches()
            series = LinkSeries(link).start()  # the rate is read at the link, over the read
            before = series.rows[0][1]
            t0, started = time.time(), time.perf_counter()
            # both sides' CPU over the read (issue 23: with every result); the spoke's
            # with its --workers process
            meter = CpuMeter({"spoke": m.pid, "hub": hub.proc.pid})
            nbytes, got = read_in_processes(groups)
            wall, t1 = time.perf_counter() - started, time.time()
            cpu = meter.stop()["cpu_s"]
            if mode == "stop":
                # the spoke's own view (for information only): its spill limit and measured
                # bandwidth-delay product when the reader stopped, and after; the larger
                gauges = ("spokefs_prefetch_spill_limit_bytes", "spokefs_link_bdp_bytes")
                at_stop = scrape(m.metrics_url, gauges)
                down = wait_quiet(link, 2 * spec.rtt_ms / 1000 + 30) - before
                after = scrape(m.metrics_url, gauges)
                spill = {k: max(at_stop.get(k, 0), after.get(k, 0)) for k in gauges}
            series.stop(settle_s=1.0)  # bytes still on their way count as carried
            in_read = series.delivered(t0, t1)
            if mode != "stop":
                down = series.rows[-1][1] - before
        wrong = [n for n, d in got.items() if sums[n] != d]
        if wrong:
            raise BenchError(f"{mode}: wrong bytes in {', '.join(wrong)}")
    out = {"wall_s": wall, "bytes_read": nbytes, "link_bytes": down,
           "link_bytes_during_read": in_read,
           "reader_mb_s": nbytes / wall / 1e6, "link_mb_s": in_read / wall / 1e6,
           "link_ratio": in_read / wall / spec.cap_bytes_per_s,
           # not graded: the second half of the read, once the start (a demand miss, then
           # the window's first round trips: 2-3 s at 900 ms) is behind it
           "second_half_link_ratio": series.rate(t0 + (t1 - t0) / 2, t1) / spec.cap_bytes_per_s,
           "link_bytes_per_byte": down / nbytes,
           "spoke_cpu_s_per_gb": cpu["spoke"] / (nbytes / 1e9),
           "hub_cpu_s_per_gb": cpu["hub"] / (nbytes / 1e9)}
    if mode == "stop":
        # graded: the benchmark's own bound; the spoke's gauge + one request, for information
        bound = overshoot_bound(spec, args.shard_mib * MIB, args.shards)
        gauge = spill.get("spokefs_prefetch_spill_limit_bytes") or None  # 0: not scraped
        gauge_bound = gauge + SPILL_REQUEST if gauge is not None else None
        out |= {"overshoot_bytes": down - nbytes, "overshoot_bound_bytes": bound,
                "overshoot_of_bound": (down - nbytes) / bound,
                "overshoot_bound_of_shard": bound / (args.shard_mib * MIB),
                "spoke_bdp_bytes": spill.get("spokefs_link_bdp_bytes", 0),
                "link_bdp_bytes": spec.cap_bytes_per_s * spec.rtt_ms / 1000}
        if gauge_bound is not None:
            out |= {"gauge_bound_bytes": gauge_bound,
                    "overshoot_of_gauge_bound": (down - nbytes) / gauge_bound}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rtts", default="60,900", help="RTTs in ms (60,900)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--shard-mib", type=int, default=256)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rate-mbit", type=float, default=1000.0)
    p.add_argument("--cache-size", default="8G")
    p.add_argument("--baseline-src", type=Path, help="another checkout's spoke, side by side")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/spokefs-bench"))
    p.add_argument("--max-seconds", type=float, default=3600.0)
    p.add_argument("--quick", action="store_true", help="1 run of 8 x 64 MiB")
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.runs, args.shard_mib = 1, 64
    rtts = [int(r) for r in args.rtts.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES]:
        p.error(f"unknown mode {bad[0]!r} (one of {', '.join(MODES)})")
    systems = [("spokefs", REPO)] + ([("baseline", args.baseline_src.resolve())]
                                     if args.baseline_src else [])
    deadline = Deadline(args.max_seconds)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    root, sums = ensure_shards(args.work_dir, args.shards, args.shard_mib)
    names = sorted(sums)
    figs: dict[tuple[str, int, str, str], Figure] = {}
    record: dict[str, Any] = run_info("bench_shards.py") | {
        "shards": args.shards, "shard_mib": args.shard_mib, "rate_mbit": args.rate_mbit,
        "baseline_src": str(args.baseline_src) if args.baseline_src else None,
        "overshoot_bound_rule": "min(2 x cap x RTT, 256 MiB) + 4 MiB, at most the bytes after "
                                "the shard (the link's configured cap and RTT; the spoke's "
                                "gauge is gauge_bound_bytes, not graded)"}
    work = Path(tempfile.mkdtemp(prefix="bench-shards-", dir=args.work_dir))
    print(f"{args.shards} x {args.shard_mib} MiB shards in {root}; work dir {work}", flush=True)
    with run_hub(root, work / "hubd.log", deadline) as hub:
        for run in range(args.runs):
            for rtt in rtts:
                spec = LinkSpec(rtt, args.rate_mbit)
                for mode in modes:
                    for system, src in systems:
                        out = one_pass(args, work, deadline, hub, spec, mode, src, names,
                                       sums)
                        for k, v in out.items():
                            figs.setdefault((system, rtt, mode, k), Figure()).add(v)
                        print(f"  run {run + 1} {rtt} ms {mode:4} {system:8}: link "
                              f"{out['link_mb_s']:.0f} MB/s ({out['link_ratio']:.2f} of cap; "
                              f"second half {out['second_half_link_ratio']:.2f}), "
                              f"reader {out['reader_mb_s']:.0f} MB/s, link bytes/byte "
                              f"{out['link_bytes_per_byte']:.3f}, CPU-s/GB spoke "
                              f"{out['spoke_cpu_s_per_gb']:.2f} hub {out['hub_cpu_s_per_gb']:.2f}"
                              + (f", overshoot {out['overshoot_bytes'] / MIB:.1f} MiB"
                                 if mode == "stop" else ""), flush=True)
    record["figures"] = {f"{s}/{r}/{m}/{k}": f.summary() for (s, r, m, k), f in figs.items()}

    def fig(system: str, rtt: int, mode: str, key: str, fmt: str = "{:.2f}") -> str:
        f = figs.get((system, rtt, mode, key))
        return f.text(fmt) if f else "-"

    for rtt in rtts:
        rows = []
        for mode in modes:
            keys = [("link_ratio", "{:.2f}"), ("second_half_link_ratio", "{:.2f}"),
                    ("link_mb_s", "{:.0f}"), ("reader_mb_s", "{:.0f}"),
                    ("link_bytes_per_byte", "{:.3f}"), ("spoke_cpu_s_per_gb", "{:.2f}"),
                    ("hub_cpu_s_per_gb", "{:.2f}")]
            if mode == "stop":
                keys = [("overshoot_bytes", "{:.0f}"), ("overshoot_bound_bytes", "{:.0f}"),
                        ("overshoot_of_bound", "{:.2f}"), ("gauge_bound_bytes", "{:.0f}"),
                        ("overshoot_of_gauge_bound", "{:.2f}")]
            for key, fmt in keys:
                scale = 1 / MIB if key.endswith("_bytes") else 1
                row = [mode, key + (" (MiB)" if scale != 1 else "")]
                for system, _ in systems:
                    f = figs.get((system, rtt, mode, key))
                    if f is None:
                        row.append("-")
                    else:
                        row.append(Figure([v * scale for v in f.samples]).text(fmt))
                rows.append(row)
        print(f"\nRTT {rtt} ms, {args.rate_mbit:g} Mbit/s cap, medians (min-max) of "
              f"{args.runs} run(s):")
        print(markdown_table(["mode", "figure"] + [s for s, _ in systems], rows))

    def value_of(goal: Goal, rtt: int) -> tuple[float | None, str]:
        mode, key = goal.key.split("_", 1)
        f = figs.get(("spokefs", rtt, mode, key))
        base = figs.get(("baseline", rtt, mode, key))
        note = f"baseline {base.median():.3f}" if base and base.median() is not None else ""
        if mode == "stop" and f:
            bound = figs[("spokefs", rtt, mode, "overshoot_bound_bytes")].median() or 0
            gauge = figs.get(("spokefs", rtt, mode, "gauge_bound_bytes"))
            note = "; ".join(x for x in (
                f"arithmetic bound {bound / MIB:.1f} MiB",
                f"spoke's gauge + 4 MiB {gauge.median() / MIB:.1f} MiB, not graded"
                if gauge and gauge.median() is not None else "", note) if x)
        return (f.median() if f else None), note

    grades = grade(GOALS, rtts, value_of)
    record["grades"] = [{"goal": g.goal.issue, "figure": g.goal.what, "rtt": g.rtt,
                         "value": g.value, "verdict": g.verdict, "note": g.note}
                        for g in grades]
    print("\n" + format_grades(grades))
    append_jsonl(args.results, record)
    print(f"\nappended to {args.results} (commit {str(record['commit'])[:7]}"
          f"{', dirty tree' if record['dirty'] else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
