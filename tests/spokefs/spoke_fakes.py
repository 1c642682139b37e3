"""Stand-ins that implement the real interfaces: a hub serving from a dict, with counters."""

from __future__ import annotations

from collections.abc import Callable

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
        self.per_file_s = 0.0

    async def fetch_range(self, file_id: int, version: int, start: int, length: int) -> bytes:
        self.calls.append((file_id, version, start, length))
        await trio.sleep(self.delay_s)
        data = self.files.get((file_id, version))
        if data is None:
            raise StaleExport(f"{file_id:x}/{version:x}")
        assert 0 <= start and start + length <= len(data), "reader asked past EOF"
        return data[start : start + length]

    rtt_s: float | None = None  # HubClient's round-trip estimate: none measured
    received_bytes = 0

    async def fetch_pack(
        self, items: list[tuple[int, int]],
        on_file: Callable[[tuple[int, int], bytes | None], None] | None = None,
    ) -> dict[tuple[int, int], bytes | None]:
        """Streams like the real client: each file is handed over ``per_file_s`` after the
        one before it, the first one ``delay_s`` after the request."""
        self.packs.append(items)
        await trio.sleep(self.delay_s)
        out: dict[tuple[int, int], bytes | None] = {}
        for key in items:
            if self.per_file_s:
                await trio.sleep(self.per_file_s)
            out[key] = self.files.get(key)
            if on_file is not None:
                on_file(key, out[key])
        return out
