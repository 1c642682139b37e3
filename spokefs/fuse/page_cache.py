"""Decides, per open, how a file may use the kernel's page cache, so that pages of one
version of a file are never served to a reader of another version.

The kernel caches pages per inode, and an inode is a file id, whatever its version. A
``(file_id, version)`` never changes its bytes, so as long as one version is read, its pages
can be kept across opens (``keep_cache``), which is what makes a second epoch fast. When the
hub's version changes:

- a handle opened on the new version while a handle on an older version is still open
  reads with ``direct_io`` (no page cache at all: the old handle keeps filling the cache
  with old pages, which only old handles may see);
- the first open on a version after the cache last held another one opens without
  ``keep_cache``, which makes the kernel drop the inode's pages.

``page_version`` remembers which version the page cache of an inode holds; it is bounded, and
an inode it has forgotten is treated as unknown (its pages are dropped at the next open).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

_TRACKED_INODES = 1 << 20


@dataclass(frozen=True, slots=True)
class OpenMode:
    keep_cache: bool
    direct_io: bool


class PageCachePolicy:
    """Per-inode bookkeeping of open versions and of the version the page cache holds."""

    def __init__(self) -> None:
        self._open: dict[int, Counter[int]] = {}
        self._page_version: OrderedDict[int, int] = OrderedDict()

    def on_open(self, ino: int, version: int) -> OpenMode:
        versions = self._open.setdefault(ino, Counter())
        others_open = any(v != version for v in versions)
        versions[version] += 1
        if others_open:
            return OpenMode(keep_cache=False, direct_io=True)
        cached = self._page_version.pop(ino, None)
        self._page_version[ino] = version
        if len(self._page_version) > _TRACKED_INODES:
            self._page_version.popitem(last=False)
        return OpenMode(keep_cache=cached == version, direct_io=False)

    def on_release(self, ino: int, version: int) -> None:
        versions = self._open.get(ino)
        if versions is None:
            return
        versions[version] -= 1
        if versions[version] <= 0:
            del versions[version]
        if not versions:
            del self._open[ino]
