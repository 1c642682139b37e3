"""Faults, end to end: the hub dies, the link stops carrying packets, the spoke is killed
mid-fill, the cache's disk fills up.

One rule throughout: a read returns exactly the source's bytes at that offset, or fails
(EIO once ``--hub-deadline`` has passed while the hub is away); it never returns wrong bytes
and never hangs. Every byte read is compared with the source file at the same offset.

Bounds, not speeds: a read that fails is given ``HANG_BOUND_S`` (several deadlines) before it
counts as hung; no test asserts how fast anything is.

Each test prints one ``FIGURES`` line (run with ``-s`` to see it); README "Reliability" quotes
them.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.helpers.page_cache import drop_pages
from tests.helpers.procs import SpokeMount, free_port, is_mounted, run_spokefs, scrape_metrics
from tests.helpers.tmpfs import tmpfs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from longlink import LongLinkProcess

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

MiB = 1 << 20
KiB = 1 << 10
DEADLINE_S = 3.0
# A failing read costs the kernel two FUSE reads: its read-ahead, then one synchronous retry
# of the first page; spokefs fails each within one deadline. Past this bound (with room for a
# loaded 2-core machine) a read counts as hung.
HANG_BOUND_S = 3 * DEADLINE_S + 10
JOIN_S = 120.0  # a thread that outlives this is stuck; the test fails instead of hanging


# -- verified reads -------------------------------------------------------------------------


@dataclass
class Tally:
    """Thread-safe counters of verified reads.

    ``wrong`` lists reads whose bytes differ from the source; ``short`` lists (when, what) of
    reads that returned a correct but short prefix before the end of the file (legal only
    when the filesystem went away under the read, as after ``kill -9``).
    """

    reads: int = 0
    bytes_verified: int = 0
    wrong: list[str] = field(default_factory=list)
    short: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def pread(self, mfd: int, sfd: int, size: int, offset: int, what: str) -> int:
        """``size`` bytes at ``offset`` from the mount, compared with the source; bytes read."""
        got = os.pread(mfd, size, offset)
        want = os.pread(sfd, size, offset)
        with self.lock:
            self.reads += 1
            if got == want[: len(got)]:
                self.bytes_verified += len(got)
                if len(got) < len(want):
                    self.short.append((time.monotonic(), f"{what} @{offset}+{size}: "
                                       f"{len(got)} of {len(want)} bytes"))
            else:
                self.wrong.append(f"{what} @{offset}+{size}: got {len(got)} bytes, want "
                                  f"{len(want)}, first difference at {_first_diff(got, want)}")
        return len(got)


def _first_diff(a: bytes, b: bytes) -> int:
    pairs = enumerate(zip(a, b, strict=False))  # up to the shorter one
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def read_whole(tally: Tally, mnt_path: Path, src_path: Path, chunk: int = MiB) -> None:
    """Read a file through the mount in ``chunk``s, each compared with the source."""
    mfd = os.open(mnt_path, os.O_RDONLY)
    sfd = os.open(src_path, os.O_RDONLY)
    try:
        drop_pages(mfd)
        size, off = os.fstat(sfd).st_size, 0
        while off < size:
            n = tally.pread(mfd, sfd, chunk, off, str(mnt_path))
            if n == 0:
                raise AssertionError(f"{mnt_path}: end of file at {off} of {size}")
            off += n
    finally:
        os.close(mfd)
        os.close(sfd)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(MiB):
            h.update(block)
    return h.hexdigest()


def files_under(root: Path) -> list[Path]:
    return sorted(Path(d, n).relative_to(root) for d, _, fs in os.walk(root) for n in fs)


def tree_meta(root: Path) -> dict[str, tuple[int, int]]:
    """rel path -> (mode, size) of every entry (metadata only: no file is opened)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(Path(d, name))
            out[str(Path(d, name).relative_to(root))] = (
                st.st_mode, st.st_size if stat.S_ISREG(st.st_mode) else 0)
    return out




def write_random(path: Path, rnd: random.Random, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rnd.randbytes(size))


