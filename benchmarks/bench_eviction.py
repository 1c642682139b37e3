#!/usr/bin/env python3
"""Eviction under training-like access: the real ``BlockCache`` against plain LRU, same traces.

In-process, no FUSE, no hub: a trace of chunk reads (64 KiB, the cache's storage unit) is
replayed against ``spokefs.cache.block_cache.BlockCache`` in a temporary directory (real LMDB, real
transactions, the real policy) and against an LRU model of the same capacity in chunks. A
read that finds all 16 blocks of its chunk is a hit (``BlockCache.read``, then
``read_on_disk`` when the bytes are not in RAM: the reader's path); a miss is filled as the
spoke's demand path does (``stage(..., ORIGIN_DEMAND)``, stored by the writer task, waited
for with ``flush``), or, in the prefetch scenario, every file is stored with
``ORIGIN_PREFETCH`` just before it is read (what read-ahead does), and a chunk that had to
be prefetched counts as a miss too. Reported: the hit ratio of each epoch.

Traces (a DataLoader's): ``--files-chunks`` chunks per file, read in order; the files in a new
random order every epoch.

- ``loop-2x``, ``loop-4x``: a dataset of 2x and 4x the cache, epoch after epoch;
  ideal = C/D.
- ``hot-4x``: ``loop-4x`` plus a 4-chunk "labels" file read after every 32 chunk reads;
  also reported: the hit ratio of the hot file alone (ideal 1; overall ideal: the hot
  reads, 4/36, plus 32/36 of (C - 4)/4C).
- ``prefetch-2x``: ``loop-2x`` with each file prefetched just before it is read.
- ``switch``: 3 epochs over a 4x dataset, then epochs over another dataset of half the
  cache (which fits): how fast a finished job's data makes room (ideal after the switch: 1
  from the second epoch on).

The cache is ``--cache-mib`` (default 32 MiB: 512 chunks) with a window of 5% of it (the
default for caches of 20 GiB and more; small caches get a larger share by default).

``--only space`` measures disk use instead: bytes of ``data.mdb`` (file size and allocated
blocks) per cached block byte, after filling ``--space-mib`` with sequential files, with
random lone 4 KiB blocks, and after a churn of mixed fills 8x the cache (which also shows
whether the file keeps growing, i.e. whether LMDB's free pages are reused).

Prints a table, then the goals of "Cache lifecycle" (items 1 and 2) word for word, graded
(the issue's "near 1" and "near cache_size / dataset_size" carry no number: those figures are
REPORTED, never passed), and appends one JSON line (with the commit and whether the tree was
dirty) to benchmarks/results/eviction.jsonl.

    python3 benchmarks/bench_eviction.py [--cache-mib 32] [--epochs 6] [--only eviction|space]
        [--results FILE]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import trio
import trio.lowlevel

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import benchlib as bl  # noqa: E402

from spokefs.cache.block_cache import ORIGIN_DEMAND, ORIGIN_PREFETCH, BlockCache  # noqa: E402
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS, CHUNK_SIZE  # noqa: E402
from spokefs.types import FileVersion  # noqa: E402

RESULTS = HERE / "results" / "eviction.jsonl"
MIB = 1 << 20
HOT_FILE = 10**6  # file id of the hot "labels" file

# -- the goals of "Cache lifecycle", word for word ---------------------------------------

CAPACITY = ("Capacity: `--cache-size` is honoured (the cache never exceeds it by more than one "
            "storage unit), the LMDB map is sized for it, and a full cache evicts instead of "
            "failing a read. Space on disk per cached byte is measured and kept near 1 (watch "
            "LMDB overflow pages).")
EVICTION = ("Eviction that suits training: a job that reads a dataset larger than the cache "
            "epoch after epoch must keep a hit ratio near cache_size / dataset_size, where plain "
            "LRU falls to zero; a small hot set (labels, index files) must survive a large scan.")
G = bl.Goal
GOALS = (
    G(CAPACITY, "over_quota", "most bytes_used over the quota in any trace, in 64 KiB chunks",
      "<=", 1.0),
    *(G(CAPACITY, f"space/{fill}", f"space: data.mdb size / cached bytes, {fill}", "", 0.0)
      for fill in ("sequential", "random-4k", "churn")),
    *(G(EVICTION, f"ideal/{trace}", f"{trace}: mean hit ratio from epoch 2 / (C/D)", "", 0.0)
      for trace in ("loop-2x", "loop-4x")),
    G(EVICTION, "hot", "hot-4x: lowest hit ratio of the hot file from epoch 2", ">=", 1.0),
)
Access = tuple[int, int]  # (file id, chunk index)


# -- traces -------------------------------------------------------------------------


def loop_epochs(
    dataset_chunks: int, file_chunks: int, epochs: int, rng: random.Random, *,
    first_file: int = 1, hot_every: int = 0,
) -> Iterator[list[Access]]:
    """Epochs over a dataset of files read in order, the files shuffled every epoch."""
    files = list(range(first_file, first_file + dataset_chunks // file_chunks))
    n = 0
    for _ in range(epochs):
        rng.shuffle(files)
        trace: list[Access] = []
        for f in files:
            for ci in range(file_chunks):
                trace.append((f, ci))
                n += 1
                if hot_every and n % hot_every == 0:
                    trace.extend((HOT_FILE, c) for c in range(4))
        yield trace


# -- the two caches -----------------------------------------------------------------


class LruModel:
    """Plain LRU over chunks, the capacity in chunks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: collections.OrderedDict[Access, None] = collections.OrderedDict()

    async def read(self, key: Access) -> bool:
        if key in self._d:
            self._d.move_to_end(key)
            return True
        self._d[key] = None
        if len(self._d) > self.capacity:
            self._d.popitem(last=False)
        return False

    async def prefetch_file(self, f: int, chunks: int) -> set[int]:
        fetched = {ci for ci in range(chunks) if (f, ci) not in self._d}
        for ci in sorted(fetched):
            await self.read((f, ci))
        return fetched


