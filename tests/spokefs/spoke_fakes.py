"""Stand-ins that implement the real interfaces: a hub serving from a dict, with counters."""

from __future__ import annotations

import trio

from spokefs.errors import StaleExport


class FakeHub:
    """``HubClient.fetch_range`` over in-memory files ``{(file_id, version): bytes}``.

    Attributes:
        calls: every (file_id, version, start, length) asked for, in order.
        delay_s: how long each fetch takes (with an autojump clock, free).
    """

    def __init__(self, files: dict[tuple[int, int], bytes], delay_s: float = 0.0) -> None:
        self.files = files
        self.delay_s = delay_s
        self.calls: list[tuple[int, int, int, int]] = []
        self.packs: list[list[tuple[int, int]]] = []

    async def fetch_range(self, file_id: int, version: int, start: int, length: int) -> bytes:
        self.calls.append((file_id, version, start, length))
        await trio.sleep(self.delay_s)
        data = self.files.get((file_id, version))
        if data is None:
            raise StaleExport(f"{file_id:x}/{version:x}")
        assert 0 <= start and start + length <= len(data), "reader asked past EOF"
        return data[start : start + length]

    async def fetch_pack(self, items: list[tuple[int, int]]) -> dict[tuple[int, int], bytes | None]:
        self.packs.append(items)
        await trio.sleep(self.delay_s)
        return {key: self.files.get(key) for key in items}
