"""How the C heap (glibc's malloc) treats hubd's MiB-sized buffers.

hubd allocates and frees buffers of about a MiB for every piece of an answer: a slice read
into its frames, a pack read whole, a bucket's GET body and its framing. glibc's default
lets its own heuristics choose: the first such buffer is its own ``mmap``, and after it is
freed the buffers come from the heap, whose free top is handed back to the kernel as soon
as it exceeds twice the last big buffer. So the next buffer lands on pages the kernel must
fault in and zero again: in a profile of the bucket hub, page clearing and faults were ~14 %
of its CPU (``benchmarks/README.md``, "The C heap").

``keep_freed_buffers()`` fixes both thresholds at start, so freed buffers stay mapped and
are reused warm: each arena keeps at most ``_TRIM_BYTES`` of free top (a few answers'
worth), and only buffers above ``_MMAP_BYTES`` get their own mapping. An operator's own
``MALLOC_*_`` settings and ``glibc.malloc`` tunables win. ``release_free_memory()`` still hands
everything free back after a big one-off (a rescan).

The spoke does not call it: the same thresholds changed nothing measurable there
(``bench_cold_cpu.py``), and it would keep more memory on a training node.

Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Buffers below this come from the heap. Above every buffer of the data path (a pack is at
# most 3.75 MiB), below glibc's own ceiling for the dynamic threshold (32 MiB).
_MMAP_BYTES = 16 << 20
# Free memory at an arena's top kept for reuse instead of handed back: a few answers.
_TRIM_BYTES = 16 << 20
# An operator who sets any of these, or a glibc.malloc tunable, has chosen: nothing is
# overridden then.
_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
        "MALLOC_MMAP_MAX_", "MALLOC_ARENA_MAX")


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc has both)
    except (OSError, AttributeError):  # not glibc
        return None
    return libc


_LIBC = _libc()


def keep_freed_buffers() -> bool:
    """Fix malloc's trim and mmap thresholds (see the module docstring); call once, at
    start, before the data path allocates. Returns whether they were set."""
    if _LIBC is None or any(name in os.environ for name in _ENV) \
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES)
                and _LIBC.mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES))


def release_free_memory() -> None:
    """Give the heap memory freed by a big one-off back to the OS (glibc only).

    A hub's rescan allocates its table in a worker thread's malloc arena; once the
    previous snapshot is dropped, glibc keeps most of that freed memory mapped (~100 MB per
    generation for 1M entries, measured) unless asked to trim. Cost: milliseconds.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
