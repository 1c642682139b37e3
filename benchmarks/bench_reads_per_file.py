#!/usr/bin/env python3
"""FUSE READ requests per file for the readers our users run, through a real spoke whose
cache already holds every file (issue 22, "one READ per file").

A real hubd and a real spoke mount (its default options); every file is read once (``cat``)
so the spoke's cache holds it, then each workload runs with the kernel's page cache of its
files dropped (``benchlib.page_cache.drop_pages``: DONTNEED, checked with mincore), and the
spoke's own counters say what it served: ``spokefs_reads_total`` (FUSE READ requests) and
``spokefs_read_bytes_total`` (bytes returned). Counts, not times: the figures do not
depend on a busy machine.

Workloads:

- ``pil``: ``PIL.Image.open(path).convert("RGB")`` on ~110 KiB JPEGs (generated with PIL;
  NOT MEASURED without it). Reads per file.
- ``tar``: Python ``tarfile`` reading every member of ~110 KiB tar files (8 members each).
  Reads per file.
- ``cat``: ``cat FILE > /dev/null`` over the same JPEGs. Reads per file.
- ``stdio-8k``: ``os.read(fd, 8192)`` to the end over the same JPEGs: what a C reader through
  ``fread`` asks of the kernel (glibc's stdio buffer is 8 KiB whatever ``st_blksize`` says),
  e.g. libjpeg behind OpenCV's ``imread``. Reads per file.
- ``rand-pread``: ``os.pread`` of 4 KiB at random 4 KiB-aligned offsets of one large file
  (``--large-mib``, 64 MiB). Bytes served / bytes asked (the over-read).
- ``rand-python``: the same offsets through one ``open(path, "rb")`` (Python's buffered
  reader: ``seek`` then ``read(4096)``). Bytes served / bytes asked.

One JSON line is appended to benchmarks/results/reads_per_file.jsonl. ``--src DIR`` runs the
hub and the spoke of another checkout (e.g. a worktree of the commit before a change) on the
same data, for a before/after table.

    python3 benchmarks/bench_reads_per_file.py [--files 200] [--large-mib 64]
        [--random-reads 512] [--src DIR] [--work-dir /var/tmp] [--results FILE] [--smoke]
"""

from __future__ import annotations

import argparse
import io
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import benchlib as bl  # noqa: E402
from benchlib.page_cache import drop_pages  # noqa: E402

from tests.helpers.treegen import tar_of_members  # noqa: E402

RESULTS = HERE / "results" / "reads_per_file.jsonl"
KIB, MIB = 1024, 1024 * 1024
ISSUE = "issue 22: One READ per file for the readers our users run"

try:
    from PIL import Image
except ImportError:  # the pil workload is then NOT MEASURED
    Image = None


# -- the data set ---------------------------------------------------------------------------


def _jpeg(rng: random.Random) -> bytes:
    """A photo-like JPEG of about 110 KiB (640x480 noise over a gradient, quality 75-85)."""
    assert Image is not None
    noise = Image.effect_noise((640, 480), rng.uniform(30, 50)).convert("RGB")
    grad = Image.linear_gradient("L").resize((640, 480)).convert("RGB")
    out = io.BytesIO()
    Image.blend(noise, grad, 0.5).save(out, "JPEG", quality=rng.randint(75, 85))
    return out.getvalue()


def build(root: Path, files: int, large_mib: int) -> dict[str, list[str]]:
    """The data set under ``root`` (built once; reused when present). Returns the files of
    each kind, relative to ``root``."""
    rng = random.Random(22)
    kinds: dict[str, list[str]] = {"jpeg": [], "tar": [], "large": ["large/rand.bin"]}
    for kind, make in (("jpeg", _jpeg if Image is not None else None), ("tar", tar_of_members)):
        if make is None:
            continue
        (root / kind).mkdir(parents=True, exist_ok=True)
        for i in range(files):
            rel = f"{kind}/{i:05d}.{kind}"
            if not (root / rel).exists():
                (root / rel).write_bytes(make(rng))
            kinds[kind].append(rel)
    large = root / kinds["large"][0]
    if not large.exists() or large.stat().st_size != large_mib * MIB:
        large.parent.mkdir(parents=True, exist_ok=True)
        with large.open("wb") as f:
            for _ in range(large_mib):
                f.write(rng.randbytes(MIB))
    return kinds


