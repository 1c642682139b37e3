"""Read slots: how many requests may read at once, and how long one waits for its turn.

Every reader (a directory's ``range_reader.RangeReader``, a bucket's ``s3.reader.BucketReader``)
holds a slot from the start of a request until its answer is written out, so the slots bound
the memory of answers in flight; a request that finds none free within ``wait_s`` (FIFO)
fails with ``Overloaded`` (503 ``overloaded``), which spokes retry.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from hubd.errors import Overloaded


class ReadSlots:
    """At most ``count`` holders at once; ``in_flight`` is how many hold one now."""

    def __init__(self, count: int, wait_s: float) -> None:
        self._wait_s = wait_s
        self._free = asyncio.Semaphore(count)
        self.in_flight = 0

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self._wait_s):
                await self._free.acquire()
        except TimeoutError:
            raise Overloaded(f"no read slot free within {self._wait_s:g} s") from None
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self._free.release()
