"""List every object under a prefix, several "directories" at once.

One ListObjectsV2 request returns at most 1,000 keys and each page needs the previous
page's token, so a plain listing of 1M keys is 1,000 requests one after another. To list
in parallel, the key space is split by directory:

1. List the export prefix with delimiter ``/``: its objects (keys with no further ``/``)
   are taken as they are, its common prefixes are the directories to list.
2. While there are fewer directories than ``workers``, for at most ``MAX_SPLIT_DEPTH``
   levels, split them the same way one level deeper (in parallel).
3. List each directory in full (no delimiter), ``workers`` at a time.

Every key is in exactly one place: an object of a split level, or below exactly one listed
directory. This needs nothing of the server's key order (S3 sorts by UTF-8 bytes; SeaweedFS
walks its directories, so ``a/x`` comes before ``a.txt``: a listing split into key ranges
would be wrong there).

A directory costs at least one request, so a split pays only when directories hold many
keys. When a level has more than ``MAX_SPLIT_PREFIXES`` directories (e.g. one directory per
sample), the split is abandoned and the prefix is listed flat, one stream.

Cost per listing of N keys: ``ceil(N / 1000)`` pages, plus one per directory listed whose
last page is partial (at most ``MAX_SPLIT_PREFIXES``), plus the split levels' own pages.
For 1M keys in 1,000 top-level directories: ~2,001 LIST requests; flat, 1,000; at
$0.005 per 1,000 on AWS S3 Standard, one cent at most.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from hubd.s3.client import ObjectInfo, S3Client
from hubd.s3.errors import first_error

T = TypeVar("T")

MAX_SPLIT_DEPTH = 2
"""Split at most two levels below the export prefix (``bucket/train/shard-00/``)."""
MAX_SPLIT_PREFIXES = 1000
"""More directories than one delimiter page holds: listing them one by one could cost
far more requests than keys/1000 (a directory per sample), so the prefix is listed flat."""
DEFAULT_WORKERS = 8
"""Parallel LIST streams. Each page costs a round trip plus the server's time: at 20 ms RTT
8 streams listed 100k keys 2.1x faster than one (benchmarks/bench_s3_list.py); on loopback
the server's CPU is the limit and they neither help nor cost much. Far below the 3,500
LIST/s that S3 allows per prefix."""


@dataclass(frozen=True, slots=True)
class Listing:
    """Every object under a prefix, and what listing it cost.

    Attributes:
        objects: in no particular order.
        pages: LIST requests answered (split levels included).
        streams: listings run at once at the widest step (1 for a flat listing).
        seconds: wall time of the whole listing.
    """

    objects: list[ObjectInfo]
    pages: int
    streams: int
    seconds: float


async def _gather(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` in a task group; the first failure (not a group) is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except ExceptionGroup as group_error:
        raise first_error(group_error) from None
    return [t.result() for t in tasks]


async def _all_pages(client: S3Client, bucket: str, prefix: str, delimiter: str = "",
                     limit: int | None = None) -> tuple[list[ObjectInfo], list[str]]:
    """Objects and common prefixes under ``prefix``; stops early once more than ``limit``
    common prefixes are seen (the caller then lists flat)."""
    objects: list[ObjectInfo] = []
    prefixes: list[str] = []
    token = None
    while True:
        page = await client.list_page(bucket, prefix, delimiter=delimiter, token=token)
        objects += page.objects
        prefixes += page.prefixes
        if page.next_token is None or (limit is not None and len(prefixes) > limit):
            return objects, prefixes
        token = page.next_token


async def _split(client: S3Client, bucket: str, prefix: str,
                 workers: int) -> tuple[list[ObjectInfo], list[str], int] | None:
    """The objects of the split levels, the directories left to list, and the widest
    split level; None: go flat."""
    objects, dirs = await _all_pages(client, bucket, prefix, "/", MAX_SPLIT_PREFIXES)
    width = 1
    for _ in range(MAX_SPLIT_DEPTH - 1):
        if len(dirs) >= workers or not dirs:
            break
        width = max(width, len(dirs))
        tasks = await _gather([_all_pages(client, bucket, d, "/", MAX_SPLIT_PREFIXES)
                               for d in dirs])
        dirs = []
        for level_objects, level_dirs in tasks:
            objects += level_objects
            dirs += level_dirs
    if len(dirs) > MAX_SPLIT_PREFIXES:
        return None
    return objects, dirs, width


async def list_objects(client: S3Client, bucket: str, prefix: str,
                       workers: int = DEFAULT_WORKERS) -> Listing:
    """Every object under ``prefix``, listed by up to ``workers`` parallel streams.

    Raises:
        The ``S3Error``s of ``S3Client.list_page``: the listing is all or nothing.
    """
    start = time.perf_counter()
    pages_before = client.stats.list_pages
    split = await _split(client, bucket, prefix, workers) if workers > 1 else None
    if split is None:
        objects, _ = await _all_pages(client, bucket, prefix)
        streams = 1
    else:
        objects, dirs, width = split
        slots = asyncio.Semaphore(workers)

        async def one(d: str) -> list[ObjectInfo]:
            async with slots:
                return (await _all_pages(client, bucket, d))[0]

        for found in await _gather([one(d) for d in dirs]):
            objects += found
        streams = max(width, min(len(dirs), workers))
    return Listing(objects, client.stats.list_pages - pages_before, streams,
                   time.perf_counter() - start)