async def read(cache: BlockCache, file_id: int, offset: int, end: int) -> bytes | None:
    """The bytes, or None if any block is missing: as the reader looks (inline, or from a
    worker thread when the stored bytes are not in RAM)."""
    res = cache.read(file_id, 1, offset, end)
    if res.on_disk:
        res = await cache.read_on_disk(file_id, 1, offset, end)
    return res.data


async def store(cache: BlockCache, file_id: int, runs: list[tuple[int, bytes]],
                origin: int) -> None:
    """Stage a fill and wait until the writer task (``BlockCache.run``) has stored it."""
    cache.stage(file_id, 1, runs, origin)
    await cache.flush()


@contextlib.asynccontextmanager
async def writer(cache: BlockCache) -> AsyncIterator[None]:
    """The cache's writer task, running for the block, as in a mount."""
    async with trio.open_nursery() as nursery:
        await nursery.start(cache.run)
        yield
        nursery.cancel_scope.cancel()


class RealCache:
    """The real BlockCache, read and filled as the spoke's reader and fetcher do (its writer
    task runs meanwhile: ``writer``)."""

    def __init__(self, path: Path, max_bytes: int, window_bytes: int) -> None:
        self.cache = BlockCache(path, max_bytes, window_bytes=window_bytes)
        self._payload = os.urandom(CHUNK_SIZE)
        self.most_used = 0  # the largest bytes_used seen after a fill

    def _note_use(self) -> None:
        self.most_used = max(self.most_used, self.cache.statistics().bytes_used)

    async def read(self, key: Access) -> bool:
        f, ci = key
        if await read(self.cache, f, ci * CHUNK_SIZE, (ci + 1) * CHUNK_SIZE) is not None:
            return True
        await store(self.cache, f, [(ci * CHUNK_BLOCKS, self._payload)], ORIGIN_DEMAND)
        self._note_use()
        return False

    async def prefetch_file(self, f: int, chunks: int) -> set[int]:
        fv = FileVersion(f, 1, chunks * CHUNK_SIZE)
        present = self.cache.present_chunks_now(fv, 0, chunks - 1)
        fetched = {ci for ci in range(chunks) if ci not in present}
        runs = [(ci * CHUNK_BLOCKS, self._payload) for ci in sorted(fetched)]
        if runs:
            await store(self.cache, f, runs, ORIGIN_PREFETCH)
            self._note_use()
        return fetched


