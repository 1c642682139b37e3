"""A bucket export through the long link, side by side with a directory export of the same
files: cold shard MB/s, cold small-file reads/s, link bytes, hub CPU per MB.

    python benchmarks/bench_s3_link.py [--runs 3] [--rtt-ms 60] [--rate-mbit 1000]
        [--shards 16] [--shard-mib 32] [--small 1000] [--small-kib 64] [--max-seconds 1800]

One dataset (``--shards`` files of ``--shard-mib`` MiB and ``--small`` files of
``--small-kib`` KiB, random bytes) is written to a directory and uploaded to a bucket of a
real SeaweedFS (``weed mini``, 127.0.0.1). Two hubs serve it: ``hubd serve DIR`` and
``hubd serve s3://BUCKET``, each behind its own long-link emulator (``longlink.py``,
``--rtt-ms``, ``--rate-mbit``, 4 MiB window per connection). Per run, for each export in
turn (the order alternates), a fresh spoke (empty cache dir, page cache dropped) mounts
the hub through the link and:

- ``shards``: reads every shard whole, 4 files at a time in 4 MiB reads (a WebDataset
  loader's pattern): cold MB/s;
- ``small``: reads every small file whole in a shuffled order, 8 at a time (a map-style
  dataset's pattern): cold files/s (the "samples/s" of this benchmark);

checking every byte against the source (``wrong_bytes`` must be 0). Link bytes are the
emulator's downstream counter; hub CPU is utime + stime of the hub process (for the
bucket: SeaweedFS's is reported apart).

Goals of issue 15 (graded on medians): cold samples/s and cold shard MB/s of the bucket
export >= 0.95 x the directory export's; link bytes <= 1.02 x the dataset; hub CPU per MB
<= 2 x. Prints a table and appends one JSON line to ``benchmarks/results/s3_link.jsonl``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import benchlib as bl  # noqa: E402
from longlink import LongLinkProcess  # noqa: E402

from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedServer  # noqa: E402

BUCKET = "bench-link"
MIB = 1 << 20
GOALS = [
    bl.Goal("cold samples/s ... >= 0.95 of the directory hub's in the same run",
            "ratio_small_files_per_s", "bucket / directory, small files read per second",
            ">=", 0.95),
    bl.Goal("cold shard MB/s >= 0.95 of the directory hub's in the same run",
            "ratio_shards_mb_per_s", "bucket / directory, shard MB/s", ">=", 0.95),
    bl.Goal("link bytes <= 1.02 x the dataset", "s3_link_over_dataset",
            "bucket export: link bytes down / dataset bytes", "<=", 1.02),
    bl.Goal("Hub CPU per MB served from the bucket <= 2 x the directory hub's",
            "ratio_hub_cpu_per_mb", "bucket / directory, hub CPU per MB (both passes)",
            "<=", 2.0),
]


def make_dataset(root: Path, args: argparse.Namespace) -> dict[str, bytes]:
    rnd = random.Random(3)
    files = {f"shards/shard-{i:04d}.tar": rnd.randbytes(args.shard_mib * MIB)
             for i in range(args.shards)}
    files |= {f"small/c{i % 20:02d}/img-{i:06d}.jpg": rnd.randbytes(args.small_kib << 10)
              for i in range(args.small)}
    for key, data in files.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def upload(server: SeaweedServer, files: dict[str, bytes]) -> None:
    server.put_objects(BUCKET, files, create=True, workers=16)


def read_whole(path: Path, expected: bytes) -> tuple[int, int]:
    """(bytes read, wrong bytes)."""
    digest = xxhash.xxh3_64()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(4 * MIB):
            digest.update(chunk)
            size += len(chunk)
    good = size == len(expected) and digest.intdigest() == xxhash.xxh3_64_intdigest(expected)
    return size, 0 if good else max(len(expected), 1)


def read_pass(mnt: Path, files: dict[str, bytes], keys: list[str],
              threads: int) -> tuple[float, int, int]:
    """(seconds, bytes, wrong bytes) reading ``keys`` whole, ``threads`` at a time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(lambda k: read_whole(mnt / k, files[k]), keys))
    return (time.perf_counter() - start, sum(r[0] for r in results),
            sum(r[1] for r in results))


