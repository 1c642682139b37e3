#!/usr/bin/env python3
"""How big ``<cache-dir>/blocks`` gets against ``--cache-size``: the real ``BlockCache`` driven
as the spoke's reader drives it (inline ``read``, ``read_on_disk``, ``stage`` of what a miss
fetched, the writer task ``run`` storing batches behind), in-process, no FUSE, no hub.

Workloads (the dataset is ``--dataset-x`` times the cache):

- ``sequential``: large files (``--large-mib``, default 48 MiB) read once, front to back, in
  1 MiB reads; a miss fetches the whole 1 MiB read ahead of it.
- ``small``: ~110 KiB files (96-128 KiB), in a random order, each staged whole.
- ``churn``: ``--epochs`` epochs over a dataset of mixed sizes (4 KiB-8 MiB), files shuffled
  every epoch, one third of them read only in part (a random 4-64 KiB window).

After each file it records the size of ``blocks/`` (all files in it) and, at the end, LMDB's
own view: the last page used, pages on the free list (parsed from ``data.mdb``: LMDB has no
API for its free-list database), the largest run of consecutive free pages, and the map size.
Every byte read is compared with the generated source. Graded: the most ``blocks/`` held
at any sample, over the cache size, against the bound of 1.10; one JSON line is appended to
benchmarks/results/cache_bound.jsonl.

    python3 benchmarks/bench_cache_bound.py [--cache-mib 128] [--dataset-x 3]
        [--only sequential,small,churn] [--work-dir /var/tmp] [--results FILE]
"""

from __future__ import annotations

import argparse
import random
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.lowlevel

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import benchlib as bl  # noqa: E402

from spokefs import metrics  # noqa: E402
from spokefs.cache.block_cache import ORIGIN_DEMAND, BlockCache  # noqa: E402
from spokefs.config import BLOCK_SIZE  # noqa: E402

RESULTS = HERE / "results" / "cache_bound.jsonl"
MIB = 1 << 20
KIB = 1 << 10
READ = MIB  # one read(2) as the reader sees it after the kernel's read-ahead


def source(fid: int, size: int) -> bytes:
    return random.Random(fid).randbytes(size)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


# -- LMDB's free list, read from the file -----------------------------------------------

_PAGE = 4096
_HDR = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize


