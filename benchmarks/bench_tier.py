"""bench_tier: three spokes in a region through a regional tier (Debian's nginx with
deploy/regional/nginx.conf.template) against one spoke alone, over one emulated far link.

    .venv/bin/python benchmarks/bench_tier.py [--quick | --smoke] [--dataset-mb 1024]
        [--rtt-ms 60] [--runs 3] [--rate-mbit 1000] [--work-dir /tmp/spokefs-tier]
        [--max-seconds S] [--keep] [--results F]

The dataset (made once in the work dir, fixed seed): 60 % in shards of 64 MiB read start to
end, 40 % in small files (~110 KiB, 20 class directories) read in a shuffled order, like a
training epoch. Each run, side by side, cold (fresh caches, kernel page cache dropped),
hubd behind the long-link emulator and, for the tier, nginx (fresh cache) in front of it:

- **lone**: one spoke straight to the hub; **lone_tier**: one spoke through nginx;
- **three**: three spokes straight to the hub; **three_tier**: three spokes through nginx;
  the three read the whole dataset at once.

Each spoke reads with the same reader: the shards by 4 threads, then the small files by 8
threads (a DataLoader's workers), every byte checked against the source (sha256). Figures:

- far-link bytes / dataset: the emulator's bytes toward the spokes (``bytes_down``) while the
  three spokes read, over the dataset's bytes;
- each spoke's cold throughput / the lone spoke's (dataset bytes / its epoch time), for the
  slowest of the three spokes (the goal); and, to tell the tier's cost from the CPU that
  three spokes share on a small machine, three via nginx against three straight, and one
  via nginx against one straight.

Medians over ``--runs`` (min-max), graded against issue 11's goal word for word, printed
as a table and appended as a JSON line to benchmarks/results/tier.jsonl (``--results``).
``--quick``: 256 MB, 1 run; ``--smoke``: 24 MB, 1 run (CI: tests/benchmarks). Needs root
(FUSE, drop_caches) and nginx with ngx_http_slice_module.
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

ISSUE = "11: a regional tier on a standard HTTP cache"
SENTENCE = ("3 spokes reading the same 1 GB dataset through the tier: far-link bytes <= 1.05 x "
            "the dataset (today 3 x without a tier; ...), each spoke's cold throughput no worse "
            "than a lone spoke's")
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


def epoch_run(data: Path, files: list[Path], want: dict[Path, bytes], link_spec: bl.LinkSpec,
              work: Path, deadline: bl.Deadline, seed: int, spokes: int,
              tier: bool) -> dict[str, object]:
    """``spokes`` cold spokes (fresh caches; through a fresh nginx with ``tier``) reading the
    whole dataset at once: each one's epoch seconds, the far link's bytes, their metrics."""
    with contextlib.ExitStack() as stack:
        hub = stack.enter_context(bl.run_hub(data, work / "hub.log", deadline))
        link = stack.enter_context(bl.open_link(hub.port, link_spec))
        extra: tuple[str, ...] = ()
        if tier:
            extra = ("--tier", stack.enter_context(nginx_tier(link.port, work / "nginx",
                                                              deadline)))
        bl.drop_caches()
        mounts = [stack.enter_context(bl.spoke_mount(
            f"http://127.0.0.1:{link.port}", work / f"mnt-{i}", work / f"cache-{i}",
            work / f"spoke-{i}.log", deadline, extra_args=extra)) for i in range(spokes)]
        before = bl.link_counters(link)
        with concurrent.futures.ThreadPoolExecutor(spokes) as pool:
            times = list(pool.map(lambda im: read_epoch(im[1].path, files, want, seed + im[0]),
                                  enumerate(mounts)))
        moved = bl.link_counters(link).minus(before).bytes_down
        origins = [bl.scrape(m.metrics_url, ("spokefs_fetched_bytes_total",
                                             "spokefs_tier_fallbacks_total")) for m in mounts]
    clean_work(work)
    return {"seconds": times, "far_bytes": moved, "origins": origins}


def clean_work(work: Path) -> None:
    for p in work.glob("cache-*"):
        shutil.rmtree(p, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="256 MB, 1 run")
    p.add_argument("--smoke", action="store_true", help="24 MB, 1 run (CI)")
    p.add_argument("--dataset-mb", type=int, default=None, help="dataset size (1024)")
    p.add_argument("--runs", type=int, default=None, help="runs (3)")
    p.add_argument("--rtt-ms", type=float, default=60.0)
    p.add_argument("--rate-mbit", type=float, default=1000.0)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/spokefs-tier"))
    p.add_argument("--max-seconds", type=float, default=3600.0)
    p.add_argument("--keep", action="store_true", help="keep the dataset and logs")
    p.add_argument("--results", type=Path, default=RESULTS, help="the JSON line goes here")
    args = p.parse_args(argv)
    args.dataset_mb = args.dataset_mb or (24 if args.smoke else 256 if args.quick else 1024)
    args.runs = args.runs or (1 if args.quick or args.smoke else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if bl.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        print("bench_tier: nginx is not installed (apt-get install nginx)", file=sys.stderr)
        return 2
    head = bl.run_info("bench_tier.py")  # before anything is written into the tree
    deadline = bl.Deadline(args.max_seconds)
    work = args.work_dir
    data = work / "data"
    total_target = args.dataset_mb * bl.MIB
    files = make_dataset(data, total_target)
    total = sum((data / f).stat().st_size for f in files)
    want = digests(data, files)
    link_spec = bl.LinkSpec(args.rtt_ms, args.rate_mbit)
    configs = {"lone": (1, False), "lone_tier": (1, True), "three": (3, False),
               "three_tier": (3, True)}
    far = {name: bl.Figure() for name in configs}
    mbs = {name: bl.Figure() for name in configs}  # the slowest spoke's MB/s
    ratio, ratio_same_cpu, ratio_one = bl.Figure(), bl.Figure(), bl.Figure()
    runs = []
    try:
        for run in range(args.runs):
            clean_work(work)
            got = {name: epoch_run(data, files, want, link_spec, work, deadline,
                                   seed=100 * (run + 1) + 10 * i, spokes=n, tier=t)
                   for i, (name, (n, t)) in enumerate(configs.items())}
            slowest = {name: max(r["seconds"]) for name, r in got.items()}  # type: ignore[type-var]
            for name, r in got.items():
                far[name].add(r["far_bytes"] / total)  # type: ignore[operator]
                mbs[name].add(total / slowest[name] / 1e6)
            ratio.add(slowest["lone"] / slowest["three_tier"])
            ratio_same_cpu.add(slowest["three"] / slowest["three_tier"])
            ratio_one.add(slowest["lone"] / slowest["lone_tier"])
            runs.append(got)
            print(f"run {run + 1}: " + "; ".join(
                f"{name}: " + ", ".join(f"{total / sec / 1e6:.0f}"
                                        for sec in r["seconds"])  # type: ignore[attr-defined]
                + f" MB/s, far {r['far_bytes'] / total:.3f}x"  # type: ignore[operator]
                for name, r in got.items()), flush=True)
    except bl.BenchError as exc:  # BudgetExhausted too: report what was measured
        print(f"bench_tier: stopped: {exc}", file=sys.stderr)
    finally:
        clean_work(work)
        if not args.keep:
            shutil.rmtree(work / "nginx", ignore_errors=True)
    values = {"far_ratio": far["three_tier"].median(), "throughput_ratio": ratio.median()}
    grades = bl.grade(GOALS, [int(args.rtt_ms)], lambda g, rtt: (values[g.key], ""))
    print()
    print(f"dataset {total / 1e6:.0f} MB ({len(files)} files), {link_spec.describe()}, "
          f"{len(runs)} run(s)")
    print(bl.markdown_table(
        ["spokes", "far-link bytes / dataset", "slowest spoke, MB/s"],
        [[{"lone": "1, straight to the hub", "lone_tier": "1, through nginx",
           "three": "3, straight to the hub", "three_tier": "3, through nginx"}[name],
          far[name].text("{:.3f}"), mbs[name].text()] for name in configs]))
    print()
    print(bl.markdown_table(
        ["cold throughput ratio", "median (min-max)"],
        [["slowest of 3 via nginx / lone spoke (the goal)", ratio.text("{:.2f}")],
         ["slowest of 3 via nginx / slowest of 3 straight (same CPU load)",
          ratio_same_cpu.text("{:.2f}")],
         ["1 via nginx / 1 straight (the tier's own cost)", ratio_one.text("{:.2f}")]]))
    bl.print_goals([ISSUE], [SENTENCE], grades)
    bl.save_record(args.results, {
        **head, "dataset_bytes": total, "files": len(files),
        "link": link_spec.describe(), "runs": runs,
        "figures": {"far_ratio": {n: f.summary() for n, f in far.items()},
                    "slowest_mb_s": {n: f.summary() for n, f in mbs.items()},
                    "throughput_ratio": ratio.summary(),
                    "throughput_ratio_same_cpu": ratio_same_cpu.summary(),
                    "throughput_ratio_one_spoke": ratio_one.summary()},
        "grades": bl.grades_json(grades)})
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if len(runs) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
