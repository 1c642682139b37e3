"""The data path's HTTP/1.1: GET requests for blob ranges and packs on keep-alive connections
(trio), each answer's body received straight into the caller's buffer.

Why not httpx, which the snapshot and the probes use: on a cold read every answer went
through httpx, httpcore and h11 in Python, the body 64 KiB at a time, copied three times
before it reached the frame check, and httpcore's pool scans every connection on every
request (``benchmarks/bench_cold_cpu.py``'s profile: a quarter of the spoke's CPU per cold GB
of shards). Here a request is one ``send``, its answer's head is parsed once, and a body of
known length is received with ``recv_into`` into one buffer.

What it speaks: ``GET`` with the caller's headers; answers with ``Content-Length``, chunked
ones, and ones that end with the connection; 1xx heads skipped; ``http`` and ``https`` (the
caller's ``ssl.SSLContext``, the host name checked). A connection goes back to the pool only
after its answer was read to the end and neither side said ``Connection: close``; an idle one
that became readable (the server closed it) or idle longer than ``IDLE_EXPIRY_S`` is dropped
before reuse, and a request whose
reused connection turns out closed before any byte of the answer is sent once more on a new
one (GET is idempotent). Failures are ``TransportError``; every wait is bounded by
``timeout_s``.
"""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Literal
from urllib.parse import urlsplit

import trio

_HEAD_MAX = 64 << 10  # an answer's status line and headers
_RECEIVE = 1 << 20  # bytes per receive when the length is not known
# Bytes per receive while a head or a chunk line is awaited: what comes with it beyond its
# end (the body's start) is copied once more, through ``_Connection.buf``, so not 1 MiB of it
# (that was two extra copies of half of a 2 MiB cold answer's body: bench_cold_cpu.py).
_LINE_RECEIVE = 16 << 10
_CHUNK_LINE_MAX = 4096
# An idle connection is closed after this long: above the longest the hub client leaves one
# it keeps warm untouched (7.5 s), below hubd's idle timeout (15 s), far below a NAT's.
IDLE_EXPIRY_S = 12.0

Which = Literal["newest", "oldest", "new"]  # the connection a request goes on (``Origin.get``)


class TransportError(Exception):
    """The connection failed, closed early, timed out, or the answer is not HTTP/1.1."""


class AnswerTooLong(Exception):
    """The answer's body is (or declares to be) longer than the caller asked for: a lying or
    broken server, which retrying does not fix."""


class Headers:
    """An answer's headers, by lower-case name (the last value of a repeated one)."""

    def __init__(self, fields: dict[str, str]) -> None:
        self._fields = fields

    def get(self, name: str, default: str = "") -> str:
        return self._fields.get(name.lower(), default)


class _Connection:
    def __init__(self, stream: trio.abc.Stream, sock: trio.socket.SocketType | None,
                 opened: float | None = None) -> None:
        self.stream = stream
        self.sock = sock  # plain TCP: received into buffers directly
        self.buf = bytearray()  # received past what was consumed
        self.idle_since = 0.0  # trio time it went back to the pool
        # plain TCP, no exchange yet: when its connect() began (``Answer.round_trip_s``)
        self.opened = opened

    def closed_by_peer(self) -> bool:
        """An idle connection with something to read: the server closed it (or misbehaves)."""
        if self.buf:
            return True
        sock = self.sock
        if sock is None:
            sock = self.stream.transport_stream.socket  # type: ignore[attr-defined]
        return bool(sock.is_readable())

    async def receive(self, timeout_s: float, size: int = _RECEIVE) -> bytes | bytearray:
        try:
            with trio.fail_after(timeout_s):
                return await self.stream.receive_some(size)
        except trio.TooSlowError:
            raise TransportError(f"no answer byte in {timeout_s:.0f}s") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise TransportError(f"connection failed: {exc}") from exc

    async def receive_into(self, view: memoryview, timeout_s: float) -> int:
        """Some bytes into ``view`` (0 at the end of the stream)."""
        if self.buf:
            n = min(len(self.buf), len(view))
            view[:n] = self.buf[:n]
            del self.buf[:n]
            return n
        if self.sock is None:
            data = await self.receive(timeout_s)
            n = min(len(data), len(view))
            view[:n] = data[:n]
            self.buf += data[n:]
            return n
        try:
            with trio.fail_after(timeout_s):
                return int(await self.sock.recv_into(view, len(view)))
        except trio.TooSlowError:
            raise TransportError(f"no answer byte in {timeout_s:.0f}s") from None
        except OSError as exc:
            raise TransportError(f"connection failed: {exc}") from exc

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True), contextlib.suppress(Exception):
            await trio.aclose_forcefully(self.stream)


