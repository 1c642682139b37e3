"""One FUSE session, several processes: what the coordinator and a worker ask of pyfuse3.

The kernel hands each request of a mount to whichever of the mount's ``/dev/fuse``
descriptors reads it first, and takes the reply on the same descriptor. A worker serves on a
clone of the mount's descriptor (``FUSE_DEV_IOC_CLONE``, what libfuse's ``clone_fd`` does per
thread): with a clone of its own, requests the worker has read but not answered end with
an error when it dies (the kernel ends a closed clone's pending requests), where on a shared
descriptor they would hang.

libfuse answers everything but INIT with EIO until its session has seen INIT, so:

- the coordinator mounts, then receives and answers INIT synchronously before its loop
  starts, keeping its bytes (``receive_init``);
- a worker makes a session of its own on ``/dev/null`` (libfuse's ``/dev/fd/N`` mountpoint:
  a descriptor that is already mounted, so nothing is mounted), replays those bytes on it
  (the reply goes to ``/dev/null``; the kernel has had the coordinator's), and then moves its
  clone under the session's descriptor number (``join``).

With several processes reading one connection, every descriptor is non-blocking: poll()
wakes each process for a request that only one of them gets, and a blocking read in the
others would stall their event loops until the next request (measured: a coordinator stuck
in ``read(2)`` on ``/dev/fuse`` while its workers served). The patched pyfuse3 takes EAGAIN
as nothing read.

The pyfuse3 functions this needs are the third change of ``deploy/build-pyfuse3.sh``.
Part of the FUSE layer (docs/contributing.md): only these modules import pyfuse3.
"""

from __future__ import annotations

import fcntl
import os
import struct
from collections.abc import Iterable

import pyfuse3

# _IOR(229, 0, uint32_t): <linux/fuse.h>
FUSE_DEV_IOC_CLONE = 0x8004E500


def supported() -> bool:
    """Whether this pyfuse3 can serve one mount from several processes."""
    return int(getattr(pyfuse3, "SPOKEFS_WORKERS", 0)) >= 2


def receive_init() -> bytes:
    """Receive the kernel's INIT on the mount just made, answer it, return its bytes; the
    mount's descriptor is non-blocking from then on."""
    data: bytes = pyfuse3.spokefs_receive_init()  # type: ignore[attr-defined]
    os.set_blocking(session_fd(), False)
    return data


def session_fd() -> int:
    """The mount's ``/dev/fuse`` descriptor (a worker clones it)."""
    fd: int = pyfuse3.spokefs_session_fd()  # type: ignore[attr-defined]
    return fd


def join(ops: pyfuse3.Operations, init: bytes, mount_fd: int, options: Iterable[str]) -> None:
    """Make this process's pyfuse3 session serve the mount behind ``mount_fd`` (inherited
    from the coordinator), on a clone of it; ``init`` is the mount's INIT request. Closes
    ``mount_fd``. Then ``pyfuse3.main`` serves, and ``pyfuse3.close(unmount=False)`` ends.

    Raises:
        OSError: ``/dev/fuse`` cannot be opened or cloned.
    """
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    clone = -1
    try:
        clone = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        fcntl.ioctl(clone, FUSE_DEV_IOC_CLONE, struct.pack("I", mount_fd))
        os.set_blocking(clone, False)
        pyfuse3.init(ops, f"/dev/fd/{null}", set(options))
        pyfuse3.spokefs_process_request(init)  # type: ignore[attr-defined]
        os.dup2(clone, null, inheritable=False)  # the session's descriptor is the clone now
    except BaseException:
        os.close(null)
        raise
    finally:
        if clone >= 0:
            os.close(clone)
        os.close(mount_fd)
