"""residency.resident: mincore(2) on the pages under a memoryview."""

from __future__ import annotations

import mmap
import os

from spokefs.cache.residency import resident


def test_touched_memory_is_resident():
    m = mmap.mmap(-1, 1 << 20)
    view = memoryview(m)[4096 : 4096 + 65536]
    bytes(view)  # touch every page
    assert resident(view)
    assert resident(view[:0])
    view.release()
    m.close()


def test_file_pages_the_kernel_dropped_are_not_resident(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped
        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        view = memoryview(m)[512 << 10 : (512 << 10) + 65536]
        assert not resident(view)
        bytes(view)
        assert resident(view)
        view.release()
        m.close()
    finally:
        os.close(fd)