class Answer:
    """One answer: its status and headers; its body read once, by one of the read methods.

    Attributes:
        status_code, headers: of the answer.
        length: the body's declared length (None: chunked, or until the connection ends).
        round_trip_s: the round trip this exchange measured, the server's time included:
            from the request's send to the answer's head; on a new plain-TCP connection,
            half the time from its ``connect()`` (the handshake's round trip, then the
            request's). Whether the handshake shows in ``connect()`` (a real network) or
            holds the first request back (a proxy that emulates a long link, as
            ``benchmarks/longlink.py`` does), that is one round trip, where the request's
            own wait would be two under the proxy.
    """

    def __init__(self, conn: _Connection, status: int, headers: Headers, timeout_s: float,
                 keep: bool, round_trip_s: float = 0.0) -> None:
        self._conn = conn
        self._timeout_s = timeout_s
        self.round_trip_s = round_trip_s
        self.status_code = status
        self.headers = headers
        self._chunked = "chunked" in headers.get("transfer-encoding").lower()
        declared = headers.get("content-length")
        self.length: int | None
        if status in (204, 304):  # never a body
            self._chunked = False
            self.length = 0
        elif self._chunked:
            self.length = None
        elif declared.isdigit():
            self.length = int(declared)
        elif declared:
            raise TransportError(f"a Content-Length of {declared[:40]!r}")
        else:
            self.length = None
            keep = False  # the body ends with the connection
        self._keep = keep
        self._left = self.length  # body bytes not read yet (Content-Length)
        self._chunk_left = 0  # chunked: bytes left in the current chunk
        self.done = False  # the whole body was read

    @property
    def reusable(self) -> bool:
        return self.done and self._keep

    async def read_into(self, buf: memoryview,
                        arrived: Callable[[int], None] | None = None) -> int:
        """Read the whole body into ``buf``; the bytes read. ``arrived`` is told of each
        piece's size as it lands.

        Raises:
            AnswerTooLong: the body is longer than ``buf``.
            TransportError: the connection failed.
        """
        if self.length is not None and self.length > len(buf):
            raise AnswerTooLong(f"an answer of {self.length} bytes, more than the "
                                f"{len(buf)} asked for")
        got = 0
        while True:
            if got == len(buf):
                # full: the body must end here (a longer one is refused)
                if not self.done and await self._more_after_full():
                    raise AnswerTooLong(f"an answer longer than the {len(buf)} bytes "
                                        f"asked for")
                return got
            n = await self.read_some_into(buf[got:])
            if n == 0:
                return got
            got += n
            if arrived is not None:
                arrived(n)

    async def _more_after_full(self) -> bool:
        probe = bytearray(1)
        return await self.read_some_into(memoryview(probe)) > 0

    async def read_some_into(self, view: memoryview) -> int:
        """Some of the body into ``view``: 0 once it is all read."""
        if self.done or not len(view):
            return 0
        conn = self._conn
        if self._chunked:
            if self._chunk_left == 0:
                self._chunk_left = await self._chunk_size()
                if self._chunk_left == 0:
                    await self._trailers()
                    self.done = True
                    return 0
            view = view[:self._chunk_left]
        elif self._left is not None:
            if self._left == 0:
                self.done = True
                return 0
            view = view[:self._left]
        n = await conn.receive_into(view, self._timeout_s)
        if n == 0:
            if self._left is None and not self._chunked:
                self.done = True  # the body ended with the connection
                return 0
            raise TransportError("the connection closed inside an answer")
        if self._chunked:
            self._chunk_left -= n
            if self._chunk_left == 0 and await self._line():  # the CRLF after its data
                raise TransportError("a chunk longer than its size")
        elif self._left is not None:
            self._left -= n
            if self._left == 0:
                self.done = True
        return n

    async def pieces(self, cap: int) -> AsyncIterator[bytes]:
        """The body as it arrives, at most ``cap`` bytes in all (else AnswerTooLong)."""
        if self.length is not None and self.length > cap:
            raise AnswerTooLong(f"an answer of {self.length} bytes, more than the {cap} "
                                f"asked for")
        buf = bytearray(min(_RECEIVE, cap + 1))
        view = memoryview(buf)
        received = 0
        while True:
            n = await self.read_some_into(view)
            if n == 0:
                return
            received += n
            if received > cap:
                raise AnswerTooLong(f"an answer longer than the {cap} bytes asked for")
            yield bytes(view[:n])

    async def read(self, cap: int) -> bytes:
        """The whole body, at most ``cap`` bytes (else AnswerTooLong)."""
        return b"".join([piece async for piece in self.pieces(cap)])

    async def _line(self) -> bytes:
        conn = self._conn
        while True:
            end = conn.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(conn.buf[:end])
                del conn.buf[:end + 2]
                return line
            if len(conn.buf) > _CHUNK_LINE_MAX:
                raise TransportError("a chunk line too long")
            data = await conn.receive(self._timeout_s, _LINE_RECEIVE)
            if not data:
                raise TransportError("the connection closed inside a chunked answer")
            conn.buf += data

    async def _chunk_size(self) -> int:
        line = (await self._line()).split(b";", 1)[0].strip()
        try:
            return int(line, 16)
        except ValueError:
            raise TransportError(f"a chunk size of {line[:20]!r}") from None

    async def _trailers(self) -> None:
        while await self._line():
            pass


