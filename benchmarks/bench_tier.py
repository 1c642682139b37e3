"""bench_tier: three spokes in a region through a regional tier (Debian's nginx with
deploy/regional/nginx.conf.template) against one spoke alone, over one emulated far link.

    python3 benchmarks/bench_tier.py [--quick] [--dataset-mb 1024] [--rtt-ms 60] [--runs 3]
        [--rate-mbit 1000] [--work-dir /tmp/spokefs-tier] [--max-seconds S] [--keep]

The dataset (made once in the work dir, fixed seed): 60 % in shards of 64 MiB read start to
end, 40 % in small files (~110 KiB, 20 class directories) read in a shuffled order, like a
training epoch. Each run, side by side, cold (fresh caches, kernel page cache dropped):

- **lone**: hubd behind the long-link emulator, one spoke straight to it;
- **tier**: hubd behind the emulator, nginx (fresh cache) in front of the emulator, three
  spokes mounted with ``--tier``, all three reading the whole dataset at once.

Each spoke reads with the same reader: the shards by 4 threads, then the small files by 8
threads (a DataLoader's workers), every byte checked against the source (sha256). Figures:

- far-link bytes / dataset: the emulator's bytes toward the spokes (``bytes_down``) while the
  three spokes read, over the dataset's bytes;
- each spoke's cold throughput / the lone spoke's (dataset bytes / its epoch time), for the
  slowest of the three spokes.

Medians over ``--runs`` (min-max), graded against issue 11's goal, printed as a table and
appended as a JSON line to benchmarks/results/tier.jsonl. Needs root (FUSE, drop_caches)
and nginx with ngx_http_slice_module.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import random
import shutil
import string
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import benchlib as bl

TEMPLATE = bl.REPO / "deploy" / "regional" / "nginx.conf.template"
RESULTS = bl.HERE / "results" / "tier.jsonl"
SHARD_BYTES = 64 * bl.MIB
SMALL_MEAN = 110 * bl.KIB
CLASSES = 20

GOALS = [
    bl.Goal("3 spokes reading the same 1 GB dataset through the tier: far-link bytes <= "
            "1.05 x the dataset", "far_ratio", "far-link bytes / dataset, 3 spokes via nginx",
            "<=", 1.05),
    bl.Goal("each spoke's cold throughput no worse than a lone spoke's", "throughput_ratio",
            "slowest of 3 spokes' cold throughput / lone spoke's", ">=", 1.0),
]


def make_dataset(root: Path, total: int) -> list[Path]:
    """The files (relative), made once per size: shards then class directories."""
    marker = root / f".complete-{total}"
    if not marker.exists():
        shutil.rmtree(root, ignore_errors=True)
        rnd = random.Random(1)
        (root / "shards").mkdir(parents=True)
        shard_total = int(total * 0.6)
        for i in range(max(1, shard_total // SHARD_BYTES)):
            (root / "shards" / f"shard-{i:04}.tar").write_bytes(
                rnd.randbytes(min(SHARD_BYTES, shard_total)))
        left, n = total - shard_total, 0
        while left > 0:
            d = root / "train" / f"class{n % CLASSES:03}"
            d.mkdir(parents=True, exist_ok=True)
            size = min(left, rnd.randrange(SMALL_MEAN // 2, SMALL_MEAN * 3 // 2))
            (d / f"{n:07}.jpg").write_bytes(rnd.randbytes(size))
            left -= size
            n += 1
        marker.touch()
    return sorted(p.relative_to(root) for p in root.rglob("*")
                  if p.is_file() and not p.name.startswith("."))


def digests(root: Path, files: list[Path]) -> dict[Path, bytes]:
    return {f: hashlib.sha256((root / f).read_bytes()).digest() for f in files}


def read_epoch(mnt: Path, files: list[Path], want: dict[Path, bytes], seed: int) -> float:
    """Read every file through the mount like a training epoch; seconds taken."""
    shards = [f for f in files if f.parts[0] == "shards"]
    small = [f for f in files if f.parts[0] != "shards"]
    random.Random(seed).shuffle(small)

    def one(rel: Path) -> None:
        h = hashlib.sha256()
        with open(mnt / rel, "rb") as f:
            while chunk := f.read(bl.MIB):
                h.update(chunk)
        if h.digest() != want[rel]:
            raise bl.BenchError(f"wrong bytes in {rel} through {mnt}")

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, shards))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, small))
    return time.perf_counter() - started


@contextlib.contextmanager
def nginx_tier(upstream_port: int, work: Path, deadline: bl.Deadline) -> Iterator[str]:
    """nginx from the shipped template in front of 127.0.0.1:upstream_port; yields its URL."""
    nginx = bl.which("nginx") or "/usr/sbin/nginx"
    shutil.rmtree(work, ignore_errors=True)
    (work / "cache").mkdir(parents=True)
    port = bl.free_port()
    conf = string.Template(TEMPLATE.read_text()).safe_substitute(
        HUB=f"127.0.0.1:{upstream_port}", LISTEN=f"127.0.0.1:{port}",
        CACHE_DIR=str(work / "cache"), CACHE_MAX_SIZE="64g", KEYS_ZONE_SIZE="64m")
    (work / "nginx.conf").write_text(conf)
    argv = [nginx, "-e", "stderr", "-p", str(work), "-c", str(work / "nginx.conf"), "-g",
            f"daemon off; pid {work / 'nginx.pid'}; user root;"]
    proc = bl.Proc("nginx", argv, work / "nginx.log")
    try:
        bl.wait_port(port, proc, deadline.timeout(30))
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def lone_run(data: Path, files: list[Path], want: dict[Path, bytes], link_spec: bl.LinkSpec,
             work: Path, deadline: bl.Deadline, seed: int) -> dict[str, float]:
    with bl.run_hub(data, work / "hub.log", deadline) as hub, \
            bl.open_link(hub.port, link_spec) as link:
        bl.drop_caches()
        with bl.spoke_mount(f"http://127.0.0.1:{link.port}", work / "mnt-lone",
                            work / "cache-lone", work / "spoke-lone.log", deadline) as m:
            before = bl.link_counters(link)
            seconds = read_epoch(m.path, files, want, seed)
            moved = bl.link_counters(link).minus(before).bytes_down
    return {"seconds": seconds, "far_bytes": moved}


def tier_run(data: Path, files: list[Path], want: dict[Path, bytes], link_spec: bl.LinkSpec,
             work: Path, deadline: bl.Deadline, seed: int) -> dict[str, object]:
    with contextlib.ExitStack() as stack:
        hub = stack.enter_context(bl.run_hub(data, work / "hub-tier.log", deadline))
        link = stack.enter_context(bl.open_link(hub.port, link_spec))
        tier = stack.enter_context(nginx_tier(link.port, work / "nginx", deadline))
        bl.drop_caches()
        mounts = [stack.enter_context(bl.spoke_mount(
            f"http://127.0.0.1:{link.port}", work / f"mnt-{i}", work / f"cache-{i}",
            work / f"spoke-{i}.log", deadline, extra_args=("--tier", tier)))
            for i in range(3)]
        before = bl.link_counters(link)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            times = list(pool.map(lambda im: read_epoch(im[1].path, files, want, seed + im[0]),
                                  enumerate(mounts)))
        moved = bl.link_counters(link).minus(before).bytes_down
        origins = [bl.scrape(m.metrics_url, ("spokefs_fetched_bytes_total",
                                             "spokefs_tier_fallbacks_total"), sum_labels=False)
                   for m in mounts]
    return {"seconds": times, "far_bytes": moved, "origins": origins}


def clean_work(work: Path) -> None:
    for p in work.glob("cache-*"):
        shutil.rmtree(p, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="256 MB, 1 run")
    p.add_argument("--dataset-mb", type=int, default=None, help="dataset size (1024)")
    p.add_argument("--runs", type=int, default=None, help="runs (3)")
    p.add_argument("--rtt-ms", type=float, default=60.0)
    p.add_argument("--rate-mbit", type=float, default=1000.0)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/spokefs-tier"))
    p.add_argument("--max-seconds", type=float, default=3600.0)
    p.add_argument("--keep", action="store_true", help="keep the dataset and logs")
    args = p.parse_args(argv)
    args.dataset_mb = args.dataset_mb or (256 if args.quick else 1024)
    args.runs = args.runs or (1 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if bl.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        print("bench_tier: nginx is not installed (apt-get install nginx)", file=sys.stderr)
        return 2
    deadline = bl.Deadline(args.max_seconds)
    work = args.work_dir
    data = work / "data"
    total_target = args.dataset_mb * bl.MIB
    files = make_dataset(data, total_target)
    total = sum((data / f).stat().st_size for f in files)
    want = digests(data, files)
    link_spec = bl.LinkSpec(args.rtt_ms, args.rate_mbit)
    far, ratio, lone_mbs, tier_mbs = bl.Figure(), bl.Figure(), bl.Figure(), bl.Figure()
    runs = []
    try:
        for run in range(args.runs):
            clean_work(work)
            lone = lone_run(data, files, want, link_spec, work, deadline, seed=100 + run)
            clean_work(work)
            tier = tier_run(data, files, want, link_spec, work, deadline, seed=200 + run)
            slowest = max(tier["seconds"])  # type: ignore[arg-type]
            far.add(tier["far_bytes"] / total)  # type: ignore[operator]
            ratio.add(lone["seconds"] / slowest)
            lone_mbs.add(total / lone["seconds"] / 1e6)
            tier_mbs.add(total / slowest / 1e6)
            runs.append({"lone": lone, "tier": tier})
            speeds = ", ".join(f"{total / s / 1e6:.0f}" for s in tier["seconds"])  # type: ignore[attr-defined]
            print(f"run {run + 1}: lone {total / lone['seconds'] / 1e6:.0f} MB/s, tier spokes "
                  f"{speeds} MB/s, far link {tier['far_bytes'] / total:.3f} x the dataset "
                  f"(lone: {lone['far_bytes'] / total:.3f})", flush=True)
    except bl.BudgetExhausted as exc:
        print(f"bench_tier: stopped: {exc}", file=sys.stderr)
    finally:
        clean_work(work)
        if not args.keep:
            shutil.rmtree(work / "nginx", ignore_errors=True)
    values = {"far_ratio": far.median(), "throughput_ratio": ratio.median()}
    grades = bl.grade(GOALS, [int(args.rtt_ms)], lambda g, rtt: (values[g.key], ""))
    print()
    print(f"dataset {total / 1e6:.0f} MB ({len(files)} files), {link_spec.describe()}, "
          f"{len(runs)} run(s)")
    print(bl.markdown_table(
        ["figure", "median (min-max)"],
        [["far-link bytes / dataset, 3 spokes via nginx", far.text("{:.3f}")],
         ["slowest tier spoke's cold throughput / lone spoke's", ratio.text("{:.2f}")],
         ["lone spoke, MB/s", lone_mbs.text()],
         ["slowest of 3 tier spokes, MB/s", tier_mbs.text()]]))
    print()
    print(bl.format_grades(grades))
    bl.append_jsonl(RESULTS, {
        **bl.run_info("bench_tier.py"), "dataset_bytes": total, "files": len(files),
        "link": link_spec.describe(), "runs": runs,
        "figures": {"far_ratio": far.summary(), "throughput_ratio": ratio.summary(),
                    "lone_mb_s": lone_mbs.summary(), "tier_slowest_mb_s": tier_mbs.summary()},
        "grades": [{"goal": g.goal.issue, "value": g.value, "verdict": g.verdict}
                   for g in grades]})
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if len(runs) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
