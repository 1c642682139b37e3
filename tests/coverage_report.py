"""Print the suite's coverage of the data path (run by .ci/run after the tests).

Usage, after ``coverage run -m pytest`` and ``coverage combine``::

    python tests/coverage_report.py [--fail-under PCT]

Prints coverage's table for the data-path modules (statements, missed, branches, partial
branches; the table's percentage counts lines and branches together), then one line with the
data path's share of lines and of branches, and one with the same figures for all of
spokefs and hubd. With ``--fail-under``, exits 2 when the data path's share of lines is below
PCT. Not a test module: pytest collects ``test_*.py`` only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import coverage

# The data path: the spoke's read path and its cache, the protocol, the hub's readers.
DATA_PATH = [
    "spokefs/read/reader.py",
    "spokefs/read/block_source.py",
    "spokefs/read/claims.py",
    "spokefs/read/grid.py",
    "spokefs/read/prefetcher.py",
    "spokefs/read/dir_fill.py",
    "spokefs/read/stream.py",
    "spokefs/hub/client.py",
    "spokefs/hub/bodies.py",
    "spokefs/fuse/ops.py",
    "spokefs/fuse/inode_streams.py",
    "spokefs/namespace/replica.py",
    "spokefs/cache/*.py",
    "spokefs/protocol/*.py",
    "hubd/framed.py",
    "hubd/range_reader.py",
    "hubd/members.py",
    "hubd/s3/reader.py",
    "hubd/routes.py",
]

REPO = Path(__file__).resolve().parent.parent


def _totals(cov: coverage.Coverage, include: list[str] | None) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "cov.json"
        cov.json_report(outfile=str(out), include=include)
        return json.loads(out.read_text())["totals"]


def _line(name: str, t: dict[str, int]) -> str:
    lines = 100.0 * t["covered_lines"] / max(t["num_statements"], 1)
    branches = 100.0 * t["covered_branches"] / max(t["num_branches"], 1)
    return (f"{name}: {lines:.1f} % of lines ({t['covered_lines']}/{t['num_statements']}), "
            f"{branches:.1f} % of branches ({t['covered_branches']}/{t['num_branches']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--fail-under", type=float, default=None, metavar="PCT",
                    help="exit 2 when the data path's share of lines is below PCT")
    args = ap.parse_args(argv)
    include = [str(REPO / p) for p in DATA_PATH]
    cov = coverage.Coverage()
    cov.load()
    print("coverage of the data path (Cover counts lines and branches together):")
    cov.report(include=include, skip_empty=True, precision=1)
    data_path = _totals(cov, include)
    print(_line("data path coverage", data_path))
    print(_line("all of spokefs and hubd", _totals(cov, None)))
    share = 100.0 * data_path["covered_lines"] / max(data_path["num_statements"], 1)
    if args.fail_under is not None and share < args.fail_under:
        print(f"coverage: FAIL: the data path has {share:.1f} % of lines covered, "
              f"under {args.fail_under} %", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
