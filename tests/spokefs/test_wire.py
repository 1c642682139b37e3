"""The data path's HTTP/1.1 client (``hub.wire``) against a raw socket server in a thread of
this process that answers exactly the bytes each test scripts: lengths declared, chunked and
until the close; 1xx heads; keep-alive reuse and servers that close idle connections; bodies
longer than asked for; malformed heads; a server that stops answering."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import trio

from spokefs.hub import wire

Script = Callable[[socket.socket, bytes], bool]  # (connection, request) -> keep it open?


class RawServer:
    """Accepts connections; for each request head read, calls ``script``; counts both."""

    def __init__(self) -> None:
        self.script: Script = lambda conn, req: False
        self.connections = 0
        self.requests: list[bytes] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/base"
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    try:
                        more = conn.recv(65536)
                    except OSError:
                        return
                    if not more:
                        return
                    buf += more
                head, buf = buf.split(b"\r\n\r\n", 1)
                self.requests.append(head)
                try:
                    if not self.script(conn, head):
                        return
                except OSError:
                    return

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def server() -> Iterator[RawServer]:
    s = RawServer()
    try:
        yield s
    finally:
        s.close()


def origin(server: RawServer, timeout_s: float = 5.0) -> wire.Origin:
    return wire.Origin(server.url, {"User-Agent": "t"}, timeout_s=timeout_s,
                       connect_timeout_s=5.0, max_connections=2)


def answer(body: bytes, *head: str, status: str = "200 OK") -> bytes:
    lines = [f"HTTP/1.1 {status}", *head]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def replies(*raw: bytes, keep: bool = True) -> Script:
    def script(conn: socket.socket, _req: bytes) -> bool:
        for part in raw:
            conn.sendall(part)
        return keep
    return script


async def get(o: wire.Origin, path: str = "/x", cap: int = 1 << 20) -> tuple[int, bytes, str]:
    async with o.get(path, {"Range": "bytes=0-9"}) as resp:
        body = await resp.read(cap)
        return resp.status_code, body, resp.headers.get("X-Tag")


async def test_the_request_and_a_declared_length(server: RawServer) -> None:
    server.script = replies(answer(b"hello", "Content-Length: 5", "x-tag: a"))
    o = origin(server)
    assert await get(o) == (200, b"hello", "a")  # header names in any case
    await o.aclose()
    head = server.requests[0].decode()
    assert head.startswith("GET /base/x HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{server.url.split(':')[2].split('/')[0]}" in head
    assert "Range: bytes=0-9" in head and "User-Agent: t" in head


async def test_keep_alive_reuses_one_connection(server: RawServer) -> None:
    server.script = replies(answer(b"abc", "Content-Length: 3"))
    o = origin(server)
    for _ in range(3):
        assert (await get(o))[1] == b"abc"
    await o.aclose()
    assert server.connections == 1 and len(server.requests) == 3


async def test_each_answer_measures_a_round_trip(server: RawServer) -> None:
    """From the request's send to the answer's head; on a new connection half the time from
    its connect(), which a long link's handshake makes one round trip whether it shows in
    connect() or (behind a proxy that emulates the link) holds the first request back."""
    def slow(conn: socket.socket, _req: bytes) -> bool:
        time.sleep(0.3)  # the server's time: here, the whole round trip
        conn.sendall(answer(b"abc", "Content-Length: 3"))
        return True
    server.script = slow
    o = origin(server)
    waits = []
    for _ in range(2):
        async with o.get("/x") as resp:
            waits.append(resp.round_trip_s)
            await resp.read(10)
    await o.aclose()
    assert server.connections == 1
    assert 0.15 <= waits[0] < 0.29  # a new connection: (connect + 0.3 s) / 2
    assert 0.3 <= waits[1] < 0.6  # the same connection again: the request's own wait


async def test_a_body_read_into_a_buffer_in_pieces(server: RawServer) -> None:
    body = bytes(range(256)) * 4096  # 1 MiB, sent in two writes
    server.script = replies(answer(b"", f"Content-Length: {len(body)}"), body[:1000],
                            body[1000:])
    o = origin(server)
    buf = bytearray(len(body))
    pieces: list[int] = []
    async with o.get("/x") as resp:
        assert await resp.read_into(memoryview(buf), pieces.append) == len(body)
    assert buf == body
    # each piece told as it lands (the link's rate is measured from them)
    assert sum(pieces) == len(body) and len(pieces) >= 2
    # a short body: the bytes it has (the caller compares with what it asked for)
    server.script = replies(answer(b"ab", "Content-Length: 2"))
    async with o.get("/x") as resp:
        assert await resp.read_into(memoryview(bytearray(10))) == 2
    await o.aclose()
    assert server.connections == 1


async def test_chunked_answers_and_1xx_heads(server: RawServer) -> None:
    server.script = replies(answer(b"", status="100 Continue"),
                            answer(b"", "Transfer-Encoding: chunked"),
                            b"3;ext=1\r\nabc\r\n", b"2\r\nde\r\n0\r\nTrailer: x\r\n\r\n")
    o = origin(server)
    assert (await get(o))[:2] == (200, b"abcde")
    buf = bytearray(5)
    async with o.get("/x") as resp:  # exactly the buffer's size
        assert await resp.read_into(memoryview(buf)) == 5
    assert buf == b"abcde"
    await o.aclose()
    assert server.connections == 1  # the connection was reusable after each


async def test_an_answer_without_a_body(server: RawServer) -> None:
    server.script = replies(answer(b"", status="304 Not Modified"))
    o = origin(server)
    assert (await get(o))[:2] == (304, b"")
    assert (await get(o))[:2] == (304, b"")
    await o.aclose()
    assert server.connections == 1


async def test_an_answer_that_ends_with_the_connection(server: RawServer) -> None:
    server.script = replies(answer(b"until close"), keep=False)
    o = origin(server)
    assert (await get(o))[1] == b"until close"
    assert (await get(o))[1] == b"until close"
    await o.aclose()
    assert server.connections == 2  # not reused: its end was the connection's


@pytest.mark.parametrize("how", ["close-header", "server-closes-idle", "http-1.0"])
async def test_a_closed_connection_is_not_reused(server: RawServer, how: str) -> None:
    if how == "close-header":
        server.script = replies(answer(b"ok", "Content-Length: 2", "Connection: close"))
    elif how == "server-closes-idle":  # a keep-alive timeout: closed after the answer
        server.script = replies(answer(b"ok", "Content-Length: 2"), keep=False)
    else:
        server.script = replies(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
    o = origin(server)
    for _ in range(3):
        assert (await get(o))[:2] == (200, b"ok")
    await o.aclose()
    assert server.connections == 3


async def test_a_connection_closed_while_idle_is_replaced_unnoticed(server: RawServer) -> None:
    """The server closes a kept connection between requests (before the client can see it):
    the request goes again on a new connection."""
    closing: list[socket.socket] = []

    def script(conn: socket.socket, _req: bytes) -> bool:
        closing.append(conn)
        conn.sendall(answer(b"ok", "Content-Length: 2"))
        return True

    server.script = script
    o = origin(server)
    assert (await get(o))[1] == b"ok"
    closing[0].shutdown(socket.SHUT_RDWR)  # reset under the idle connection
    assert (await get(o))[1] == b"ok"
    await o.aclose()
    assert server.connections == 2


@pytest.mark.parametrize("lie", ["declared", "sent", "chunked"])
async def test_a_body_longer_than_asked_for_is_refused(server: RawServer, lie: str) -> None:
    if lie == "declared":
        server.script = replies(answer(b"x" * 100, f"Content-Length: {1 << 40}"))
    elif lie == "sent":
        server.script = replies(answer(b"x" * 100), keep=False)
    else:
        server.script = replies(answer(b"", "Transfer-Encoding: chunked"),
                                b"64\r\n" + b"x" * 100 + b"\r\n0\r\n\r\n")
    o = origin(server)
    with pytest.raises(wire.AnswerTooLong):
        await get(o, cap=10)
    with pytest.raises(wire.AnswerTooLong):
        async with o.get("/x") as resp:
            await resp.read_into(memoryview(bytearray(10)))
    await o.aclose()


@pytest.mark.parametrize("raw", [
    b"SPDY/3 200 OK\r\n\r\n",
    b"HTTP/1.1 2xx OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX: " + b"y" * (70 << 10) + b"\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
])
async def test_what_is_not_an_http_answer_is_a_transport_error(server: RawServer,
                                                               raw: bytes) -> None:
    server.script = replies(raw, keep=False)
    o = origin(server)
    with pytest.raises(wire.TransportError):
        await get(o)
    await o.aclose()


async def test_a_server_that_stops_answering_times_out(server: RawServer) -> None:
    stop = threading.Event()

    def script(conn: socket.socket, _req: bytes) -> bool:
        conn.sendall(answer(b"", "Content-Length: 10") + b"abc")
        stop.wait(10)
        return False

    server.script = script
    o = origin(server, timeout_s=0.3)
    try:
        with pytest.raises(wire.TransportError, match="no answer byte"):
            await get(o)
    finally:
        stop.set()
    await o.aclose()


async def test_nobody_listening_is_a_transport_error() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    o = wire.Origin(f"http://127.0.0.1:{port}", {}, timeout_s=1, connect_timeout_s=1,
                    max_connections=1)
    with pytest.raises(wire.TransportError, match="cannot connect"):
        await get(o)


async def test_at_most_max_connections_at_once(server: RawServer) -> None:
    gate = threading.Event()

    def script(conn: socket.socket, _req: bytes) -> bool:
        gate.wait(5)
        conn.sendall(answer(b"ok", "Content-Length: 2"))
        return True

    server.script = script
    o = origin(server)  # max_connections=2
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(get, o)
        await trio.sleep(0.3)
        assert server.connections == 2
        gate.set()
    await o.aclose()
    assert server.connections == 2 and len(server.requests) == 5


def test_only_http_urls() -> None:
    with pytest.raises(ValueError, match="not an http"):
        wire.Origin("ftp://x", {}, timeout_s=1, connect_timeout_s=1, max_connections=1)


async def test_an_idle_connection_expires(server: RawServer, monkeypatch) -> None:
    server.script = replies(answer(b"ok", "Content-Length: 2"))
    monkeypatch.setattr(wire, "IDLE_EXPIRY_S", 0.2)
    o = origin(server)
    assert (await get(o))[1] == b"ok"
    assert (await get(o))[1] == b"ok"
    assert server.connections == 1
    await trio.sleep(0.3)
    assert (await get(o))[1] == b"ok"
    await o.aclose()
    assert server.connections == 2


async def test_a_request_goes_on_the_newest_idle_connection_the_oldest_or_a_new_one(
        server: RawServer) -> None:
    seen: list[int] = []  # the server-side port of each request's connection

    def script(conn: socket.socket, _req: bytes) -> bool:
        seen.append(conn.getpeername()[1])
        conn.sendall(answer(b"ok", "Content-Length: 2"))
        return True

    server.script = script
    o = wire.Origin(server.url, {}, timeout_s=5.0, connect_timeout_s=5.0, max_connections=4)
    async with trio.open_nursery() as nursery:  # two connections, both idle after
        for _ in range(2):
            nursery.start_soon(get, o)
    first, second = seen
    assert o.usage(0.0) == (2, 2)
    await get(o)  # the newest
    newest = seen[-1]
    async with o.get("/x", on="oldest") as resp:
        await resp.read(16)
    assert seen[-1] == ({first, second} - {newest}).pop()
    assert o.usage(60.0) == (2, 0)  # none idle for a minute
    async with o.get("/x", on="new") as resp:
        await resp.read(16)
    assert server.connections == 3 and o.usage(0.0) == (3, 3)
    await o.aclose()


async def test_keeping_warm_touches_only_connections_nobody_used_lately(
        server: RawServer, monkeypatch) -> None:
    from spokefs.hub.client import HubClient

    server.script = replies(answer(b"ok", "Content-Length: 2"))
    hub = HubClient(server.url, token=None, max_connections=8, request_timeout_s=5.0,
                    deadline_s=5.0)
    assert hub.rtt_s is None
    await hub.warm_up(3, 5.0)  # at mount: three new ones
    assert server.connections == 3 and len(server.requests) == 3
    assert hub.rtt_s is not None and hub.rtt_s < 1.0  # the first round trip, before any data
    await hub.warm_up(3, 5.0, idle_s=1.0)  # all used just now: nothing to do
    assert server.connections == 3 and len(server.requests) == 3
    await hub.warm_up(5, 5.0, idle_s=1.0)  # two more wanted: two new ones
    assert server.connections == 5 and len(server.requests) == 5
    await trio.sleep(0.3)
    await hub.warm_up(5, 5.0, idle_s=0.2)  # unused for 0.2 s: each touched, on itself
    assert server.connections == 5 and len(server.requests) == 10
    await hub.aclose()
