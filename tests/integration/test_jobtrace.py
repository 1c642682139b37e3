"""Job-aware prefetch on real mounts of a real hub: access traces, replays, lists and pins.

- A mount records which files (and which 4 MiB extents of a large file) are read, in the
  order of first access; the trace survives a ``kill -9`` of the spoke (the remount goes on
  recording into it) and ``trace save`` writes it with paths; ``trace show`` summarises it.
- A fresh mount (empty cache) with ``--replay`` of that trace fetches its working set in the
  background, and its first pass over the files then hits, on blocks of the replay's own
  origin; ``warm --trace`` does the same from the command line, and a second run fetches
  nothing (it skips what is cached). A trace whose files changed on the hub says how many.
- ``warm --files-from`` (newline and NUL separated, and from stdin) fills the cache.
- A pinned file survives a scan that evicts everything else, and a remount; a pin beyond
  ``--max-pinned-share`` is refused with one line and exit 1; unpinned, it may go.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import procs
from tests.helpers.page_cache import drop_pages

pytestmark = pytest.mark.fuse

KiB, MiB = 1 << 10, 1 << 20
SCANS = 10  # the policy lets a chunk read once go after 8 cache-fulls of reads


@pytest.fixture
def export(tmp_path: Path) -> Path:
    rnd = random.Random(13)
    root = tmp_path / "export"
    for d in ("train/a", "train/b", "val"):
        (root / d).mkdir(parents=True)
        for i in range(12):
            (root / d / f"{i:03}.jpg").write_bytes(rnd.randbytes(20 * KiB + i))
    (root / "shard.tar").write_bytes(rnd.randbytes(14 * MiB))
    return root


def _attr(path: Path, name: str) -> str:
    return os.getxattr(path, f"user.spokefs.{name}").decode()


def _status(mnt: Path) -> dict:
    return json.loads(_attr(mnt, "status"))


def _cached(path: Path) -> tuple[int, int]:
    have, total = _attr(path, "cached").split()
    return int(have), int(total)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def _spokefs_ok(*args: str, input_bytes: bytes | None = None) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "spokefs", *args], input=input_bytes or b"", capture_output=True,
        timeout=60, cwd=procs.REPO_ROOT, env=procs.child_env(), check=False)
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 0, f"spokefs {' '.join(args)}: exit {r.returncode}\n{out}\n{err}"
    assert "Traceback" not in err
    return out


def _as_nobody(path: Path, name: str) -> subprocess.CompletedProcess:
    """``getxattr(path, name)`` as uid 65534 (the system's Python: no imports but os)."""
    code = "import os, sys; print(os.getxattr(sys.argv[1], sys.argv[2]).decode())"
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           "/usr/bin/python3", "-c", code, str(path), name],
                          capture_output=True, text=True, timeout=30, check=False)


def _read_uncached(path: Path) -> bytes:
    """Read a file with the kernel's page cache of it dropped first (so the spoke sees it)."""
    drop_pages(path)
    return path.read_bytes()


def _read_job(mnt: Path) -> list[str]:
    """What a job reads: some small files in a fixed order, and two extents of the shard."""
    order = ["train/b/003.jpg", "val/000.jpg", "train/a/007.jpg", "train/a/001.jpg",
             "val/011.jpg"]
    for rel in order:
        (mnt / rel).read_bytes()
    with open(mnt / "shard.tar", "rb") as f:
        f.seek(9 * MiB)
        f.read(64 * KiB)  # extent 2
        f.seek(0)
        f.read(64 * KiB)  # extent 0
    return order


