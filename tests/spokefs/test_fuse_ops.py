"""SpokeOps called directly, without the kernel: errnos and attributes."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pyfuse3
import pytest
from prometheus_client import REGISTRY
from spoke_fakes import FakeHub

from spokefs.cache.block_cache import BlockCache
from spokefs.config import SpokeConfig
from spokefs.fuse.control import Control
from spokefs.fuse.io_size import preferred_io_size
from spokefs.fuse.ops import SpokeOps
from spokefs.namespace.replica import ROOT_INODE, Namespace
from spokefs.protocol import Entry
from spokefs.read.block_source import BlockSource
from spokefs.read.reader import Reader
from tests.helpers import wire

ROOT = 0x100
DATA = os.urandom(10_000)


class Ctx:
    uid = gid = pid = 0
    umask = 0o022


def make_ops(tmp_path: Path, open_mode: str, control: bool = False):
    ns = Namespace(tmp_path / "ns")
    ns.reload_snapshot(wire.snapshot(3, ROOT, [
        Entry(ROOT, 0, stat.S_IFDIR | 0o755, 0, 10, 2, 0, b""),
        Entry(0x200, ROOT, stat.S_IFREG | 0o640, len(DATA), 123456789, 1, 9, b"f"),
        Entry(0x300, ROOT, stat.S_IFLNK | 0o777, 0, 10, 1, 0, b"l", b"f"),
    ]))
    cache = BlockCache(tmp_path / "blocks", 16 << 20)
    source = BlockSource(cache, FakeHub({(0x200, 9): DATA}),  # type: ignore[arg-type]
                         small_file_bytes=1 << 20)
    reader = Reader(source, None)
    cfg = SpokeConfig("http://hub", tmp_path, tmp_path, 16 << 20, uid=7, gid=8,
                      open_mode=open_mode)
    ctl = Control(ns, reader, None) if control else None  # type: ignore[arg-type]
    return SpokeOps(ns, reader, ctl, cfg), cache, ns


@pytest.fixture
def ops(tmp_path: Path):
    ops, cache, ns = make_ops(tmp_path, "handle")
    yield ops
    cache.close()
    ns.close()


@pytest.fixture
def kernel_ops(tmp_path: Path):
    ops, cache, ns = make_ops(tmp_path, "kernel")
    yield ops, ns
    cache.close()
    ns.close()


async def test_kernel_opens_answer_enosys_and_reads_name_the_inode(kernel_ops):
    ops, _ = kernel_ops
    with pytest.raises(pyfuse3.FUSEError) as info:  # ENOSYS: the kernel opens files itself
        await ops.open(0x200, os.O_RDONLY, Ctx())
    assert info.value.errno == errno.ENOSYS
    with pytest.raises(pyfuse3.FUSEError) as info:  # writes are still refused first
        await ops.open(0x200, os.O_WRONLY, Ctx())
    assert info.value.errno == errno.EROFS
    assert await ops.read(0x200, 4090, 20) == DATA[4090:4110]  # fh 0 arrives as the inode
    assert await ops.read(0x200, 9_990, 4096) == DATA[9_990:]
    with pytest.raises(pyfuse3.FUSEError) as info:
        await ops.read(0x999, 0, 10)
    assert info.value.errno == errno.ENOENT


async def test_attributes(ops):
    a = await ops.lookup(ROOT_INODE, b"f", Ctx())
    assert (a.st_ino, a.st_size, a.st_mtime_ns, a.st_uid, a.st_gid) == (
        0x200, 10_000, 123456789, 7, 8)
    assert a.st_mode == stat.S_IFREG | 0o640
    link = await ops.lookup(ROOT_INODE, b"l", Ctx())
    assert link.st_size == 1 and await ops.readlink(link.st_ino, Ctx()) == b"f"
    root = await ops.getattr(ROOT_INODE, Ctx())
    assert stat.S_ISDIR(root.st_mode) and root.st_nlink == 2
    # a small file's preferred I/O size holds it whole (io_size); others keep one block
    assert (a.st_blksize, link.st_blksize, root.st_blksize) == (16384, 4096, 4096)


def test_preferred_io_size_holds_small_files_whole():
    bound = 1 << 20
    sizes = [0, 1, 4096, 4097, 114_560, 131_072, 131_073, bound, bound + 1, 1 << 40]
    assert [preferred_io_size(s, bound) for s in sizes] == [
        4096, 4096, 4096, 8192, 131_072, 131_072, 262_144, bound, 4096, 4096]


async def test_read_through_handle(ops):
    fi = await ops.open(0x200, os.O_RDONLY, Ctx())
    assert await ops.read(fi.fh, 4090, 20) == DATA[4090:4110]
    assert await ops.read(fi.fh, 9_990, 4096) == DATA[9_990:]
    await ops.release(fi.fh)


async def test_opendir_leaves_directories_to_the_kernel(ops):
    """With the patched pyfuse3, opendir answers ENOSYS (the kernel stops asking) and a
    listing names the inode as its handle; with a stock one, the handle is the inode."""
    if getattr(pyfuse3, "SPOKEFS_PLAIN_READDIR", False):
        with pytest.raises(pyfuse3.FUSEError) as info:
            await ops.opendir(ROOT_INODE, Ctx())
        assert info.value.errno == errno.ENOSYS
    else:
        assert await ops.opendir(ROOT_INODE, Ctx()) == ROOT_INODE
    assert ops.readdirplus is False


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (lambda o: o.lookup(ROOT_INODE, b"missing", Ctx()), errno.ENOENT),
        (lambda o: o.lookup(ROOT_INODE, b"x" * 256, Ctx()), errno.ENAMETOOLONG),
        (lambda o: o.open(0x200, os.O_WRONLY, Ctx()), errno.EROFS),
        (lambda o: o.open(0x200, os.O_RDWR, Ctx()), errno.EROFS),
        (lambda o: o.open(0x200, os.O_RDONLY | os.O_TRUNC, Ctx()), errno.EROFS),
        (lambda o: o.open(ROOT_INODE, os.O_RDONLY, Ctx()), errno.EISDIR),
        (lambda o: o.opendir(0x200, Ctx()), errno.ENOTDIR),
        (lambda o: o.readlink(0x200, Ctx()), errno.EINVAL),
        (lambda o: o.mkdir(ROOT_INODE, b"d", 0o755, Ctx()), errno.EROFS),
        (lambda o: o.unlink(ROOT_INODE, b"f", Ctx()), errno.EROFS),
        (lambda o: o.create(ROOT_INODE, b"n", 0o644, os.O_WRONLY, Ctx()), errno.EROFS),
        (lambda o: o.getxattr(0x200, b"user.x", Ctx()), pyfuse3.ENOATTR),
        (lambda o: o.getattr(0x999, Ctx()), errno.ENOENT),
    ],
)
async def test_errnos(ops, call, code):
    with pytest.raises(pyfuse3.FUSEError) as info:
        await call(ops)
    assert info.value.errno == code


async def test_an_unknown_control_attribute_is_enoattr_and_not_counted(tmp_path: Path):
    """Control raises NoAttribute; the boundary answers ENOATTR, as for names not ours, and
    counts no FUSE error (an answer, not a failure)."""
    ops, cache, ns = make_ops(tmp_path, "handle", control=True)
    try:
        with pytest.raises(pyfuse3.FUSEError) as info:
            await ops.getxattr(0x200, b"user.spokefs.nope", Ctx())
        assert info.value.errno == pyfuse3.ENOATTR
        assert REGISTRY.get_sample_value("spokefs_fuse_errors_total",
                                         {"op": "getxattr", "errno": "ENODATA"}) is None
    finally:
        cache.close()
        ns.close()
