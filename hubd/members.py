"""A pack's members read from their directory, straight into the answer, in one call.

``read_members`` opens nothing but the members: the caller has opened their directory
(``ExportRoot.open_dir``, the confined walk, once per pack). For each member, in order: an
``lstat`` (a device node swapped in is not even opened), an open that follows no symlink
and cannot block, an ``fstat``, its bytes read into ``body`` after its record header, an
``fstat`` again, the close, and the xxh3-64 of the bytes. A member read whole takes
``record_size + size`` bytes of ``body``; any other only ``record_size`` (its header says
gone). Each result is a ``Read`` (the caller checks the file id and the version before and
after) or an int: an errno of the lstat or the open, or ``NOT_REGULAR``, ``SIZE_DIFFERS``,
``SHRANK``, ``NOT_LISTED`` (a size below 0: not in the snapshot, nothing opened).

Native (``members_c``, C) where it is built: the GIL is released once for the whole pack,
where Python released and took it back around each of some ten system calls a member,
against the event loop and the other reading threads. The Python steps below are the
fallback, and the tests run both on the same directories and compare.

Raises:
    OSError: an ``fstat`` or a read of an open member failed (the whole pack fails).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import NamedTuple

import xxhash

from hubd.export_root import FILE_FLAGS
from hubd.scan import clamp_ns

try:  # C, optional: see the module docstring
    import hubd.members_c as members_c

    NATIVE = True
except ImportError:  # pragma: no cover - installed without its C part
    NATIVE = False

NOT_REGULAR = -1
SIZE_DIFFERS = -2
SHRANK = -3
NOT_LISTED = -4


class Read(NamedTuple):
    """A member read whole: its ``fstat`` before the read and after it, and its digest."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ino_after: int
    size_after: int
    mtime_ns_after: int
    digest: int


def read_members(dir_fd: int, names: list[bytes], sizes: list[int], body: bytearray,
                 pos: int, record_size: int, *, native: bool | None = None) -> list[Read | int]:
    """Each member of ``names`` (in ``dir_fd``) read into ``body`` from ``pos`` on, after
    room for its record header (see the module docstring); ``native``: C or Python
    (None: C where it is built, which checks its arguments itself, as below)."""
    if NATIVE if native is None else native:
        return [r if isinstance(r, int) else Read(*r)
                for r in members_c.read_members(dir_fd, names, sizes, body, pos, record_size)]
    if len(names) != len(sizes):
        raise ValueError("names and sizes differ in length")
    if pos < 0 or record_size < 0 or \
            pos + sum(record_size + max(s, 0) for s in sizes) > len(body):
        raise ValueError("the body is too small for the members")
    out: list[Read | int] = []
    with memoryview(body) as view:
        for name, size in zip(names, sizes, strict=True):
            got = _read_one(dir_fd, name, size, view[pos + record_size:])
            out.append(got)
            pos += record_size + (size if isinstance(got, Read) else 0)
    return out


def _read_one(dir_fd: int, name: bytes, size: int, into: memoryview) -> Read | int:
    if size < 0:
        return NOT_LISTED
    if b"\0" in name:
        raise ValueError("a member name is not bytes without NUL")
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        return exc.errno or errno.EIO
    if not stat.S_ISREG(st.st_mode):
        return NOT_REGULAR
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        return exc.errno or errno.EIO
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            return NOT_REGULAR
        if before.st_size != size:
            return SIZE_DIFFERS
        got = 0
        while got < size:
            n = os.preadv(fd, [into[got:size]], got)
            if n == 0:
                return SHRANK
            got += n
        after = os.fstat(fd)
    finally:
        os.close(fd)
    return Read(before.st_dev, before.st_ino, before.st_size, clamp_ns(before.st_mtime_ns),
                after.st_ino, after.st_size, clamp_ns(after.st_mtime_ns),
                xxhash.xxh3_64_intdigest(into[:size]))
