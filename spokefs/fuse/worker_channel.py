"""The local channel between a mount's coordinator and one of its serving workers.

One ``socketpair`` per worker, made by the coordinator and inherited by the worker
(``workers``). Messages are a 4-byte length, a 1-byte kind and a ``marshal``-encoded body
(tuples of ints, bytes, floats and None: what marshal encodes fastest). The two ends are our
own processes, started by the same program, so nothing on the channel is untrusted.

Worker -> coordinator:

- ``READ (unique, file_id, offset, size)``: a read the worker could not serve from the
  cache (a miss, bytes only staged in the coordinator's memory, a block that failed its
  checksum), by the kernel's request id. Not answered on the channel: the coordinator
  writes the request's reply to the kernel itself (``device``).
- ``XATTR (rid, ino, name, uid)``: a control attribute (``user.spokefs.*``). ``REPLY``.
- ``HIT (reads, by_origin, nbytes, seconds, errors)``: the reads the worker served from the
  cache since its last batch: ``reads`` a list of ``(file_id, version, file_size,
  parent_id, offset, size, visits)`` (the file version as the worker read it), then
  their metric counts summed (blocks per origin, bytes), each one's latency, and the errors
  the worker answered meanwhile, ``(handler, errno, count)``. The coordinator does what its
  own reads do besides serving (the prefetcher, the trace, visits for eviction, the metrics).
- ``LISTED (dir_id)``: a directory is being listed (the prefetcher may fill it).
- ``SERVING (threads)``: the worker's threads read the mount's requests now.
- ``SYNCED (rid,)``: the answer to a ``SYNC``, after every hit gathered until then.

Coordinator -> worker:

- ``HELLO (pickled WorkerSetup)``: the first message: what the worker needs to join.
- ``REPLY (rid, errno, data)``: the answer to an ``XATTR`` (errno 0: ``data``).
- ``BYE ()``: the mount is ending; exit without unmounting anything.
- ``SYNC (rid,)``: send what you have gathered, then ``SYNCED`` (a ``Calls`` request): the
  coordinator is about to answer a control attribute a request to its own descriptor asked
  for (a request it read as the worker took over), and ``/metrics`` must count every read
  answered before it.

Events (``HIT``, ``LISTED``) are queued and sent together by one task, so a busy worker makes
one ``send`` per batch, not one per read. Hits go as one ``HIT`` message per batch, taken from
the worker's collector when the batch is sent (``queue_collected``). A batch of hits waits
``collect_delay_s`` (5 ms in a worker) for more, and then, while fewer than are ``enough``
(8) are gathered, up to ``collect_max_delay_s`` (50 ms); it goes at once when 64 or 4 MiB of
hits are gathered, or when a request goes out (which carries them ahead of itself). The
coordinator pays per message: without the wait a busy worker's batches held 1.1 hits, and
with 5 ms alone a slow reader's (a job that decodes) one or two.
"""

from __future__ import annotations

import errno
import itertools
import marshal
import pickle
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from spokefs.config import SpokeConfig

READ, XATTR, HIT, LISTED, HELLO, REPLY, BYE, SERVING, SYNC, SYNCED = range(1, 11)
KINDS = {READ: "READ", XATTR: "XATTR", HIT: "HIT", LISTED: "LISTED", HELLO: "HELLO",
         REPLY: "REPLY", BYE: "BYE", SERVING: "SERVING", SYNC: "SYNC", SYNCED: "SYNCED"}
