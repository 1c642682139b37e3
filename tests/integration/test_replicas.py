"""Hub replicas end to end: two hubd processes over one export, one spoke mounting both.

- ``test_failover_mid_epoch_and_back``: readers go through a shuffled epoch, every file
  checked against its SHA-256; hub A (preferred) is killed with SIGKILL mid-epoch. No read
  may fail or take longer than the hub deadline, no byte may differ, the namespace must go
  on without a snapshot, and what was cached before the kill must still be cached (a
  second pass fetches nothing). Then A is restarted and the spoke must move back to it.
- ``test_both_hubs_down_then_back``: cached reads are served with both hubs dead, an
  uncached read fails with EIO after the deadline, and reads recover when one hub returns.
- ``test_a_replica_one_rescan_behind``: the spoke has a generation B has not reached when
  A dies: it keeps it, B serves the changed file from disk, a new file waits for B's
  rescan rather than failing.

Bounds, not speeds; the failover gap is measured in ``benchmarks/bench_replicas.py``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import HubFactory, MountFactory
from tests.helpers.page_cache import drop_pages
from tests.helpers.procs import HubProcess, free_port, run_spokefs

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

KiB, MiB = 1 << 10, 1 << 20
DEADLINE_S = 8.0
JOIN_S = 60.0  # a reader thread that outlives this is stuck: fail rather than hang
WAIT_S = 20.0


def _make_export(root: Path, count: int, seed: int) -> dict[str, str]:
    """``count`` files of 16 KiB to 1.5 MiB in a few directories; rel path -> SHA-256."""
    rnd = random.Random(seed)
    out = {}
    for i in range(count):
        rel = f"shard{i % 4}/sample{i:04d}.bin"
        data = rnd.randbytes(rnd.randrange(16 * KiB, 3 * MiB // 2))
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        out[rel] = hashlib.sha256(data).hexdigest()
    return out


def _read_file(path: Path) -> bytes:
    """The whole file through the mount, past the kernel's page cache (dropped first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_pages(fd)
        parts = []
        while chunk := os.read(fd, MiB):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


