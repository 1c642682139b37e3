"""A serving worker's ``/dev/fuse`` descriptor, on the coordinator's side too.

The kernel takes a request's reply only on the descriptor that read the request (each clone
of a mount's descriptor has its own queue of requests being processed). The coordinator
makes the worker's clone (``clone_device``) and keeps a copy (``WorkerDevice``), so that it
writes the replies of the reads it serves for the worker itself: the bytes go from the
coordinator to the kernel in one ``writev``, not over the worker's channel and out again.

The kernel ends a clone's pending requests with an error when the clone's last descriptor
closes: the coordinator closes its copy as soon as the worker is gone, so the requests the
worker held end then, as they would without the copy, and never hang.

Part of the FUSE layer (docs/contributing.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct

log = logging.getLogger(__name__)

# _IOR(229, 0, uint32_t): <linux/fuse.h>
FUSE_DEV_IOC_CLONE = 0x8004E500
# struct fuse_out_header: len (u32), error (i32, minus an errno), unique (u64)
_OUT_HEADER = struct.Struct("<IiQ")


def clone_device(mount_fd: int) -> int:
    """A new ``/dev/fuse`` descriptor on the connection of ``mount_fd`` (blocking: the loop's
    threads sleep in read(2), and the kernel wakes one of them per request; close-on-exec:
    only the worker it is passed to inherits it).

    Raises:
        OSError: ``/dev/fuse`` cannot be opened or cloned.
    """
    clone = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(clone, FUSE_DEV_IOC_CLONE, struct.pack("I", mount_fd))
    except BaseException:
        os.close(clone)
        raise
    return clone


class WorkerDevice:
    """The coordinator's copy of a worker's clone: replies to requests the worker read."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @property
    def fd(self) -> int:
        """The descriptor (-1 once closed)."""
        return self._fd

    def reply(self, unique: int, data: bytes | memoryview) -> None:
        """Answer request ``unique`` with ``data``."""
        self._write(unique, [_OUT_HEADER.pack(_OUT_HEADER.size + len(data), 0, unique), data])

    def reply_error(self, unique: int, err: int) -> None:
        """Answer request ``unique`` with an errno."""
        self._write(unique, [_OUT_HEADER.pack(_OUT_HEADER.size, -err, unique)])

    def _write(self, unique: int, parts: list[bytes | memoryview]) -> None:
        if self._fd < 0:
            return  # the worker is gone, and the kernel ended its requests
        try:
            os.writev(self._fd, parts)
        except OSError as exc:
            # ENOENT: the request was interrupted and is gone; ENODEV: the mount is ending
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning("a reply to the worker's request %d failed: %s", unique, exc)

    def close(self) -> None:
        """Close the copy (the worker is gone: its pending requests end now)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

