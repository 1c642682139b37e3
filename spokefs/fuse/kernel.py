"""What the spoke asks of the kernel outside FUSE requests: which reads the pyfuse3 build can
route (``reads_by_inode``), and the kernel's caches to forget (``KernelCache``, which the
refresher is given once the mount is up).

Part of the FUSE layer (docs/contributing.md): only these modules import pyfuse3.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

import pyfuse3

log = logging.getLogger(__name__)


def reads_by_inode() -> bool:
    """Whether this pyfuse3 names the inode of a read whose handle is 0 (the build of
    deploy/build-pyfuse3.sh): what ``--open-mode kernel`` needs."""
    return bool(getattr(pyfuse3, "SPOKEFS_READ_INODE", False))


class KernelCache:
    """The kernel's entry, attribute and page caches of the mount, to invalidate (they are
    the connection's, so a serving worker's view of the mount forgets them too)."""

    def forget_entry(self, parent: int, name: bytes) -> None:
        """Drop a cached name (queued: pyfuse3 invalidates it from a thread of its own)."""
        _quietly(pyfuse3.invalidate_entry_async, pyfuse3.InodeT(parent),
                 pyfuse3.FileNameT(name))

    def forget_inodes(self, inodes: list[int]) -> None:
        """Drop the cached attributes and pages of these inodes: a synchronous write to
        /dev/fuse each, which may wait on the kernel's page locks (held by a read we are
        serving): call it from a worker thread, never from the trio thread."""
        for ino in inodes:
            _quietly(pyfuse3.invalidate_inode, pyfuse3.InodeT(ino))


def _quietly(fn: Callable[..., object], *args: object) -> None:
    """Kernel cache invalidation; ENOENT means the kernel had nothing cached: fine."""
    try:
        fn(*args)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            log.debug("invalidation %s%r failed: %s", getattr(fn, "__name__", fn), args, exc)
