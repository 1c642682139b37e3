"""HubClient against a hub that lies: wrong frame sums, frames from another offset, wrong
lengths, bodies far longer than asked for, bad pack answers, a snapshot with the wrong
content type, a hub of an older protocol.

The "hub" is ``http.server`` in a thread of this process, answering what each test sets.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import xxhash

from spokefs import protocol
from spokefs.errors import CorruptBlock, HubProtocolError, HubUnavailable
from spokefs.hub.client import HubClient
from tests.hubd.hubd_testlib import framed

DATA = bytes(range(251)) * 50  # 12,550 bytes: four frames, the last one short
FRAMED = framed(DATA, 2, 3)
Answer = Callable[[BaseHTTPRequestHandler], tuple[int, dict[str, str], bytes]]


class LyingHub:
    """Answers every request with ``self.answer(handler)``; counts requests."""

    def __init__(self) -> None:
        self.answer: Answer = lambda h: (404, {}, b"")
        self.requests = 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _reply(self) -> None:
                hub.requests += 1
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                status, headers, body = hub.answer(self)
                self.send_response(status)
                headers.setdefault("Content-Length", str(len(body)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                # the client stopped reading: that is the point of some tests
                with contextlib.suppress(OSError):
                    self.wfile.write(body)

            do_GET = do_POST = _reply

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def hub() -> Iterator[LyingHub]:
    lying = LyingHub()
    thread = threading.Thread(target=lying.server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield lying
    finally:
        lying.server.shutdown()
        lying.server.server_close()
        thread.join(timeout=10)


def client(hub: LyingHub, deadline_s: float = 0.5) -> HubClient:
    return HubClient(hub.url, token=None, max_connections=4, request_timeout_s=5,
                     deadline_s=deadline_s)


def ranged(body: bytes, **extra: str) -> Answer:
    def answer(h: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        first, last = map(int, h.headers["Range"].removeprefix("bytes=").split("-"))
        part = body[first : last + 1]
        return 206, {"Content-Range": f"bytes {first}-{last}/{len(body)}", **extra}, part
    return answer


async def test_honest_hub_is_read(hub: LyingHub) -> None:
    hub.answer = ranged(FRAMED)
    frame = protocol.FRAME_DATA_BYTES
    async with client(hub) as c:
        assert await c.fetch_frames(2, 3, len(DATA), 0, len(DATA)) == DATA
        assert await c.fetch_frames(2, 3, len(DATA), frame, 2 * frame) == DATA[frame : 2 * frame]
        assert await c.fetch_frames(2, 3, len(DATA), 2 * frame, len(DATA)) == DATA[2 * frame :]


@pytest.mark.parametrize("lie", ["flipped-byte", "flipped-sum", "other-offset", "other-file"])
async def test_bad_frames_are_retried_then_corrupt(lie: str, hub: LyingHub) -> None:
    """Whatever range was asked, a frame must be the one at that offset of that file."""
    body = bytearray(FRAMED)
    if lie == "flipped-byte":
        body[protocol.FRAME_BYTES + 5] ^= 1
    elif lie == "flipped-sum":
        body[2 * protocol.FRAME_BYTES - 1] ^= 1
    elif lie == "other-offset":  # a cache that put frame 0 where frame 1 belongs
        body[protocol.FRAME_BYTES : 2 * protocol.FRAME_BYTES] = body[: protocol.FRAME_BYTES]
    else:  # the same bytes framed for another file
        body = bytearray(framed(DATA, 2, 4))
    hub.answer = ranged(bytes(body))
    async with client(hub, deadline_s=2.0) as c:  # room for retries on a loaded machine
        with pytest.raises(CorruptBlock):
            await c.fetch_frames(2, 3, len(DATA), 0, 2 * protocol.FRAME_DATA_BYTES)
    assert hub.requests >= 2  # fetched again before giving up


@pytest.mark.parametrize("lie", ["short", "200-not-206", "too-long", "declared-huge"])
async def test_wrong_bodies_are_protocol_errors(lie: str, hub: LyingHub) -> None:
    if lie == "short":
        hub.answer = lambda h: (206, {}, FRAMED[:100])
    elif lie == "200-not-206":
        hub.answer = lambda h: (200, {}, FRAMED[: protocol.FRAME_BYTES])
    elif lie == "too-long":  # more than asked for: never read past what was asked
        big = bytes(8 << 20)
        hub.answer = lambda h: (206, {}, big)
    else:  # a declared length far past the range: refused before reading the body
        hub.answer = lambda h: (206, {"Content-Length": str(1 << 40)}, b"x" * 100)
    async with client(hub) as c:
        with pytest.raises(HubProtocolError):
            await c.fetch_frames(2, 3, len(DATA), 0, protocol.FRAME_DATA_BYTES)


async def test_bad_pack_answers(hub: LyingHub) -> None:
    members = ((2, 3, 3), (4, 5, 7))
    plan = protocol.PackPlan(9, 0, members, protocol.pack_digest(members))
    good = (protocol.encode_pack_record(2, 3, b"abc", xxhash.xxh3_64_intdigest(b"abc"))
            + protocol.encode_pack_record(4, 5, None, 0))
    hub.answer = lambda h: (200, {}, good)
    async with client(hub) as c:
        assert await c.fetch_pack(plan) == {(2, 3): b"abc", (4, 5): None}
        record = protocol.encode_pack_record
        swapped = record(4, 5, None, 0) + record(2, 3, None, 0)
        for body in (good[:-5], swapped, good + b"extra", bytes(64)):  # cut, out of order...
            hub.answer = lambda h, body=body: (200, {}, body)
            with pytest.raises(HubProtocolError):
                await c.fetch_pack(plan)
        lied = record(2, 3, b"abc", 12345) + record(4, 5, None, 0)
        hub.answer = lambda h: (200, {}, lied)
        with pytest.raises(HubUnavailable):  # a bad checksum is retried, then given up
            await c.fetch_pack(plan)
        huge = (protocol.MAX_RANGE_BYTES + 1 << 10)
        hub.answer = lambda h: (200, {"Content-Length": str(huge)}, b"")
        with pytest.raises(HubProtocolError):
            await c.fetch_pack(plan)


async def test_an_older_hub_fails_with_both_versions_named(hub: LyingHub) -> None:
    """A v1 hub has no /v2 routes: 404 for the snapshot, which is not "file gone"."""
    hub.answer = lambda h: (404, {}, b"404: Not Found")
    async with client(hub) as c:
        with pytest.raises(HubProtocolError, match=r"does not speak protocol v2.*protocol v1"):
            await c.stream_snapshot(Discard())


async def test_snapshot_with_another_content_type_is_a_bad_snapshot(hub: LyingHub) -> None:
    hub.answer = lambda h: (200, {"Content-Type": "text/html"}, b"<html>login</html>")
    async with client(hub) as c:
        with pytest.raises(protocol.WireError, match="content type"):
            await c.stream_snapshot(Discard())


class Discard:
    """A snapshot sink that keeps nothing (these tests look at the errors)."""

    async def restart(self) -> None:
        pass

    async def feed(self, chunk: bytes) -> None:
        pass
