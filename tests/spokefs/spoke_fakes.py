"""Stand-ins that implement the real interfaces: a hub serving from a dict, with counters."""

from __future__ import annotations

from collections.abc import Callable

import trio

from spokefs import protocol
from spokefs.errors import StaleExport


class FakeHub:
    """``HubClient.fetch_frames`` and ``fetch_pack`` over in-memory files
    ``{(file_id, version): bytes}``.

    Attributes:
        calls: every (file_id, version, start, length) of data asked for, in order.
        packs: the member items of every pack asked for, in order.
        delay_s: how long each fetch takes (with an autojump clock, free).
        align_bytes: the grid ranges are asked on (one frame: no tier).
        through_tier: whether it stands for a hub behind a regional tier.
    """

    align_bytes = protocol.FRAME_DATA_BYTES
    through_tier = False

    def __init__(self, files: dict[tuple[int, int], bytes], delay_s: float = 0.0) -> None:
        self.files = files
        self.delay_s = delay_s
        self.calls: list[tuple[int, int, int, int]] = []
        self.packs: list[list[tuple[int, int]]] = []
        self.per_file_s = 0.0

    async def fetch_frames(self, file_id: int, version: int, size: int,
                           start: int, stop: int) -> bytes:
        self.calls.append((file_id, version, start, stop - start))
        await trio.sleep(self.delay_s)
        data = self.files.get((file_id, version))
        if data is None:
            raise StaleExport(f"{file_id:x}/{version:x}")
        assert size == len(data)
        assert start % self.align_bytes == 0, "range off the grid"
        assert stop % self.align_bytes == 0 or stop == size, "range off the grid"
        assert 0 <= start < stop <= len(data), "reader asked past EOF"
        return data[start:stop]

    rtt_s: float | None = None  # HubClient's round-trip estimate: none measured
    received_bytes = 0

    async def fetch_pack(
        self, plan: protocol.PackPlan,
        on_file: Callable[[tuple[int, int], bytes | None], None] | None = None,
    ) -> dict[tuple[int, int], bytes | None]:
        """Streams like the real client: each file is handed over ``per_file_s`` after the
        one before it, the first one ``delay_s`` after the request."""
        items = plan.items
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


async def poll_until(ready: Callable[[], bool], interval_s: float) -> None:
    """Return once ``ready()`` holds, checking it every ``interval_s`` (the caller bounds the
    wait with ``trio.fail_after``): for states the code under test sets without an event."""
    while not ready():  # noqa: ASYNC110 - the code under test has no event to wait on
        await trio.sleep(interval_s)