async def replay(
    cache: RealCache | LruModel, epochs: list[list[Access]], file_chunks: int, prefetch: bool
) -> tuple[list[float], list[float]]:
    """Hit ratio per epoch, and that of the hot file alone."""
    ratios, hot_ratios = [], []
    for trace in epochs:
        hits = hot_hits = hot_reads = 0
        fetched: set[int] = set()
        for i, key in enumerate(trace):
            if prefetch and key[1] == 0 and key[0] != HOT_FILE:
                fetched = await cache.prefetch_file(key[0], file_chunks)
            hit = await cache.read(key)
            if prefetch and key[0] != HOT_FILE and key[1] in fetched:
                hit = False  # it came over the link all the same, just earlier
            hits += hit
            if key[0] == HOT_FILE:
                hot_reads += 1
                hot_hits += hit
            if i % 256 == 0:
                await trio.lowlevel.checkpoint()
        ratios.append(hits / len(trace))
        hot_ratios.append(hot_hits / hot_reads if hot_reads else float("nan"))
    return ratios, hot_ratios


# -- scenarios ----------------------------------------------------------------------


def scenarios(cap: int, file_chunks: int, epochs: int) -> dict[str, dict[str, Any]]:
    def loop(mult: int, seed: int, **kw: Any) -> list[list[Access]]:
        return list(loop_epochs(mult * cap, file_chunks, epochs, random.Random(seed), **kw))

    switch = list(loop_epochs(4 * cap, file_chunks, 3, random.Random(5)))
    switch += list(loop_epochs(cap // 2, file_chunks, epochs, random.Random(6),
                               first_file=10**5))
    return {
        "loop-2x": {"epochs": loop(2, 1), "ideal": 0.5},
        "loop-4x": {"epochs": loop(4, 2), "ideal": 0.25},
        # the hot file is 4 of every 36 reads: ideal = 4/36 + 32/36 * (C - 4) / 4C
        "hot-4x": {"epochs": loop(4, 3, hot_every=32), "hot": True,
                   "ideal": 4 / 36 + 32 / 36 * (cap - 4) / (4 * cap)},
        "prefetch-2x": {"epochs": loop(2, 4), "ideal": 0.5, "prefetch": True},
        "switch": {"epochs": switch, "ideal": None, "switch_at": 3},
    }