@dataclass
class Epoch:
    """Readers over a list of files, each read timed and checked against its SHA-256."""

    mnt: Path
    sums: dict[str, str]
    files: list[str]
    threads: int = 4
    done: int = 0
    wrong: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    slowest_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, on_progress: Callable[[int], None] | None = None) -> None:
        queue = list(self.files)

        def reader() -> None:
            while True:
                with self._lock:
                    if not queue:
                        return
                    rel = queue.pop()
                started = time.monotonic()
                try:
                    data = _read_file(self.mnt / rel)
                except OSError as exc:
                    with self._lock:
                        self.failed.append(f"{rel}: {exc}")
                    continue
                took = time.monotonic() - started
                with self._lock:
                    self.slowest_s = max(self.slowest_s, took)
                    if hashlib.sha256(data).hexdigest() != self.sums[rel]:
                        self.wrong.append(rel)
                    self.done += 1
                    done = self.done
                if on_progress is not None:
                    on_progress(done)

        workers = [threading.Thread(target=reader, daemon=True) for _ in range(self.threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(JOIN_S)
            assert not w.is_alive(), "a reader hung"


def _metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The spoke's samples, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(port: int, name: str, **labels: str) -> float:
    return _metrics(port).get((name, tuple(sorted(labels.items()))), 0.0)


def _wait_for(what: str, check: Callable[[], bool], log: Callable[[], str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {WAIT_S}s\n{log()}"
        time.sleep(0.1)


def _hubs(hub_factory: HubFactory, root: Path) -> tuple[HubProcess, HubProcess]:
    return hub_factory(root=root), hub_factory(root=root)


def test_failover_mid_epoch_and_back(tmp_path: Path, hub_factory: HubFactory,
                                     mount_factory: MountFactory) -> None:
    export = tmp_path / "export"
    sums = _make_export(export, 96, seed=11)
    a, b = _hubs(hub_factory, export)
    port = free_port()
    spoke = mount_factory(f"{a.url},{b.url}", "--hub-deadline", str(DEADLINE_S),
                          "--refresh-interval", "1", "--metrics-port", str(port))
    names = sorted(sums)
    random.Random(5).shuffle(names)
    epoch_files, later = names[:80], names[80:]

    killed_at: list[float] = []

    def kill_a(done: int) -> None:
        if done == 25 and not killed_at:
            killed_at.append(time.monotonic())
            a.proc.kill()  # SIGKILL: no goodbye, in-flight answers cut off

    first = Epoch(spoke.mnt, sums, epoch_files)
    first.run(kill_a)
    a.proc.wait(timeout=10)
    assert killed_at, "A was never killed"
    assert (first.failed, first.wrong) == ([], [])
    assert first.done == len(epoch_files)
    assert first.slowest_s < DEADLINE_S
    assert _value(port, "spokefs_hub_origin", url=b.url) == 1
    assert _value(port, "spokefs_hub_origin", url=a.url) == 0
    assert _value(port, "spokefs_hub_failovers_total", reason="failed") >= 1
    print(f"FIGURES failover: {first.done} files, slowest read {first.slowest_s:.3f}s, "
          f"failovers {_value(port, 'spokefs_hub_failovers_total', reason='failed'):g}")
    assert "using hub " + b.url in spoke.stderr()

    # The namespace goes on against B from the generation A gave it: no snapshot.
    time.sleep(2.5)  # two polls of --refresh-interval 1 against B
    assert spoke.stderr().count("snapshot loaded") == 1, spoke.stderr()
    assert "namespace refresh failed" not in spoke.stderr()

    # Nothing cached was lost: a second pass over the epoch fetches no block.
    misses = _value(port, "spokefs_block_misses_total")
    hub_reads = _value(port, "spokefs_reads_total", source="hub")
    again = Epoch(spoke.mnt, sums, epoch_files)
    again.run()
    assert (again.failed, again.wrong, again.done) == ([], [], len(epoch_files))
    assert _value(port, "spokefs_block_misses_total") == misses
    assert _value(port, "spokefs_reads_total", source="hub") == hub_reads

    # A comes back (same port): the spoke moves back to it.
    a.start()
    _wait_for("the move back to A", lambda: _value(port, "spokefs_hub_origin", url=a.url) == 1,
              spoke.stderr)
    assert _value(port, "spokefs_hub_failovers_total", reason="preferred") == 1
    rest = Epoch(spoke.mnt, sums, later)
    rest.run()
    assert (rest.failed, rest.wrong, rest.done) == ([], [], len(later))
    def polled_a() -> bool:  # the restarted A answers the namespace polls (every second)
        with urllib.request.urlopen(f"{a.url}/metrics", timeout=10) as resp:
            return any(line.startswith("hubd_requests_total") and "changes" in line
                       and float(line.rsplit(" ", 1)[1]) > 0
                       for line in resp.read().decode().splitlines())

    _wait_for("a namespace poll answered by A", polled_a, spoke.stderr)
    assert spoke.stderr().count("snapshot loaded") == 1


def test_both_hubs_down_then_back(tmp_path: Path, hub_factory: HubFactory,
                                  mount_factory: MountFactory) -> None:
    export = tmp_path / "export"
    sums = _make_export(export, 12, seed=12)
    a, b = _hubs(hub_factory, export)
    deadline_s = 2.0
    spoke = mount_factory(f"{a.url},{b.url}", "--hub-deadline", str(deadline_s),
                          "--no-prefetch")
    names = sorted(sums)
    cached, uncached = names[:6], names[6:]
    warm = Epoch(spoke.mnt, sums, cached)
    warm.run()
    assert (warm.failed, warm.wrong) == ([], [])

    for hub in (a, b):
        hub.proc.kill()
        hub.proc.wait(timeout=10)
    served = Epoch(spoke.mnt, sums, cached)
    served.run()
    assert (served.failed, served.wrong) == ([], [])  # the cache serves with both hubs gone

    started = time.monotonic()
    with pytest.raises(OSError) as exc:
        _read_file(spoke.mnt / uncached[0])
    took = time.monotonic() - started
    assert exc.value.errno == errno.EIO
    # The kernel may retry a failed read once: each waits one deadline, no more.
    assert deadline_s * 0.9 <= took <= 2 * deadline_s + 5, took

    b.start()  # the non-preferred hub returns first: reads recover through it

    def readable() -> bool:
        try:
            return hashlib.sha256(_read_file(spoke.mnt / uncached[1])).hexdigest() == \
                sums[uncached[1]]
        except OSError:
            return False

    _wait_for("reads through B", readable, spoke.stderr)
    a.start()
    rest = Epoch(spoke.mnt, sums, uncached)
    rest.run()
    assert (rest.failed, rest.wrong) == ([], [])


def _sighup_and_wait(hub: HubProcess) -> None:
    """Rescan now (SIGHUP) and wait for the scan's log line."""
    done = hub.stderr().count("rescanned ")
    hub.proc.send_signal(signal.SIGHUP)
    _wait_for("a rescan", lambda: hub.stderr().count("rescanned ") > done, hub.stderr)


def test_a_replica_one_rescan_behind(tmp_path: Path, hub_factory: HubFactory,
                                     mount_factory: MountFactory) -> None:
    """A rescanned after a change, B not yet; the spoke took A's generation; A dies.

    The spoke keeps A's namespace (B is behind it), reads the changed file from B (the
    version is on B's disk), and a file B does not list yet waits for B's rescan instead
    of failing; afterwards it goes on against B without a snapshot."""
    export = tmp_path / "export"
    sums = _make_export(export, 8, seed=13)
    a = hub_factory(root=export, args=("--rescan-interval", "0"))
    b = hub_factory(root=export, args=("--rescan-interval", "0"))
    spoke = mount_factory(f"{a.url},{b.url}", "--hub-deadline", "20",
                          "--refresh-interval", "0", "--no-prefetch")
    names = sorted(sums)
    warm = Epoch(spoke.mnt, sums, names)
    warm.run()
    assert (warm.failed, warm.wrong) == ([], [])

    changed, new = names[0], "shard0/new.bin"
    with open(export / changed, "ab") as f:
        f.write(b"appended")
    sums[changed] = hashlib.sha256((export / changed).read_bytes()).hexdigest()
    (export / new).write_bytes(os.urandom(300 * KiB))
    sums[new] = hashlib.sha256((export / new).read_bytes()).hexdigest()
    _sighup_and_wait(a)
    ahead = run_spokefs("refresh", str(spoke.mnt))
    assert ahead.returncode == 0, ahead.stderr
    a.proc.kill()
    a.proc.wait(timeout=10)

    behind = run_spokefs("refresh", str(spoke.mnt))  # B answers 400: keep our namespace
    assert behind.returncode == 0 and behind.stdout == ahead.stdout, (behind, ahead)
    assert "keeping generation" in spoke.stderr()
    assert hashlib.sha256(_read_file(spoke.mnt / changed)).hexdigest() == sums[changed]

    threading.Timer(1.0, b.proc.send_signal, (signal.SIGHUP,)).start()  # B catches up later
    started = time.monotonic()
    assert hashlib.sha256(_read_file(spoke.mnt / new)).hexdigest() == sums[new]
    assert time.monotonic() - started >= 0.9  # it waited for B's rescan, and did not fail
    _wait_for("B's rescan", lambda: "rescanned " in b.stderr(), b.stderr)
    after = run_spokefs("refresh", str(spoke.mnt))
    assert after.returncode == 0 and after.stdout == ahead.stdout  # B: the same generation
    assert spoke.stderr().count("snapshot loaded") == 1