def figures(name: str, **values: object) -> None:
    print(f"\nFIGURES {name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))


# -- 1. hub outages: the hub process dies, or the link stops carrying packets ----------------


@pytest.fixture
def outage_src(tmp_path: Path) -> Path:
    """warm/: read before the fault; cold/: first opened during it (all over 1 MiB, so no
    directory fill or small-file fetch can bring them in early); big.bin: being read when
    the fault hits."""
    root = tmp_path / "src"
    rnd = random.Random(11)
    for i, size in enumerate((3 * MiB // 2 + 1, 700 * KiB, 2 * MiB + 4095, 64 * KiB + 3,
                              3 * MiB, 5000)):
        write_random(root / "warm" / f"w{i}", rnd, size)
    for i in range(4):
        write_random(root / "cold" / f"c{i}", rnd, 2 * MiB + 17 * i + 1)
    write_random(root / "big.bin", rnd, 24 * MiB)
    return root


@dataclass
class FileResult:
    rel: str
    read: int = 0  # bytes verified before the end or the error
    error: int | None = None  # errno
    error_after_s: float = 0.0  # how long the failing read took
    first_read_s: float = 0.0  # how long the first read of the file took


def _epoch(mnt: Path, src: Path, order: list[str], tally: Tally, pause_at: tuple[str, int],
           at_fault: threading.Event, fault_on: threading.Event,
           results: list[FileResult]) -> None:
    """Read ``order`` in 256 KiB reads; stop at ``pause_at`` until the fault is in; on an
    error, record it and go on with the next file (as a DataLoader worker would)."""
    for rel in order:
        res = FileResult(rel)
        results.append(res)
        mfd = os.open(mnt / rel, os.O_RDONLY)
        sfd = os.open(src / rel, os.O_RDONLY)
        try:
            drop_pages(mfd)
            size = os.fstat(sfd).st_size
            while res.read < size:
                if rel == pause_at[0] and res.read >= pause_at[1] and not at_fault.is_set():
                    at_fault.set()
                    fault_on.wait(60)
                started = time.monotonic()
                try:
                    n = tally.pread(mfd, sfd, 256 * KiB, res.read, rel)
                except OSError as exc:
                    res.error, res.error_after_s = exc.errno, time.monotonic() - started
                    break
                finally:
                    if res.read == 0:
                        res.first_read_s = time.monotonic() - started
                res.read += n
        finally:
            os.close(mfd)
            os.close(sfd)


def run_outage(name: str, spoke: SpokeMount, src: Path, inject: Callable[[], None],
               clear: Callable[[], None], min_fail_s: float) -> None:
    """The outage scenario, for any fault that makes the hub unreachable:

    1. warm/ is read (cached); one cold file is opened and left open;
    2. a reader thread reads an epoch (big.bin, then warm and cold files interleaved); the
       fault is injected while it is 6 MiB into big.bin;
    3. during the fault: metadata of the whole tree, cached reads, and the held handle;
    4. the fault is cleared: every file reads back exactly, through the same mount (and the
       held handle works again).

    ``min_fail_s``: the least time the first read of a cold file must take to fail (it kept
    trying instead of giving up at once); a lower bound, not a speed.
    """
    mnt = spoke.mnt
    tally = Tally()
    warm = [f"warm/{p.name}" for p in sorted((src / "warm").iterdir())]
    cold = [f"cold/{p.name}" for p in sorted((src / "cold").iterdir())]
    for rel in warm:
        read_whole(tally, mnt / rel, src / rel)
    held_rel = cold[-1]
    held = os.open(mnt / held_rel, os.O_RDONLY)
    held_src = os.open(src / held_rel, os.O_RDONLY)
    interleaved = [x for pair in zip(warm, cold, strict=False) for x in pair]
    order = ["big.bin", *interleaved, *warm[len(cold):]]
    at_fault, fault_on = threading.Event(), threading.Event()
    results: list[FileResult] = []
    reader = threading.Thread(target=_epoch, daemon=True, args=(
        mnt, src, order, tally, ("big.bin", 6 * MiB), at_fault, fault_on, results))
    try:
        reader.start()
        assert at_fault.wait(60), "the epoch reader never got 6 MiB into big.bin"
        fault_began = time.monotonic()
        inject()
        fault_on.set()
        # -- during the fault: metadata and cached reads keep working
        want_meta = tree_meta(src)
        meta_walks = 0
        while True:
            assert tree_meta(mnt) == want_meta
            os.statvfs(mnt)
            meta_walks += 1
            if not reader.is_alive() or meta_walks >= 200:
                break
            time.sleep(0.1)
        for rel in warm:  # cached: served by spokefs (pages dropped) without the hub
            read_whole(tally, mnt / rel, src / rel)
        status = run_spokefs("status", str(mnt))  # the control path needs no hub either
        assert status.returncode == 0, status.stderr
        started = time.monotonic()
        with pytest.raises(OSError) as info:
            tally.pread(held, held_src, 64 * KiB, 0, held_rel)
        held_error_s = time.monotonic() - started
        assert info.value.errno == errno.EIO
        reader.join(JOIN_S)
        assert not reader.is_alive(), f"the epoch reader is stuck; results so far: {results}"
        clear()
        fault_ended = time.monotonic()
        # -- after the fault: the same mount, the same handle, every byte
        assert tally.pread(held, held_src, 64 * KiB, 0, held_rel) == 64 * KiB
        for rel in order:
            read_whole(tally, mnt / rel, src / rel)
        assert spoke.proc is not None and spoke.proc.poll() is None, "the spoke died"
    finally:
        fault_on.set()
        os.close(held)
        os.close(held_src)
        reader.join(JOIN_S)

    by_rel = {r.rel: r for r in results}
    assert not tally.wrong, tally.wrong
    # an error after part of a read was copied gives a short read (then EIO): only in the fault
    short = [x for x in tally.short if not fault_began <= x[0] <= fault_ended]
    assert not short, short
    assert set(by_rel) == set(order), results
    for rel in warm:
        assert by_rel[rel].error is None, by_rel[rel]
    for rel in cold:  # never opened before the fault: only the hub has them
        assert by_rel[rel].error == errno.EIO, by_rel[rel]
        assert by_rel[rel].read == 0, by_rel[rel]
        assert by_rel[rel].first_read_s >= min_fail_s, by_rel[rel]
    failed = [r for r in results if r.error is not None]
    assert all(r.error == errno.EIO for r in failed), failed
    slowest = max([r.error_after_s for r in failed] + [held_error_s])
    assert slowest < HANG_BOUND_S, f"a failing read took {slowest:.1f}s: {failed}"
    figures(name, reads=tally.reads, bytes_verified=tally.bytes_verified,
            failed_reads=len(failed) + 1, eio_within_s=f"{slowest:.1f}",
            deadline_s=DEADLINE_S, metadata_walks=meta_walks, wrong_bytes=len(tally.wrong))


def test_hub_killed_mid_epoch_then_restarted(outage_src, hub_factory, mount_factory):
    hub = hub_factory(root=outage_src)
    spoke = mount_factory(hub.url, "--hub-deadline", str(DEADLINE_S))

    def kill_hub() -> None:
        assert hub.proc is not None
        hub.proc.kill()  # SIGKILL: no goodbye to open connections
        hub.proc.wait(10)

    # The hub refuses connections at once, so each read fails after its retries: the client
    # backs off with full jitter and gives up when the next pause would cross the deadline,
    # which can be well before it (hence no lower bound here).
    run_outage("hub_killed", spoke, outage_src, kill_hub, hub.start,  # same port on restart
               min_fail_s=0.0)


def test_link_blackholed_mid_epoch_then_restored(outage_src, hub_factory, mount_factory):
    hub = hub_factory(root=outage_src)
    parts = urlsplit(hub.url)
    # established connections stay open but carry nothing: only the spoke's per-attempt
    # deadline can end a request
    with LongLinkProcess((parts.hostname, parts.port), delay_ms=2, rate_mbit=0) as link:
        spoke = mount_factory(f"http://127.0.0.1:{link.port}", "--hub-deadline", str(DEADLINE_S))

        def blackhole(on: bool) -> Callable[[], None]:
            def switch() -> None:
                link.set_blackhole(on)
                time.sleep(0.3)  # the signal is handled asynchronously by the proxy
            return switch

        try:
            # every attempt hangs until the deadline cuts it: a read cannot fail sooner
            run_outage("link_blackholed", spoke, outage_src, blackhole(True), blackhole(False),
                       min_fail_s=0.9 * DEADLINE_S)
        finally:
            link.set_blackhole(False)
            spoke.unmount()  # before the link goes away


# -- 2. spoke faults: kill -9 mid-fill, a cache disk that fills up ---------------------------


@pytest.fixture
def fill_src(tmp_path: Path) -> Path:
    """Big files (sequential read-ahead) and two directories of small files (directory
    fills): ~62 MiB, so a fill is in full swing when the spoke is killed."""
    root = tmp_path / "src"
    rnd = random.Random(23)
    for i in range(6):
        write_random(root / "big" / f"b{i}.bin", rnd, 8 * MiB + 4096 * i + i)
    for d in range(2):
        for i in range(60):
            write_random(root / f"small{d}" / f"f{i:03}", rnd, rnd.randrange(1, 256 * KiB))
    return root


def _fill_reader(mnt: Path, src: Path, rels: list[Path], tally: Tally, rnd: random.Random,
                 stop: threading.Event, errors: list[tuple[float, str, int | None]]) -> None:
    """Read files whole in random-sized reads until stopped or the mount goes away."""
    try:
        for rel in rels:
            mfd = os.open(mnt / rel, os.O_RDONLY)
            sfd = os.open(src / rel, os.O_RDONLY)
            try:
                size, off = os.fstat(sfd).st_size, 0
                while off < size and not stop.is_set():
                    off += tally.pread(mfd, sfd, rnd.choice((4096, 65536, 200_000, MiB)), off,
                                       str(rel))
            finally:
                os.close(mfd)
                os.close(sfd)
            if stop.is_set():
                return
    except OSError as exc:
        errors.append((time.monotonic(), str(exc), exc.errno))


def test_kill9_during_heavy_fill_then_remount_reads_exact_bytes(
        fill_src, tmp_path, hub_factory, mount_factory, make_mountpoint):
    hub = hub_factory(root=fill_src)
    cache = tmp_path / "cache"
    spoke = SpokeMount(hub.url, make_mountpoint("kill9"), cache, tmp_path / "killed")
    rels = files_under(fill_src)
    tally = Tally()
    kills = []
    cached_at_kill = []
    try:
        # kill at a different point of the fill each round, from early to late
        for rnd_no, kill_after in enumerate((1 * MiB, 3 * MiB, 6 * MiB, 10 * MiB, 16 * MiB)):
            spoke.start()
            started = time.monotonic()
            stop = threading.Event()
            errors: list[tuple[float, str, int | None]] = []
            start_bytes = tally.bytes_verified
            readers = []
            for i in range(4):
                rnd = random.Random(rnd_no * 100 + i)
                order = rels[:]
                rnd.shuffle(order)
                readers.append(threading.Thread(target=_fill_reader, daemon=True, args=(
                    spoke.mnt, fill_src, order, tally, rnd, stop, errors)))
            for t in readers:
                t.start()
            limit = time.monotonic() + 60
            while (tally.bytes_verified - start_bytes < kill_after
                   and any(t.is_alive() for t in readers) and time.monotonic() < limit):
                time.sleep(0.005)
            assert spoke.proc is not None
            cached, total = map(int, os.getxattr(spoke.mnt, "user.spokefs.cached").split())
            cached_at_kill.append(f"{100 * cached / total:.0f}%")
            killed_at = time.monotonic()
            spoke.proc.kill()
            spoke.proc.wait(10)
            kills.append(tally.bytes_verified - start_bytes)
            stop.set()
            for t in readers:
                t.join(JOIN_S)
            assert not any(t.is_alive() for t in readers), "a reader hangs on the dead mount"
            before_kill = [e for e in errors if e[0] < killed_at]
            assert not before_kill, f"reads failed before the kill: {before_kill}"
            short = [x for x in tally.short if started <= x[0] < killed_at]
            assert not short, f"short reads before the kill: {short}"
            # a serving worker (the default) detaches the mount when its process dies;
            # with none, `spokefs umount` clears the dead mount
            res = run_spokefs("umount", str(spoke.mnt))
            assert res.returncode == 0 or "is not mounted" in res.stderr, res.stderr
            assert not is_mounted(spoke.mnt)
            assert not tally.wrong, tally.wrong
    finally:
        spoke.unmount()
    again = mount_factory(hub.url, cache_dir=cache)
    for rel in rels:
        assert sha256_of(again.mnt / rel) == sha256_of(fill_src / rel), rel
    total = sum((fill_src / rel).stat().st_size for rel in rels)
    figures("kill9", rounds=len(kills), bytes_read_before_each_kill=kills,
            cached_at_each_kill=cached_at_kill,
            short_reads_at_kill=len(tally.short),
            reads=tally.reads, bytes_verified=tally.bytes_verified + total,
            files_sha256_checked=len(rels), wrong_bytes=len(tally.wrong))


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs, always unmounted."""
    with tmpfs(tmp_path / "tiny", "48m") as where:
        yield where


def test_cache_on_a_full_disk_degrades_and_reads_stay_exact(tmp_path, tiny_fs, hub_factory,
                                                            make_mountpoint):
    src = tmp_path / "src"
    rnd = random.Random(31)
    for i in range(10):  # 80 MiB: more than the whole filesystem
        write_random(src / f"part{i}.bin", rnd, 8 * MiB - 4096 * i + i)
    hub = hub_factory(root=src)
    port = free_port()
    spoke = SpokeMount(hub.url, make_mountpoint("tiny"), tiny_fs / "cache", tmp_path / "tiny-log",
                       args=("--metrics-port", str(port), "--metrics-addr", "127.0.0.1"),
                       cache_size="1G")  # the quota is not what stops it: the disk is
    tally = Tally()
    rels = files_under(src)
    try:
        spoke.start()
        for _ in range(2):
            for rel in rels:
                read_whole(tally, spoke.mnt / rel, src / rel)
            for _ in range(300):  # random reads across all of it
                rel = rnd.choice(rels)
                size = (src / rel).stat().st_size
                mfd, sfd = os.open(spoke.mnt / rel, os.O_RDONLY), os.open(src / rel, os.O_RDONLY)
                try:
                    drop_pages(mfd)
                    tally.pread(mfd, sfd, rnd.randrange(1, 300_000), rnd.randrange(size), str(rel))
                finally:
                    os.close(mfd)
                    os.close(sfd)
            assert spoke.proc is not None and spoke.proc.poll() is None, spoke.stderr()
        m = scrape_metrics(port)
        free = os.statvfs(tiny_fs)
        # the fault really happened: fills failed for want of space
        assert m.get("spokefs_cache_write_errors_total", 0) > 0, (m, spoke.stderr())
        assert m.get("spokefs_internal_errors_total", 0) == 0, spoke.stderr()
        assert m.get("spokefs_fuse_errors_total", 0) == 0, spoke.stderr()
        for rel in rels:
            assert sha256_of(spoke.mnt / rel) == sha256_of(src / rel), rel
    finally:
        spoke.unmount()
    spoke.assert_clean_exit()
    assert not tally.wrong, tally.wrong
    assert not tally.short, tally.short
    figures("full_disk", reads=tally.reads, bytes_verified=tally.bytes_verified,
            write_errors=int(m.get("spokefs_cache_write_errors_total", 0)),
            fs_free_bytes=free.f_bavail * free.f_frsize, wrong_bytes=len(tally.wrong))


@pytest.mark.parametrize("open_mode", ["kernel", "handle"])
def test_uncached_read_with_the_hub_down_fails_within_the_deadline(tmp_path, hub_factory,
                                                                   mount_factory, open_mode):
    """The hub killed, an uncached 8 MiB file read whole (1 MiB reads, as ``cat`` does):
    EIO within 2.2 x ``--hub-deadline``, though the kernel sends several FUSE reads for it
    (read-ahead, then the page itself); README "Reliability" states the multiple."""
    deadline_s = 5.0
    src = tmp_path / "src"
    write_random(src / "big.bin", random.Random(11), 8 * MiB)
    hub = hub_factory(root=src)
    spoke = mount_factory(hub.url, "--hub-deadline", str(deadline_s), "--open-mode", open_mode)
    assert hub.stop() is not None
    started = time.monotonic()
    with pytest.raises(OSError) as exc, open(spoke.mnt / "big.bin", "rb") as f:
        while f.read(MiB):
            pass
    seconds = time.monotonic() - started
    assert exc.value.errno == errno.EIO, exc.value
    assert seconds <= 2.2 * deadline_s, seconds
    # a later read (past one more deadline) tries the hub afresh, and fails the same way
    figures(f"uncached_read_hub_down_{open_mode}", deadline_s=deadline_s,
            eio_after_s=f"{seconds:.1f}", multiple=f"{seconds / deadline_s:.2f}")
