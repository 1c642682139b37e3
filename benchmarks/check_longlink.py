#!/usr/bin/env python3
"""Validate the long-link emulator (benchmarks/longlink.py) against what a real link would do.

Each check starts the proxy as a subprocess (as the benchmarks use it) in front of a small
threaded TCP server (its own subprocess), then measures through it from this process:

- ping-pong latency of 1-byte messages on an open connection (expect RTT = 2 x delay), and the
  time from ``connect()`` to the first echo (expect 2 RTT: handshake + one round trip);
- one connection downloading N bytes (expect min(cap, window / RTT));
- several connections at once (expect the shared cap), and ping-pong while they run;
- a long RTT (900 ms) single connection (expect window / 900 ms);
- the proxy with no delay, cap or window: what Python can carry on this machine.

Throughput is bytes / (last byte - first byte) at the receiver: here the receiver is a raw
socket with no read-ahead, and the check is of the emulator itself, end to end (the link
bytes the emulator counted are in the "link MiB" column). "proxy CPU" is the proxy
process's user+system CPU time over the check's wall time (100% = one core). The issue
("Prefetch and the long link", item 1) sets no number for the emulator: each row's
"expected" is what a real link with those settings would do.
Prints a table and appends a JSON line (``"script": "check_longlink.py"``, with the commit and
whether the tree was dirty) to benchmarks/results/longlink.jsonl.

    python3 benchmarks/check_longlink.py [--quick | --smoke] [--results FILE]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl
from longlink import MIB

RESULTS = Path(__file__).resolve().parent / "results" / "longlink.jsonl"
_REQUEST = struct.Struct("<cQ")  # mode (b"S" send N bytes, b"E" echo), N
_PAYLOAD = memoryview(os.urandom(MIB))


# -- the far end: a tiny threaded server ---------------------------------------------------


class FarEnd:
    """A threaded TCP server: on b"S" it sends N bytes then closes; on b"E" it echoes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.sock.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                mode, n = _REQUEST.unpack(_recv_exactly(conn, _REQUEST.size))
                if mode == b"S":
                    _send_n(conn, n)
                else:
                    while data := conn.recv(65536):
                        conn.sendall(data)
            except OSError:
                pass


class FarEndProcess:
    """FarEnd in its own process (``--far-end`` mode), so its threads never share our GIL."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--far-end"],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"far end did not start: {line!r}")
        self.port = int(line)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def serve_far_end() -> None:
    """The ``--far-end`` mode: print the port, serve until killed."""
    far = FarEnd()
    print(far.port, flush=True)
    threading.Event().wait()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed early")
        buf += chunk
    return bytes(buf)


def _send_n(sock: socket.socket, n: int) -> None:
    while n > 0:
        piece = _PAYLOAD[: min(n, len(_PAYLOAD))]
        sock.sendall(piece)
        n -= len(piece)


# -- clients ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Download:
    nbytes: int
    first_byte_s: float  # perf_counter of the first byte
    last_byte_s: float


def download(port: int, nbytes: int) -> Download:
    """Ask the far end for nbytes through the proxy and read them with 1 MiB recv_into."""
    buf = bytearray(MIB)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_REQUEST.pack(b"S", nbytes))
        got, first = 0, 0.0
        while got < nbytes:
            n = sock.recv_into(buf)
            if not n:
                raise ConnectionError(f"short download: {got} of {nbytes}")
            if got == 0:
                first = time.perf_counter()
            got += n
        return Download(got, first, time.perf_counter())


def ping_pong(port: int, rounds: int) -> tuple[float, list[float]]:
    """Seconds from connect() to the first echo, and the RTT of each later 1-byte round trip."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_REQUEST.pack(b"E", 0) + b"x")
        _recv_exactly(sock, 1)
        setup = time.perf_counter() - t0
        rtts = []
        for _ in range(rounds):
            t = time.perf_counter()
            sock.sendall(b"x")
            _recv_exactly(sock, 1)
            rtts.append(time.perf_counter() - t)
    return setup, rtts


def parallel_downloads(port: int, conns: int, nbytes: int) -> list[Download]:
    results: list[Download] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            results.append(download(port, nbytes))
        except BaseException as exc:  # reported below, after join
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# -- checks ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    check: str
    delay_ms: float
    rate_mbit: float
    window_mib: float
    conns: int
    mib_each: float
    expected: str
    measured: str
    link_mib_down: float
    proxy_cpu_pct: float


def _run_with_proxy(
    far: FarEndProcess, delay_ms: float, rate_mbit: float, window: int,
    body: Callable[[int], str],
) -> tuple[str, float, float]:
    """Run body(port) through a fresh proxy; return its text, link MiB down, proxy CPU %."""
    with bl.open_link(far.port, bl.LinkSpec(2 * delay_ms, rate_mbit, window)) as link:
        assert link.proc is not None
        meter = bl.CpuMeter({"proxy": link.proc.pid})
        text = body(link.port)
        cpu = meter.stop()
        stats = link.close()  # its last counters
    return text, stats.get("bytes_down", 0) / MIB, cpu["cpu_s"]["proxy"] / cpu["wall_s"] * 100


def _expected_rate(delay_ms: float, rate_mbit: float, window: int, conns: int) -> float:
    """MB/s a real link would give: min(cap, conns x window / RTT)."""
    per_conn = window / (2 * delay_ms / 1000) if window and delay_ms else float("inf")
    cap = rate_mbit * 1e6 / 8 if rate_mbit else float("inf")
    return min(cap, conns * per_conn) / 1e6


