#!/usr/bin/env python3
"""Read the first ``--limit`` files named on stdin whole, one at a time, at most ``--rate``
files per second: a reader whose files come slowly, as a job that decodes each sample takes
them (``bench_workers.py``'s ``paced`` workload). Takes all of stdin first (so nothing
upstream sees a closed pipe). Exits 1 with the path if a read fails.

    find ROOT -type f | LC_ALL=C sort | python benchmarks/paced_read.py --rate 300 --limit 2400
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, required=True, help="files per second, at most")
    ap.add_argument("--limit", type=int, default=None, help="files to read, at most")
    args = ap.parse_args()
    paths = sys.stdin.read().splitlines()[:args.limit]
    t0 = time.monotonic()
    for i, path in enumerate(paths):
        try:
            with open(path, "rb", buffering=0) as f:
                f.readall()
        except OSError as exc:
            print(f"paced_read: {path}: {exc.strerror}", file=sys.stderr)
            return 1
        wait = t0 + (i + 1) / args.rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    return 0


if __name__ == "__main__":
    sys.exit(main())
