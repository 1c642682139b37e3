#!/usr/bin/env python3
"""longlink: a TCP proxy that makes loopback look like a long, thin link (no netem here).

It emulates, in each direction separately:

- a **one-way delay** (``delay_s``; RTT = 2 x delay). Pipelined: every chunk is released
  ``delay_s`` after it left, however many chunks are in flight, never stop-and-wait;
- a **bandwidth cap shared by all connections** (the link is one pipe): a serialisation clock
  per direction. A chunk of n bytes occupies the pipe for n / rate seconds after the previous
  chunk of any connection; the pipe's queue is bounded (``queue_s`` of serialisation, a router
  buffer), beyond which senders wait;
- an **emulated TCP window per connection** (``window_bytes``): bytes taken from the sender
  count against the window until their acknowledgement would arrive, one delay after they were
  delivered (one full RTT after they left). While the window is full the proxy stops reading
  the sender, so backpressure reaches it and one connection tops out at window / RTT;
- **connection setup** costing one RTT: the upstream connect starts one delay after the accept
  (the SYN's flight) and client bytes leave at the earliest one RTT after the accept (when the
  client would have seen the SYN-ACK), so a request arrives 1.5 RTT after ``connect()``.

Fault switches: ``set_blackhole(True)`` stops carrying bytes (nothing is lost: like a partition
with retransmission, traffic resumes when it is cleared; new connections hang in "SYN sent");
``reset_connections()`` aborts every open connection with an RST.

Counters (bytes delivered per direction, connections accepted/open) come from
``LongLink.statistics()``, from the CLI's status file, and are printed when the CLI exits.

Library use (trio)::

    async with open_longlink(("127.0.0.1", hub_port), LinkConfig(delay_s=0.03)) as link:
        url = f"http://127.0.0.1:{link.port}"

From a non-trio program use :class:`LongLinkProcess`, which runs the CLI as a subprocess:

    python3 benchmarks/longlink.py --listen 127.0.0.1:0 --upstream 127.0.0.1:PORT \\
        --delay-ms 30 --rate-mbit 1000 --window-bytes 4194304 [--status-file F [--status-ms 200]]

It prints one readiness line ``longlink: listening on HOST:PORT -> ...`` (flushed); SIGTERM or
SIGINT ends it with exit code 0 after a ``longlink: stats {json}`` line; SIGUSR1 turns the
blackhole on, SIGUSR2 off.

Cost: one recv and one send per chunk of up to ``chunk_bytes`` (256 KiB), no per-byte work.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

log = logging.getLogger("longlink")

KIB = 1024
MIB = 1024 * KIB
READY_RE = re.compile(r"^longlink: listening on (\S+):(\d+) ")


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """The emulated link's knobs, each with its unit.

    Attributes:
        delay_s: one-way delay per direction (RTT = 2 x delay_s).
        rate_bytes_per_s: capacity of each direction, shared by all connections; None = no cap.
        window_bytes: per connection and direction, bytes in flight (not yet acknowledged);
            None = unbounded. Linux's default largest receive window is about 6 MiB.
        chunk_bytes: largest single read from a sender (one chunk travels as a unit).
        queue_s: the link's queue, in seconds of serialisation; a sender whose chunk would wait
            longer for the pipe waits (un-read) instead, as behind a full router buffer. Senders
            take turns (FIFO), each with a chunk in hand, so a message that joins a busy link
            waits at most queue_s + (busy connections x chunk_bytes / rate): with 8 busy
            connections at 1 Gbit/s, 5 ms + 8 x 2.1 ms.
        handshake: charge one RTT of TCP connection setup.
    """

    delay_s: float = 0.030
    rate_bytes_per_s: float | None = 125e6
    window_bytes: int | None = 4 * MIB
    chunk_bytes: int = 256 * KIB
    queue_s: float = 0.005
    handshake: bool = True


@dataclass(frozen=True, slots=True)
class LinkStats:
    """A snapshot of the link's counters (bytes are counted when delivered to the far side)."""

    connections_accepted: int
    connections_open: int
    bytes_up: int  # client -> upstream
    bytes_down: int  # upstream -> client
    blackhole: bool