async def run_eviction(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    max_bytes = args.cache_mib * MIB
    cap = max_bytes // CHUNK_SIZE
    out: dict[str, Any] = {}
    for name, sc in scenarios(cap, args.file_chunks, args.epochs).items():
        started = time.monotonic()
        prefetch = sc.get("prefetch", False)
        real = RealCache(work / name, max_bytes, max_bytes // 20)
        try:
            async with writer(real.cache):
                r_real, h_real = await replay(real, sc["epochs"], args.file_chunks, prefetch)
            stats = real.cache.statistics()
        finally:
            real.cache.close()
        r_lru, h_lru = await replay(LruModel(cap), sc["epochs"], args.file_chunks, prefetch)
        out[name] = {
            "ideal": sc["ideal"], "spokefs": r_real, "lru": r_lru,
            "spokefs_hot": h_real if sc.get("hot") else None,
            "lru_hot": h_lru if sc.get("hot") else None,
            "switch_at": sc.get("switch_at"),
            "final_bytes_used": stats.bytes_used, "final_protected_bytes": stats.protected_bytes,
            "most_bytes_used": real.most_used, "quota_bytes": max_bytes,
            "seconds": round(time.monotonic() - started, 1),
        }
    return out


def print_eviction(res: dict[str, Any], cache_mib: int) -> None:
    print(f"\nhit ratio per epoch (cache {cache_mib} MiB = {cache_mib * MIB // CHUNK_SIZE} "
          "chunks of 64 KiB; window 5%)")
    n = max(len(r["spokefs"]) for r in res.values())
    head = "| trace | policy | " + " | ".join(f"e{i + 1}" for i in range(n)) + " | ideal |"
    print(head)
    print("|" + " --- |" * (n + 3))
    for name, r in res.items():
        rows = [("spokefs", r["spokefs"]), ("LRU", r["lru"])]
        if r["spokefs_hot"] is not None:
            rows += [("spokefs, hot file", r["spokefs_hot"]), ("LRU, hot file", r["lru_hot"])]
        for policy, ratios in rows:
            cells = [f"{x:.2f}" for x in ratios] + [""] * (n - len(ratios))
            if r["switch_at"]:  # the first epoch over the new dataset
                cells[r["switch_at"]] = "**" + cells[r["switch_at"]] + "**"
            ideal = "1.00" if "hot file" in policy else (
                f"{r['ideal']:.2f}" if r["ideal"] is not None else "1.00 from the 2nd after **")
            print(f"| {name} | {policy} | " + " | ".join(cells) + f" | {ideal} |")


# -- space per byte -----------------------------------------------------------------


def disk_use(path: Path) -> tuple[int, int]:
    st = os.stat(path / "data.mdb")
    return st.st_size, st.st_blocks * 512


# Both fills stop at the quota, or once they have written 1.25x it: where the cache evicts
# before the quota (its pages in use reach the bound on the file; lone blocks take more pages
# per byte), its use saws between that bound less a batch and the bound.
_FILL_MAX = 1.25


async def fill_sequential(cache: BlockCache, nbytes: int) -> None:
    payload = os.urandom(4 * MIB)
    f = 1
    while cache.statistics().bytes_used + len(payload) <= nbytes and \
            (f - 1) * len(payload) < _FILL_MAX * nbytes:
        await store(cache, f, [(0, payload)], ORIGIN_DEMAND)
        f += 1


async def fill_random(cache: BlockCache, nbytes: int, rng: random.Random) -> None:
    block = os.urandom(BLOCK_SIZE)
    written = 0
    while cache.statistics().bytes_used + BLOCK_SIZE <= nbytes and \
            written < _FILL_MAX * nbytes:
        runs = [(rng.randrange(1 << 30), block) for _ in range(64)]
        for first, data in runs:
            await store(cache, 7, [(first, data)], ORIGIN_DEMAND)
        written += len(runs) * BLOCK_SIZE


async def churn(cache: BlockCache, turnover: int, rng: random.Random) -> list[int]:
    """Mixed fills (whole files, lone blocks, partial chunks) and reads; file sizes seen."""
    payload = os.urandom(2 * MIB)
    written = 0
    sizes = []
    f = 100
    while written < turnover:
        kind = rng.random()
        if kind < 0.6:
            n = rng.choice([1, 4, 16, 32]) * CHUNK_SIZE
            await store(cache, f, [(0, payload[:n])], ORIGIN_DEMAND)
        elif kind < 0.9:
            n = rng.randrange(1, 12) * BLOCK_SIZE
            await store(cache, f, [(rng.randrange(64), payload[:n])], ORIGIN_PREFETCH)
        else:
            n = 0
            g = rng.randrange(100, f + 1)
            await read(cache, g, 0, 512 * BLOCK_SIZE)
        written += n
        f += 1
        if f % 200 == 0:
            sizes.append(disk_use(cache.path)[0])
    return sizes


async def run_space(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    nbytes = args.space_mib * MIB
    out: dict[str, Any] = {}
    for name in ("sequential", "random-4k", "churn"):
        path = work / f"space-{name}"
        cache = BlockCache(path, nbytes)
        try:
            rng = random.Random(9)
            async with writer(cache):
                if name == "sequential":
                    await fill_sequential(cache, nbytes)
                elif name == "random-4k":
                    await fill_random(cache, nbytes, rng)
                else:
                    sizes = await churn(cache, 8 * nbytes, rng)
                    step = max(1, len(sizes) // 12)
                    out["churn_file_mib_over_time"] = [round(n / MIB) for n in sizes[::step]]
            used = cache.statistics().bytes_used
        finally:
            cache.close()
        size, alloc = disk_use(path)
        out[name] = {
            "bytes_used": used, "file_bytes": size, "allocated_bytes": alloc,
            "file_per_byte": round(size / used, 4),
            "allocated_per_byte": round(alloc / used, 4),
            "file_per_quota": round(size / nbytes, 4),
        }
    return out


def print_space(res: dict[str, Any], space_mib: int) -> None:
    print(f"\nspace on disk per cached byte (quota {space_mib} MiB)")
    print("| fill | cached MiB | data.mdb MiB | size / cached | allocated / cached "
          "| size / quota |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in ("sequential", "random-4k", "churn"):
        r = res[name]
        print(f"| {name} | {r['bytes_used'] / MIB:.1f} | {r['file_bytes'] / MIB:.1f} | "
              f"{r['file_per_byte']:.3f} | {r['allocated_per_byte']:.3f} | "
              f"{r['file_per_quota']:.3f} |")
    print("churn: data.mdb MiB over time:", res["churn_file_mib_over_time"])


# -- main ---------------------------------------------------------------------------


def goal_value(record: dict[str, Any], goal: bl.Goal) -> tuple[float | None, str]:
    ev, space = record.get("eviction"), record.get("space")
    kind, _, which = goal.key.partition("/")
    if kind == "space":
        return (space[which]["file_per_byte"], "") if space else (None, "")
    if ev is None:
        return None, ""
    if kind == "over_quota":
        worst = max(ev.values(), key=lambda r: r["most_bytes_used"] - r["quota_bytes"])
        return (worst["most_bytes_used"] - worst["quota_bytes"]) / CHUNK_SIZE, ""
    if kind == "ideal":
        r = ev[which]
        later = r["spokefs"][1:]
        lru = r["lru"][1:]
        if not later:
            return None, "needs --epochs 2 or more"
        mean = sum(later) / len(later)
        return mean / r["ideal"], (f"spokefs {mean:.2f}, LRU {sum(lru) / len(lru):.2f}, "
                                   f"ideal {r['ideal']:.2f}")
    hot = ev["hot-4x"]["spokefs_hot"][1:]
    return (min(hot), "") if hot else (None, "needs --epochs 2 or more")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-mib", type=int, default=32)
    ap.add_argument("--file-chunks", type=int, default=8, help="chunks (64 KiB) per file")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--space-mib", type=int, default=128)
    ap.add_argument("--only", choices=["eviction", "space"])
    ap.add_argument("--work-dir", default="/var/tmp")
    ap.add_argument("--results", type=Path, default=RESULTS, help="JSON lines appended here")
    args = ap.parse_args()
    started = time.monotonic()
    record: dict[str, Any] = bl.run_info("bench_eviction.py") | {
        "block_size": BLOCK_SIZE, "chunk_blocks": CHUNK_BLOCKS,
        "config": {k: v for k, v in vars(args).items() if k not in ("work_dir", "results")},
    }
    with tempfile.TemporaryDirectory(prefix="bench-eviction-", dir=args.work_dir) as tmp:
        work = Path(tmp)
        if args.only in (None, "eviction"):
            record["eviction"] = trio.run(run_eviction, args, work)
            print_eviction(record["eviction"], args.cache_mib)
        if args.only in (None, "space"):
            record["space"] = trio.run(run_space, args, work)
            print_space(record["space"], args.space_mib)
    record["seconds"] = round(time.monotonic() - started, 1)
    grades = bl.grade(GOALS, [None], lambda g, _: goal_value(record, g))
    record["graded"] = bl.print_goals(["Cache lifecycle"], [CAPACITY, EVICTION], grades)
    record["grades"] = bl.grades_json(grades)
    bl.save_record(args.results, record, f"{record['seconds']} s; ")


if __name__ == "__main__":
    main()
