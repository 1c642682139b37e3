"""Read streams keyed by inode, for mounts where the kernel opens files itself.

With ``open_mode="kernel"`` the open handler answers ENOSYS once, and from then on the kernel
opens and closes files without asking (FUSE's no_open): a file costs a lookup and its reads,
not also an open and a release. Each read then names the inode, not a handle (our patched
pyfuse3 passes the inode where the handle is 0, see deploy/build-pyfuse3.sh), so the state a
handle used to carry lives here, per inode:

- the file version being read: the namespace's current one, looked up again only when the
  namespace generation has changed since (an attribute read per read would cost more than
  the rest of a cached read);
- the access pattern (``Stream``) the prefetcher keeps; concurrent readers of one file share
  it (they look random to it, so it reads ahead less);
- the prefetcher's open hint, given at the first read of an inode.

Streams are kept for the ``_TRACKED`` most recently read inodes; one that falls out is
closed (its queued read-ahead is dropped). What the kernel caches per inode survives
across opens (no_open implies keep_cache); when a file's version changes, the refresher has
the kernel drop those pages (``kernel.KernelCache``), and the next read here sees the new
version. What no_open gives up: a process that holds a file open across such a change reads
the new version from then on, not the one it opened (``open_mode="handle"`` keeps one
version per open file and answers ESTALE instead).
"""

from __future__ import annotations

from collections import OrderedDict

from spokefs.namespace.replica import Namespace
from spokefs.read.stream import Stream, StreamReader
from spokefs.types import FileVersion

_TRACKED = 4096
_UNCHECKED = -2  # no generation: kept from a worker's read, not from a namespace look


class InodeStreams:
    """The read stream of each recently read inode."""

    def __init__(self, namespace: Namespace, reader: StreamReader) -> None:
        self._ns = namespace
        self._reader = reader
        self._streams: OrderedDict[int, tuple[int, Stream]] = OrderedDict()

    def stream(self, ino: int) -> Stream:
        """The stream to read ``ino`` with, at the namespace's current version."""
        generation = self._ns.info.generation if self._ns.info is not None else -1
        entry = self._streams.get(ino)
        if entry is not None and entry[0] == generation:
            self._streams.move_to_end(ino)
            return entry[1]
        a = self._ns.getattr(ino)  # NotFound (ENOENT) if it is gone
        fv = FileVersion(a.file_id, a.version, a.size)
        if entry is not None and entry[1].fv == fv:
            stream = entry[1]
        else:
            if entry is not None:
                self._reader.close(entry[1])
            stream = self._reader.open(fv, a.parent_id)
        self._keep(ino, generation, stream)
        return stream

    def stream_read(self, ino: int, fv: FileVersion, parent_id: int) -> Stream:
        """The stream a read of ``ino`` that a serving worker answered at ``fv`` is noted on:
        the one kept if it reads that version, else a new one. It is kept unchecked: the
        next ``stream`` looks at the namespace again (a worker's version may be older than
        the namespace by now), and keeps the stream if the version is the same."""
        entry = self._streams.get(ino)
        if entry is not None and entry[1].fv == fv:
            self._streams.move_to_end(ino)
            return entry[1]
        if entry is not None:
            self._reader.close(entry[1])
        stream = self._reader.open(fv, parent_id)
        self._keep(ino, _UNCHECKED, stream)
        return stream

    def _keep(self, ino: int, generation: int, stream: Stream) -> None:
        self._streams[ino] = (generation, stream)
        self._streams.move_to_end(ino)
        if len(self._streams) > _TRACKED:
            _, (_, old) = self._streams.popitem(last=False)
            self._reader.close(old)