def test_trace_survives_kill_9_and_is_saved_with_paths(export, tmp_path, hub_factory,
                                                       make_mountpoint):
    hub = hub_factory(root=export)
    cache = tmp_path / "cache"
    spoke = procs.SpokeMount(hub.url, make_mountpoint("trace"), cache, tmp_path / "spoke",
                             ("--no-prefetch",))
    try:
        spoke.start()
        order = _read_job(spoke.mnt)
        _wait(lambda: _status(spoke.mnt)["trace_records"] == len(order) + 2, 10,
              "the reads are recorded")
        time.sleep(1.5)  # the writer appends once a second: at most that is lost
        spoke.proc.send_signal(signal.SIGKILL)
        spoke.proc.wait(timeout=10)
        spoke.unmount()  # the dead mount
        spoke.start()  # the same cache dir: the trace goes on
        assert _status(spoke.mnt)["trace_records"] == len(order) + 2
        (spoke.mnt / "train/b/000.jpg").read_bytes()  # recorded after the earlier ones
        (spoke.mnt / "val/000.jpg").read_bytes()  # read before: not recorded again
        saved = tmp_path / "job.trace"
        out = _spokefs_ok("trace", "save", str(saved), "--mount", str(spoke.mnt))
        assert f"saved trace {saved}: 7 files" in out, out
        lines = saved.read_text().splitlines()
        head = json.loads(lines[0])
        assert head["format"] == "spokefs-trace" and head["entries"] == 7
        entries = [json.loads(line) for line in lines[1:]]
        assert [e[0] for e in entries] == [*order, "shard.tar", "train/b/000.jpg"]
        shard = entries[len(order)]
        assert shard[2] == 14 * MiB and shard[3] == [2, 0]
        assert all(e[3] is None for i, e in enumerate(entries) if i != len(order))
        out = _spokefs_ok("trace", "show", str(saved), "--mount", str(spoke.mnt))
        assert "files:       7 (1 read in ranges)" in out, out
        assert "directories: 4" in out, out  # train/b, val, train/a, the root
        assert "mismatches:  0 changed on the hub, 0 gone" in out, out
        _spokefs_ok("trace", "clear", "--mount", str(spoke.mnt))
        assert _status(spoke.mnt)["trace_records"] == 0
    finally:
        spoke.unmount()
    spoke.assert_clean_exit()


def _save_trace(hub_url: str, tmp_path: Path, make_mountpoint) -> Path:
    spoke = procs.SpokeMount(hub_url, make_mountpoint("first"), tmp_path / "cache-first",
                             tmp_path / "spoke-first", ("--no-prefetch",))
    try:
        spoke.start()
        for p in sorted((spoke.mnt / "train").rglob("*.jpg")):
            p.read_bytes()
        with open(spoke.mnt / "shard.tar", "rb") as f:
            f.read(6 * MiB)  # extents 0 and 1
        saved = tmp_path / "first.trace"
        _spokefs_ok("trace", "save", str(saved), "--mount", str(spoke.mnt))
    finally:
        spoke.unmount()
    spoke.assert_clean_exit()
    return saved


def test_a_replayed_mount_reads_warm_data(export, tmp_path, hub_factory, mount_factory,
                                          make_mountpoint):
    hub = hub_factory(root=export)
    saved = _save_trace(hub.url, tmp_path, make_mountpoint)
    # a fresh node: an empty cache, the trace replayed from the mount on
    port = procs.free_port()
    spoke = mount_factory(hub.url, "--replay", str(saved), "--no-prefetch",
                          "--metrics-port", str(port))
    mnt = spoke.mnt
    _wait(lambda: json.loads(_attr(mnt, "replay"))["state"] == "done", 30, "replay done")
    progress = json.loads(_attr(mnt, "replay"))
    working_set = 24 * (20 * KiB) + sum(range(12)) * 2 + 8 * MiB
    assert progress["total_bytes"] == progress["done_bytes"] == working_set
    assert progress["fetched_bytes"] == working_set
    assert progress["changed"] == progress["missing"] == 0
    shown = _spokefs_ok("status", str(mnt))
    assert "replay:     first.trace: done, 8.5 MiB of 8.5 MiB (100.0%)" in shown, shown
    before = _status(mnt)
    for p in sorted((mnt / "train").rglob("*.jpg")):
        assert p.read_bytes() == (export / p.relative_to(mnt)).read_bytes()
    with open(mnt / "shard.tar", "rb") as f:
        assert f.read(6 * MiB) == (export / "shard.tar").read_bytes()[: 6 * MiB]
    after = _status(mnt)
    assert after["block_misses"] == before["block_misses"] == 0, after
    hits = after["block_hits"] - before["block_hits"]
    assert hits > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines()
                   if line and not line.startswith("#"))
    assert float(samples['spokefs_block_hits_total{origin="replay"}']) == hits
    assert float(samples["spokefs_replay_done_bytes"]) == working_set
    assert float(samples["spokefs_replay_total_bytes"]) == working_set
    assert float(samples["spokefs_replay_fetched_bytes_total"]) == working_set


