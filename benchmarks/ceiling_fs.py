#!/usr/bin/env python3
"""ceiling_fs: a minimal in-memory, read-only pyfuse3 filesystem: the ceiling of FUSE in Python.

The training benchmark (benchmarks/train.py) reads the same files through it and through
spokefs, so its report can say what fraction of the "FUSE served by a Python process on
trio" ceiling spokefs reaches. How: at start the whole directory tree ROOT is read into a
dict (inode -> node, file contents as bytes); then it mounts MNT and answers only
lookup, getattr, open, read, release, opendir, readdir and releasedir from that dict.

It takes the spoke's request path, so that a ratio to it measures the spoke, not a
difference in how many requests the kernel sends (with OPEN and RELEASE answered, a small
file cost 5.5 requests here against the spoke's 3.5, which made every "fraction of the
ceiling" look better than it was):
- ``--open-mode kernel`` (the default, as the spoke's where setup built the patched pyfuse3):
  OPEN answers ENOSYS, so the kernel opens and closes files itself (FUSE no_open, which
  implies keep_cache), and reads name the inode; ``handle``: OPEN and RELEASE answered,
  ``keep_cache=False`` (like a first open in the spoke's handle mode).
- directories as the spoke serves them: OPENDIR answers ENOSYS (no OPENDIR, RELEASEDIR;
  the kernel caches listings) and plain READDIR (``readdirplus = False``), where the patched
  pyfuse3 has them (``SPOKEFS_PLAIN_READDIR``), else as a stock pyfuse3 does.
- no flush method (the kernel gets ENOSYS once and stops sending flushes), long entry and
  attribute timeouts, the spoke's mount options (``ro``, ``allow_other``,
  ``default_permissions``), its pyfuse3 worker count and its 1 MiB kernel read-ahead, set
  once INIT is answered as the spoke does (written before, the INIT reply capped it to
  128 KiB), and its ``st_blksize`` (``spokefs.fuse.io_size``: a small file's size rounded up
  to a power of two, so that a buffered reader's first read takes it in one FUSE READ).
Nothing else: no cache, no network, no locks.

    python benchmarks/ceiling_fs.py ROOT MNT [--open-mode kernel|handle] [--count-requests F]

With ``--count-requests F`` it counts the requests it answers, by operation, and writes them
to F as JSON on SIGUSR1 (``bench_request_cost.py`` checks with them what the kernel sent; a
dict increment per request, ~0.1 us against the tens of us a request costs).

Prints ``ceiling_fs: mounted N files (B bytes) at MNT (open mode M, readdir R)`` once
mounted; exits 0 after ``fusermount3 -u MNT`` or SIGTERM/SIGINT (then it unmounts itself).
Needs root for ``allow_other`` and the read-ahead setting (without root, read-ahead stays at
the default).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pyfuse3
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spokefs.fuse.io_size import preferred_io_size  # the repository, above

TIMEOUT_S = 3600.0  # entry and attribute timeouts: the tree never changes
READAHEAD_KIB = 1024  # spokefs's default kernel_readahead_kib
MAX_TASKS = 64  # spokefs's default fuse_max_tasks
# What the patched pyfuse3 of deploy/build-pyfuse3.sh adds: reads that name the inode
# when the kernel opened the file itself, and plain READDIR for readdirplus = False.
READ_INODE = bool(getattr(pyfuse3, "SPOKEFS_READ_INODE", False))
PLAIN_READDIR = bool(getattr(pyfuse3, "SPOKEFS_PLAIN_READDIR", False))


@dataclass
class Node:
    """A directory (children: name -> inode, in name order) or a regular file (data)."""

    inode: int
    mode: int
    mtime_ns: int
    data: bytes = b""
    children: dict[bytes, int] = field(default_factory=dict)


def load_tree(root: Path) -> dict[int, Node]:
    """Every directory and regular file under root, contents in memory; the root is
    ``pyfuse3.ROOT_INODE``. Symlinks and other kinds are skipped."""
    nodes: dict[int, Node] = {}
    next_inode = pyfuse3.ROOT_INODE

    def add(st: os.stat_result, data: bytes = b"") -> Node:
        nonlocal next_inode
        node = Node(next_inode, st.st_mode, st.st_mtime_ns, data)
        nodes[node.inode] = node
        next_inode += 1
        return node

    def walk(path: Path, node: Node) -> None:
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                child = add(st)
                walk(Path(entry.path), child)
            elif stat.S_ISREG(st.st_mode):
                child = add(st, Path(entry.path).read_bytes())
            else:
                continue
            node.children[os.fsencode(entry.name)] = child.inode

    walk(root, add(root.stat()))
    return nodes


class CeilingOps(pyfuse3.Operations):
    """Answers from the dict; every other operation is pyfuse3's default (ENOSYS)."""

    enable_writeback_cache = False
    readdirplus = False  # the spoke's plain READDIR (a stock pyfuse3 ignores it)

    def __init__(self, nodes: dict[int, Node], kernel_open: bool) -> None:
        super().__init__()
        self.nodes = nodes
        self.kernel_open = kernel_open
        self.initialised = trio.Event()

    def init(self) -> None:
        """Called while pyfuse3 handles INIT; the reply is written right after, in the same
        call, so a task waiting on ``initialised`` runs once the kernel applied it."""
        self.initialised.set()

    def _node(self, inode: int) -> Node:
        node = self.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _attr(self, node: Node) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = pyfuse3.InodeT(node.inode)
        e.generation = 0
        e.entry_timeout = TIMEOUT_S
        e.attr_timeout = TIMEOUT_S
        e.st_mode = pyfuse3.ModeT(node.mode)
        e.st_nlink = 2 if stat.S_ISDIR(node.mode) else 1
        e.st_uid = e.st_gid = 0
        e.st_size = len(node.data)
        e.st_blksize = (preferred_io_size(len(node.data), READAHEAD_KIB * 1024)
                        if stat.S_ISREG(node.mode) else 4096)
        e.st_blocks = (e.st_size + 511) // 512
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = node.mtime_ns
        return e

    async def lookup(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        child = self._node(parent_inode).children.get(bytes(name))
        if child is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(self.nodes[child])

    async def getattr(self, inode: pyfuse3.InodeT,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attr(self._node(inode))

    async def open(self, inode: pyfuse3.InodeT, flags: int,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self._node(inode)
        if stat.S_ISDIR(node.mode):
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        if self.kernel_open:  # ENOSYS is success: the kernel opens files itself from now on
            raise pyfuse3.FUSEError(errno.ENOSYS)
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(inode), keep_cache=False)

    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        # the handle is the inode either way (kernel opens: the patched pyfuse3 passes it)
        return self.nodes[fh].data[off:off + size]

    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        return None

    async def opendir(self, inode: pyfuse3.InodeT,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.FileHandleT:
        if not stat.S_ISDIR(self._node(inode).mode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if PLAIN_READDIR:  # the kernel opens directories itself (no OPENDIR, RELEASEDIR)
            raise pyfuse3.FUSEError(errno.ENOSYS)
        return pyfuse3.FileHandleT(inode)

    async def readdir(self, fh: pyfuse3.FileHandleT, start_id: int,
                      token: pyfuse3.ReaddirToken) -> None:
        entries = list(self.nodes[fh].children.items())
        for i in range(start_id, len(entries)):
            name, inode = entries[i]
            if not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(name),
                                         self._attr(self.nodes[inode]), i + 1):
                return

    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        return None


class CountingOps(CeilingOps):
    """``CeilingOps`` that counts what it answers (``--count-requests``)."""

    def __init__(self, nodes: dict[int, Node], kernel_open: bool) -> None:
        super().__init__(nodes, kernel_open)
        self.counts: dict[str, int] = {}

    def _count(self, op: str) -> None:
        self.counts[op] = self.counts.get(op, 0) + 1

    async def lookup(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        self._count("lookup")
        return await super().lookup(parent_inode, name, ctx)

    async def getattr(self, inode: pyfuse3.InodeT,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        self._count("getattr")
        return await super().getattr(inode, ctx)

    async def open(self, inode: pyfuse3.InodeT, flags: int,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        self._count("open")
        return await super().open(inode, flags, ctx)

    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        self._count("read")
        return await super().read(fh, off, size)

    async def opendir(self, inode: pyfuse3.InodeT,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.FileHandleT:
        self._count("opendir")
        return await super().opendir(inode, ctx)

    async def readdir(self, fh: pyfuse3.FileHandleT, start_id: int,
                      token: pyfuse3.ReaddirToken) -> None:
        self._count("readdir")
        return await super().readdir(fh, start_id, token)


async def _write_counts_on_signal(ops: CountingOps, path: Path) -> None:
    with trio.open_signal_receiver(signal.SIGUSR1) as signals:
        async for _ in signals:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(ops.counts))
            tmp.replace(path)


def set_readahead(mnt: Path, kib: int) -> None:
    """The mount's kernel read-ahead, as spokefs sets its own (default 128 KiB)."""
    target = os.path.abspath(mnt)
    with open("/proc/self/mountinfo") as f:
        devices = [line.split()[2] for line in f if line.split()[4] == target]
    if devices:
        try:
            Path(f"/sys/class/bdi/{devices[-1]}/read_ahead_kb").write_text(f"{kib}\n")
        except OSError as exc:
            print(f"ceiling_fs: read-ahead left at its default: {exc}", file=sys.stderr)


async def _serve(ops: CeilingOps, mnt: Path, counts_path: Path | None) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_terminate_on_signal)
        if isinstance(ops, CountingOps) and counts_path is not None:
            nursery.start_soon(_write_counts_on_signal, ops, counts_path)
        nursery.start_soon(_readahead_once_initialised, ops, mnt)
        await pyfuse3.main(min_tasks=2, max_tasks=MAX_TASKS)
        nursery.cancel_scope.cancel()


async def _readahead_once_initialised(ops: CeilingOps, mnt: Path) -> None:
    await ops.initialised.wait()
    set_readahead(mnt, READAHEAD_KIB)


async def _terminate_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            pyfuse3.terminate()
            return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("root", type=Path, help="directory to load into memory")
    p.add_argument("mountpoint", type=Path)
    p.add_argument("--open-mode", choices=["kernel", "handle"],
                   default="kernel" if READ_INODE else "handle",
                   help="as the spoke's --open-mode (default: kernel where pyfuse3 allows it)")
    p.add_argument("--count-requests", type=Path, metavar="F",
                   help="count requests by operation; write them to F on SIGUSR1")
    args = p.parse_args(argv)
    if args.open_mode == "kernel" and not READ_INODE:
        p.error("--open-mode kernel needs the pyfuse3 that deploy/build-pyfuse3.sh builds")
    nodes = load_tree(args.root)
    files = [n for n in nodes.values() if stat.S_ISREG(n.mode)]
    options = set(pyfuse3.default_options) | {"ro", "allow_other", "fsname=ceilingfs",
                                              "subtype=ceilingfs"}
    ops = (CountingOps if args.count_requests else CeilingOps)(nodes,
                                                               args.open_mode == "kernel")
    pyfuse3.init(ops, str(args.mountpoint), options)
    try:
        print(f"ceiling_fs: mounted {len(files)} files ({sum(len(n.data) for n in files)} "
              f"bytes) at {args.mountpoint} (open mode {args.open_mode}, readdir "
              f"{'plain' if PLAIN_READDIR else 'plus'})", flush=True)
        trio.run(_serve, ops, args.mountpoint, args.count_requests)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