class _Pipe:
    """One direction of the link: a serialisation clock shared by every connection.

    ``next_free`` is the trio time at which the pipe has finished sending everything booked
    so far. A sender enters through ``admission()`` (trio's Lock is FIFO, so in arrival
    order), waits there until the queue has room, reads its chunk (already known to be
    waiting in its socket) and books it before leaving. So the booked queue never exceeds
    ``queue_s`` plus one chunk, busy senders take turns, and a small message waits behind at
    most one chunk per busy sender plus ``queue_s``; it never loses a wake-up race to a crowd.
    """

    def __init__(self, rate_bytes_per_s: float | None, queue_s: float) -> None:
        self.rate = rate_bytes_per_s
        self.queue_s = queue_s
        self.next_free = 0.0
        self.bytes_carried = 0
        self._turn = trio.Lock()

    @contextlib.asynccontextmanager
    async def admission(self) -> AsyncIterator[None]:
        """Hold the pipe's turn, once the queue is at most ``queue_s`` of serialisation long."""
        if self.rate is None:
            yield
            return
        async with self._turn:
            backlog = self.next_free - trio.current_time()
            if backlog > self.queue_s:
                await trio.sleep(backlog - self.queue_s)
            yield

    def book(self, nbytes: int) -> float:
        """Book the pipe for nbytes (inside ``admission``); return when they have left."""
        now = trio.current_time()
        if self.rate is None:
            return now
        self.next_free = max(now, self.next_free) + nbytes / self.rate
        return self.next_free


class _Gate:
    """The blackhole switch: ``wait_open`` blocks while the link carries nothing."""

    def __init__(self) -> None:
        self.closed = False
        self._opened = trio.Event()
        self._opened.set()

    def set_closed(self, closed: bool) -> None:
        if closed and not self.closed:
            self._opened = trio.Event()
        elif not closed and self.closed:
            self._opened.set()
        self.closed = closed

    async def wait_open(self) -> None:
        while self.closed:
            await self._opened.wait()


