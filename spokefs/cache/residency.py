"""Whether the pages behind a memoryview of a memory map are in RAM (``mincore(2)``).

The block cache reads LMDB's memory map on the trio thread, because a thread hop costs more
than a read from RAM. A read whose pages are on disk, though (after a restart, or once the
kernel has dropped them), would stop the whole event loop for a disk read per page fault,
one fault at a time, while the other readers wait. So a read first asks whether its bytes
are resident: if not, it runs in a worker thread, where page faults of concurrent reads
overlap (``block_cache.BlockCache.read``).

A memoryview does not expose its address to Python, so ``address_of`` asks CPython through
``PyObject_GetBuffer`` (the C-API call behind every memoryview); ``mincore`` comes from libc.
Where either is unavailable, every view counts as resident (the old behaviour: read inline).
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_PAGE = mmap.PAGESIZE
_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None
_mincore: Callable[..., int] | None  # libc.mincore, where there is one
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _mincore = _libc.mincore
    _mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    _mincore.restype = ctypes.c_int
except (OSError, AttributeError):  # not Linux/glibc: no way to ask
    _mincore = None
_MAX_PAGES = 1024  # a 4 MiB view at most is asked about (reads are at most 1 MiB + a chunk)


# Scratch space for the trio thread, the only caller (worker threads read without asking).
_buf = _PyBuffer()
_vec = (ctypes.c_ubyte * _MAX_PAGES)()
_buf_ref = ctypes.byref(_buf)
_vec_addr = ctypes.addressof(_vec)


def address_of(view: memoryview) -> int:
    """The address of a C-contiguous memoryview's first byte."""
    if _get_buffer(view, _buf_ref, 0) != 0:
        raise ValueError("no buffer")
    try:
        return int(_buf.buf or 0)
    finally:
        _release_buffer(_buf_ref)


def resident(view: memoryview) -> bool:
    """Whether every page under ``view`` is in RAM (True when it cannot be told).

    Call it from one thread only (it reuses module-level scratch buffers).
    """
    if _mincore is None or not len(view):
        return True
    start = address_of(view)
    first = start - start % _PAGE
    pages = min(_MAX_PAGES, -(-(start + len(view) - first) // _PAGE))
    if _mincore(first, pages * _PAGE, _vec_addr) != 0:  # e.g. ENOMEM: not a mapping
        return True
    return all(ctypes.string_at(_vec_addr, pages))