def one_pass(name: str, hub: bl.Proc, link_port: int, link: LongLinkProcess,
             files: dict[str, bytes], tmp: Path, deadline: bl.Deadline,
             run: int) -> dict[str, float]:
    cache = tmp / f"cache-{name}-{run}"
    mnt = tmp / f"mnt-{name}-{run}"
    out: dict[str, float] = {}
    bl.drop_caches()
    with bl.spoke_mount(f"http://127.0.0.1:{link_port}", mnt, cache,
                        tmp / "logs" / f"spoke-{name}-{run}.log", deadline, "4G"):
        shards = sorted(k for k in files if k.startswith("shards/"))
        small = sorted(k for k in files if k.startswith("small/"))
        random.Random(run).shuffle(small)
        for what, keys, threads in (("shards", shards, 4), ("small", small, 8)):
            before = bl.link_counters(link)
            cpu0 = bl.proc_cpu_ticks(hub.pid)
            seconds, size, wrong = read_pass(mnt, files, keys, threads)
            cpu = (bl.proc_cpu_ticks(hub.pid) - cpu0) / bl.CLK_TCK
            after = bl.link_counters(link)
            out[f"{what}_seconds"] = seconds
            out[f"{what}_mb_per_s"] = size / 1e6 / seconds
            out[f"{what}_files_per_s"] = len(keys) / seconds
            out[f"{what}_wrong_bytes"] = wrong
            out[f"{what}_link_bytes"] = after.minus(before).bytes_down
            out[f"{what}_bytes"] = size
            out[f"{what}_hub_cpu_s"] = cpu
    shutil.rmtree(cache, ignore_errors=True)
    total = out["shards_bytes"] + out["small_bytes"]
    out["link_over_dataset"] = (out["shards_link_bytes"] + out["small_link_bytes"]) / total
    out["hub_cpu_ms_per_mb"] = 1000 * (out["shards_hub_cpu_s"] + out["small_hub_cpu_s"]) / \
        (total / 1e6)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rtt-ms", type=float, default=60.0)
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--shard-mib", type=int, default=32)
    parser.add_argument("--small", type=int, default=1000)
    parser.add_argument("--small-kib", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=1800.0)
    parser.add_argument("--results", type=Path, default=HERE / "results" / "s3_link.jsonl",
                        help="JSON lines file to append this run's record to")
    args = parser.parse_args()
    info = bl.run_info(Path(__file__).name)
    deadline = bl.Deadline(args.max_seconds)
    spec = bl.LinkSpec(args.rtt_ms, args.rate_mbit)
    figures: dict[str, bl.Figure] = {}

    def add(name: str, value: float) -> None:
        figures.setdefault(name, bl.Figure()).add(value)

    with tempfile.TemporaryDirectory(prefix="s3-bench-link-") as tmp_s:
        tmp = Path(tmp_s)
        files = make_dataset(tmp / "export", args)
        server = SeaweedServer(tmp / "weed", tmp / "logs")
        procs: list[bl.Proc] = []
        try:
            server.start()
            upload(server, files)
            os.environ |= {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
            hubs = {}
            for name, root, extra in (("dir", str(tmp / "export"), []),
                                      ("s3", f"s3://{BUCKET}",
                                       ["--s3-endpoint", server.endpoint])):
                proc = bl.Proc(f"hubd-{name}", [
                    sys.executable, "-m", "hubd", "serve", root, "--listen", "127.0.0.1:0",
                    "--log-level", "WARNING", "--rescan-interval", "0", *extra],
                    tmp / "logs" / f"hub-{name}.log")
                procs.append(proc)
                url = proc.wait_line(bl.HUB_READY_RE, deadline.timeout(120)).group(1)
                hubs[name] = (proc, int(url.rstrip("/").rsplit(":", 1)[1]))
            with bl.open_link(hubs["dir"][1], spec) as dir_link, \
                    bl.open_link(hubs["s3"][1], spec) as s3_link:
                links = {"dir": dir_link, "s3": s3_link}
                for run in range(args.runs):
                    order = ["dir", "s3"] if run % 2 == 0 else ["s3", "dir"]
                    results = {}
                    for name in order:
                        results[name] = one_pass(name, hubs[name][0], links[name].port,
                                                 links[name], files, tmp, deadline, run)
                        for k, v in results[name].items():
                            add(f"{name}_{k}", v)
                    d, s = results["dir"], results["s3"]
                    add("ratio_shards_mb_per_s", s["shards_mb_per_s"] / d["shards_mb_per_s"])
                    add("ratio_small_files_per_s",
                        s["small_files_per_s"] / d["small_files_per_s"])
                    if d["hub_cpu_ms_per_mb"] > 0:  # a tiny run may not last a clock tick
                        add("ratio_hub_cpu_per_mb",
                            s["hub_cpu_ms_per_mb"] / d["hub_cpu_ms_per_mb"])
                    add("s3_link_over_dataset", s["link_over_dataset"])
                    print(f"run {run + 1}: shards {d['shards_mb_per_s']:.0f} / "
                          f"{s['shards_mb_per_s']:.0f} MB/s, small "
                          f"{d['small_files_per_s']:.0f} / {s['small_files_per_s']:.0f} "
                          "files/s (dir / s3)", flush=True)
        finally:
            for proc in procs:
                proc.stop()
            server.stop()
    rows = [(name, fig.text("{:.3f}")) for name, fig in sorted(figures.items())]
    print(spec.describe())
    print(bl.markdown_table(("figure", "median (min-max)"), rows))
    medians = {k: v.median() for k, v in figures.items()}
    grades = bl.grade(GOALS, [int(args.rtt_ms)],
                      lambda goal, _rtt: (medians.get(goal.key), "median"))
    print(bl.format_grades(grades))
    bl.save_record(args.results, {
        **info, "config": vars(args), "link": spec.describe(),
        "figures": {k: v.summary() for k, v in figures.items()},
        "grades": bl.grades_json(grades)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