class _Pump:
    """Carries one direction of one connection: reader task -> delay line -> writer task.

    Invariant: ``inflight`` = bytes read from ``src`` whose ack time (in ``acks``, ascending)
    has not yet passed; the reader never lets it exceed the window.
    """

    def __init__(
        self,
        src: trio.SocketStream,
        dst: trio.SocketStream,
        pipe: _Pipe,
        gate: _Gate,
        cfg: LinkConfig,
    ) -> None:
        self._src, self._dst, self._pipe, self._gate, self._cfg = src, dst, pipe, gate, cfg
        self._inflight = 0
        self._acks: collections.deque[tuple[float, int]] = collections.deque()
        self._acked = trio.lowlevel.ParkingLot()
        window = cfg.window_bytes or 64 * MIB
        # Each queued chunk holds >= 1 byte of the window, so this capacity is never the limit;
        # with no window the 64 MiB stands in as a memory bound.
        self._tx, self._rx = trio.open_memory_channel[tuple[float, bytes]](window)

    async def run(self, not_before: float) -> None:
        """Carry bytes until EOF from src, then half-close dst."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_loop, not_before)
            nursery.start_soon(self._write_loop)

    async def _read_loop(self, not_before: float) -> None:
        async with self._tx:
            await trio.sleep_until(not_before)
            while True:
                room = await self._wait_window()
                await self._gate.wait_open()
                # Queue for the pipe only with bytes (or EOF) in hand, so receive_some below
                # returns at once and the pipe's turn is never held by an idle sender.
                await trio.lowlevel.wait_readable(self._src.socket)
                async with self._pipe.admission():
                    data = await self._src.receive_some(min(room, self._cfg.chunk_bytes))
                    left_at = self._pipe.book(len(data))
                if not data:
                    return
                self._inflight += len(data)
                await self._tx.send((left_at + self._cfg.delay_s, data))

    async def _write_loop(self) -> None:
        async with self._rx:
            async for deliver_at, data in self._rx:
                await trio.sleep_until(deliver_at)
                await self._gate.wait_open()
                await self._dst.send_all(data)
                self._pipe.bytes_carried += len(data)
                # The ack leaves the receiver once it has taken the bytes, and takes one delay.
                acked_at = max(deliver_at, trio.current_time()) + self._cfg.delay_s
                self._acks.append((acked_at, len(data)))
                self._acked.unpark_all()
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self._dst.send_eof()

    async def _wait_window(self) -> int:
        """Wait until the window has room worth a read (>= a quarter chunk: no silly window)."""
        window = self._cfg.window_bytes
        if window is None:
            return self._cfg.chunk_bytes
        min_room = max(1, min(self._cfg.chunk_bytes, window) // 4)
        while True:
            now = trio.current_time()
            while self._acks and self._acks[0][0] <= now:
                self._inflight -= self._acks.popleft()[1]
            room = window - self._inflight
            if room >= min_room:
                return room
            if self._acks:
                await trio.sleep_until(self._acks[0][0])
            else:
                await self._acked.park()


def _abort(stream: trio.SocketStream) -> None:
    """Make the next close send an RST instead of a FIN."""
    with contextlib.suppress(OSError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class LongLink:
    """The proxy: accepts on ``listen``, connects each client to ``upstream`` through the link.

    Attributes:
        port: the bound listening port (valid once ``run`` has started).
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        cfg: LinkConfig,
        listen: tuple[str, int] = ("127.0.0.1", 0),
    ) -> None:
        self.cfg = cfg
        self.upstream = upstream
        self.listen = listen
        self.port = 0
        self._up = _Pipe(cfg.rate_bytes_per_s, cfg.queue_s)
        self._down = _Pipe(cfg.rate_bytes_per_s, cfg.queue_s)
        self._gate = _Gate()
        self._accepted = 0
        self._open: dict[int, tuple[trio.CancelScope, list[trio.SocketStream]]] = {}

    def statistics(self) -> LinkStats:
        """Counters so far."""
        return LinkStats(
            connections_accepted=self._accepted,
            connections_open=len(self._open),
            bytes_up=self._up.bytes_carried,
            bytes_down=self._down.bytes_carried,
            blackhole=self._gate.closed,
        )

    def set_blackhole(self, on: bool) -> None:
        """Stop (on) or resume (off) carrying bytes, in both directions, for all connections."""
        log.info("blackhole %s", "on" if on else "off")
        self._gate.set_closed(on)

    def reset_connections(self) -> None:
        """Abort every open connection with an RST on both sides."""
        for scope, streams in list(self._open.values()):
            for stream in streams:
                _abort(stream)
            scope.cancel()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; ``task_status.started(port)`` once bound."""
        listeners = await trio.open_tcp_listeners(self.listen[1], host=self.listen[0])
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(self.port)
            await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)

    async def _handle(self, client: trio.SocketStream) -> None:
        self._accepted += 1
        conn_id = self._accepted
        accepted_at = trio.current_time()
        streams = [client]
        with trio.CancelScope() as scope:
            self._open[conn_id] = (scope, streams)
            try:
                await self._serve(client, streams, accepted_at)
            except Exception as exc:  # resets, refused upstream: end this connection only
                log.debug("connection %d ended: %r", conn_id, exc)
            finally:
                del self._open[conn_id]
                for stream in streams:
                    with contextlib.suppress(Exception):
                        await trio.aclose_forcefully(stream)

    async def _serve(
        self, client: trio.SocketStream, streams: list[trio.SocketStream], accepted_at: float
    ) -> None:
        delay = self.cfg.delay_s if self.cfg.handshake else 0.0
        await trio.sleep_until(accepted_at + delay)  # the SYN crosses the link
        await self._gate.wait_open()
        upstream = await trio.open_tcp_stream(*self.upstream)
        streams.append(upstream)
        down = _Pump(upstream, client, self._down, self._gate, self.cfg)
        up = _Pump(client, upstream, self._up, self._gate, self.cfg)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(down.run, trio.current_time())
            # The client sends once the SYN-ACK is back: one RTT after it connected.
            nursery.start_soon(up.run, accepted_at + 2 * delay)


@contextlib.asynccontextmanager
async def open_longlink(
    upstream: tuple[str, int],
    cfg: LinkConfig | None = None,
    listen: tuple[str, int] = ("127.0.0.1", 0),
) -> AsyncIterator[LongLink]:
    """Run a LongLink for the duration of the block (trio)."""
    link = LongLink(upstream, cfg or LinkConfig(), listen)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run)
        try:
            yield link
        finally:
            nursery.cancel_scope.cancel()


# -- subprocess helper (for benchmarks that are not trio programs) -------------------------


class LongLinkProcess:
    """Runs the CLI in a subprocess; a context manager. ``port`` is the bound port.

    ``statistics()`` reads the status file the proxy rewrites every --status-ms (and at exit).
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        delay_ms: float,
        rate_mbit: float,
        window_bytes: int = 4 * MIB,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        fd, status = tempfile.mkstemp(prefix="longlink-", suffix=".json")
        os.close(fd)
        self.status_file = Path(status)
        self.args = [
            sys.executable, str(Path(__file__).resolve()),
            "--listen", "127.0.0.1:0", "--upstream", f"{upstream[0]}:{upstream[1]}",
            "--delay-ms", str(delay_ms), "--rate-mbit", str(rate_mbit),
            "--window-bytes", str(window_bytes), "--status-file", status, *extra_args,
        ]
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    def __enter__(self) -> LongLinkProcess:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = READY_RE.match(line)
        if match is None:
            self.close()
            raise RuntimeError(f"longlink did not start: {line!r}")
        self.port = int(match.group(2))
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> dict[str, Any]:
        """Stop the proxy (SIGTERM, then SIGKILL after 5 s); return its last counters."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
        stats = self.statistics()
        self.status_file.unlink(missing_ok=True)
        return stats

    def statistics(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.status_file.read_text() or "{}"))
        except (OSError, ValueError):
            return {}

    def set_blackhole(self, on: bool) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGUSR1 if on else signal.SIGUSR2)


# -- CLI --------------------------------------------------------------------------------


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"want HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--listen", type=_hostport, default=("127.0.0.1", 0), help="HOST:PORT (0 ok)")
    p.add_argument("--upstream", type=_hostport, required=True, help="HOST:PORT to connect to")
    p.add_argument("--delay-ms", type=float, default=30.0, help="one-way delay (default 30)")
    p.add_argument("--rate-mbit", type=float, default=1000.0,
                   help="cap per direction, all connections together; 0 = none (default 1000)")
    p.add_argument("--window-bytes", type=int, default=4 * MIB,
                   help="per-connection window; 0 = none (default 4 MiB)")
    p.add_argument("--chunk-bytes", type=int, default=256 * KIB, help="largest read (256 KiB)")
    p.add_argument("--queue-ms", type=float, default=5.0,
                   help="link queue: ms of serialisation it may hold beyond one chunk per busy "
                        "connection (default 5)")
    p.add_argument("--no-handshake", action="store_true", help="no RTT for connection setup")
    p.add_argument("--status-file", type=Path, help="JSON counters, rewritten every --status-ms")
    p.add_argument("--status-ms", type=float, default=200.0,
                   help="how often the status file is rewritten (default 200)")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> LinkConfig:
    return LinkConfig(
        delay_s=args.delay_ms / 1000.0,
        rate_bytes_per_s=args.rate_mbit * 1e6 / 8 if args.rate_mbit > 0 else None,
        window_bytes=args.window_bytes or None,
        chunk_bytes=args.chunk_bytes,
        queue_s=args.queue_ms / 1000.0,
        handshake=not args.no_handshake,
    )


def _write_status(path: Path, stats: LinkStats) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(stats)))
    tmp.replace(path)


async def _report_status(link: LongLink, path: Path, period_s: float) -> None:
    while True:
        await trio.to_thread.run_sync(_write_status, path, link.statistics())
        await trio.sleep(period_s)


async def _handle_signals(link: LongLink, cancel: Callable[[], None]) -> None:
    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    with trio.open_signal_receiver(*sigs) as received:
        async for signum in received:
            if signum == signal.SIGUSR1:
                link.set_blackhole(True)
            elif signum == signal.SIGUSR2:
                link.set_blackhole(False)
            else:
                cancel()
                return


async def _main(args: argparse.Namespace) -> LinkStats:
    cfg = config_from_args(args)
    link = LongLink(args.upstream, cfg, args.listen)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_handle_signals, link, nursery.cancel_scope.cancel)
        port = await nursery.start(link.run)
        rate = f"{args.rate_mbit:g} Mbit/s" if cfg.rate_bytes_per_s else "unlimited"
        print(
            f"longlink: listening on {args.listen[0]}:{port} -> "
            f"{args.upstream[0]}:{args.upstream[1]} (delay {args.delay_ms:g} ms each way, "
            f"rate {rate}, window {cfg.window_bytes or 'unlimited'} B)",
            flush=True,
        )
        if args.status_file is not None:
            nursery.start_soon(_report_status, link, args.status_file, args.status_ms / 1000)
    return link.statistics()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    stats = trio.run(_main, args)
    if args.status_file is not None:
        _write_status(args.status_file, stats)
    print(f"longlink: stats {json.dumps(dataclasses.asdict(stats))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
