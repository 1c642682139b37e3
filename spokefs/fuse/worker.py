"""A serving worker of a mount: ``python -m spokefs.fuse.worker CHANNEL_FD MOUNT_FD
GENERATION_FD``, started by the mount's coordinator (``workers``), never by hand.

It reads FUSE requests from its own clone of the mount's descriptor (``session.join``) and
answers lookups, attributes, listings and cached reads from the mount's namespace and block
cache, both opened read-only beside the coordinator that writes them; misses and control
attributes go to the coordinator (``worker_reader``). The namespace's generation is a shared
counter the coordinator moves before it has the kernel forget what changed, so a worker
never serves a version older than the kernel's view.

It ends when the coordinator says ``BYE`` (the mount is ending) or its channel closes (the
coordinator died: the worker then detaches the mount, so no dead mount is left, and exits).
SIGINT and SIGTERM are the coordinator's to act on: a worker ignores them, so a Ctrl-C or a
service stop that signals the whole group unmounts once, through the coordinator.

Part of the FUSE layer (docs/contributing.md): only these modules import pyfuse3.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from pathlib import Path

import pyfuse3
import trio

from spokefs.cache.block_cache import BlockCache
from spokefs.cache.chunk_reader import ChunkReader
from spokefs.fuse import session
from spokefs.fuse.ops import SpokeOps
from spokefs.fuse.worker_channel import (
    BYE,
    REPLY,
    Channel,
    ChannelBroken,
    ChannelClosed,
    WorkerSetup,
    receive_hello,
)
from spokefs.fuse.worker_reader import HIT_DELAY_S, Calls, ForwardedControl, WorkerReader
from spokefs.namespace.replica import Namespace, NamespaceInfo
from spokefs.shared_counter import SharedCounter

log = logging.getLogger("spokefs.fuse.worker")  # not "__main__": it runs with -m


class FollowingNamespace(Namespace):
    """The mount's namespace as a worker reads it: its info read again whenever the
    coordinator's generation counter has moved."""

    def __init__(self, path: Path, generation: SharedCounter) -> None:
        self._generation = generation
        self._seen = -1
        self._info_now: NamespaceInfo | None = None
        super().__init__(path, beside=True)

    @property
    def info(self) -> NamespaceInfo | None:
        generation = self._generation.value
        if generation != self._seen:
            self._seen = generation
            self._info_now = self._read_info()
        return self._info_now

    @info.setter
    def info(self, value: NamespaceInfo | None) -> None:
        self._info_now = value


async def serve(setup: WorkerSetup, sock: socket.socket, mount_fd: int,
                generation: SharedCounter) -> None:
    """Join the mount and serve until the coordinator says bye or goes away."""
    cfg = setup.cfg
    ns = FollowingNamespace(cfg.cache_dir / "namespace", generation)
    chunks = ChunkReader.open_readonly(cfg.cache_dir / "blocks",
                                       BlockCache.bound_bytes(cfg.cache_max_bytes))
    channel = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(sock)),
                      collect_delay_s=HIT_DELAY_S)
    calls = Calls(channel)
    ops = SpokeOps(ns, WorkerReader(chunks, channel, calls), ForwardedControl(calls), cfg)
    session.join(ops, setup.init, mount_fd, setup.options)
    log.info("worker %d serving %s", setup.index, cfg.mountpoint)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_listen, channel, calls, cfg.mountpoint)
            nursery.start_soon(_send_events, channel)
            await pyfuse3.main(min_tasks=2, max_tasks=cfg.fuse_max_tasks)
            nursery.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=False)
        chunks.close()
        ns.close(seal=False)


async def _listen(channel: Channel, calls: Calls, mountpoint: Path) -> None:
    """Replies to the worker's requests; ``BYE``, or the coordinator's death, ends it."""
    try:
        while True:
            kind, body = await channel.receive()
            if kind == REPLY:
                calls.replied(*body)
            elif kind == BYE:
                log.debug("the coordinator said bye")
                break
    except (ChannelClosed, ChannelBroken) as exc:
        calls.close()
        log.error("the mount's coordinator is gone (%s): detaching %s", exc, mountpoint)
        # the kernel's connection ends with the last descriptor; the mount entry would stay
        await trio.run_process(["fusermount3", "-u", "-z", str(mountpoint)], check=False,
                               capture_stdout=True, capture_stderr=True)
    pyfuse3.terminate()


async def _send_events(channel: Channel) -> None:
    try:
        await channel.send_queued()
    except ChannelClosed:
        return  # _listen sees it too, and acts


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if len(argv) != 4:
        print("usage: python -m spokefs.fuse.worker CHANNEL_FD MOUNT_FD GENERATION_FD "
              "(started by `spokefs mount --workers N`)", file=sys.stderr)
        return 2
    channel_fd, mount_fd, generation_fd = (int(a) for a in argv[1:])
    sock = socket.socket(fileno=channel_fd)
    setup = receive_hello(sock)
    logging.basicConfig(level=setup.cfg.log_level, filename=setup.log_file,
                        format=f"%(asctime)s %(levelname)s worker{setup.index} %(name)s: "
                               "%(message)s")
    trio.run(serve, setup, sock, mount_fd, SharedCounter(generation_fd))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
