"""The control interface: extended attributes through the mount itself.

``spokefs status``, ``refresh`` and ``warm`` talk to the running daemon by reading extended
attributes of paths in the mount, so they need no socket, no pid file and no knowledge of
the cache dir, and they work for any user who can see the path. None of these names is
listed by ``listxattr`` (a copy tool must not trigger them), and reading them is harmless:
warm and refresh are idempotent.

| attribute                | on        | value (ASCII)                                             |
| ------------------------ | --------- | --------------------------------------------------------- |
| ``user.spokefs.cached``  | file, dir | ``<cached bytes> <total bytes>`` (dir: its whole subtree) |
| ``user.spokefs.status``  | any path  | JSON: cache use, hit ratio, namespace generation and size |
| ``user.spokefs.refresh`` | any path  | polls the hub for changes now; the new generation         |
| ``user.spokefs.warm``    | file      | fetches the whole file at full link speed; bytes fetched  |

Traces, replays and pins have attributes of their own: ``jobs.control``.
Any other name under ``user.spokefs.`` raises ``NoAttribute`` (ENOATTR at the boundary).
"""

from __future__ import annotations

import json
import stat

import trio
from prometheus_client import REGISTRY

from spokefs.errors import NoAttribute, NotFound
from spokefs.jobs.control import JobControl
from spokefs.namespace.refresher import Refresher
from spokefs.namespace.replica import Attr, Namespace
from spokefs.read.reader import Reader
from spokefs.types import FileVersion

PREFIX = b"user.spokefs."
CACHED = PREFIX + b"cached"
STATUS = PREFIX + b"status"
REFRESH = PREFIX + b"refresh"
WARM = PREFIX + b"warm"


class Control:
    """Answers the control attributes."""

    def __init__(self, ns: Namespace, reader: Reader, refresher: Refresher,
                 jobs: JobControl | None = None) -> None:
        self._ns = ns
        self._reader = reader
        self._refresher = refresher
        self._jobs = jobs

    async def getxattr(self, attr: Attr, name: bytes, uid: int = 0) -> bytes:
        if self._jobs is not None:
            value = await self._jobs.getxattr(attr, name, uid)
            if value is not None:
                return value
        if name == CACHED:
            cached, total = await self._cached(attr)
            return f"{cached} {total}".encode()
        if name == STATUS:
            return json.dumps(self._status(), sort_keys=True).encode()
        if name == REFRESH:
            return str(await self._refresher.refresh_now()).encode()
        if name == WARM and stat.S_ISREG(attr.mode):
            fv = FileVersion(attr.file_id, attr.version, attr.size)
            return str(await self._reader.warm(fv)).encode()
        raise NoAttribute(name.decode(errors="replace"))

    async def _cached(self, attr: Attr) -> tuple[int, int]:
        if stat.S_ISREG(attr.mode):
            fv = FileVersion(attr.file_id, attr.version, attr.size)
            return await self._reader.cached_bytes([fv]), attr.size
        if not stat.S_ISDIR(attr.mode):
            return 0, 0
        files = await trio.to_thread.run_sync(self._tree_files, attr.ino)
        return await self._reader.cached_bytes(files), sum(f.size for f in files)

    def _tree_files(self, dir_ino: int) -> list[FileVersion]:
        """Every regular file below a directory, each once (blocking: run in a thread)."""
        seen: dict[FileVersion, None] = {}
        stack = [dir_ino]
        while stack:
            ino = stack.pop()
            for _, _, a in self._ns.readdir(ino, 0):
                if stat.S_ISDIR(a.mode):
                    stack.append(a.ino)
                elif stat.S_ISREG(a.mode):
                    seen[FileVersion(a.file_id, a.version, a.size)] = None
        return list(seen)

    def _status(self) -> dict[str, object]:
        info = self._ns.info
        if info is None:
            raise NotFound("no namespace")
        cache = self._reader.cache_statistics()
        hits = _sample_sum("spokefs_block_hits_total")
        misses = _sample_sum("spokefs_block_misses_total")
        jobs = self._jobs.status() if self._jobs is not None else {}
        return {
            **jobs,
            "pinned_bytes": cache.pinned_bytes,
            "generation": info.generation,
            "entries": info.entries,
            "namespace_bytes": info.total_bytes,
            "cache_bytes": cache.bytes_used,
            "cache_capacity_bytes": cache.max_bytes,
            "block_hits": int(hits),
            "block_misses": int(misses),
            "hit_ratio": hits / (hits + misses) if hits + misses else None,
        }


def _sample_sum(name: str) -> float:
    """Sum of a counter over all its label values, from this process's registry."""
    total = 0.0
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total
