"""Load with a hub restart: 64 threads read the mount for a bounded time, and every byte is
checked against the source file at the same offset.

The hub is stopped and started again (same port) in the middle, for less than
``--hub-deadline``, so no read may fail at all: a read that needs the hub while it is away
waits for it. The cache is smaller than the dataset, so it evicts all the time and reads keep
needing the hub. Pages are dropped from the kernel's page cache at each open (per file), so
the reads reach spokefs instead of being answered by the kernel.

Prints one ``FIGURES`` line (run with ``-s``); README "Reliability" quotes it.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.procs import SpokeMount, free_port, scrape_metrics

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

MiB = 1 << 20
KiB = 1 << 10
THREADS = 64
DURATION_S = 40.0
RESTART_AT_S = 12.0
HUB_DOWN_S = 2.0
HUB_DEADLINE_S = 20.0  # the hub is away for much less than this: no read may fail
JOIN_S = 120.0


@dataclass
class Stats:
    """Thread-safe counters; ``problems`` holds the first few errors and mismatches."""

    reads: int = 0
    bytes_verified: int = 0
    errors: int = 0
    wrong: int = 0
    slowest_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def problem(self, kind: str, text: str) -> None:
        with self.lock:
            if kind == "error":
                self.errors += 1
            else:
                self.wrong += 1
            if len(self.problems) < 20:
                self.problems.append(f"{kind}: {text}")


class Worker:
    """One reading thread: ``kind`` is random, sequential or small."""

    def __init__(self, kind: str, seed: int, mnt: Path, src: Path, bigs: list[str],
                 smalls: list[str], stats: Stats, stop: threading.Event) -> None:
        self.kind, self.rnd = kind, random.Random(seed)
        self.mnt, self.src, self.bigs, self.smalls = mnt, src, bigs, smalls
        self.stats, self.stop = stats, stop

    def run(self) -> None:
        step = {"random": self.random_reads, "sequential": self.sequential_read,
                "small": self.small_file}[self.kind]
        while not self.stop.is_set():
            try:
                step()
            except OSError as exc:
                self.stats.problem("error", f"{self.kind}: {exc!r}")

    def _open(self, rel: str) -> tuple[int, int]:
        mfd = os.open(self.mnt / rel, os.O_RDONLY)
        sfd = os.open(self.src / rel, os.O_RDONLY)
        os.posix_fadvise(mfd, 0, 0, os.POSIX_FADV_DONTNEED)
        return mfd, sfd

    def _check(self, mfd: int, sfd: int, size: int, offset: int, what: str) -> int:
        started = time.monotonic()
        got = os.pread(mfd, size, offset)
        took = time.monotonic() - started
        want = os.pread(sfd, size, offset)
        if got != want:
            self.stats.problem("wrong", f"{what} @{offset}+{size}: {len(got)} bytes, want "
                                        f"{len(want)}")
        with self.stats.lock:
            self.stats.reads += 1
            self.stats.bytes_verified += len(got) if got == want else 0
            self.stats.slowest_s = max(self.stats.slowest_s, took)
        return len(got)

    def random_reads(self) -> None:
        """A burst of unaligned reads at random offsets of one big file."""
        rel = self.rnd.choice(self.bigs)
        mfd, sfd = self._open(rel)
        try:
            size = os.fstat(sfd).st_size
            for _ in range(20):
                n = self.rnd.choice((1, 4096, 4097, 20_000, 65536, 300_000))
                self._check(mfd, sfd, n, self.rnd.randrange(size), rel)
                if self.stop.is_set():
                    return
        finally:
            os.close(mfd)
            os.close(sfd)

    def sequential_read(self) -> None:
        """4-16 MiB of one big file, in order, from a random (unaligned) start."""
        rel = self.rnd.choice(self.bigs)
        mfd, sfd = self._open(rel)
        try:
            size = os.fstat(sfd).st_size
            off = self.rnd.randrange(size)
            end = min(size, off + self.rnd.randrange(4 * MiB, 16 * MiB))
            chunk = self.rnd.choice((128 * KiB, MiB))
            while off < end and not self.stop.is_set():
                n = self._check(mfd, sfd, chunk, off, rel)
                if n == 0:
                    self.stats.problem("wrong", f"{rel}: end of file at {off} of {size}")
                    return
                off += n
        finally:
            os.close(mfd)
            os.close(sfd)

    def small_file(self) -> None:
        """One small file, stat then whole."""
        rel = self.rnd.choice(self.smalls)
        if os.stat(self.mnt / rel).st_size != os.stat(self.src / rel).st_size:
            self.stats.problem("wrong", f"{rel}: size differs")
        mfd, sfd = self._open(rel)
        try:
            self._check(mfd, sfd, 1 << 20, 0, rel)
        finally:
            os.close(mfd)
            os.close(sfd)


@pytest.fixture
def load_src(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    rnd = random.Random(41)
    (root / "big").mkdir(parents=True)
    (root / "small").mkdir()
    for i in range(4):
        (root / "big" / f"shard{i}.bin").write_bytes(rnd.randbytes(64 * MiB + 1000 * i + 1))
    for i in range(150):
        (root / "small" / f"s{i:03}").write_bytes(rnd.randbytes(rnd.randrange(1, 200 * KiB)))
    return root




def test_64_readers_with_a_hub_restart_read_only_exact_bytes(load_src, tmp_path, hub_factory,
                                                            make_mountpoint):
    hub = hub_factory(root=load_src)
    port = free_port()
    # a cache of half the dataset: eviction never stops, so reads keep needing the hub
    spoke = SpokeMount(hub.url, make_mountpoint("load"), tmp_path / "cache", tmp_path / "spoke",
                       args=("--hub-deadline", str(HUB_DEADLINE_S), "--metrics-port", str(port),
                             "--metrics-addr", "127.0.0.1"),
                       cache_size="128M")
    bigs = sorted(f"big/{p.name}" for p in (load_src / "big").iterdir())
    smalls = sorted(f"small/{p.name}" for p in (load_src / "small").iterdir())
    stats, stop = Stats(), threading.Event()
    kinds = ["random"] * 28 + ["sequential"] * 20 + ["small"] * 16
    assert len(kinds) == THREADS
    threads = [threading.Thread(target=Worker(kind, n, spoke.mnt, load_src, bigs, smalls, stats,
                                              stop).run, daemon=True)
               for n, kind in enumerate(kinds)]
    try:
        spoke.start()
        began = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(RESTART_AT_S)
        down_at = time.monotonic()
        reads_before = stats.reads
        assert hub.stop() == 0, hub.stderr()  # SIGTERM under load: a clean exit
        time.sleep(HUB_DOWN_S)
        hub.start()  # the same port
        hub_down_s = time.monotonic() - down_at
        reads_during = stats.reads - reads_before
        time.sleep(max(0.0, DURATION_S - (time.monotonic() - began)))
        stop.set()
        for t in threads:
            t.join(JOIN_S)
        assert not any(t.is_alive() for t in threads), "a reader is stuck"
        m = scrape_metrics(port)
        assert spoke.proc is not None and spoke.proc.poll() is None, spoke.stderr()
    finally:
        stop.set()
        spoke.unmount()
    spoke.assert_clean_exit()
    print(f"\nFIGURES load: threads={THREADS}, seconds={DURATION_S:.0f}, reads={stats.reads}, "
          f"bytes_verified={stats.bytes_verified}, errors={stats.errors}, wrong={stats.wrong}, "
          f"hub_down_s={hub_down_s:.1f}, reads_while_hub_restarting={reads_during}, "
          f"slowest_read_s={stats.slowest_s:.1f}, "
          f"hub_errors={int(m.get('spokefs_hub_errors_total', 0))}, "
          f"hub_retries={int(m.get('spokefs_hub_retries_total', 0))}, "
          f"evicted_bytes={int(m.get('spokefs_cache_evicted_bytes_total', 0))}")
    assert stats.errors == 0 and stats.wrong == 0, stats.problems
    assert hub_down_s < HUB_DEADLINE_S / 2
    # the restart was felt: requests failed and were retried, and nothing failed a read
    assert m.get("spokefs_hub_errors_total", 0) > 0
    assert m.get("spokefs_fuse_errors_total", 0) == 0
    assert m.get("spokefs_internal_errors_total", 0) == 0
