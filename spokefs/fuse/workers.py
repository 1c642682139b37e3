"""The serving worker of a mount: the coordinator's side.

With ``--workers N`` a worker process (``worker``) serves the mount's FUSE requests on N
threads of the native read loop (``read_loop``), reading the namespace and the block cache
read-only beside the mount's own process (the coordinator), which keeps everything that writes
or fetches: the hub client, fills, the prefetcher, replays, the cache's writer and eviction,
pins, the trace, the refresher and ``/metrics``. While the worker serves, the coordinator reads
no FUSE request itself (``session.pause_reading``); over the worker's channel
(``worker_channel``) it

- serves the reads the worker could not (``READ``) through its own handlers and writes
  their replies, errors included, itself, on its copy of the worker's ``/dev/fuse`` clone
  (``device``: the bytes do not cross the channel); and answers the control attributes
  (``XATTR``) over the channel;
- takes the worker's cache hits (``HIT``) and listings (``LISTED``) as its own reads would
  count them: the prefetcher, the trace, eviction's visits and the metrics see every read of
  the mount, and ``/metrics`` has the totals.

The worker reads every request's namespace records in a transaction of its own, so it never
serves an older namespace than the one the refresher has committed (and the kernel forgets
what changed only after that commit).

A worker that dies (kill -9, a crash) is started again; meanwhile the coordinator reads the
requests again. The requests it held end with an error (the coordinator closes its copy of
the worker's clone as soon as the channel closes, and the clone's last descriptor is gone)
and the kernel retries a failed page read, so readers see at most an error, never a hang; the
reader slots it held in the LMDB environments are freed. If the coordinator dies, the worker
sees its channel close, detaches the mount and exits. When the mount ends, the coordinator
says ``BYE`` before it unmounts.

Part of the FUSE layer (docs/contributing.md): only these modules import pyfuse3.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pyfuse3
import trio

from spokefs import metrics
from spokefs.config import SpokeConfig
from spokefs.errors import SpokeError
from spokefs.fuse import session
from spokefs.fuse.device import WorkerDevice, clone_device
from spokefs.fuse.ops import SpokeOps
from spokefs.fuse.worker_channel import (
    BYE,
    HELLO,
    HIT,
    KINDS,
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
    encode,
)
from spokefs.namespace.replica import Namespace
from spokefs.read.block_source import BlockSource
from spokefs.read.reader import Reader
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

_QUICK_DEATH_S = 5.0  # a worker that dies sooner is started again after a pause, ...
_RESTART_PAUSE_S = (1.0, 30.0)  # ... doubling from the first to the last while it goes on
_EXIT_WAIT_S = 5.0  # after BYE, how long a worker gets before it is killed
_SYNC_WAIT_S = 2.0  # how long a control attribute waits for a worker's hits at most


class _Context:
    """The part of a request context the control attributes read."""

    def __init__(self, uid: int) -> None:
        self.uid = uid


class Workers:
    """The mount's serving worker (see the module docstring)."""

    def __init__(self, cfg: SpokeConfig, ops: SpokeOps, reader: Reader, ns: Namespace,
                 source: BlockSource) -> None:
        self._threads = cfg.workers
        self._ops = ops
        self._reader = reader
        self._ns = ns
        self._source = source
        # the worker needs neither the token nor TLS (and an SSLContext does not pickle)
        self._cfg = dataclasses.replace(cfg, token=None, tls=None)
        self._log_file = next((h.baseFilename for h in logging.getLogger().handlers
                               if isinstance(h, logging.FileHandler)), None)
        self._mount_fd = session.session_fd()
        self._channel: Channel | None = None  # the running worker's, while it runs
        self._calls: Calls | None = None  # its requests from us (``SYNC``), likewise
        self._process: trio.Process | None = None
        self._stopping = False
        self._batches = self._hit_reads = 0  # (logged at stop: how well hits are batched)
        metrics.WORKERS.set(0)
        ops.control_barrier = self.sync

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the worker, and start it again whenever it dies, until ``stop``."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep, 1)
            task_status.started()

    async def stop(self) -> None:
        """Say ``BYE`` to the worker and wait for it to exit (kill it if it does not)."""
        self._stopping = True
        log.info("took %d reads served by workers in %d HIT messages", self._hit_reads,
                 self._batches)
        channel, process = self._channel, self._process
        if channel is not None:
            with contextlib.suppress(ChannelClosed):  # gone already
                await channel.send(BYE, ())
        if process is None:
            return
        with trio.move_on_after(_EXIT_WAIT_S):
            await process.wait()
        if process.returncode is None:
            log.warning("worker pid %d did not exit after bye: killing it", process.pid)
            process.kill()

    async def sync(self) -> None:
        """Return once the serving worker's hits gathered until now are taken (``SYNC``):
        the mount's own process answers a request a worker might have taken, and
        ``/metrics`` read after the answer must count every read answered before it. At
        most ``_SYNC_WAIT_S``; at once when no worker serves."""
        calls = self._calls
        if calls is None:
            return
        try:
            with trio.move_on_after(_SYNC_WAIT_S) as waited:
                await calls.call(SYNC, ())
            if waited.cancelled_caught:
                log.warning("the worker did not answer a sync within %gs", _SYNC_WAIT_S)
        except CallFailed:
            pass  # it died: what it had gathered is lost with it

    async def _keep(self, index: int) -> None:
        pause = _RESTART_PAUSE_S[0]
        while not self._stopping:
            started = trio.current_time()
            code = await self._one(index)
            if self._stopping:
                return
            if code == 0:  # its session ended: the mount is going away (fusermount3 -u)
                log.info("worker %d ended with the mount", index)
                return
            metrics.WORKER_RESTARTS.inc()
            log.warning("worker %d ended (exit status %s): starting another", index, code)
            # a worker killed inside a read transaction leaves its reader slot behind
            self._source.check_readers()
            self._ns.check_readers()
            if trio.current_time() - started < _QUICK_DEATH_S:  # it cannot start: no spin
                await trio.sleep(pause)
                pause = min(pause * 2, _RESTART_PAUSE_S[1])
            else:
                pause = _RESTART_PAUSE_S[0]

    async def _one(self, index: int) -> int | None:
        """Run worker ``index`` until it exits; its exit status."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            device = WorkerDevice(clone_device(self._mount_fd))
        except BaseException:
            ours.close()
            theirs.close()
            raise
        try:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "spokefs.fuse.worker", str(theirs.fileno()),
                 str(device.fd)],
                pass_fds=(theirs.fileno(), device.fd))
        except BaseException:
            ours.close()
            device.close()
            raise
        finally:
            theirs.close()
        channel = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
        self._process, self._channel = process, channel
        self._calls = calls = Calls(channel)
        try:
            setup = WorkerSetup(self._cfg, index, self._threads, self._log_file)
            await channel.send_raw(encode(HELLO, setup.encode()))
            async with trio.open_nursery() as nursery:
                await self._serve(index, process, channel, calls, device, nursery)
                # the worker is gone (or being killed): the requests it held end now, and
                # the reads still being served for it (the nursery waits) reply to nothing
                device.close()
        except ChannelClosed:
            pass  # it died before HELLO
        finally:
            device.close()  # (at once: the requests it held end now)
            session.pause_reading(False)  # the coordinator serves until the next one does
            metrics.WORKERS.set(0)
            self._channel = self._calls = None
            calls.close()  # a sync waiting for it ends now
            with trio.CancelScope(shield=True):
                with trio.move_on_after(_EXIT_WAIT_S):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()
                self._process = None
                await channel.aclose()
        return process.returncode

    async def _serve(self, index: int, process: trio.Process, channel: Channel,
                     calls: Calls, device: WorkerDevice, nursery: trio.Nursery) -> None:
        """Answer one worker's requests and take its events until its channel closes."""
        while True:
            try:
                kind, body = await channel.receive()
            except ChannelClosed:
                return
            except ChannelBroken as exc:
                log.error("worker %d sent what is not a message (%s): stopping it", index, exc)
                process.kill()  # (closing the channel would tell it the coordinator is gone)
                return
            if kind == HIT:
                self._hits(*body)
            elif kind == SERVING:
                log.info("worker %d serves the mount on %d threads", index, body)
                session.pause_reading(True)
                metrics.WORKERS.set(body)
            elif kind == LISTED:
                self._reader.on_readdir(body)
            elif kind == SYNCED:
                calls.replied(body[0], 0, b"")
            elif kind == READ:
                nursery.start_soon(self._answer_read, device, *body)
            elif kind == XATTR:
                nursery.start_soon(self._answer_xattr, channel, *body)
            else:
                log.error("worker %d sent a %s: stopping it", index, KINDS[kind])
                process.kill()
                return

    def _hits(self, reads: list[tuple[int, int, int, int, int, int, list[Any]]],
              by_origin: list[int], nbytes: int, seconds: list[float],
              errors: list[tuple[str, int, int]]) -> None:
        self._batches += 1
        self._hit_reads += len(reads)
        stream_read, inode, served = self._ops.stream_read, self._ns.inode, self._reader.served
        for file_id, version, file_size, parent_id, offset, size, visits in reads:
            # the version the worker read, with its size and directory: no namespace look
            # per hit (it was a fifth of the coordinator's time per hit)
            stream = stream_read(inode(file_id), FileVersion(file_id, version, file_size),
                                 parent_id)
            served(stream, offset, size, visits)
        self._reader.account_served(by_origin, nbytes, seconds)
        for op, err, count in errors:
            metrics.FUSE_ERRORS.labels(op=op, errno=errno.errorcode.get(err, str(err))).inc(count)

    async def _answer_read(self, device: WorkerDevice, unique: int, file_id: int, offset: int,
                           size: int) -> None:
        """Serve the worker's request ``unique``, a read, and reply to the kernel."""
        err, data = await _outcome(self._read, file_id, offset, size)
        if err:
            device.reply_error(unique, err)
        else:
            device.reply(unique, data)

    async def _answer_xattr(self, channel: Channel, rid: int, ino: int, name: bytes,
                            uid: int) -> None:
        """Answer the worker's request ``rid``, a control attribute, over the channel."""
        err, value = await _outcome(self._xattr, ino, name, uid)
        with contextlib.suppress(ChannelClosed):  # the worker died: its request ended too
            await channel.send(REPLY, (rid, err, value))

    async def _read(self, file_id: int, offset: int, size: int) -> bytes | memoryview:
        fh = pyfuse3.FileHandleT(self._ns.inode(file_id))
        return await self._ops.read(fh, offset, size)

    async def _xattr(self, ino: int, name: bytes, uid: int) -> bytes:
        ctx: Any = _Context(uid)
        return await self._ops.getxattr(pyfuse3.InodeT(ino), pyfuse3.XAttrNameT(name), ctx,
                                        forwarded=True)


async def _outcome(handler: Callable[..., Awaitable[bytes | memoryview]],
                   *args: Any) -> tuple[int, bytes | memoryview]:
    """``(0, bytes)`` from one of the coordinator's handlers, or ``(errno, b"")`` of its
    error, as the kernel would be answered."""
    try:
        return 0, await handler(*args)
    except pyfuse3.FUSEError as exc:
        return exc.errno, b""
    except SpokeError as exc:
        return exc.code, b""