# -- the workloads --------------------------------------------------------------------------


def read_pil(paths: list[Path]) -> int:
    assert Image is not None
    for p in paths:
        with Image.open(p) as img:
            img.convert("RGB")
    return 0


def read_tar(paths: list[Path]) -> int:
    for p in paths:
        with tarfile.open(p) as tf:
            for m in tf.getmembers():
                f = tf.extractfile(m)
                if f is not None:
                    f.read()
    return 0


def read_cat(paths: list[Path]) -> int:
    for p in paths:
        subprocess.run(["cat", str(p)], stdout=subprocess.DEVNULL, check=True)
    return 0


def _offsets(size: int, count: int) -> list[int]:
    rng = random.Random(4096)
    return [rng.randrange(size // (4 * KIB)) * 4 * KIB for _ in range(count)]


def read_stdio(paths: list[Path]) -> int:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while os.read(fd, 8 * KIB):
                pass
        finally:
            os.close(fd)
    return 0


def rand_pread(path: Path, count: int) -> int:
    """``count`` 4 KiB preads at random aligned offsets; the bytes asked."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for off in _offsets(os.fstat(fd).st_size, count):
            os.pread(fd, 4 * KIB, off)
    finally:
        os.close(fd)
    return count * 4 * KIB


def rand_python(path: Path, count: int) -> int:
    """The same reads through Python's buffered reader (``seek``, ``read(4096)``)."""
    with path.open("rb") as f:
        for off in _offsets(os.fstat(f.fileno()).st_size, count):
            f.seek(off)
            f.read(4 * KIB)
    return count * 4 * KIB


def measure(metrics_url: str | None, paths: list[Path],
            run: Callable[[], int]) -> dict[str, Any]:
    """Run one workload on page-cache-cold files; what the spoke served for it."""
    for p in paths:  # checked gone (DONTNEED alone is best effort), so every read reaches it
        drop_pages(p)
    before = bl.scrape_counted(paths[0], metrics_url, ("spokefs_read",), sum_labels=True)
    asked = run()
    after = bl.scrape_counted(paths[0], metrics_url, ("spokefs_read",), sum_labels=True)

    def delta(name: str) -> int:
        return round(after.get(name, 0.0) - before.get(name, 0.0))

    reads, served = delta("spokefs_reads_total"), delta("spokefs_read_bytes_total")
    file_bytes = sum(p.stat().st_size for p in paths)
    return {"files": len(paths), "reads": reads, "bytes_served": served,
            "file_bytes": file_bytes, "bytes_asked": asked or None,
            "reads_per_file": reads / len(paths),
            "over_read": served / asked if asked else None}


GOALS = (
    bl.Goal(ISSUE, "pil", "PIL Image.open().convert('RGB'): FUSE READs per ~110 KiB JPEG",
            "<=", 1.0),
    bl.Goal(ISSUE, "tar", "tarfile, every member: FUSE READs per ~110 KiB tar", "<=", 1.0),
    bl.Goal(ISSUE, "cat", "cat: FUSE READs per ~110 KiB file", "<=", 1.0),
    bl.Goal(ISSUE, "stdio-8k", "8 KiB reads (C stdio): FUSE READs per ~110 KiB file", "<=", 1.0),
    bl.Goal(ISSUE + ", without over-reading large files read at random", "rand-pread",
            "random 4 KiB preads of a large file: bytes served / bytes asked", "", 0),
    bl.Goal(ISSUE + ", without over-reading large files read at random", "rand-python",
            "random 4 KiB reads through Python's buffered reader: bytes served / bytes asked",
            "", 0),
)


def run(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], bl.Unmounted | None]:
    """Build the data, mount it, warm the spoke's cache, measure each workload; the
    workloads' figures and how the spoke's unmount went."""
    deadline = bl.Deadline(args.max_seconds)
    root = work / "data"
    kinds = build(root, args.files, args.large_mib)
    logs = work / "logs"
    out: dict[str, Any] = {}
    src = args.src
    with bl.run_hub(root, logs / "hubd.log", deadline, src=src) as hub, \
            bl.spoke_mount(hub.url, work / "mnt", work / "cache", logs / "spokefs.log",
                           deadline, cache_size="2G", extra_args=args.spoke_args,
                           src=src) as mount:
        mnt = mount.path
        every = [mnt / rel for rels in kinds.values() for rel in rels]
        read_cat(every)  # the spoke's cache now holds every file
        jpegs = [mnt / rel for rel in kinds["jpeg"]]
        tars = [mnt / rel for rel in kinds["tar"]]
        large = mnt / kinds["large"][0]
        url = mount.metrics_url
        if jpegs:
            out["pil"] = measure(url, jpegs, lambda: read_pil(jpegs))
        out["tar"] = measure(url, tars, lambda: read_tar(tars))
        plain = jpegs or tars
        out["cat"] = measure(url, plain, lambda: read_cat(plain))
        out["stdio-8k"] = measure(url, plain, lambda: read_stdio(plain))
        out["rand-pread"] = measure(url, [large], lambda: rand_pread(large, args.random_reads))
        out["rand-python"] = measure(url, [large],
                                     lambda: rand_python(large, args.random_reads))
    return out, mount.result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=200, help="JPEGs and tars, of each")
    ap.add_argument("--large-mib", type=int, default=64)
    ap.add_argument("--random-reads", type=int, default=512)
    ap.add_argument("--work-dir", default="/var/tmp")
    ap.add_argument("--max-seconds", type=float, default=900)
    ap.add_argument("--spoke-arg", dest="spoke_args", action="append", default=[],
                    help="an extra argument for spokefs mount (repeatable)")
    ap.add_argument("--src", type=Path, help="the checkout whose hubd and spokefs to run "
                    "(default: this one)")
    ap.add_argument("--smoke", action="store_true", help="8 files of each, an 8 MiB file")
    ap.add_argument("--results", type=Path, default=RESULTS, help="JSON lines appended here")
    args = ap.parse_args()
    if args.smoke:
        args.files, args.large_mib, args.random_reads = 8, 8, 64
    args.src = args.src.resolve() if args.src else bl.REPO
    record: dict[str, Any] = bl.run_info("bench_reads_per_file.py") | {
        "src": {"path": str(args.src), **bl.git_info(args.src)}}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="reads-per-file-", dir=args.work_dir) as tmp:
        workloads, unmounted = run(args, Path(tmp))

    def value_of(goal: bl.Goal, rtt: int | None) -> tuple[float | None, str]:
        row = workloads.get(goal.key)
        if row is None:
            return None, "PIL is not installed" if goal.key == "pil" else "not run"
        if row["over_read"] is not None:
            return round(row["over_read"], 3), f"{row['bytes_served']} B served"
        return round(row["reads_per_file"], 3), f"{row['reads']} READs, {row['files']} files"

    grades = bl.grade(GOALS, [None], value_of)
    rows = [[name, str(r["files"]), str(r["reads"]), f"{r['reads_per_file']:.2f}",
             f"{r['over_read']:.2f}" if r["over_read"] is not None else "-"]
            for name, r in workloads.items()]
    print(bl.markdown_table(["workload", "files", "FUSE READs", "READs/file",
                             "served/asked"], rows))
    print(bl.format_grades(grades))
    clean = unmounted is not None and unmounted.clean and unmounted.exit_code == 0
    record |= {"seconds": round(time.monotonic() - started, 1), "workloads": workloads,
               "grades": bl.grades_json(grades), "clean_unmount": clean}
    bl.save_record(args.results, record, f"{record['seconds']} s; ")
    if not clean:
        sys.exit(f"the spoke's unmount was not clean: {unmounted}")


if __name__ == "__main__":
    main()
