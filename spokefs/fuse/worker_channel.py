"""The local channel between a mount's coordinator and one of its serving workers.

One ``socketpair`` per worker, made by the coordinator and inherited by the worker
(``workers``). Messages are a 4-byte length, a 1-byte kind and a ``marshal``-encoded body
(tuples of ints, bytes, floats and None: what marshal encodes fastest). The two ends are our
own processes, started by the same program, so nothing on the channel is untrusted.

Worker -> coordinator:

- ``READ (rid, file_id, offset, size)``: a read the worker could not serve from the cache
  (a miss, bytes only staged in the coordinator's memory, a block that failed its
  checksum). Answered with ``REPLY``.
- ``XATTR (rid, ino, name, uid)``: a control attribute (``user.spokefs.*``). ``REPLY``.
- ``HIT (file_id, offset, end, by_origin, seen, seconds)``: a read the worker served from
  the cache: the coordinator does what its own reads do besides serving (the prefetcher,
  the trace, visits for eviction, the metrics).
- ``LISTED (dir_id)``: a directory is being listed (the prefetcher may fill it).

Coordinator -> worker:

- ``HELLO (pickled WorkerSetup)``: the first message: what the worker needs to join.
- ``REPLY (rid, errno, data)``: the answer to a ``READ`` or ``XATTR`` (errno 0: ``data``).
- ``BYE ()``: the mount is ending; exit without unmounting anything.

Events (``HIT``, ``LISTED``) are queued and sent together by one task, so a busy worker makes
one ``send`` per batch, not one per read.
"""

from __future__ import annotations

import marshal
import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any

import trio

from spokefs.config import SpokeConfig

READ, XATTR, HIT, LISTED, HELLO, REPLY, BYE = range(1, 8)
KINDS = {READ: "READ", XATTR: "XATTR", HIT: "HIT", LISTED: "LISTED", HELLO: "HELLO",
         REPLY: "REPLY", BYE: "BYE"}
_HEAD = struct.Struct("<IB")
_MAX_MESSAGE = 64 << 20  # a reply carries at most one FUSE read (<= 1 MiB); hello is small
_RECEIVE_BYTES = 1 << 20


class ChannelClosed(Exception):
    """The other end is gone (its process exited or was killed)."""


class ChannelBroken(Exception):
    """The other end sent something that is not a message: a bug, never data."""


def encode(kind: int, body: Any) -> bytes:
    payload = body if kind == HELLO else marshal.dumps(body)
    return _HEAD.pack(len(payload), kind) + payload


def receive_hello(sock: socket.socket) -> WorkerSetup:
    """The coordinator's first message, read by a worker before its event loop starts."""
    length, kind = _HEAD.unpack(_exactly(sock, _HEAD.size))
    if kind != HELLO:
        raise ChannelBroken(f"the first message is of kind {kind}, not HELLO")
    if length > _MAX_MESSAGE:
        raise ChannelBroken(f"a HELLO of {length} bytes")
    return WorkerSetup.decode(_exactly(sock, length))


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ChannelClosed("the coordinator closed the channel before HELLO")
        buf += chunk
    return bytes(buf)


class Channel:
    """Messages over one end of the socketpair (trio)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._buf = bytearray()
        self._send_lock = trio.Lock()
        self._queued: list[bytes] = []
        self._queue_ready = trio.Event()

    async def send(self, kind: int, body: Any) -> None:
        """Send one message now (replies and requests: someone waits for it)."""
        await self.send_raw(encode(kind, body))

    def queue(self, kind: int, body: Any) -> None:
        """Queue an event for ``send_queued`` (never blocks, never fails)."""
        self._queued.append(encode(kind, body))
        self._queue_ready.set()

    async def send_queued(self) -> None:
        """Send queued events, a batch per ``send``, until the channel closes."""
        while True:
            await self._queue_ready.wait()
            self._queue_ready = trio.Event()
            batch, self._queued = self._queued, []
            if batch:
                await self.send_raw(b"".join(batch))

    async def send_raw(self, data: bytes) -> None:
        async with self._send_lock:
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ChannelClosed(str(exc)) from None

    async def receive(self) -> tuple[int, Any]:
        """The next message ``(kind, body)``; raises ChannelClosed at the end."""
        while True:
            if len(self._buf) >= _HEAD.size:
                length, kind = _HEAD.unpack_from(self._buf)
                if length > _MAX_MESSAGE or kind not in KINDS:
                    raise ChannelBroken(f"a message of kind {kind} and {length} bytes")
                end = _HEAD.size + length
                if len(self._buf) >= end:
                    payload = bytes(self._buf[_HEAD.size:end])
                    del self._buf[:end]
                    if kind == HELLO:
                        return kind, payload
                    try:
                        return kind, marshal.loads(payload)
                    except (ValueError, EOFError, TypeError) as exc:
                        raise ChannelBroken(f"an undecodable {KINDS[kind]}: {exc}") from None
            try:
                chunk = await self._stream.receive_some(_RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ChannelClosed(str(exc)) from None
            if not chunk:
                raise ChannelClosed("end of stream")
            self._buf += chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker needs to join the mount: the body of ``HELLO`` (pickled).

    Attributes:
        cfg: the mount's configuration.
        index: the worker's number (1..N-1; the coordinator is 0), for logs.
        init: the mount's INIT request, as the kernel sent it (``session.receive_init``).
        options: the FUSE options the mount was made with.
        log_file: the file the coordinator logs to (a daemon has no stderr), or None: the
            worker logs to the stderr it inherits.
    """

    cfg: SpokeConfig
    index: int
    init: bytes
    options: tuple[str, ...]
    log_file: str | None = None

    def encode(self) -> bytes:
        return pickle.dumps(self)

    @staticmethod
    def decode(raw: bytes) -> WorkerSetup:
        setup = pickle.loads(raw)
        if not isinstance(setup, WorkerSetup):
            raise ChannelBroken(f"HELLO holds a {type(setup).__name__}")
        return setup
