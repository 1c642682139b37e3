"""Checking answer bodies for ``hub.client`` (``hub.wire`` reads them, never past the bytes
asked for): framed blobs verified frame by frame, pack answers decoded as they stream, and
the origin of an answer that came through a regional tier.
"""

from __future__ import annotations

from spokefs import protocol
from spokefs.errors import HubProtocolError
from spokefs.hub.wire import Answer
from spokefs.protocol.packs import Member

# the header deploy/regional's nginx adds: its cache status for the answer
TIER_CACHE_HEADER = "X-Spokefs-Tier-Cache"
_TIER_HIT = frozenset({"HIT", "STALE", "REVALIDATED", "UPDATING"})


class FrameMismatch(Exception):
    """A frame of a blob answer failed its seeded sum (damaged, or from another offset or
    file): transient, the caller fetches again."""


def origin_of(resp: Answer, origin: str) -> str:
    """``hub``, or the tier's own word on where its answer came from."""
    if origin == "hub":
        return origin
    status = resp.headers.get(TIER_CACHE_HEADER, "").upper()
    if not status:
        return "tier"
    return "tier_hit" if status in _TIER_HIT else "tier_miss"


def unframed(body: bytes | bytearray | memoryview, file_id: int, version: int,
             first_frame: int) -> bytes:
    """The data of a framed body, every frame checked against its seeded sum."""
    try:
        return protocol.unframe(body, file_id, version, first_frame)
    except protocol.FrameSumError as exc:
        raise FrameMismatch(f"frame {exc.index} of {file_id:x} failed its checksum") from None
    except protocol.WireError as exc:
        raise HubProtocolError(f"bad framed answer: {exc}") from None


def scanned(decoder: protocol.PackDecoder, view: memoryview, end: int) -> list[Member]:
    """``decoder.scan``, its errors the hub client's."""
    try:
        return decoder.scan(view, end)
    except protocol.WireError as exc:
        raise HubProtocolError(f"bad pack answer: {exc}") from None
