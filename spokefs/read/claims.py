"""Single flight: one table of the chunks being fetched, shared by every fill.

While anyone fetches blocks of a chunk, everyone else who needs that chunk waits for it
instead of asking the hub again, so a reader catching up with the prefetcher waits for the
bytes already on their way. A claim is taken without an await between looking in the cache
and claiming, so nobody fetches again what another task has just staged.
"""

from __future__ import annotations

from collections.abc import Iterable

import trio

from spokefs.types import FileVersion

ChunkKey = tuple[int, int, int]  # (file id, version, chunk index)


class Claims:
    """Chunks in flight, each with the event its waiters wait on."""

    def __init__(self) -> None:
        self._inflight: dict[ChunkKey, trio.Event] = {}

    def claim(self, fv: FileVersion, chunks: Iterable[int]) -> tuple[set[ChunkKey],
                                                                      list[trio.Event]]:
        """Mark the free ones of ``chunks`` in flight (ours); return them and the events
        of the others."""
        claimed: set[ChunkKey] = set()
        waits: list[trio.Event] = []
        for ci in chunks:
            key = (fv.file_id, fv.version, ci)
            if (event := self._inflight.get(key)) is not None:
                waits.append(event)
            else:
                self._inflight[key] = trio.Event()
                claimed.add(key)
        return claimed, waits

    def release(self, claimed: Iterable[ChunkKey]) -> None:
        """Our fetch of these chunks is over (arrived or failed): wake their waiters."""
        for key in claimed:
            self._inflight.pop(key).set()

    def busy(self, fv: FileVersion, chunk: int) -> bool:
        return (fv.file_id, fv.version, chunk) in self._inflight

    def event(self, fv: FileVersion, chunk: int) -> trio.Event | None:
        """The event to wait on for a chunk in flight (None: not in flight)."""
        return self._inflight.get((fv.file_id, fv.version, chunk))

    def any_busy(self, fv: FileVersion) -> bool:
        """Whether any of the file's chunks is being fetched."""
        inflight = self._inflight
        return any((fv.file_id, fv.version, ci) in inflight for ci in range(fv.chunks()))
