"""CI smoke tests of the bucket-export benchmarks (``benchmarks/bench_s3_*.py``), in tiny
sizes, each against its own real SeaweedFS; the same checks as ``test_bench_smoke.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.test_bench_smoke import check_grades, run_script


def test_bench_s3_list_small(tmp_path: Path) -> None:
    record = run_script("bench_s3_list.py", tmp_path, "--keys", "1200", "--dirs", "3",
                        "--runs", "1", "--delay-ms", "5")
    check_grades(record)
    assert record["figures"]["flat_pages"]["median"] == 2  # 1,000 + 200 keys
    assert {g["verdict"] for g in record["grades"]} == {"REPORTED"}


def test_bench_s3_list_tree(tmp_path: Path) -> None:
    record = run_script("bench_s3_list.py", tmp_path, "--tree-keys", "5000")
    assert record["figures"]["peak_rss_mb"] > 0


def test_bench_s3_hub_small(tmp_path: Path) -> None:
    record = run_script("bench_s3_hub.py", tmp_path, "--runs", "1", "--big-files", "2",
                        "--big-mib", "4", "--small-files", "20", "--small-kib", "4")
    check_grades(record)
    figures = record["figures"]
    assert figures["s3_big_wrong_bytes"]["median"] == figures["dir_big_wrong_bytes"]["median"] == 0


@pytest.mark.fuse
def test_bench_s3_link_small(tmp_path: Path) -> None:
    record = run_script("bench_s3_link.py", tmp_path, "--runs", "1", "--shards", "2",
                        "--shard-mib", "4", "--small", "20", "--small-kib", "4",
                        "--rtt-ms", "20", timeout_s=300)
    check_grades(record)
    figures = record["figures"]
    for name in ("dir", "s3"):
        for what in ("shards", "small"):
            assert figures[f"{name}_{what}_wrong_bytes"]["median"] == 0
