"""CI smoke test of benchmarks/train.py: ``--smoke`` in a subprocess must exit 0 with 0
mismatches.

``--smoke`` is a tiny run (60 files in 3 directories, a 4 ms RTT through the long-link
emulator, one run, io mode, configurations local, spoke-cold, spoke-warm, spoke-remount,
spoke-replay and copy-first, no plots); timing is not asserted, only that every
configuration ran, every sample matched its manifest digest, and every spoke exited 0 after
a clean unmount (the script exits 1 otherwise). Its JSON line goes to a temporary file, not
into benchmarks/results/. Needs root, /dev/fuse and fusermount3 (the ``fuse`` marker) and
PyTorch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.procs import child_env

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "benchmarks" / "train.py"
TIMEOUT_S = 150

pytestmark = [pytest.mark.fuse, pytest.mark.slow]


def test_train_smoke(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    results = tmp_path / "train-smoke.jsonl"
    cmd = [sys.executable, str(TRAIN), "--smoke", "--results-file", str(results),
           "--work-dir", str(tmp_path / "work"), "--max-seconds", "120"]
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=REPO,
                          env=child_env(), stdin=subprocess.DEVNULL, timeout=TIMEOUT_S,
                          check=False)
    output = f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, output
    lines = results.read_text().splitlines()
    assert len(lines) == 1, output
    record = json.loads(lines[0])
    assert record["error"] is None, output
    assert record["problems"] == [], output
    assert record["mismatches_total"] == 0, output
    epochs = record["epochs"]
    assert {e["config"] for e in epochs} == {"local", "spoke-cold", "spoke-warm",
                                             "spoke-remount", "spoke-replay", "copy-first"}, output
    for e in epochs:
        assert e["samples"] == e["planned"] == 60, e
        assert e["mismatches"] == 0 and e["read_errors"] == 0, e
        assert not e["cut"], e
    cold = next(e for e in epochs if e["config"] == "spoke-cold")
    assert cold["link_bytes"] >= cold["bytes"] > 0, cold  # counted at the emulator
    replay = next(e for e in epochs if e["config"] == "spoke-replay")
    assert replay["trace_bytes"] == cold["bytes"], replay  # the trace names every file read
    assert replay["replay"]["state"] == "done" and replay["replay"]["missing"] == 0, replay
    # the replay's clock starts at its mount command, before any byte crossed its link
    assert replay["link_bytes_at_clock_start"] == 0, replay
    assert replay["pre_epoch_s"] >= replay["mount_ready_s"] > 0, replay
    assert replay["link_bytes"] >= replay["trace_bytes"], replay  # counted from the clock
    assert record["commit"] and record["kernel"], record
    assert isinstance(record["dirty"], bool), record


def test_train_smoke_bucket(tmp_path: Path) -> None:
    """``--hub-source bucket``: the dataset uploaded to a real SeaweedFS and read cold through
    ``hubd serve s3://...`` (configuration bucket-cold), every sample matching its digest."""
    pytest.importorskip("torch")
    results = tmp_path / "train-smoke-bucket.jsonl"
    cmd = [sys.executable, str(TRAIN), "--smoke", "--hub-source", "bucket", "--results-file",
           str(results), "--work-dir", str(tmp_path / "work"), "--max-seconds", "120"]
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=REPO,
                          env=child_env(), stdin=subprocess.DEVNULL, timeout=TIMEOUT_S,
                          check=False)
    output = f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, output
    record = json.loads(results.read_text().splitlines()[0])
    assert record["error"] is None and record["problems"] == [], output
    assert {e["config"] for e in record["epochs"]} == {"local", "bucket-cold"}, output
    cold = next(e for e in record["epochs"] if e["config"] == "bucket-cold")
    assert cold["samples"] == cold["planned"] == 60 and cold["mismatches"] == 0, cold
    assert cold["link_bytes"] >= cold["bytes"] > 0, cold
    assert cold["hub_cpu_ms_per_mb"] is not None and cold["store_cpu_ms_per_mb"] >= 0, cold
    grades = {g["figure"]: g for g in record["goals"]}
    assert grades["bucket-cold, io: link bytes / dataset byte"]["verdict"] == "PASS", grades
