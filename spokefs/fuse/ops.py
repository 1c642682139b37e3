"""The pyfuse3 operations: thin handlers over the namespace and the reader.

Each handler decodes, calls one domain method and encodes; ``@fuse_errors`` turns domain
exceptions into errnos at this one boundary. Metadata calls never touch the network.
Write-like calls answer EROFS (the mount is also ``ro``, so the kernel usually answers
first). Permission checks are the kernel's (``default_permissions``) on the exported modes.

Part of the FUSE layer (docs/contributing.md): only these modules import pyfuse3.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Protocol

import pyfuse3
import trio

from spokefs.config import BLOCK_SIZE, SpokeConfig
from spokefs.errors import NotADir, ReadOnly
from spokefs.fuse.control import PREFIX
from spokefs.fuse.errors import fuse_errors
from spokefs.fuse.inode_streams import InodeStreams
from spokefs.fuse.io_size import preferred_io_size, whole_read_max
from spokefs.fuse.page_cache import PageCachePolicy
from spokefs.namespace.replica import Attr, Namespace
from spokefs.read.stream import Stream, StreamReader
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

_NAME_MAX = 255
# The patched pyfuse3 (deploy/build-pyfuse3.sh) answers listings with plain READDIR when
# asked and names the inode in listings of a directory the kernel opened without us.
_LISTINGS_NAME_INODE = bool(getattr(pyfuse3, "SPOKEFS_PLAIN_READDIR", False))


class ControlAttributes(Protocol):
    """The ``user.spokefs.*`` attributes (``control.Control``; a serving worker forwards
    them to the mount's own process)."""

    async def getxattr(self, attr: Attr, name: bytes, uid: int = 0) -> bytes: ...


class SpokeOps(pyfuse3.Operations):
    """Read-only FUSE view of the replicated namespace.

    Two open modes (``SpokeConfig.open_mode``):

    - ``handle``: every open gets a handle with its own stream, fixed to the file version of
      the open (one version per open file, ESTALE when the hub no longer has it); the page
      cache is kept across opens of one version (``page_cache``).
    - ``kernel``: open answers ENOSYS, so the kernel opens files without asking and sends
      no OPEN or RELEASE (two requests fewer per file); reads name the inode, and the
      stream is per inode (``inode_streams``, which also says what this gives up).

    Attributes:
        handles: open file handle -> its stream (the file version it reads, fixed at open,
            and its access pattern); ``handle`` mode only.
        initialised: set once the kernel's INIT has been answered (see ``init``).
    """

    supports_dot_lookup = False  # no NFS export, so the kernel never looks up ".."
    enable_writeback_cache = False
    enable_acl = False
    # Listings are plain FUSE_READDIR (names, inode numbers, types), not READDIRPLUS: with
    # READDIRPLUS the kernel allocates an inode and a dentry for every entry listed, which is
    # most of a `find`'s time over a large tree (and ~1 KB of kernel memory per entry), while
    # a DataLoader's scandir needs only names and types. A stat of a listed entry costs one
    # LOOKUP instead. Needs the patched pyfuse3 (SPOKEFS_PLAIN_READDIR); a stock one ignores it
    # and keeps READDIRPLUS.
    readdirplus = False

    def __init__(
        self, namespace: Namespace, reader: StreamReader, control: ControlAttributes | None,
        cfg: SpokeConfig,
    ) -> None:
        super().__init__()
        self._ns = namespace
        self._reader = reader
        self._control = control
        self._uid = cfg.uid
        self._gid = cfg.gid
        self._timeout = cfg.attr_timeout_s
        self._whole_read_max = whole_read_max(cfg)  # larger st_blksize up to here (io_size)
        self._fh = itertools.count(1)
        self._pages = PageCachePolicy()
        self.handles: dict[int, Stream] = {}
        self._by_inode = InodeStreams(namespace, reader) if cfg.open_mode == "kernel" else None
        self.initialised = trio.Event()
        # Set while a serving worker runs (``workers.Workers``): what the mount's own answer
        # to a control attribute awaits first, the worker's gathered hits, so that
        # ``/metrics`` read after it counts every read answered before it.
        self.control_barrier: Callable[[], Awaitable[None]] | None = None

    def init(self) -> None:
        """pyfuse3 calls this while it handles the kernel's INIT request, and libfuse writes
        the INIT reply right after, in the same synchronous call: a task waiting on
        ``initialised`` runs only once the kernel has applied that reply (which is what
        resets the mount's read-ahead, see ``mount.set_kernel_readahead``)."""
        self.initialised.set()

    def _entry_template(self) -> pyfuse3.EntryAttributes:
        """An EntryAttributes with the fields every entry shares (owner, timeouts)."""
        e = pyfuse3.EntryAttributes()
        e.generation = 0
        e.entry_timeout = self._timeout
        e.attr_timeout = self._timeout
        e.st_uid = self._uid
        e.st_gid = self._gid
        e.st_rdev = 0
        e.st_blksize = BLOCK_SIZE
        return e

    def _entry(self, a: Attr) -> pyfuse3.EntryAttributes:
        e = self._entry_template()
        e.st_ino = pyfuse3.InodeT(a.ino)
        e.st_mode = pyfuse3.ModeT(a.mode)
        e.st_nlink = a.nlink
        e.st_size = len(a.target) if stat.S_ISLNK(a.mode) else a.size
        e.st_blocks = (e.st_size + 511) // 512
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = a.mtime_ns
        if stat.S_ISREG(a.mode):  # small files: one FUSE READ for a reader's first read
            e.st_blksize = preferred_io_size(a.size, self._whole_read_max)
        return e

    # -- metadata ---------------------------------------------------------------------

    @fuse_errors
    async def lookup(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if len(name) > _NAME_MAX:
            raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
        return self._entry(self._ns.lookup(parent_inode, name))

    @fuse_errors
    async def getattr(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        return self._entry(self._ns.getattr(inode))

    @fuse_errors
    async def readlink(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> bytes:
        a = self._ns.getattr(inode)
        if not stat.S_ISLNK(a.mode):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return a.target

    @fuse_errors
    async def opendir(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileHandleT:
        if not stat.S_ISDIR(self._ns.getattr(inode).mode):
            raise NotADir(f"inode {inode}")
        if _LISTINGS_NAME_INODE:
            # The kernel then opens directories without asking ("no_opendir"): no OPENDIR
            # and no RELEASEDIR, two of the five requests per directory of a `find`;
            # readdir gets the inode as its handle, which is what the handle is anyway; and
            # the kernel caches listings (FOPEN_CACHE_DIR), which the refresher invalidates
            # when a directory's names change (``Applied.inodes``).
            raise pyfuse3.FUSEError(errno.ENOSYS)
        return pyfuse3.FileHandleT(inode)

    @fuse_errors
    async def readdir(
        self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken
    ) -> None:
        if start_id == 0:
            self._reader.on_readdir(self._ns.file_id(fh))
        # One synchronous stretch: the namespace generator holds a read transaction. One
        # EntryAttributes for the whole reply: readdir_reply copies it into the reply
        # buffer at once, so only the fields that differ are set per entry (a million
        # entries cost a million replies: ``find`` over a large tree is this loop).
        e = self._entry_template()
        reply = pyfuse3.readdir_reply
        if _LISTINGS_NAME_INODE:  # plain READDIR: the kernel takes the inode and the type
            for next_id, name, ino, mode in self._ns.readdir_types(fh, start_id):
                e.st_ino = ino
                e.st_mode = mode
                if not reply(token, name, e, next_id):
                    break
            return
        for next_id, name, ino, mode, size, mtime_ns, nlink in self._ns.readdir_rows(fh, start_id):
            e.st_ino = ino
            e.st_mode = mode
            e.st_nlink = nlink
            e.st_size = size
            e.st_blocks = (size + 511) // 512
            e.st_blksize = (preferred_io_size(size, self._whole_read_max) if stat.S_ISREG(mode)
                            else BLOCK_SIZE)
            e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = mtime_ns
            if not reply(token, name, e, next_id):
                break

    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        return None

    @fuse_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        info = self._ns.info
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = BLOCK_SIZE
        s.f_blocks = -(-(info.total_bytes if info else 0) // BLOCK_SIZE)
        s.f_bfree = s.f_bavail = 0
        s.f_files = info.entries if info else 0
        s.f_ffree = s.f_favail = 0
        s.f_namemax = _NAME_MAX
        return s

    @fuse_errors
    async def getxattr(
        self, inode: pyfuse3.InodeT, name: pyfuse3.XAttrNameT, ctx: pyfuse3.RequestContext,
        *, forwarded: bool = False,
    ) -> bytes:
        """A control attribute; ``forwarded``: the worker asks it, after its hits."""
        attr = self._ns.getattr(inode)  # ENOENT for a vanished inode
        if self._control is None or not name.startswith(PREFIX):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        if self.control_barrier is not None and not forwarded:
            await self.control_barrier()
        return await self._control.getxattr(attr, name, ctx.uid)

    @fuse_errors
    async def listxattr(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext
    ) -> list[pyfuse3.XAttrNameT]:
        self._ns.getattr(inode)
        return []

    # -- data -------------------------------------------------------------------------

    @fuse_errors
    async def open(
        self, inode: pyfuse3.InodeT, flags: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise ReadOnly("open for writing")
        a = self._ns.getattr(inode)
        if stat.S_ISDIR(a.mode):
            raise pyfuse3.FUSEError(errno.EISDIR)
        if self._by_inode is not None:
            # ENOSYS is success to the kernel: it opens every file itself from now on
            # (FUSE no_open), and reads carry the inode (inode_streams)
            raise pyfuse3.FUSEError(errno.ENOSYS)
        fh = next(self._fh)
        self.handles[fh] = self._reader.open(FileVersion(a.file_id, a.version, a.size), a.parent_id)
        mode = self._pages.on_open(a.ino, a.version)
        return pyfuse3.FileInfo(
            fh=pyfuse3.FileHandleT(fh), keep_cache=mode.keep_cache, direct_io=mode.direct_io
        )

    def stream_read(self, ino: int, fv: FileVersion, parent_id: int) -> Stream:
        """The read stream of ``ino`` for a read a serving worker answered at ``fv``
        (``InodeStreams.stream_read``; kernel opens only)."""
        if self._by_inode is None:
            raise RuntimeError("streams by inode need --open-mode kernel")
        return self._by_inode.stream_read(ino, fv, parent_id)

    @fuse_errors
    async def read(  # type: ignore[override]  # pyfuse3 takes any buffer (GetBuffer)
            self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes | memoryview:
        # kernel opens: ``fh`` is the inode (our pyfuse3 passes it where the handle is 0)
        stream = self.handles[fh] if self._by_inode is None else self._by_inode.stream(fh)
        return await self._reader.read(stream, off, size)

    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        stream = self.handles.pop(fh, None)
        if stream is not None:
            self._reader.close(stream)
            self._pages.on_release(self._ns.inode(stream.fv.file_id), stream.fv.version)

    # No ``flush``: pyfuse3 then answers FLUSH with ENOSYS, and the kernel stops sending it
    # for this mount; with a method, every close(2) costs one more request.

    # -- everything that writes -------------------------------------------------------

    @fuse_errors
    async def _read_only(self, *args: object, **kwargs: object) -> None:
        raise ReadOnly("read-only file system")

    setattr = mknod = mkdir = unlink = rmdir = symlink = _read_only  # type: ignore[assignment]
    rename = link = create = write = setxattr = removexattr = _read_only  # type: ignore[assignment]