class Origin:
    """Keep-alive connections to one origin (``scheme://host[:port]``), at most
    ``max_connections`` open, each carrying one request at a time."""

    def __init__(self, url: str, headers: dict[str, str], *, timeout_s: float,
                 connect_timeout_s: float, max_connections: int,
                 tls: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        host = f"[{self._host}]" if ":" in self._host else self._host
        default_port = self._port == (443 if self._https else 80)
        fields = {"Host": host if default_port else f"{host}:{self._port}", **headers}
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        self._tls = tls if tls is not None else (
            ssl.create_default_context() if self._https else None)
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._slots = trio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self._max_idle = max_connections

    def usage(self, idle_s: float) -> tuple[int, int]:
        """Connections open or opening (idle and busy), and the idle ones unused for at
        least ``idle_s``."""
        now = trio.current_time()
        busy = self._max_idle - self._slots.value
        return busy + len(self._idle), sum(now - c.idle_since >= idle_s for c in self._idle)

    @contextlib.asynccontextmanager
    async def get(self, path: str, headers: dict[str, str] | None = None, *,
                  on: Which = "newest") -> AsyncIterator[Answer]:
        """``GET path`` (with extra ``headers``): its answer, whose body the caller reads
        inside the block (a connection whose answer was not read to the end is closed).
        ``on``: the idle connection it goes on, the most recently used (``newest``), the
        least (``oldest``: a touch that keeps it open), or a new one (``new``)."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        request = f"GET {self._prefix}{path} HTTP/1.1\r\n{self._head}{extra}\r\n".encode()
        async with self._slots:
            answer = await self._send(request, on)
            try:
                yield answer
            except BaseException:
                await answer._conn.aclose()
                raise
            if answer.reusable and len(self._idle) < self._max_idle:
                answer._conn.idle_since = trio.current_time()
                self._idle.append(answer._conn)
            else:
                await answer._conn.aclose()

    async def _send(self, request: bytes, on: Which) -> Answer:
        while self._idle and on != "new":
            conn = self._idle.pop(0 if on == "oldest" else -1)
            if (trio.current_time() - conn.idle_since > IDLE_EXPIRY_S
                    or conn.closed_by_peer()):
                await conn.aclose()
                continue
            try:
                return await self._exchange(conn, request)
            except _ClosedBeforeAnswer:
                await conn.aclose()  # closed by the server while idle: a new one
            except BaseException:
                await conn.aclose()
                raise
        conn = await self._connect()
        try:
            return await self._exchange(conn, request)
        except _ClosedBeforeAnswer as exc:
            await conn.aclose()
            raise TransportError(str(exc)) from None
        except BaseException:
            await conn.aclose()
            raise

    async def _connect(self) -> _Connection:
        try:
            with trio.fail_after(self._connect_timeout_s):
                opened = time.monotonic()
                stream = await trio.open_tcp_stream(self._host, self._port)
                if self._tls is None:
                    return _Connection(stream, stream.socket, opened)
                tls = trio.SSLStream(stream, self._tls, server_hostname=self._host,
                                     https_compatible=True)
                try:
                    await tls.do_handshake()
                except BaseException:
                    await trio.aclose_forcefully(tls)
                    raise
                return _Connection(tls, None)
        except trio.TooSlowError:
            raise TransportError(f"no connection to {self._host}:{self._port} in "
                                 f"{self._connect_timeout_s:.0f}s") from None
        except (OSError, trio.BrokenResourceError) as exc:
            raise TransportError(f"cannot connect to {self._host}:{self._port}: "
                                 f"{exc}") from exc

    async def _exchange(self, conn: _Connection, request: bytes) -> Answer:
        sent = time.monotonic()
        try:
            with trio.fail_after(self._timeout_s):
                await conn.stream.send_all(request)
        except trio.TooSlowError:
            raise TransportError("the request could not be sent in time") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise _ClosedBeforeAnswer(f"connection failed: {exc}") from exc
        while True:
            status, headers, keep = await self._head_of(conn)
            if not 100 <= status < 200:
                now = time.monotonic()
                waited = now - sent if conn.opened is None else (now - conn.opened) / 2
                conn.opened = None
                return Answer(conn, status, headers, self._timeout_s, keep, waited)

    async def _head_of(self, conn: _Connection) -> tuple[int, Headers, bool]:
        while (end := conn.buf.find(b"\r\n\r\n")) < 0:
            if len(conn.buf) > _HEAD_MAX:
                raise TransportError(f"an answer head longer than {_HEAD_MAX} bytes")
            try:
                data = await conn.receive(self._timeout_s, _LINE_RECEIVE)
            except TransportError as exc:
                if not conn.buf and isinstance(exc.__cause__, OSError | trio.BrokenResourceError):
                    raise _ClosedBeforeAnswer(str(exc)) from None
                raise
            if not data:
                if conn.buf:
                    raise TransportError("the connection closed inside an answer head")
                raise _ClosedBeforeAnswer("the connection closed before the answer")
            conn.buf += data
        if end > _HEAD_MAX:
            raise TransportError(f"an answer head longer than {_HEAD_MAX} bytes")
        head = bytes(conn.buf[:end]).decode("latin-1")
        del conn.buf[:end + 4]
        status_line, *lines = head.split("\r\n")
        version, _, rest = status_line.partition(" ")
        code = rest[:3]
        if version not in ("HTTP/1.1", "HTTP/1.0") or not code.isdigit():
            raise TransportError(f"not an HTTP/1.1 answer: {status_line[:60]!r}")
        fields: dict[str, str] = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if not sep:
                raise TransportError(f"a header line without a colon: {line[:60]!r}")
            fields[name.strip().lower()] = value.strip()
        connection = fields.get("connection", "").lower()
        keep = "close" not in connection if version == "HTTP/1.1" else \
            "keep-alive" in connection
        return int(code), Headers(fields), keep

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()


class _ClosedBeforeAnswer(Exception):
    """The connection ended before any byte of the answer (a reused one may: send again)."""
