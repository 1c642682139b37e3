"""A 64-bit number one process writes and others read from shared memory, at the cost of a
memory read: how a mount's coordinator tells its serving workers that the namespace moved
to a new generation (``fuse.workers``) before it has the kernel forget what changed.

Backed by a ``memfd`` the workers inherit; an aligned 8-byte store is seen whole.
"""

from __future__ import annotations

import mmap
import os
import struct

_U64 = struct.Struct("<Q")


class SharedCounter:
    """One shared unsigned 64-bit value."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map = mmap.mmap(fd, _U64.size)

    @classmethod
    def create(cls, value: int = 0) -> SharedCounter:
        """A new counter; its ``fd`` is inheritable by the processes that read it."""
        fd = os.memfd_create("spokefs-counter", 0)
        os.ftruncate(fd, _U64.size)
        counter = cls(fd)
        counter.set(value)
        return counter

    @property
    def value(self) -> int:
        value: int = _U64.unpack_from(self._map)[0]
        return value

    def set(self, value: int) -> None:
        _U64.pack_into(self._map, 0, value)

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)