def lmdb_freelist(path: Path) -> dict[str, Any]:
    """Pages on the free list (by the transaction that freed them) and the longest run of
    consecutive free pages, from the newest meta page of ``data.mdb`` (read when the file is
    not being written)."""
    raw = (path / "data.mdb").read_bytes()
    metas = []
    for m in (0, 1):
        base = m * _PAGE + 16
        free_root = struct.unpack_from("<Q", raw, base + 24 + 40)[0]
        last_pg, txnid = struct.unpack_from("<QQ", raw, base + 24 + 96)
        metas.append((txnid, free_root, last_pg))
    txnid, root, last_pg = max(metas)
    pages: list[int] = []
    by_txn: dict[int, int] = {}

    def walk(pgno: int) -> None:
        if pgno == 0xFFFFFFFFFFFFFFFF:
            return
        off = pgno * _PAGE
        _, _, flags, lower, _ = _HDR.unpack_from(raw, off)
        for i in range((lower - 16) // 2):
            ptr = struct.unpack_from("<H", raw, off + 16 + 2 * i)[0]
            lo, hi, nflags, ksize = _NODE.unpack_from(raw, off + ptr)
            body = off + ptr + 8
            if flags & 0x01:  # branch: the child's page number in lo, hi, flags
                walk(lo | hi << 16 | nflags << 32)
                continue
            key = struct.unpack_from("<Q", raw, body)[0]
            vbody = body + ksize
            if nflags & 0x01:  # F_BIGDATA: the IDL is on overflow pages
                vbody = struct.unpack_from("<Q", raw, vbody)[0] * _PAGE + 16
            n = struct.unpack_from("<Q", raw, vbody)[0]
            ids = struct.unpack_from(f"<{n}Q", raw, vbody + 8)
            pages.extend(ids)
            by_txn[key] = n

    walk(root)
    pages.sort()
    longest = run = 0
    for i, p in enumerate(pages):
        run = run + 1 if i and p == pages[i - 1] + 1 else 1
        longest = max(longest, run)
    runs16 = 0  # disjoint runs of 16 free pages: chunks that fit without growing the file
    run = 0
    for i, p in enumerate(pages):
        run = run + 1 if i and p == pages[i - 1] + 1 else 1
        if run == 16:
            runs16 += 1
            run = 0
    return {"txnid": txnid, "last_pgno": last_pg, "free_pages": len(pages),
            "free_records": len(by_txn), "longest_free_run": longest, "free_runs_of_16": runs16,
            "newest_free_txns": sorted(by_txn.items())[-3:]}


# -- the reader's side ----------------------------------------------------------------


class Driver:
    """Reads through a BlockCache as ``spokefs.read.reader`` does, filling misses by ``stage``."""

    def __init__(self, cache: BlockCache, blocks: Path) -> None:
        self.cache = cache
        self.blocks = blocks
        self.hits = self.misses = 0
        self.bytes_read = 0
        self.wrong = 0
        self.peak = 0
        self.peak_used = 0

    def sample(self) -> None:
        self.peak = max(self.peak, dir_bytes(self.blocks))
        self.peak_used = max(self.peak_used, self.cache.statistics().bytes_used)

    async def read(self, fid: int, data: bytes, offset: int, end: int) -> None:
        res = self.cache.read(fid, 1, offset, end)
        if res.on_disk:
            res = await self.cache.read_on_disk(fid, 1, offset, end)
        if res.data is None:  # a miss: the reader fetches the missing blocks and stages them
            self.misses += 1
            first = res.missing[0] * BLOCK_SIZE
            stop = min(len(data), (res.missing[-1] + 1) * BLOCK_SIZE)
            self.cache.stage(fid, 1, [(first // BLOCK_SIZE, data[first:stop])], ORIGIN_DEMAND)
            got = self.cache.read(fid, 1, offset, end, record=False).data
        else:
            self.hits += 1
            got = res.data
        self.bytes_read += end - offset
        if got != data[offset:end]:
            self.wrong += 1
        await trio.lowlevel.checkpoint()  # the writer runs meanwhile, as under FUSE

    async def read_file(self, fid: int, size: int, lo: int = 0, hi: int | None = None) -> None:
        data = source(fid, size)
        hi = size if hi is None else hi
        for off in range(lo, hi, READ):
            await self.read(fid, data, off, min(hi, off + READ))
        self.sample()


async def sequential(d: Driver, cache_bytes: int, args: argparse.Namespace) -> None:
    size = args.large_mib * MIB
    for fid in range(1, 1 + max(2, int(args.dataset_x * cache_bytes) // size)):
        await d.read_file(fid, size)


def sized_files(first_id: int, nbytes: float, size: Callable[[], int]) -> dict[int, int]:
    """File id -> size, ids from ``first_id`` on, until the sizes add up to ``nbytes``."""
    sizes: dict[int, int] = {}
    total, fid = 0, first_id
    while total < nbytes:
        sizes[fid] = size()
        total += sizes[fid]
        fid += 1
    return sizes


async def small(d: Driver, cache_bytes: int, args: argparse.Namespace) -> None:
    rng = random.Random(7)
    sizes = sized_files(10_000, args.dataset_x * cache_bytes,
                        lambda: rng.randrange(96 * KIB, 128 * KIB))
    order = list(sizes)
    for _ in range(args.epochs):
        rng.shuffle(order)
        for f in order:
            await d.read_file(f, sizes[f])


async def churn(d: Driver, cache_bytes: int, args: argparse.Namespace) -> None:
    rng = random.Random(11)
    sizes = sized_files(100_000, args.dataset_x * cache_bytes, lambda: rng.choice(
        [4 * KIB, 20 * KIB, 110 * KIB, 700 * KIB, 3 * MIB, 8 * MIB]) - rng.randrange(0, 4 * KIB))
    order = list(sizes)
    for _ in range(args.epochs):
        rng.shuffle(order)
        for f in order:
            if rng.random() < 1 / 3:  # a part of it: a random window
                lo = rng.randrange(0, sizes[f]) // BLOCK_SIZE * BLOCK_SIZE
                await d.read_file(f, sizes[f], lo, min(sizes[f], lo + rng.randrange(1, 17)
                                                      * BLOCK_SIZE))
            else:
                await d.read_file(f, sizes[f])


WORKLOADS = {"sequential": sequential, "small": small, "churn": churn}


async def run_one(name: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    cache_bytes = args.cache_mib * MIB
    blocks = work / name / "blocks"
    cache = BlockCache(blocks, cache_bytes)
    d = Driver(cache, blocks)
    errors = metrics.CACHE_WRITE_ERRORS._value.get()
    started = time.monotonic()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            await WORKLOADS[name](d, cache_bytes, args)
            await cache.flush()
            nursery.cancel_scope.cancel()
        stats = cache.statistics()
        map_size = cache._store._env.info()["map_size"]
    finally:
        cache.close()
    d.sample()
    fl = lmdb_freelist(blocks)
    size = (blocks / "data.mdb").stat().st_size
    return {
        "workload": name, "cache_bytes": cache_bytes, "bytes_read": d.bytes_read,
        "seconds": round(time.monotonic() - started, 1),
        "hit_ratio": round(d.hits / max(1, d.hits + d.misses), 3), "wrong_reads": d.wrong,
        "bytes_used": stats.bytes_used, "peak_bytes_used": d.peak_used,
        "data_mdb": size, "blocks_dir": dir_bytes(blocks), "peak_blocks_dir": d.peak,
        "ratio": round(dir_bytes(blocks) / cache_bytes, 3),
        "peak_ratio": round(d.peak / cache_bytes, 3), "map_size": map_size,
        "write_errors": metrics.CACHE_WRITE_ERRORS._value.get() - errors,
        "free_pages_mib": round(fl["free_pages"] * _PAGE / MIB, 1), **fl,
    }


BOUND = ("The cache dir outgrows its bound: `blocks/` (data.mdb + lock.mdb + side files) "
         "<= 1.10 x `--cache-size` under three workloads: sequential (large files read once, "
         "dataset several times the cache), shuffled small files (~110 KiB files, random "
         "order, dataset > cache), and churn (repeated epochs over a dataset of 2-4x the "
         "cache, mixed sizes). Enforce means: evict earlier rather than grow.")
GOALS = tuple(bl.Goal(BOUND, name, f"{name}: most blocks/ bytes seen / cache size", "<=", 1.10)
              for name in WORKLOADS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-mib", type=int, default=128)
    ap.add_argument("--dataset-x", type=float, default=3.0, help="dataset / cache")
    ap.add_argument("--large-mib", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=2, help="for small and churn")
    ap.add_argument("--only", default="sequential,small,churn")
    ap.add_argument("--work-dir", default="/var/tmp")
    ap.add_argument("--results", type=Path, default=RESULTS, help="JSON lines appended here")
    args = ap.parse_args()
    started = time.monotonic()
    record: dict[str, Any] = bl.run_info("bench_cache_bound.py") | {
        "config": {k: v for k, v in vars(args).items() if k not in ("work_dir", "results")},
        "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="bench-bound-", dir=args.work_dir) as tmp:
        for name in args.only.split(","):
            r = trio.run(run_one, name, Path(tmp), args)
            record["workloads"][name] = r
            print(f"{name}: {r['bytes_read'] / MIB:.0f} MiB read in {r['seconds']} s, hits "
                  f"{r['hit_ratio']}, wrong {r['wrong_reads']}, write errors "
                  f"{r['write_errors']}\n  blocks/ {r['blocks_dir'] / MIB:.1f} MiB = "
                  f"{r['ratio']} x cache (peak {r['peak_ratio']}), data.mdb "
                  f"{r['data_mdb'] / MIB:.1f} MiB, map {r['map_size'] / MIB:.0f} MiB, used "
                  f"{r['bytes_used'] / MIB:.1f} MiB (peak {r['peak_bytes_used'] / MIB:.1f})\n"
                  f"  last_pgno {r['last_pgno']}, free {r['free_pages']} pages "
                  f"({r['free_pages_mib']} MiB) in {r['free_records']} records, longest run "
                  f"{r['longest_free_run']}, runs of 16: {r['free_runs_of_16']}, newest "
                  f"{r['newest_free_txns']} at txn {r['txnid']}", flush=True)
    record["seconds"] = round(time.monotonic() - started, 1)

    def value_of(goal: bl.Goal, _: Any) -> tuple[float | None, str]:
        r = record["workloads"].get(goal.key)
        if r is None:
            return None, ""
        return r["peak_ratio"], f"wrong reads {r['wrong_reads']}"

    grades = bl.grade(GOALS, [None], value_of)
    record["graded"] = bl.print_goals(["Cache dir bound"], [BOUND], grades)
    record["grades"] = bl.grades_json(grades)
    bl.save_record(args.results, record, f"{record['seconds']} s; ")


if __name__ == "__main__":
    main()
