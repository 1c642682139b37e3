"""End to end: a real hubd exports the awkward tree, a real spokefs mounts it, and the mount
must be indistinguishable from the source for every read-only observation.

Most checks share one module-scoped mount (``shared_mount``) to keep the run short; tests that
stop the hub or need other mount options make their own through the factories.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable

import pytest

from tests.helpers import treegen
from tests.helpers.page_cache import drop_pages
from tests.helpers.procs import SpokeMount, is_mounted

pytestmark = pytest.mark.fuse

KiB = 1024


def _b(path: os.PathLike | str | bytes) -> bytes:
    return os.fsencode(path)


def _read(path: bytes) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def mnt(shared_mount: SpokeMount) -> bytes:
    return _b(shared_mount.mnt)


def lstat_walk(root: bytes) -> dict[bytes, os.stat_result]:
    """rel path -> lstat for every entry under root (root itself as b''), no symlink followed."""
    out = {b"": os.lstat(root)}
    stack = [b""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for entry in it:
                sub = os.path.join(rel, entry.name) if rel else entry.name
                out[sub] = entry.stat(follow_symlinks=False)
                if entry.is_dir(follow_symlinks=False):
                    stack.append(sub)
    return out


@pytest.fixture(scope="module")
def source_stats(source_tree: treegen.Tree) -> dict[bytes, os.stat_result]:
    return lstat_walk(source_tree.root)


@pytest.fixture(scope="module")
def mount_stats(mnt: bytes) -> dict[bytes, os.stat_result]:
    return lstat_walk(mnt)


def _pread_all(path: bytes, offset: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


# -- namespace ------------------------------------------------------------------------------


def test_walk_same_dirs_and_files(mnt: bytes, source_tree: treegen.Tree) -> None:
    def walk(root: bytes) -> dict[bytes, tuple[list[bytes], list[bytes]]]:
        return {os.path.relpath(d, root): (sorted(ds), sorted(fs))
                for d, ds, fs in os.walk(root, followlinks=False)}

    src, got = walk(source_tree.root), walk(mnt)
    assert got.keys() == src.keys()
    for rel, want in src.items():
        assert got[rel] == want, rel


def test_lstat_fields_match(source_stats, mount_stats) -> None:
    assert mount_stats.keys() == source_stats.keys()
    diffs = []
    for rel, s in source_stats.items():
        m = mount_stats[rel]
        want = {"mode": s.st_mode, "mtime_ns": s.st_mtime_ns, "nlink": s.st_nlink,
                "uid": 0, "gid": 0}
        have = {"mode": m.st_mode, "mtime_ns": m.st_mtime_ns, "nlink": m.st_nlink,
                "uid": m.st_uid, "gid": m.st_gid}
        # A directory's st_size is a property of the source file system (ext4: 4096 and up),
        # not of the tree, so only files and symlinks are compared.
        if not stat.S_ISDIR(s.st_mode):
            want["size"], have["size"] = s.st_size, m.st_size
        if want != have:
            diffs.append((rel, {k: (want[k], have[k]) for k in want if want[k] != have[k]}))
    assert not diffs, f"{len(diffs)} entries differ (want, have): {diffs[:20]}"


def test_special_entries_have_their_types(mnt: bytes, source_tree: treegen.Tree,
                                          mount_stats) -> None:
    t = source_tree
    assert mount_stats[t.sparse].st_size == treegen.SPARSE_SIZE
    assert stat.S_IMODE(mount_stats[t.private_dir].st_mode) == 0o700
    for mode, rel in t.modes.items():
        assert stat.S_IMODE(mount_stats[rel].st_mode) == mode, rel
    for role, rel in t.symlinks.items():
        assert stat.S_ISLNK(mount_stats[rel].st_mode), role
    assert stat.S_IMODE(mount_stats[b""].st_mode) == 0o755


def test_hard_links_share_one_inode(mnt: bytes, source_tree: treegen.Tree) -> None:
    a, b = (os.lstat(os.path.join(mnt, rel)) for rel in source_tree.hardlinks)
    assert a.st_nlink == b.st_nlink == 2
    assert a.st_ino == b.st_ino


def test_readlink_every_symlink(mnt: bytes, source_tree: treegen.Tree, source_stats) -> None:
    links = [rel for rel, s in source_stats.items() if stat.S_ISLNK(s.st_mode)]
    assert len(links) == len(source_tree.symlinks)
    for rel in links:
        assert os.readlink(os.path.join(mnt, rel)) == os.readlink(source_tree.abs(rel)), rel


def test_symlinks_resolve_like_the_source(mnt: bytes, source_tree: treegen.Tree) -> None:
    links = source_tree.symlinks
    # inside file and inside dir resolve within the mount
    with open(os.path.join(mnt, links["file"]), "rb") as f:
        assert f.read() == source_tree.read(source_tree.sized[4096])
    assert sorted(os.listdir(os.path.join(mnt, links["dir"]))) == [b"d1"]
    with pytest.raises(FileNotFoundError):
        os.stat(os.path.join(mnt, links["dangling"]))
    with pytest.raises(OSError) as exc:
        os.stat(os.path.join(mnt, links["loop"]))
    assert exc.value.errno == errno.ELOOP


def test_big_dir_lists_completely(mnt: bytes, source_tree: treegen.Tree) -> None:
    got = os.listdir(os.path.join(mnt, source_tree.big_dir))
    assert len(got) == treegen.DIR_ENTRIES
    assert set(got) == set(os.listdir(source_tree.abs(source_tree.big_dir)))
    with os.scandir(os.path.join(mnt, source_tree.big_dir)) as it:
        assert sum(1 for _ in it) == treegen.DIR_ENTRIES


def test_awkward_names_round_trip(mnt: bytes, source_tree: treegen.Tree) -> None:
    names = set(os.listdir(os.path.join(mnt, b"names")))
    for rel in source_tree.awkward:
        assert os.path.basename(rel) in names, rel
        path = os.path.join(mnt, rel)
        if os.path.isdir(path):
            assert os.listdir(path) == os.listdir(source_tree.abs(rel))
        else:
            with open(path, "rb") as f:
                assert f.read() == source_tree.read(rel), rel


# -- data -----------------------------------------------------------------------------------


def test_sha256_of_every_file(mnt: bytes, source_tree: treegen.Tree, source_stats) -> None:
    files = [rel for rel, s in source_stats.items()
             if stat.S_ISREG(s.st_mode) and rel != source_tree.sparse]
    assert len(files) > treegen.DIR_ENTRIES
    bad = [rel for rel in files
           if treegen.sha256_file(os.path.join(mnt, rel))
           != treegen.sha256_file(source_tree.abs(rel))]
    assert not bad, f"{len(bad)} files differ: {bad[:20]}"


def test_diff_r_no_dereference(mnt: bytes, source_tree: treegen.Tree) -> None:
    r = subprocess.run(["diff", "-r", "--no-dereference", b"-x", treegen.SPARSE_NAME,
                        source_tree.root, mnt], capture_output=True, timeout=300, check=False)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])


def _boundary_offsets(size: int, rng: random.Random) -> list[tuple[int, int]]:
    """(offset, length) pairs around 4 KiB boundaries, at and past EOF, and random."""
    reads = []
    for _ in range(12):
        edge = rng.randrange(0, size // (4 * KiB) + 1) * 4 * KiB
        off = max(0, edge + rng.randint(-5, 5))
        reads.append((off, rng.choice([1, 7, 4 * KiB, 4 * KiB + 1, 3 * 4 * KiB + 5,
                                       rng.randint(1, 200 * KiB)])))
    reads += [(size, 10), (size + 4096, 10), (max(0, size - 3), 100), (0, size + 100)]
    return reads


def test_random_pread_matches_source(mnt: bytes, source_tree: treegen.Tree) -> None:
    rng = random.Random(7)
    files = list(source_tree.sized.values()) + source_tree.random_files
    for rel in files:
        size = os.path.getsize(source_tree.abs(rel))
        src = os.open(source_tree.abs(rel), os.O_RDONLY)
        dst = os.open(os.path.join(mnt, rel), os.O_RDONLY)
        try:
            for off, n in _boundary_offsets(size, rng):
                want = os.pread(src, n, off)
                got = os.pread(dst, n, off)
                assert got == want, (rel, off, n, len(got), len(want))
                assert len(got) == max(0, min(n, size - off))
        finally:
            os.close(src)
            os.close(dst)


def test_sparse_file_reads(mnt: bytes, source_tree: treegen.Tree) -> None:
    rng = random.Random(11)
    size = treegen.SPARSE_SIZE
    reads = []
    for off, data in source_tree.sparse_segments:
        reads += [(off, len(data)), (max(0, off - 10), len(data) + 20), (off + len(data) // 2, 1)]
    reads += [(2**32 - 1, 2), (2**32, 4096), (2**32 - 4096, 8192), (size - 1, 1),
              (size - 1, 100), (size, 1), (size + 10**6, 4096)]
    reads += [(rng.randrange(0, size), rng.randint(1, 64 * KiB)) for _ in range(40)]
    src = os.open(source_tree.abs(source_tree.sparse), os.O_RDONLY)
    dst = os.open(os.path.join(mnt, source_tree.sparse), os.O_RDONLY)
    try:
        for off, n in reads:
            want = os.pread(src, n, off)
            assert len(want) == max(0, min(n, size - off))
            got = os.pread(dst, n, off)
            assert got == want, (off, n, len(got))
    finally:
        os.close(src)
        os.close(dst)
    # the segments are what the generator wrote, so the reference itself is right
    for off, data in source_tree.sparse_segments:
        assert _pread_all(os.path.join(mnt, source_tree.sparse), off, len(data)) == data


def test_mmap_read(mnt: bytes, source_tree: treegen.Tree) -> None:
    rel = source_tree.mmap_file
    want = source_tree.read(rel)
    with open(os.path.join(mnt, rel), "rb") as f, \
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert len(m) == len(want)
        assert m[:] == want
        assert m[4095:4097 + 8192] == want[4095:4097 + 8192]


def test_statvfs(mnt: bytes) -> None:
    st = os.statvfs(mnt)
    assert st.f_bsize > 0
    assert st.f_flag & os.ST_RDONLY
    assert st.f_namemax >= 255


# -- read-only ------------------------------------------------------------------------------

def _write_ops() -> dict[str, Callable[[bytes], object]]:
    file = b"sizes/size_4096"  # an existing file of the tree
    new = b"sizes/new-entry"
    return {
        "open_wronly": lambda m: os.open(os.path.join(m, file), os.O_WRONLY),
        "open_rdwr": lambda m: os.open(os.path.join(m, file), os.O_RDWR),
        "open_append": lambda m: os.open(os.path.join(m, file), os.O_WRONLY | os.O_APPEND),
        "create": lambda m: os.open(os.path.join(m, new), os.O_WRONLY | os.O_CREAT | os.O_EXCL),
        "mkdir": lambda m: os.mkdir(os.path.join(m, new)),
        "rmdir": lambda m: os.rmdir(os.path.join(m, b"deep/d0/d1/d2/d3/d4/d5/d6/d7/d8/d9")),
        "unlink": lambda m: os.unlink(os.path.join(m, file)),
        "rename": lambda m: os.rename(os.path.join(m, file), os.path.join(m, new)),
        "link": lambda m: os.link(os.path.join(m, file), os.path.join(m, new)),
        "symlink": lambda m: os.symlink(b"target", os.path.join(m, new)),
        "mkfifo": lambda m: os.mkfifo(os.path.join(m, new)),
        "chmod": lambda m: os.chmod(os.path.join(m, file), 0o600),
        "chown": lambda m: os.chown(os.path.join(m, file), 1, 1),
        "utime": lambda m: os.utime(os.path.join(m, file), ns=(1, 1)),
        "truncate": lambda m: os.truncate(os.path.join(m, file), 0),
        "setxattr": lambda m: os.setxattr(os.path.join(m, file), b"user.test", b"x"),
        "removexattr": lambda m: os.removexattr(os.path.join(m, file), b"user.test"),
    }


WRITE_OPS = sorted(_write_ops())


@pytest.mark.parametrize("op", WRITE_OPS)
def test_writes_fail_with_erofs(op: str, mnt: bytes, source_tree: treegen.Tree) -> None:
    assert source_tree.sized[4096] == b"sizes/size_4096"
    fn = _write_ops()[op]
    with pytest.raises(OSError) as exc:
        fd = fn(mnt)
        if isinstance(fd, int):  # an open that wrongly succeeded
            os.close(fd)
    assert exc.value.errno == errno.EROFS, f"{op}: {exc.value!r}"
    # nothing changed
    assert treegen.sha256_file(os.path.join(mnt, source_tree.sized[4096])) == \
        treegen.sha256_file(source_tree.abs(source_tree.sized[4096]))


# -- other users ----------------------------------------------------------------------------


def _as_nobody(*argv: str | bytes) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           *argv], capture_output=True, timeout=60, check=False)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is missing")
def test_other_user_reads_by_mode(mnt: bytes, source_tree: treegen.Tree) -> None:
    t = source_tree
    ok = _as_nobody("cat", os.path.join(mnt, t.modes[0o644]))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == t.read(t.modes[0o644])

    denied = _as_nobody("cat", os.path.join(mnt, t.modes[0o600]))
    assert denied.returncode != 0
    assert b"Permission denied" in denied.stderr, denied.stderr

    private = _as_nobody("ls", os.path.join(mnt, t.private_dir))
    assert private.returncode != 0
    assert b"Permission denied" in private.stderr, private.stderr

    listing = _as_nobody("ls", os.path.join(mnt, b"modes"))
    assert listing.returncode == 0, listing.stderr


# -- own mounts -----------------------------------------------------------------------------


def test_hub_down_serves_cached_data_and_metadata(hub, mount_factory,
                                                  source_tree: treegen.Tree) -> None:
    spoke = mount_factory(hub.url, "--hub-deadline", "3")
    mnt = _b(spoke.mnt)
    rels = [source_tree.sized[65537], source_tree.mmap_file, source_tree.modes[0o644]]
    first = {rel: _read(os.path.join(mnt, rel)) for rel in rels}
    for rel in rels:
        assert first[rel] == source_tree.read(rel)
    walk_before = sorted((d, sorted(ds), sorted(fs)) for d, ds, fs in os.walk(mnt))

    assert hub.stop() == 0
    for rel in rels:
        drop_pages(os.path.join(mnt, rel))
        assert _read(os.path.join(mnt, rel)) == first[rel], rel
    assert sorted((d, sorted(ds), sorted(fs)) for d, ds, fs in os.walk(mnt)) == walk_before
    assert os.readlink(os.path.join(mnt, source_tree.symlinks["absolute"])) == b"/etc/passwd"
    # teardown: the unmount must stay clean with the hub gone


def test_hub_down_uncached_read_fails_then_recovers(hub, mount_factory,
                                                     source_tree: treegen.Tree) -> None:
    spoke = mount_factory(hub.url, "--hub-deadline", "2")
    mnt = _b(spoke.mnt)
    rel = source_tree.random_files[0]
    want = source_tree.read(rel)

    assert hub.stop() == 0
    with pytest.raises(OSError) as exc, open(os.path.join(mnt, rel), "rb") as f:
        f.read()
    assert exc.value.errno == errno.EIO, exc.value
    assert os.path.ismount(mnt)

    hub.start()  # same port
    drop_pages(os.path.join(mnt, rel))
    assert _read(os.path.join(mnt, rel)) == want


def test_uid_gid_options(hub, mount_factory, source_tree: treegen.Tree) -> None:
    spoke = mount_factory(hub.url, "--uid", "1234", "--gid", "1234")
    mnt = _b(spoke.mnt)
    for rel in (b"", b"sizes", source_tree.sized[1], source_tree.symlinks["dangling"],
                source_tree.sparse, source_tree.private_dir):
        st = os.lstat(os.path.join(mnt, rel) if rel else mnt)
        assert (st.st_uid, st.st_gid) == (1234, 1234), rel


def test_readiness_lines_agree(hub, mount_factory, source_stats) -> None:
    """Both daemons announce the same namespace: every entry of the tree plus the root."""
    hub_line = hub.stdout_path.read_text().splitlines()[0]
    m = re.fullmatch(r"hubd: serving (.+) at (http://\S+) \((\d+) entries, generation (\d+)\)",
                     hub_line)
    assert m, hub_line
    assert (m.group(2), int(m.group(3))) == (hub.url, len(source_stats))
    spoke = mount_factory(hub.url)
    # the mount is visible when the kernel has it; the line comes once the serving workers
    # have started too (a moment later: CI once read an empty stdout here)
    deadline = time.monotonic() + 30
    while not spoke.stdout() and time.monotonic() < deadline:
        time.sleep(0.05)
    spoke_line = spoke.stdout().splitlines()[0]
    assert spoke_line == (f"spokefs: mounted {hub.url} at {spoke.mnt} "
                          f"({len(source_stats)} entries, generation {m.group(4)})")


def test_sigterm_unmounts_and_exits_0(hub, mount_factory, source_tree: treegen.Tree) -> None:
    spoke = mount_factory(hub.url)
    rel = source_tree.sized[8192]
    with open(os.path.join(_b(spoke.mnt), rel), "rb") as f:
        assert f.read() == source_tree.read(rel)
    spoke.proc.send_signal(signal.SIGTERM)
    assert spoke.proc.wait(timeout=30) == 0, spoke.stderr()
    assert not is_mounted(spoke.mnt)
