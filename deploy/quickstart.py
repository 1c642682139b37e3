"""The main job on an embedded sample dataset, end to end on this machine.

Builds a small image-classification-like dataset (shards, labels, an index), serves it with
hubd on loopback, mounts it with spokefs, reads every file through the mount twice (cold from
the hub, then warm from the spoke's cache with the kernel page cache dropped), checks every
byte against the source, prints the cache metrics, and unmounts. Everything it starts is
stopped, also on failure.

Usage: python deploy/quickstart.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

_SEED = 20261202


def make_sample_dataset(root: Path) -> int:
    """A deterministic sample dataset; returns its size in bytes."""
    rng = random.Random(_SEED)
    total = 0
    for split, shards in (("train", 12), ("val", 3)):
        d = root / split
        d.mkdir(parents=True)
        for i in range(shards):
            data = rng.randbytes(rng.randrange(1 << 20, 3 << 20))
            (d / f"shard-{i:05d}.tar").write_bytes(data)
            total += len(data)
        for i in range(200):  # many small samples, like a folder of JPEGs
            data = rng.randbytes(rng.randrange(16 << 10, 128 << 10))
            (d / f"sample-{i:05d}.jpg").write_bytes(data)
            total += len(data)
    labels = "".join(f"sample-{i:05d}.jpg,{rng.randrange(10)}\n" for i in range(200))
    (root / "labels.csv").write_text(labels)
    (root / "README").write_text("spokefs sample dataset: train/ and val/ shards and samples\n")
    os.symlink("train", root / "latest")
    return total + len(labels)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_tree(root: Path) -> tuple[int, dict[str, str]]:
    total, sums = 0, {}
    for dirpath, _, files in os.walk(root):
        for name in sorted(files):
            path = Path(dirpath, name)
            data = path.read_bytes()
            total += len(data)
            sums[str(path.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return total, sums


def drop_page_cache() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        print("  (cannot drop the page cache here: warm figures include it)")


def metric_lines(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    keep = re.compile(
        r"^spokefs_(reads_total|read_bytes_total|block_(hits|misses)_total|cache_bytes|"
        r"cache_capacity_bytes|link_bytes_total|namespace_entries|hub_requests_total)"
    )
    return [line for line in text.splitlines() if keep.match(line)]


def run(work: Path) -> None:
    src, mnt, cache = work / "dataset", work / "mnt", work / "cache"
    mnt.mkdir()
    size = make_sample_dataset(src)
    print(f"sample dataset: {size / 1e6:.1f} MB in {src}")
    py = sys.executable
    hub = subprocess.Popen(
        [py, "-m", "hubd", "serve", str(src), "--listen", "127.0.0.1:0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, text=True,
    )
    mounted = False
    try:
        line = hub.stdout.readline() if hub.stdout else ""
        m = re.search(r"at (http://\S+) \(", line)
        if not m:
            raise SystemExit(f"hubd did not start: {line!r}")
        url = m.group(1)
        print(line.strip())
        mport = free_port()
        out = subprocess.run(
            [py, "-m", "spokefs", "mount", url, str(mnt), "--cache-dir", str(cache),
             "--cache-size", "1G", "--metrics-port", str(mport), "--metrics-addr", "127.0.0.1",
             "--daemon", "--log-file", str(work / "spokefs.log")],
            check=True, capture_output=True, text=True,
        )
        mounted = True
        print(out.stdout.strip())
        entries = sum(1 + len(f) for _, _, f in os.walk(mnt))
        print(f"walk of the mount: {entries} entries (namespace is local: no data moved yet)")
        _, want = read_tree(src)
        for label in ("cold (from the hub)", "warm (from the spoke cache)"):
            drop_page_cache()
            started = time.monotonic()
            nbytes, got = read_tree(mnt)
            secs = time.monotonic() - started
            status = "all bytes match" if got == want else "MISMATCH"
            print(f"read {label}: {nbytes / 1e6:.1f} MB in {secs:.2f}s "
                  f"({nbytes / 1e6 / secs:.0f} MB/s), {status}")
            if got != want:
                raise SystemExit("bytes read through the mount differ from the source")
        print(f"cache metrics (http://127.0.0.1:{mport}/metrics):")
        for metric in metric_lines(mport):
            print("  " + metric)
    finally:
        if mounted:
            subprocess.run([py, "-m", "spokefs", "umount", str(mnt)], check=False)
            print(f"unmounted {mnt}")
        hub.send_signal(signal.SIGTERM)
        hub.wait(timeout=10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", type=Path, help="work in this (new) dir and keep it")
    args = p.parse_args()
    if args.keep:
        args.keep.mkdir(parents=True)
        run(args.keep)
        return
    work = Path(tempfile.mkdtemp(prefix="spokefs-quickstart-"))
    try:
        run(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
