from __future__ import annotations

from spokefs.fuse.page_cache import OpenMode, PageCachePolicy

KEEP = OpenMode(keep_cache=True, direct_io=False)
DROP = OpenMode(keep_cache=False, direct_io=False)
DIRECT = OpenMode(keep_cache=False, direct_io=True)


def test_one_version_keeps_its_pages_across_opens():
    p = PageCachePolicy()
    assert p.on_open(5, 1) == DROP  # unknown: whatever the kernel holds is dropped
    p.on_release(5, 1)
    assert p.on_open(5, 1) == KEEP
    assert p.on_open(5, 1) == KEEP


def test_new_version_never_sees_old_pages():
    p = PageCachePolicy()
    p.on_open(5, 1)
    assert p.on_open(5, 2) == DIRECT  # an old handle is open: bypass the page cache
    p.on_release(5, 2)
    p.on_release(5, 1)
    assert p.on_open(5, 2) == DROP  # the cache held version 1: drop it
    p.on_release(5, 2)
    assert p.on_open(5, 2) == KEEP
