"""Fast checks of the long-link emulator's semantics (benchmarks/longlink.py), in-process on trio.

Timing bounds here are loose on purpose (lower bounds that a correct emulator must respect,
generous upper bounds): these test the emulator's logic, not the machine's speed.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from longlink import KIB, LinkConfig, open_longlink

DELAY = 0.05  # one way: RTT 100 ms


async def _echo(stream: trio.SocketStream) -> None:
    try:
        async for data in stream:
            await stream.send_all(data)
    except trio.BrokenResourceError:  # the reset test resets the server side too
        pass


async def _sender(stream: trio.SocketStream) -> None:
    """Sends 256 KiB on connect, then closes."""
    await stream.send_all(b"\0" * (256 * KIB))
    await stream.send_eof()
    await trio.sleep(5)


async def _with_server(
    handler: Callable[[trio.SocketStream], Awaitable[None]], cfg: LinkConfig,
    body: Callable[[int, object], Awaitable[None]],
) -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        async with open_longlink(("127.0.0.1", port), cfg) as link:
            await body(link.port, link)
        nursery.cancel_scope.cancel()


async def _read_all(stream: trio.SocketStream) -> int:
    total = 0
    async for data in stream:
        total += len(data)
    return total


@pytest.mark.trio
async def test_round_trip_is_two_delays_and_setup_one_rtt() -> None:
    async def body(port: int, link: object) -> None:
        t0 = trio.current_time()
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"x")
        assert await stream.receive_some(1) == b"x"
        first = trio.current_time() - t0
        t1 = trio.current_time()
        await stream.send_all(b"y")
        assert await stream.receive_some(1) == b"y"
        rtt = trio.current_time() - t1
        await stream.aclose()
        assert 2 * DELAY <= rtt < 2 * DELAY + 0.05
        assert 4 * DELAY <= first < 4 * DELAY + 0.1  # handshake RTT + one round trip

    await _with_server(_echo, LinkConfig(delay_s=DELAY), body)


@pytest.mark.trio
async def test_window_bounds_one_connection_and_counters_count() -> None:
    # 64 KiB window, 100 ms RTT: 256 KiB needs >= 4 windows, so >= 3 RTTs after the first byte.
    cfg = LinkConfig(delay_s=DELAY, window_bytes=64 * KIB, chunk_bytes=16 * KIB)

    async def body(port: int, link: object) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        t0 = trio.current_time()
        assert await _read_all(stream) == 256 * KIB
        elapsed = trio.current_time() - t0
        assert 3 * 2 * DELAY <= elapsed < 3.0
        stats = link.statistics()  # type: ignore[attr-defined]
        assert stats.bytes_down == 256 * KIB
        assert stats.connections_accepted == 1

    await _with_server(_sender, cfg, body)


@pytest.mark.trio
async def test_rate_cap_is_shared() -> None:
    # 2 connections x 256 KiB at 2 MB/s total: >= 0.26 s however many connections.
    cfg = LinkConfig(delay_s=0.001, rate_bytes_per_s=2e6, window_bytes=None, queue_s=0.01)

    async def body(port: int, link: object) -> None:
        async def one() -> None:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            assert await _read_all(stream) == 256 * KIB

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)
        assert 2 * 256 * KIB / 2e6 <= trio.current_time() - t0 + 0.01 < 3.0

    await _with_server(_sender, cfg, body)


@pytest.mark.trio
async def test_blackhole_holds_traffic_until_cleared() -> None:
    async def body(port: int, link: object) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"a")
        assert await stream.receive_some(1) == b"a"
        link.set_blackhole(True)  # type: ignore[attr-defined]
        await stream.send_all(b"b")
        with trio.move_on_after(0.3) as scope:
            await stream.receive_some(1)
        assert scope.cancelled_caught
        link.set_blackhole(False)  # type: ignore[attr-defined]
        with trio.fail_after(2):
            assert await stream.receive_some(1) == b"b"
        await stream.aclose()

    await _with_server(_echo, LinkConfig(delay_s=0.01), body)


@pytest.mark.trio
async def test_reset_connections_aborts_open_streams() -> None:
    async def body(port: int, link: object) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"a")
        assert await stream.receive_some(1) == b"a"
        link.reset_connections()  # type: ignore[attr-defined]
        # An RST makes the read fail; a FIN would return b"" instead.
        with trio.fail_after(2), pytest.raises(trio.BrokenResourceError):
            await stream.receive_some(1)
        await stream.aclose()

    await _with_server(_echo, LinkConfig(delay_s=0.01), body)
