"""The data sets the benchmarks read, each built once under a work dir and reused.

- ``ensure_tree``: a namespace of N entries (dirs of 100 files, every 10th file 1-100 bytes,
  the rest empty), with its ``find | wc -l`` count (bench_foundation's metadata part and
  bench_longlink's meta workload);
- ``ensure_files``: F files of M MiB of random bytes (bench_foundation's seqread);
- ``ensure_data``: bench_longlink's large, random-access and small files, at the sizes of
  ``FULL`` or ``SMOKE`` (a tiny set for the CI smoke test), with the small files' xxh3;
- ``ensure_dataset``: an ImageNet-like set (lognormal sizes, median 110 KiB, in class
  directories) with a manifest of sizes and xxh3 digests (train.py, bench_workers.py).

A data set is complete only once its marker (count, ``.done`` or manifest) is written, so an
interrupted build is rebuilt, not reused.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from workloads import find_count

KIB, MIB = 1024, 1024 * 1024
FILES_PER_DIR = 100
MEDIAN_BYTES, SIGMA = 110 * KIB, 0.6  # ensure_dataset's sizes
MIN_BYTES, MAX_BYTES = 16 * KIB, MIB


def ensure_tree(work: Path, entries: int) -> tuple[Path, int]:
    """A tree of ``entries`` entries (dirs of 100 files; every 10th file 1-100 bytes), built
    once. Returns the root and its ``find | wc -l`` count (entries + 1 for the root)."""
    root, marker = work / f"tree-{entries}", work / f"tree-{entries}.count"
    if marker.exists():
        return root, int(marker.read_text())
    shutil.rmtree(root, ignore_errors=True)
    made, d = 0, 0
    while made < entries:
        sub = root / f"d{d:05d}"
        sub.mkdir(parents=True)
        made, d = made + 1, d + 1
        for i in range(min(FILES_PER_DIR, entries - made)):
            (sub / f"f{i:03d}").write_bytes(b"x" * (i % 100 + 1) if i % 10 == 0 else b"")
            made += 1
    count = find_count(root, 3600)
    assert count is not None
    marker.write_text(str(count))
    return root, count


def write_random(path: Path, mib: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for _ in range(mib):
            f.write(os.urandom(MIB))


def ensure_files(work: Path, files: int, file_mib: int) -> Path:
    """``files`` files of ``file_mib`` MiB of random data (shard-000.bin, ...), built once."""
    root, marker = work / f"seq-{files}x{file_mib}M", work / f"seq-{files}x{file_mib}M.done"
    if marker.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for i in range(files):
        write_random(root / f"shard-{i:03d}.bin", file_mib)
    subprocess.run(["sync"], check=True)
    marker.touch()
    return root


@dataclass(frozen=True)
class Sizes:
    """bench_longlink's data set: ``seq_files`` large files of ``seq_mib`` (and of
    ``seq_quick_mib`` for --quick), one file of ``rand_mib`` for random reads, and
    ``small_dirs`` x ``small_per_dir`` files of 16-128 KiB (uniform; mean ~72 KiB)."""

    name: str
    seq_files: int = 2
    seq_mib: int = 512
    seq_quick_mib: int = 128
    rand_mib: int = 1024
    small_dirs: int = 10
    small_per_dir: int = 1000


FULL = Sizes("longlink-data")
SMOKE = Sizes("longlink-data-smoke", seq_mib=8, seq_quick_mib=8, rand_mib=16, small_dirs=1,
              small_per_dir=50)
SMALL_MIN, SMALL_MAX = 16 * KIB, 128 * KIB


@dataclass
class Data:
    root: Path
    seq: list[str]  # relative paths of the large files, in read order
    seq_quick: list[str]  # smaller ones for --quick (whole files, so link bytes stay honest)
    rand: str  # the random-access file
    small: dict[str, tuple[int, str]]  # relative path -> (size, xxh3_64 hex digest)


def _build_small(root: Path, sizes: Sizes) -> dict[str, tuple[int, str]]:
    rng = random.Random(1234)
    small: dict[str, tuple[int, str]] = {}
    for d in range(sizes.small_dirs):
        (root / "small" / f"d{d:02d}").mkdir(parents=True, exist_ok=True)
        for i in range(sizes.small_per_dir):
            rel = f"small/d{d:02d}/f{i:04d}.bin"
            data = os.urandom(rng.randint(SMALL_MIN, SMALL_MAX))
            (root / rel).write_bytes(data)
            small[rel] = (len(data), xxhash.xxh3_64_hexdigest(data))
    return small


def _write_files(root: Path, folder: str, count: int, mib: int) -> list[str]:
    rels = [f"{folder}/shard-{i}.bin" for i in range(count)]
    for rel in rels:
        write_random(root / rel, mib)
    return rels


def _write_rand(root: Path, mib: int) -> str:
    rel = "rand/file-1G.bin" if mib == 1024 else f"rand/file-{mib}M.bin"
    write_random(root / rel, mib)
    return rel


def ensure_data(work: Path, sizes: Sizes = FULL) -> Data:
    """Built once, part by part, under work/NAME (manifest: work/NAME.json): seq/,
    seq-quick/, rand/ and small/; all random bytes."""
    root, manifest = work / sizes.name, work / f"{sizes.name}.json"
    m = json.loads(manifest.read_text()) if manifest.exists() else {}
    parts = {
        "seq": lambda: _write_files(root, "seq", sizes.seq_files, sizes.seq_mib),
        "seq_quick": lambda: _write_files(root, "seq-quick", sizes.seq_files,
                                          sizes.seq_quick_mib),
        "rand": lambda: _write_rand(root, sizes.rand_mib),
        "small": lambda: _build_small(root, sizes),
    }
    for name, build in parts.items():
        if name not in m:
            print(f"building {name} under {root} (once)", flush=True)
            m[name] = build()
            subprocess.run(["sync"], check=True)
            manifest.write_text(json.dumps(m))
    return Data(root, m["seq"], m["seq_quick"], m["rand"],
                {k: tuple(v) for k, v in m["small"].items()})


# -- an ImageNet-like data set (train.py, bench_workers.py) -----------------------------------


@dataclass
class DataSet:
    """An ImageNet-like dataset on local disk and its manifest."""

    root: Path
    rels: list[str]
    sizes: list[int]
    digests: list[str]

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def mean_bytes(self) -> float:
        return self.total_bytes / len(self.sizes)

    def describe(self) -> str:
        dirs = len({r.split("/", 1)[0] for r in self.rels})
        return (f"{len(self.rels)} files in {dirs} dirs, {self.total_bytes / 1e6:.0f} MB, "
                f"mean {self.mean_bytes / KIB:.0f} KiB, median "
                f"{statistics.median(self.sizes) / KIB:.0f} KiB")


def file_sizes(files: int, seed: int) -> list[int]:
    """Lognormal sizes, median 110 KiB, sigma 0.6 (mean ~132 KiB), clipped to 16 KiB-1 MiB."""
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(mean=math.log(MEDIAN_BYTES), sigma=SIGMA, size=files)
    return [int(s) for s in np.clip(sizes, MIN_BYTES, MAX_BYTES)]


def _write_dataset(root: Path, files: int, dirs: int, seed: int) -> list[list[Any]]:
    rng = np.random.default_rng(seed + 1)
    entries = []
    for i, size in enumerate(file_sizes(files, seed)):
        rel = f"n{i % dirs:04d}/img-{i:06d}.bin"
        data = rng.bytes(size)
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        entries.append([rel, size, xxhash.xxh3_64_hexdigest(data)])
    return entries


def ensure_dataset(work: Path, files: int, dirs: int, seed: int) -> DataSet:
    """Generated once under work (``imagenet-<files>x<dirs>-s<seed>/`` and its ``.json``
    manifest), then reused."""
    name = f"imagenet-{files}x{dirs}-s{seed}"
    root, manifest = work / name, work / f"{name}.json"
    if not manifest.exists():
        print(f"generating {files} files in {dirs} dirs under {root} (once)", flush=True)
        shutil.rmtree(root, ignore_errors=True)
        entries = _write_dataset(root, files, dirs, seed)
        subprocess.run(["sync"], check=True)
        manifest.write_text(json.dumps({"files": entries, "seed": seed}))
    entries = json.loads(manifest.read_text())["files"]
    return DataSet(root, [e[0] for e in entries], [e[1] for e in entries],
                   [e[2] for e in entries])
