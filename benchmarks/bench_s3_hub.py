"""Hub CPU per MB and per GET, bucket export vs directory export, and the S3 client's own
CPU per GET and per LIST page vs botocore's; side by side in one run.

    python benchmarks/bench_s3_hub.py [--runs 3] [--big-files 32] [--big-mib 8]
                                      [--small-files 1000] [--small-kib 16]

One dataset (``--big-files`` files of ``--big-mib`` MiB, ``--small-files`` of ``--small-kib``
KiB, random bytes) is written to a directory and uploaded to a bucket on a real SeaweedFS
(``weed mini``, 127.0.0.1). Two hubd processes serve it: ``hubd serve DIR`` and
``hubd serve s3://BUCKET``. Per run, for each hub in turn, this process (an aiohttp
client, 8 requests in flight, as a spoke's fetchers) reads:

- ``big``: every big file in ranges of 3.75 MiB of its framed representation (the spoke's
  ``request_bytes``);
- ``small``: every small file whole, one GET each.

and records the hub's CPU (utime + stime from /proc) per MB and per request, and for the
bucket also SeaweedFS's (another process: not the hub's). Every body is checked against the
source bytes framed as protocol v2 frames them (``wrong_bytes`` must be 0): data and
every frame's checksum.

``client``: in this process, 500 GETs of one small object and 10 full listings of the
small files, with hubd's ``S3Client`` and with botocore (the library aiobotocore wraps),
one request at a time: CPU per GET and per LIST page of each.

Prints medians (min-max) over runs and appends one JSON line to
``benchmarks/results/s3_hub.jsonl``. Loopback only: these are CPU figures, not link ones.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import benchlib as bl  # noqa: E402

from hubd.s3.client import S3Client, S3Config  # noqa: E402
from hubd.s3.sigv4 import Credentials  # noqa: E402
from spokefs import protocol  # noqa: E402
from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedServer  # noqa: E402

BUCKET = "bench-hub"
REQUEST_BYTES = (4 << 20) - (256 << 10)  # spokefs PrefetchConfig.request_bytes
IN_FLIGHT = 8
MB = 1e6
GOALS = [
    bl.Goal("Hub CPU per MB served from the bucket <= 2 x the directory hub's",
            "ratio_big_hub_cpu_per_mb_s3_over_dir",
            "bucket / directory, hub CPU per MB of 3.75 MiB ranges", "<=", 2.0),
]


def cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make_dataset(root: Path, args: argparse.Namespace) -> dict[str, bytes]:
    rnd = random.Random(5)
    files = {f"big/shard-{i:03d}.bin": rnd.randbytes(args.big_mib << 20)
             for i in range(args.big_files)}
    files |= {f"small/d{i % 10}/f{i:05d}.jpg": rnd.randbytes(args.small_kib << 10)
              for i in range(args.small_files)}
    for key, data in files.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def upload(server: SeaweedServer, files: dict[str, bytes]) -> None:
    server.put_objects(BUCKET, files, create=True, workers=16)


def start_hub(root: str, log: Path, *args: str) -> tuple[bl.Proc, str]:
    env_args = ["--log-level", "WARNING", "--rescan-interval", "0", *args]
    proc = bl.Proc("hubd", [sys.executable, "-m", "hubd", "serve", root, "--listen",
                            "127.0.0.1:0", *env_args], log)
    url = proc.wait_line(bl.HUB_READY_RE, 120).group(1).rstrip("/")
    return proc, url


async def snapshot_files(session: aiohttp.ClientSession, url: str) -> dict[str, protocol.Entry]:
    async with session.get(url + protocol.SNAPSHOT_PATH) as resp:
        body = await resp.read()
    decoder = protocol.SnapshotDecoder()
    entries = list(decoder.feed(body))
    decoder.finish()
    paths: dict[int, str] = {}
    out: dict[str, protocol.Entry] = {}
    for e in entries:
        path = "" if e.parent_id == 0 else f"{paths[e.parent_id]}/{e.name.decode()}".lstrip("/")
        paths[e.file_id] = path
        if not e.is_dir:
            out[path] = e
    return out


_FRAMED: dict[tuple[int, int], bytes] = {}  # by (file id, version): the hubs' ids differ


def framed_of(path: str, entry: protocol.Entry, files: dict[str, bytes]) -> bytes:
    """The framed representation of a file (protocol v2), built here from the source
    bytes: each 4 KiB frame, then its seeded xxh3; what every answer must equal."""
    key = (entry.file_id, entry.version)
    if key not in _FRAMED:
        _FRAMED[key] = protocol.encode_frames(files[path], entry.file_id, entry.version, 0)
    return _FRAMED[key]


async def fetch_all(url: str, jobs: list[tuple[str, protocol.Entry, int, int]],
                    files: dict[str, bytes]) -> tuple[int, int, int]:
    """(requests, body bytes, wrong bytes) for every (path, entry, start, stop) job."""
    wrong = total = 0
    queue = list(reversed(jobs))

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal wrong, total
        while queue:
            path, entry, start, stop = queue.pop()
            whole = protocol.framed_size(entry.size)
            headers = {"Range": f"bytes={start}-{stop - 1}"} if stop - start < whole else {}
            async with session.get(url + protocol.blob_path(entry.file_id, entry.version),
                                   headers=headers) as resp:
                body = await resp.read()
            expected = framed_of(path, entry, files)[start:stop]
            if resp.status not in (200, 206) or body != expected:
                wrong += max(len(expected), 1)
            total += len(body)

    async with aiohttp.ClientSession(auto_decompress=False) as session:
        await asyncio.gather(*(worker(session) for _ in range(IN_FLIGHT)))
    return len(jobs), total, wrong


async def read_phase(url: str, files: dict[str, bytes], which: str) -> list[Any]:
    async with aiohttp.ClientSession() as session:
        entries = await snapshot_files(session, url)
    jobs = []
    for path, entry in sorted(entries.items()):
        if not path.startswith(which):
            continue
        whole = protocol.framed_size(entry.size)  # ranges are of the framed representation
        for start in range(0, whole, REQUEST_BYTES):
            jobs.append((path, entry, start, min(start + REQUEST_BYTES, whole)))
    return jobs


def measure(url: str, pids: dict[str, int], files: dict[str, bytes],
            which: str) -> dict[str, float]:
    jobs = asyncio.run(read_phase(url, files, which))
    meter = bl.CpuMeter(pids)
    requests, body, wrong = asyncio.run(fetch_all(url, jobs, files))
    cpu = meter.stop()
    hub_cpu = cpu["cpu_s"]["hub"]
    out = {"requests": requests, "mb": body / MB, "wrong_bytes": wrong,
           "wall_s": cpu["wall_s"], "hub_cpu_s": hub_cpu,
           "hub_cpu_ms_per_mb": 1000 * hub_cpu / (body / MB),
           "hub_cpu_ms_per_request": 1000 * hub_cpu / requests,
           "mb_per_s": body / MB / cpu["wall_s"]}
    if "seaweedfs" in cpu["cpu_s"]:
        out["seaweedfs_cpu_s"] = cpu["cpu_s"]["seaweedfs"]
    return out


async def our_client(endpoint: str, key: str, gets: int, listings: int) -> tuple[float, float,
                                                                                 int]:
    async with S3Client(S3Config(endpoint), Credentials(ACCESS_KEY, SECRET_KEY)) as client:
        page = await client.list_page(BUCKET, key)
        obj = page.objects[0]
        c0 = cpu_self()
        for _ in range(gets):
            await client.get(BUCKET, key, obj.etag, 0, obj.size)
        c1 = cpu_self()
        pages = 0
        for _ in range(listings):
            token = None
            while True:
                page = await client.list_page(BUCKET, "small/", token=token)
                pages += 1
                if (token := page.next_token) is None:
                    break
        c2 = cpu_self()
    return (c1 - c0) / gets, (c2 - c1) / pages, pages


def botocore_client(server: SeaweedServer, key: str, gets: int,
                    listings: int) -> tuple[float, float, int]:
    client = server.writer()
    c0 = cpu_self()
    for _ in range(gets):
        client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    c1 = cpu_self()
    pages = 0
    paginator = client.get_paginator("list_objects_v2")
    for _ in range(listings):
        for _page in paginator.paginate(Bucket=BUCKET, Prefix="small/"):
            pages += 1
    c2 = cpu_self()
    return (c1 - c0) / gets, (c2 - c1) / pages, pages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--big-files", type=int, default=32)
    parser.add_argument("--big-mib", type=int, default=8)
    parser.add_argument("--small-files", type=int, default=1000)
    parser.add_argument("--small-kib", type=int, default=16)
    parser.add_argument("--results", type=Path, default=HERE / "results" / "s3_hub.jsonl",
                        help="JSON lines file to append this run's record to")
    args = parser.parse_args()
    info = bl.run_info(Path(__file__).name)  # the commit and tree measured, taken at start
    figures: dict[str, bl.Figure] = {}

    def add(name: str, value: float) -> None:
        figures.setdefault(name, bl.Figure()).add(value)

    with tempfile.TemporaryDirectory(prefix="s3-bench-hub-") as tmp_s:
        tmp = Path(tmp_s)
        files = make_dataset(tmp / "export", args)
        server = SeaweedServer(tmp / "weed", tmp / "logs")
        hubs: list[bl.Proc] = []
        try:
            server.start()
            upload(server, files)
            os.environ |= {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
            dir_hub, dir_url = start_hub(str(tmp / "export"), tmp / "logs" / "hub-dir.log")
            hubs.append(dir_hub)
            s3_hub, s3_url = start_hub(f"s3://{BUCKET}", tmp / "logs" / "hub-s3.log",
                                       "--s3-endpoint", server.endpoint)
            hubs.append(s3_hub)
            assert server.proc is not None
            for run in range(args.runs):
                order = [("dir", dir_url, dir_hub), ("s3", s3_url, s3_hub)]
                for name, url, hub in order if run % 2 == 0 else order[::-1]:
                    pids = {"hub": hub.pid}
                    if name == "s3":
                        pids["seaweedfs"] = server.proc.pid
                    for which in ("big", "small"):
                        result = measure(url, pids, files, which)
                        for k, v in result.items():
                            add(f"{name}_{which}_{k}", v)
                small_key = next(k for k in files if k.startswith("small/"))
                get_s, page_s, _ = asyncio.run(our_client(server.endpoint, small_key, 500, 10))
                add("client_ours_cpu_ms_per_get", 1000 * get_s)
                add("client_ours_cpu_ms_per_list_page", 1000 * page_s)
                get_s, page_s, _ = botocore_client(server, small_key, 500, 10)
                add("client_botocore_cpu_ms_per_get", 1000 * get_s)
                add("client_botocore_cpu_ms_per_list_page", 1000 * page_s)
                print(f"run {run + 1} done", flush=True)
        finally:
            for hub in hubs:
                hub.stop()
            server.stop()
    for which in ("big", "small"):
        for unit in ("per_mb", "per_request"):
            d = figures[f"dir_{which}_hub_cpu_ms_{unit}"].samples
            s = figures[f"s3_{which}_hub_cpu_ms_{unit}"].samples
            for a, b in zip(d, s, strict=True):
                if a > 0:  # a tiny run may not last one clock tick (10 ms): no ratio then
                    add(f"ratio_{which}_hub_cpu_{unit}_s3_over_dir", b / a)
    rows = [(name, fig.text("{:.3f}")) for name, fig in sorted(figures.items())]
    print(bl.markdown_table(("figure", "median (min-max)"), rows))
    medians = {k: v.median() for k, v in figures.items()}
    grades = bl.grade(GOALS, [None], lambda goal, _rtt: (medians.get(goal.key), "median"))
    print(bl.format_grades(grades))
    bl.save_record(args.results, {
        **info, "config": vars(args), "in_flight": IN_FLIGHT,
        "request_bytes": REQUEST_BYTES, "figures": {k: v.summary() for k, v in figures.items()},
        "grades": bl.grades_json(grades),
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
