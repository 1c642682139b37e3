"""Dropping a file's pages from the kernel's page cache, so the next read reaches the mount.

``posix_fadvise(POSIX_FADV_DONTNEED)`` is best effort: a page that is locked, mapped or
briefly held by someone else at that moment stays, silently. A test that counts the reads
the mount answers must know the pages are gone (CI runs saw a whole file served from the
page cache right after the advice, in a test and in ``bench_reads_per_file.py``), so
``drop_pages`` checks with mincore(2), advises
again a few times, then drops the machine's clean caches (``vm.drop_caches``, root), and
fails loudly if pages still stay.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

_PAGE = mmap.PAGESIZE
_ATTEMPTS = 5
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def _errno_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def resident_pages(fd: int) -> int:
    """How many of the open file's pages are in the page cache (mincore of a shared map:
    mapping reads nothing, and mincore looks the file's pages up without faulting them)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        raise _errno_error("mmap")
    try:
        vec = (ctypes.c_ubyte * ((size + _PAGE - 1) // _PAGE))()
        if _libc.mincore(addr, size, vec) != 0:
            raise _errno_error("mincore")
        return sum(v & 1 for v in vec)
    finally:
        _libc.munmap(addr, size)


def drop_pages(target: str | bytes | os.PathLike[str] | int) -> None:
    """Evict every cached page of one file (a path, or an open descriptor)."""
    fd = target if isinstance(target, int) else os.open(target, os.O_RDONLY)
    try:
        for attempt in range(_ATTEMPTS):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if resident_pages(fd) == 0:
                return
            time.sleep(0.01 * (attempt + 1))
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        left = resident_pages(fd)
        if left:
            raise AssertionError(f"{left} pages of the file stay in the page cache")
    finally:
        if not isinstance(target, int):
            os.close(fd)
