"""Pins: files whose cached bytes are never evicted (``spokefs pin`` / ``unpin``).

A pinned file's chunks live in the block cache's PINNED segment (``cache.layout``), which no
eviction walk visits, so nothing the policy does can push them out; the segment is part of
the LMDB environment, so pins survive restarts (and ``kill -9``: a pin is one committed
transaction). Pinning a file that is not (wholly) cached fetches it first, then pins it.

Bound: pinned bytes stay at most ``limit_bytes`` (``--max-pinned-share`` of the cache), so
the rest of the cache keeps room to work; a pin that would cross it changes nothing and
fails with ``PinLimit`` (ENOSPC through the control attribute; the CLI says what is pinned
and what the bound is). A pin is all or nothing per file.

Unpinning a file unpins every version of it (a version changed on the hub since the pin
would otherwise stay pinned for good); its chunks go to the protected segment, where the
policy's clock hand lets them go once nobody reads them.
"""

from __future__ import annotations

import logging

from spokefs import metrics
from spokefs.cache.block_cache import BlockCache
from spokefs.errors import HubUnavailable, PinLimit
from spokefs.read.reader import Reader
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

_ATTEMPTS = 3  # fetch-then-pin rounds before giving up (the cache let the bytes go again)


class Pins:
    """Pins and unpins files within the bound.

    Attributes:
        limit_bytes: the most bytes that may be pinned.
    """

    def __init__(self, cache: BlockCache, reader: Reader, limit_bytes: int) -> None:
        self._cache = cache
        self._reader = reader
        self.limit_bytes = limit_bytes
        metrics.CACHE_PINNED_LIMIT.set(limit_bytes)

    async def pin(self, fv: FileVersion) -> int:
        """Pin a whole file version, fetching what is not cached; bytes newly pinned.

        Raises:
            PinLimit: pinning it would take the pinned bytes over ``limit_bytes``.
            HubUnavailable: its bytes could not be fetched and kept long enough to pin.
        """
        for _ in range(_ATTEMPTS):
            added, missing = await self._cache.pin(fv, self.limit_bytes)
            if added < 0:
                raise self._refusal(fv)
            if not missing:
                log.info("pinned file %x (%d bytes newly pinned)", fv.file_id, added)
                return added
            # refuse before fetching what could not be pinned anyway
            if self._cache.statistics().pinned_bytes + fv.size > self.limit_bytes:
                raise self._refusal(fv)
            await self._reader.warm(fv)
        raise HubUnavailable(f"file {fv.file_id:x} left the cache before it could be pinned")

    async def unpin(self, file_id: int) -> int:
        """Unpin every version of a file; the bytes unpinned."""
        return await self._cache.unpin(file_id)

    def _refusal(self, fv: FileVersion) -> PinLimit:
        pinned = self._cache.statistics().pinned_bytes
        return PinLimit(f"pinning {fv.size} bytes would exceed the pin limit "
                        f"({pinned} of {self.limit_bytes} bytes pinned)")
