"""The serving worker of a mount: ``python -m spokefs.fuse.worker CHANNEL_FD DEVICE_FD``,
started by the mount's coordinator (``workers``), never by hand.

It serves the mount's FUSE requests on a clone of the mount's ``/dev/fuse`` descriptor that
the coordinator made for it (``device``) with the native read loop (``read_loop``, C):
several threads answer lookups, attributes, listings and reads of cached bytes from the
namespace and block cache, opened read-only beside the coordinator that writes them, without
entering Python. What the loop hands over, this
module carries to the coordinator over the worker's channel (``worker_channel``):

- a read the cache cannot answer (a miss, a block that failed its checksum, bytes only staged
  in the coordinator's memory): ``READ``, and the coordinator replies to the kernel itself,
  errors included, on its copy of the clone;
- a control attribute (``user.spokefs.*``): ``XATTR``, and the coordinator's answer goes back
  over the channel as the request's reply, errors included;
- the reads it served (``HIT``, in batches: up to 64 or 4 MiB, 5 ms late, or up to 50 ms
  while fewer than 8) and directories listed (``LISTED``), so the coordinator's prefetcher,
  trace, eviction and metrics see every read of the mount.

It tells the coordinator ``SERVING`` once its threads read requests: the coordinator stops
reading its own descriptor then (every request goes to the threads, which the kernel wakes
one at a time), and reads again when this process is gone.

It ends (exit 0) when its session ends (the mount went away), when the coordinator says
``BYE`` (the mount is ending), or when its channel closes (the coordinator died: it detaches
the mount first, so no dead mount is left, and the requests it holds then fail). SIGINT and
SIGTERM are the coordinator's to act on: a worker ignores them, so a Ctrl-C or a service stop
that signals the whole group unmounts once, through the coordinator.

Part of the FUSE layer (docs/contributing.md). It does not import pyfuse3: the kernel's side
of the session (INIT) is the coordinator's, and the loop speaks the FUSE protocol itself.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys

import trio

from spokefs.cache.layout import bound_bytes
from spokefs.fuse.io_size import whole_read_max
from spokefs.fuse.read_loop import (  # C, built with the package
    HIT_BATCH,
    HIT_BYTES,
    HIT_ENOUGH,
    ReadLoop,
)
from spokefs.fuse.worker_channel import (
    BYE,
    HIT,
    LISTED,
    READ,
    REPLY,
    SERVING,
    SYNC,
    SYNCED,
    XATTR,
    CallFailed,
    Calls,
    Channel,
    ChannelBroken,
    ChannelClosed,
    WorkerSetup,
    receive_hello,
)

log = logging.getLogger("spokefs.fuse.worker")  # not "__main__": it runs with -m

# What a hit waits for others to go with it (``worker_channel``): HIT_DELAY_S, and then, while
# fewer than HIT_ENOUGH are gathered, up to HIT_MAX_DELAY_S; HIT_BATCH hits or HIT_BYTES of
# them go at once. Each message costs the worker's Python thread and the coordinator a
# wake-up and a trip through their event loops, paid per hit where hits come slowly: a reader
# pacing 300 files/s (a job that decodes) cost the spoke 0.63-0.75 ms of CPU per file with
# 5 ms alone (one or two hits a message), against 0.33-0.38 with 50 ms alone (~15)
# (bench_workers.py's paced workload). But 50 ms alone left the coordinator up to 4 MiB
# behind a reader taking files at the link's rate, and a job's told order fetched 3-5 % less
# (train.py, spoke-order, 60 ms): at 8 hits it hears of such a reader as soon as before.
# The paced reader costs 0.39-0.53 ms a file with this rule.
HIT_DELAY_S = 0.005
HIT_MAX_DELAY_S = 0.050


def open_loop(setup: WorkerSetup, fd: int) -> ReadLoop:
    """The native read loop on ``fd`` over the mount's cache dir (not started).

    Raises:
        OSError: an LMDB environment cannot be opened.
    """
    cfg = setup.cfg
    return ReadLoop(
        fd, str(cfg.cache_dir / "namespace"), str(cfg.cache_dir / "blocks"),
        bound_bytes(cfg.cache_max_bytes), cfg.uid, cfg.gid, cfg.attr_timeout_s,
        whole_read_max(cfg), setup.threads)


async def serve(setup: WorkerSetup, sock: socket.socket, fd: int) -> None:
    """Serve the mount on ``fd`` until its session ends, the coordinator says bye or goes
    away."""
    loop = open_loop(setup, fd)
    channel = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(sock)),
                      collect_delay_s=HIT_DELAY_S, collect_max_delay_s=HIT_MAX_DELAY_S)
    calls = Calls(channel)
    try:
        loop.start()
        log.info("worker %d serving %s with %d threads", setup.index, setup.cfg.mountpoint,
                 setup.threads)
        await channel.send(SERVING, setup.threads)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_listen, loop, channel, calls, setup.cfg.mountpoint,
                               nursery.cancel_scope)
            nursery.start_soon(_send_events, channel)
            await _pump(loop, channel, calls, nursery)
            nursery.cancel_scope.cancel()
    finally:
        stats = loop.statistics()
        loop.stop()
        os.close(fd)
        log.info("worker %d stopped: %s", setup.index, stats)


async def _pump(loop: ReadLoop, channel: Channel, calls: Calls, nursery: trio.Nursery) -> None:
    """Carry what the loop hands over to the coordinator, until the session ends."""
    while True:
        await trio.lowlevel.wait_readable(loop.event_fd)
        for event in loop.take_events():
            kind = event[0]
            if kind == "read":
                nursery.start_soon(_hand_over, loop, channel, event[1:])
            elif kind == "xattr":
                nursery.start_soon(_forward_xattr, loop, calls, *event[1:])
            elif kind == "listed":
                channel.queue(LISTED, event[1])
            else:  # "end": the session is over (unmounted)
                return
        _queue_hits(loop, channel)


def _queue_hits(loop: ReadLoop, channel: Channel) -> None:
    """Have the channel's next batch carry the hits the loop has gathered, if any."""
    pending, nbytes = loop.pending_hits()
    if pending:
        channel.queue_collected(HIT, loop.take_hits,
                                now=pending >= HIT_BATCH or nbytes >= HIT_BYTES,
                                enough=pending >= HIT_ENOUGH)


