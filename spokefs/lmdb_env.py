"""Opening the spoke's LMDB environments so that a full disk is an error, never a crash.

LMDB keeps its reader table in ``lock.mdb``, a file it sizes with ``ftruncate`` and then
writes through a shared memory map. On a full filesystem the truncate succeeds (the file is
sparse) and the first store into the map finds no page to back it: the kernel sends SIGBUS
and the process dies (measured: a mount on a full tmpfs died with "Fatal Python error: Bus
error" inside ``lmdb.open``). So the lock file's blocks are reserved with
``posix_fallocate`` first: on a full disk that fails with ENOSPC, a plain error, and once
they are reserved LMDB's stores into them cannot fault. ``data.mdb`` needs nothing of the
kind: without ``writemap`` LMDB writes it with ``pwrite``, whose ENOSPC comes back as
``lmdb.DiskError``.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import lmdb

from spokefs.errors import StoreFailed

# LMDB's lock file: a header and 126 reader slots of 64 bytes by default (about 8 KiB);
# a larger file only gives it more slots.
LOCK_BYTES = 64 << 10


def open_env(path: Path, **kwargs: Any) -> lmdb.Environment:
    """``lmdb.open(path, **kwargs)`` with the lock file's blocks reserved first.

    Raises:
        StoreFailed: no room on the disk for the lock file.
    """
    path.mkdir(parents=True, exist_ok=True)
    reserve(path / "lock.mdb", LOCK_BYTES)
    return lmdb.open(str(path), **kwargs)


def reserve(file: Path, nbytes: int) -> None:
    """Back the first ``nbytes`` of ``file`` with disk blocks (creating it, mode 0600).

    Raises:
        StoreFailed: the disk is full.
    """
    fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFailed(f"no room on the cache disk for {file}: "
                              f"{exc.strerror}") from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate here: as before
            raise
    finally:
        os.close(fd)
