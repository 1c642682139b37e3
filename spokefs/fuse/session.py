"""One FUSE session, served beside a worker process: what the coordinator asks of pyfuse3.

The kernel hands each request of a mount to whichever of the mount's ``/dev/fuse``
descriptors reads it first, and takes the reply on the same descriptor. A serving worker
(``worker``) reads a clone of the mount's descriptor (``FUSE_DEV_IOC_CLONE``, what libfuse's
``clone_fd`` does per thread; ``device``): with a clone of its own, the requests it has read
but not answered end with an error when it dies (the kernel ends a closed clone's pending
requests), where on a shared descriptor they would hang.

- The coordinator mounts, then receives and answers INIT synchronously before its loop
  starts (``receive_init``): the mount's kernel read-ahead can only be set after the INIT
  reply (``mount.set_kernel_readahead``), and a worker's requests come only after it.
- While a worker serves, the coordinator reads no requests (``pause_reading``): a process
  that poll()s the descriptor is woken by every request, while of the worker's threads, each
  asleep in read(2), the kernel wakes one. Once the worker is gone, the coordinator reads
  again, so the mount never goes unserved.
- Two readers share one connection, so the coordinator's descriptor is non-blocking: poll()
  may call it readable for a request the worker then takes, and a blocking read would stall
  the event loop until the next one. The patched pyfuse3 takes EAGAIN as nothing read.

The pyfuse3 functions this needs are the third change of ``deploy/build-pyfuse3.sh``.
Part of the FUSE layer (docs/contributing.md): only these modules import pyfuse3.
"""

from __future__ import annotations

import importlib.util
import os

import pyfuse3


def supported() -> bool:
    """Whether this pyfuse3 can serve one mount beside a worker process."""
    return int(getattr(pyfuse3, "SPOKEFS_WORKERS", 0)) >= 3


def read_loop_built() -> bool:
    """Whether the native read loop a worker serves with (``read_loop``, C) is installed."""
    return importlib.util.find_spec("spokefs.fuse.read_loop") is not None


def receive_init() -> None:
    """Receive the kernel's INIT on the mount just made and answer it; the mount's descriptor
    is non-blocking from then on."""
    pyfuse3.spokefs_receive_init()  # type: ignore[attr-defined]
    os.set_blocking(session_fd(), False)


def session_fd() -> int:
    """The mount's ``/dev/fuse`` descriptor (a worker clones it)."""
    fd: int = pyfuse3.spokefs_session_fd()  # type: ignore[attr-defined]
    return fd


def pause_reading(paused: bool) -> None:
    """Stop reading the mount's requests (a worker serves them all), or read them again."""
    pyfuse3.spokefs_pause_reading(paused)  # type: ignore[attr-defined]