_HEAD = struct.Struct("<IB")
_MAX_MESSAGE = 64 << 20  # a reply carries at most an attribute's value; hello is small
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

    def __init__(self, stream: trio.SocketStream, *, collect_delay_s: float = 0.0,
                 collect_max_delay_s: float | None = None) -> None:
        """Args:
            collect_delay_s: how long ``send_queued`` lets collectors gather before it sends
                what they have (unless an event or a full collector asks for it sooner).
            collect_max_delay_s: how long it waits at most while no collector has gathered
                ``enough`` (None: ``collect_delay_s``).
        """
        self._stream = stream
        self._buf = bytearray()
        self._send_lock = trio.Lock()
        self._queued: list[bytes] = []
        self._collectors: dict[int, Callable[[], Any]] = {}
        self._collect_delay_s = collect_delay_s
        self._collect_max_delay_s = max(collect_delay_s, collect_max_delay_s or 0.0)
        self._queue_ready = trio.Event()
        self._send_now = trio.Event()
        self._enough = trio.Event()  # set with _send_now, or by a collector with enough

    async def send(self, kind: int, body: Any) -> None:
        """Send one message now (replies and requests: someone waits for it), after what the
        collectors have gathered: the coordinator hears of a worker's hits before the miss
        that follows them."""
        message = encode(kind, body)
        if self._collectors:
            message = self._take_collected() + message
        await self.send_raw(message)

    def queue(self, kind: int, body: Any) -> None:
        """Queue an event for ``send_queued`` (never blocks, never fails)."""
        self._queued.append(encode(kind, body))
        self._queue_ready.set()
        self._send_now.set()
        self._enough.set()

    def queue_collected(self, kind: int, collect: Callable[[], Any], *,
                        now: bool = False, enough: bool = False) -> None:
        """Have a batch carry one ``kind`` message whose body ``collect()`` gives when the
        batch is sent (what was gathered until then): ``collect_delay_s`` on if the
        collector has ``enough``, else within ``collect_max_delay_s``; at once with ``now``
        (the collector is full)."""
        self._collectors[kind] = collect
        self._queue_ready.set()
        if now:
            self._send_now.set()
        if now or enough:
            self._enough.set()

    async def send_queued(self) -> None:
        """Send queued events, a batch per ``send``, until the channel closes."""
        while True:
            await self._queue_ready.wait()
            if self._collect_delay_s and not self._send_now.is_set():
                with trio.move_on_after(self._collect_delay_s):
                    await self._send_now.wait()
                if not self._enough.is_set():
                    with trio.move_on_after(self._collect_max_delay_s - self._collect_delay_s):
                        await self._enough.wait()
            self._queue_ready = trio.Event()
            self._send_now = trio.Event()
            self._enough = trio.Event()
            batch, self._queued = self._queued, []
            if self._collectors:
                batch.append(self._take_collected())
            if batch:
                await self.send_raw(b"".join(batch))

    def _take_collected(self) -> bytes:
        collectors, self._collectors = self._collectors, {}
        return b"".join(encode(kind, collect()) for kind, collect in collectors.items())

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


class CallFailed(Exception):
    """A request to the coordinator failed: ``errno`` is the answer to give the kernel."""

    def __init__(self, err: int) -> None:
        super().__init__(errno.errorcode.get(err, str(err)))
        self.errno = err


class Calls:
    """Requests over the channel and their replies, matched by request id: a worker's to
    the coordinator (``XATTR``, ``READ``), and the coordinator's ``SYNC`` to its worker."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[trio.Event, list[Any]]] = {}
        self._closed = False

    async def call(self, kind: int, args: tuple[Any, ...]) -> bytes:
        """Send a request and wait for its reply.

        Raises:
            CallFailed: the other end answered an errno, or is gone (EIO).
        """
        if self._closed:
            raise CallFailed(errno.EIO)
        rid = next(self._ids)
        done = trio.Event()
        slot: list[Any] = []
        self._waiting[rid] = (done, slot)
        try:
            await self._channel.send(kind, (rid, *args))
            await done.wait()
        except ChannelClosed:
            raise CallFailed(errno.EIO) from None
        finally:
            self._waiting.pop(rid, None)
        err, data = slot
        if err:
            raise CallFailed(err)
        return bytes(data)

    def replied(self, rid: int, err: int, data: bytes) -> None:
        waiting = self._waiting.get(rid)
        if waiting is not None:
            waiting[1].extend((err, data))
            waiting[0].set()

    def close(self) -> None:
        """The other end is gone: every waiting request fails with EIO."""
        self._closed = True
        for done, slot in self._waiting.values():
            slot.extend((errno.EIO, b""))
            done.set()


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker needs to serve the mount: the body of ``HELLO`` (pickled).

    Attributes:
        cfg: the mount's configuration.
        index: the worker's number (1 and up; the coordinator is 0), for logs.
        threads: how many threads of the native read loop serve.
        log_file: the file the coordinator logs to (a daemon has no stderr), or None: the
            worker logs to the stderr it inherits.
    """

    cfg: SpokeConfig
    index: int
    threads: int
    log_file: str | None = None

    def encode(self) -> bytes:
        return pickle.dumps(self)

    @staticmethod
    def decode(raw: bytes) -> WorkerSetup:
        setup = pickle.loads(raw)
        if not isinstance(setup, WorkerSetup):
            raise ChannelBroken(f"HELLO holds a {type(setup).__name__}")
        return setup