def test_warm_trace_replays_resumably_and_counts_changes(export, tmp_path, hub_factory,
                                                         mount_factory, make_mountpoint):
    hub = hub_factory(root=export)
    saved = _save_trace(hub.url, tmp_path, make_mountpoint)
    spoke = mount_factory(hub.url, "--no-prefetch")
    out = _spokefs_ok("warm", "--trace", str(saved), "--mount", str(spoke.mnt))
    assert "replayed 25 files" in out and "cached already" in out, out
    have, total = _cached(spoke.mnt / "train")
    assert have == total
    assert _cached(spoke.mnt / "shard.tar")[0] == 8 * MiB  # extents 0 and 1 only
    again = _spokefs_ok("warm", "--trace", str(saved), "--mount", str(spoke.mnt))
    assert "(0 B fetched" in again, again
    # a path too long for an attribute name goes through a short temporary copy
    deep = tmp_path / ("d" * 120) / ("e" * 120)
    deep.mkdir(parents=True)
    (deep / "job.trace").write_bytes(saved.read_bytes())
    again = _spokefs_ok("warm", "--trace", str(deep / "job.trace"), "--mount", str(spoke.mnt))
    assert "replayed 25 files" in again and "(0 B fetched" in again, again
    # a trace that names a file the hub no longer has, and one of another version
    lines = saved.read_text().splitlines()
    first = json.loads(lines[1])
    changed = json.dumps([first[0], first[1] + 1, first[2], None])
    gone = json.dumps(["train/nope.jpg", 1, 10, None])
    edited = tmp_path / "edited.trace"
    edited.write_text("\n".join([lines[0], changed, gone, *lines[2:]]) + "\n")
    out = _spokefs_ok("warm", "--trace", str(edited), "--mount", str(spoke.mnt))
    assert "1 entries changed on the hub" in out and "1 no longer on it" in out, out
    out = _spokefs_ok("trace", "show", str(edited), "--mount", str(spoke.mnt))
    assert "mismatches:  1 changed on the hub, 1 gone" in out, out
    # the daemon reads a trace for a caller only if the caller may read it
    shared = Path(tempfile.mkdtemp(prefix="jobtrace-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        private = shared / "private.trace"
        private.write_bytes(saved.read_bytes())
        private.chmod(0o600)
        denied = _as_nobody(spoke.mnt, f"user.spokefs.replay:{private}")
        assert "Permission denied" in denied.stderr, denied.stderr
        private.chmod(0o644)
        allowed = _as_nobody(spoke.mnt, f"user.spokefs.replay:{private}")
        assert allowed.returncode == 0, allowed.stderr
    finally:
        shutil.rmtree(shared)
    # a file that is no trace: one line, exit 1
    bad = tmp_path / "bad.trace"
    bad.write_text("hello\n")
    r = procs.run_spokefs("warm", "--trace", str(bad), "--mount", str(spoke.mnt))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"spokefs: error: {bad} is not a spokefs trace (no trace " \
                               "header on its first line)"


def test_a_replay_stops_where_the_cache_is_full(export, tmp_path, hub_factory,
                                                 make_mountpoint):
    hub = hub_factory(root=export)
    saved = _save_trace(hub.url, tmp_path, make_mountpoint)
    # 6 MiB of cache, 1.5 MiB of it the fill window: 4.5 MiB for the 8.5 MiB working set
    spoke = procs.SpokeMount(hub.url, make_mountpoint("small"), tmp_path / "cache-small",
                             tmp_path / "spoke-small", ("--no-prefetch",), cache_size="6M")
    try:
        spoke.start()
        out = _spokefs_ok("warm", "--trace", str(saved), "--mount", str(spoke.mnt))
        progress = json.loads(_attr(spoke.mnt, "replay"))
        assert progress["total_bytes"] <= 6 * MiB - 6 * MiB // 4 < progress["total_bytes"] \
            + progress["over_budget_bytes"]
        assert "left out: more than the cache holds" in out, out
        # the first accesses are the ones kept: every small file of train/ is cached
        have, total = _cached(spoke.mnt / "train")
        assert have == total
        assert _status(spoke.mnt)["cache_bytes"] <= 6 * MiB
    finally:
        spoke.unmount()
    spoke.assert_clean_exit()


def test_warm_files_from_lists(export, tmp_path, hub_factory, mount_factory):
    hub = hub_factory(root=export)
    spoke = mount_factory(hub.url, "--no-prefetch", "--no-trace")
    mnt = spoke.mnt
    assert "trace:      off" in _spokefs_ok("status", str(mnt))
    r = procs.run_spokefs("trace", "save", str(tmp_path / "t.trace"), "--mount", str(mnt))
    assert r.returncode == 1 and r.stderr.strip() == (
        f"spokefs: error: {mnt} records no trace (mounted with --no-trace)"), r.stderr
    listing = tmp_path / "list.txt"
    listing.write_text(f"{mnt}/val/000.jpg\n{mnt}/val/001.jpg\n")
    _spokefs_ok("warm", "--files-from", str(listing))
    assert _cached(mnt / "val/000.jpg") == (20 * KiB, 20 * KiB)
    assert _cached(mnt / "val/001.jpg") == (20 * KiB + 1, 20 * KiB + 1)
    # small files come in picks of the list (protocol v2): the two listed, nothing else
    assert _cached(mnt / "val/002.jpg")[0] == 0
    assert _cached(mnt / "train") == (0, 24 * 20 * KiB + 2 * sum(range(12)))
    nul = f"{mnt}/train/a\0{mnt}/shard.tar\0".encode()
    _spokefs_ok("warm", "--files-from", "-", "-0", input_bytes=nul)
    have, total = _cached(mnt / "train/a")
    assert have == total > 0
    assert _cached(mnt / "shard.tar") == (14 * MiB, 14 * MiB)  # a large file listed: whole
    assert _cached(mnt / "train/b")[0] == 0
    outside = tmp_path / "outside.txt"
    outside.write_text(f"{listing}\n")
    r = procs.run_spokefs("warm", "--files-from", str(outside), "--mount", str(mnt))
    assert r.returncode == 1 and r.stderr.startswith("spokefs: error: ") \
        and "is not on the mount" in r.stderr, r.stderr


def test_warm_ordered_announces_the_list_as_the_jobs_order(export, tmp_path, hub_factory,
                                                            mount_factory):
    """``warm --files-from --ordered`` returns at once and the mount fetches the list in its
    order (one job for the command line: the next list replaces it); a mount without
    prefetch takes no orders, and says so."""
    hub = hub_factory(root=export)
    mnt = mount_factory(hub.url, "--no-trace").mnt
    listing = tmp_path / "order.txt"
    listing.write_text("".join(f"{mnt}/train/b/{i:03}.jpg\n" for i in (7, 1, 4)))
    out = _spokefs_ok("warm", "--files-from", str(listing), "--ordered")
    assert f"of 3 files sent to {mnt}" in out, out
    _wait(lambda: json.loads(_attr(mnt, "order"))[0]["state"] == "done", 30, "the order")
    (order,) = json.loads(_attr(mnt, "order"))
    assert order["job"] == "spokefs warm" and order["entries"] == 3, order
    assert [_cached(mnt / f"train/b/{i:03}.jpg")[0] > 0 for i in (7, 1, 4, 2)] == \
        [True, True, True, False]
    _spokefs_ok("warm", "--files-from", str(listing), "--ordered")
    assert len(json.loads(_attr(mnt, "order"))) == 1  # the same job's new order
    off = mount_factory(hub.url, "--no-prefetch", "--no-trace").mnt
    listing.write_text(f"{off}/val/000.jpg\n")
    r = procs.run_spokefs("warm", "--files-from", str(listing), "--ordered")
    assert r.returncode == 1 and "refused order" in r.stderr, r.stderr
    r = procs.run_spokefs("warm", str(off / "val"), "--ordered")
    assert r.returncode == 1 and "--ordered goes with --files-from" in r.stderr, r.stderr


def test_a_pinned_file_survives_a_scan_and_a_pin_beyond_the_bound_is_refused(
        tmp_path, hub_factory, make_mountpoint):
    rnd = random.Random(5)
    root = tmp_path / "export"
    (root / "scan").mkdir(parents=True)
    (root / "keep.bin").write_bytes(rnd.randbytes(2 * MiB))
    (root / "big.bin").write_bytes(rnd.randbytes(3 * MiB))
    for i in range(20):
        (root / "scan" / f"{i:02}.bin").write_bytes(rnd.randbytes(1 * MiB))
    hub = hub_factory(root=root)
    spoke = procs.SpokeMount(hub.url, make_mountpoint("pin"), tmp_path / "cache",
                             tmp_path / "spoke", ("--no-prefetch", "--max-pinned-share", "0.4"),
                             cache_size="10M")
    try:
        spoke.start()
        mnt = spoke.mnt
        out = _spokefs_ok("pin", str(mnt / "keep.bin"))  # not cached: fetched, then pinned
        assert "pinned 1 files, 2.0 MiB" in out, out
        st = _status(mnt)
        assert st["pinned_bytes"] == 2 * MiB and st["pinned_limit_bytes"] == 4 * MiB
        assert "pinned:     2.0 MiB of at most 4.0 MiB" in _spokefs_ok("status", str(mnt))
        (mnt / "big.bin").read_bytes()  # cached, not pinned (stored by the writer soon after)
        _wait(lambda: _cached(mnt / "big.bin") == (3 * MiB, 3 * MiB), 10, "big.bin stored")
        for _ in range(SCANS):  # scans over 2x the cache: everything else goes
            for p in sorted((mnt / "scan").iterdir()):
                _read_uncached(p)
        assert _status(mnt)["cache_bytes"] <= 10 * MiB
        assert _cached(mnt / "keep.bin") == (2 * MiB, 2 * MiB)
        assert _cached(mnt / "big.bin")[0] == 0
        r = procs.run_spokefs("pin", str(mnt / "big.bin"))
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert r.stderr.strip() == (
            f"spokefs: error: pinning {mnt / 'big.bin'} (3.0 MiB) would exceed the pin limit: "
            "2.0 MiB of 4.0 MiB pinned (--max-pinned-share of the cache); unpin something "
            "first"), r.stderr
        assert _status(mnt)["pinned_bytes"] == 2 * MiB
        spoke.unmount()
        spoke.assert_clean_exit()
        spoke.start()  # pins persist
        assert _status(mnt)["pinned_bytes"] == 2 * MiB
        assert _cached(mnt / "keep.bin") == (2 * MiB, 2 * MiB)
        out = _spokefs_ok("unpin", str(mnt / "keep.bin"))
        assert "unpinned 1 files, 2.0 MiB" in out, out
        assert _status(mnt)["pinned_bytes"] == 0
        _spokefs_ok("pin", str(mnt / "big.bin"))  # fits now
        assert _status(mnt)["pinned_bytes"] == 3 * MiB
    finally:
        spoke.unmount()
    spoke.assert_clean_exit()