def check_latency(far: FarEndProcess, delay_ms: float) -> Row:
    def body(port: int) -> str:
        setup, rtts = ping_pong(port, 20)
        return (f"RTT p50 {statistics.median(rtts) * 1e3:.1f} ms, max {max(rtts) * 1e3:.1f}; "
                f"connect->1st echo {setup * 1e3:.0f} ms")

    text, mib, cpu = _run_with_proxy(far, delay_ms, 1000, 4 * MIB, body)
    expected = f"RTT {2 * delay_ms:g} ms; 1st echo {4 * delay_ms:g} ms"
    return Row("ping-pong", delay_ms, 1000, 4, 1, 0, expected, text, mib, cpu)


def check_latency_under_load(far: FarEndProcess, delay_ms: float, conns: int, nbytes: int) -> Row:
    """Ping-pong while conns downloads fill the link: RTT plus the queue.

    The queue bound is longlink's: queue_ms (5) + conns x one 256 KiB chunk's serialisation.

    The downloads run in a subprocess (``--download``) so that they do not hold our GIL.
    """

    def body(port: int) -> str:
        argv = [sys.executable, __file__, "--download", str(port), str(conns), str(nbytes)]
        with subprocess.Popen(argv) as bulk:
            time.sleep(1.0)  # let the downloads fill the pipe
            _, rtts = ping_pong(port, 10)
            bulk.wait(timeout=120)
        return f"RTT p50 {statistics.median(rtts) * 1e3:.1f} ms, max {max(rtts) * 1e3:.1f}"

    text, mib, cpu = _run_with_proxy(far, delay_ms, 1000, 4 * MIB, body)
    chunk_ms = 256 * 1024 / (1000e6 / 8) * 1e3
    expected = f"<= {2 * delay_ms:g} + 5 + {conns} x {chunk_ms:.1f} = "
    expected += f"{2 * delay_ms + 5 + conns * chunk_ms:.0f} ms"
    return Row(f"ping under {conns}-conn load", delay_ms, 1000, 4, conns, nbytes / MIB,
               expected, text, mib, cpu)


def check_throughput(
    far: FarEndProcess, name: str, delay_ms: float, rate_mbit: float, window: int,
    conns: int, nbytes: int,
) -> Row:
    def body(port: int) -> str:
        t0 = time.perf_counter()
        runs = parallel_downloads(port, conns, nbytes)
        first = min(r.first_byte_s for r in runs)
        last = max(r.last_byte_s for r in runs)
        total = sum(r.nbytes for r in runs)
        rate = total / (last - first) / 1e6
        return f"{rate:.1f} MB/s ({total / (last - t0) / 1e6:.1f} incl. setup)"

    text, mib, cpu = _run_with_proxy(far, delay_ms, rate_mbit, window, body)
    exp = _expected_rate(delay_ms, rate_mbit, window, conns)
    expected = f"{exp:.1f} MB/s" if exp != float("inf") else "as fast as it can"
    return Row(name, delay_ms, rate_mbit, window / MIB, conns, nbytes / MIB,
               expected, text, mib, cpu)


def run_checks(size: int, long_size: int = 16 * MIB) -> list[Row]:
    """Every check, with ``size`` bytes per connection (``long_size`` at 900 ms)."""
    far = FarEndProcess()
    try:
        return [
            check_latency(far, 30),
            check_throughput(far, "1 conn, 60 ms RTT", 30, 1000, 4 * MIB, 1, size),
            check_throughput(far, "8 conns, 60 ms RTT", 30, 1000, 4 * MIB, 8, size),
            check_latency_under_load(far, 30, 8, size),
            check_throughput(far, "1 conn, 900 ms RTT", 450, 1000, 4 * MIB, 1, long_size),
            check_throughput(far, "4 conns, 60 ms, 100 Mbit", 30, 100, 4 * MIB, 4, size // 4),
            check_throughput(far, "raw: no delay/cap/window", 0, 0, 0, 8, size),
        ]
    finally:
        far.close()


def print_table(rows: list[Row]) -> None:
    head = ("check", "delay", "Mbit", "win MiB", "conns", "MiB each", "expected", "measured",
            "link MiB", "proxy CPU")
    lines = [head] + [
        (r.check, f"{r.delay_ms:g} ms", f"{r.rate_mbit:g}", f"{r.window_mib:g}", str(r.conns),
         f"{r.mib_each:g}", r.expected, r.measured, f"{r.link_mib_down:.1f}",
         f"{r.proxy_cpu_pct:.0f}%")
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for i, line in enumerate(lines):
        print(" | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="16 MiB transfers instead of 64 MiB")
    p.add_argument("--smoke", action="store_true", help="CI: 2 MiB transfers (~10 s)")
    p.add_argument("--results", type=Path, default=RESULTS, help="JSON lines appended here")
    p.add_argument("--far-end", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--download", nargs=3, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.far_end:
        serve_far_end()
        return 0
    if args.download:
        parallel_downloads(*args.download)
        return 0
    head = bl.run_info("check_longlink.py")
    if args.smoke:
        rows = run_checks(2 * MIB, 2 * MIB)
    else:
        rows = run_checks((16 if args.quick else 64) * MIB)
    print_table(rows)
    bl.save_record(args.results, head | {"rows": [asdict(r) for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