async def _hand_over(loop: ReadLoop, channel: Channel, read: tuple[int, int, int, int]) -> None:
    """Have the coordinator serve a read, ``(unique, file_id, offset, size)``: it replies to
    the kernel itself (EIO here if it is gone)."""
    try:
        await channel.send(READ, read)
    except ChannelClosed:
        loop.reply_error(read[0], errno.EIO)


async def _forward_xattr(loop: ReadLoop, calls: Calls, unique: int, ino: int, name: bytes,
                         uid: int, size: int) -> None:
    """Have the coordinator answer a control attribute's request ``unique``: its value goes
    to the kernel, its errno (EIO if it is gone) likewise."""
    try:
        value = await calls.call(XATTR, (ino, name, uid))
    except CallFailed as exc:
        loop.reply_error(unique, exc.errno)
    else:
        loop.reply_xattr(unique, size, value)


async def _listen(loop: ReadLoop, channel: Channel, calls: Calls,
                  mountpoint: os.PathLike[str], serving: trio.CancelScope) -> None:
    """Replies to the worker's requests and ``SYNC``; ``BYE`` ends the worker, and the
    coordinator's death the mount too."""
    try:
        while True:
            kind, body = await channel.receive()
            if kind == REPLY:
                calls.replied(*body)
            elif kind == SYNC:
                # every hit gathered until now goes ahead of the answer (``Channel.send``),
                # those the pump has not seen yet too
                _queue_hits(loop, channel)
                await channel.send(SYNCED, body)
            elif kind == BYE:
                log.debug("the coordinator said bye")
                serving.cancel()
                return
    except (ChannelClosed, ChannelBroken) as exc:
        calls.close()
        log.error("the mount's coordinator is gone (%s): detaching %s", exc, mountpoint)
        # the kernel's connection ends with the last descriptor; the mount entry would stay.
        # The loop's threads then read ENODEV, and the worker ends with the session.
        await trio.run_process(["fusermount3", "-u", "-z", str(mountpoint)], check=False,
                               capture_stdout=True, capture_stderr=True)
        serving.cancel()  # what it holds now fails when its descriptor closes


async def _send_events(channel: Channel) -> None:
    try:
        await channel.send_queued()
    except ChannelClosed:
        return  # _listen sees it too, and acts


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if len(argv) != 3:
        print("usage: python -m spokefs.fuse.worker CHANNEL_FD DEVICE_FD "
              "(started by `spokefs mount --workers N`)", file=sys.stderr)
        return 2
    channel_fd, device_fd = (int(a) for a in argv[1:])
    sock = socket.socket(fileno=channel_fd)
    setup = receive_hello(sock)
    logging.basicConfig(level=setup.cfg.log_level, filename=setup.log_file,
                        format=f"%(asctime)s %(levelname)s worker{setup.index} %(name)s: "
                               "%(message)s")
    trio.run(serve, setup, sock, device_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
