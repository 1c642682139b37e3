"""Mount lifecycle: check the mountpoint, replicate the namespace, wire the components, run
pyfuse3, and tear down in reverse order.

Order matters for "no stale mount": everything that can fail for a user-fixable reason (bad
mountpoint, unreachable hub, bad snapshot, no /dev/fuse) fails before ``pyfuse3.init``
mounts anything. A cache dir that holds a namespace is mounted without waiting for the hub
at all (``refresher`` catches up afterwards), so a remount is as fast with the hub down.
After the mount, SIGINT/SIGTERM end the loop and the filesystem is unmounted;
``fusermount3 -u`` (``spokefs umount``) ends the loop from outside.

Part of the FUSE layer (docs/contributing.md): only these modules import pyfuse3. The
refresher is handed the kernel's caches (``kernel.KernelCache``) once the mount is up.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import signal
import stat
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TypeVar

import lmdb
import pyfuse3
import trio
from prometheus_client import start_http_server

from spokefs import cachedir, protocol
from spokefs.cache.block_cache import BlockCache
from spokefs.config import SpokeConfig
from spokefs.errors import StoreFailed, UserError
from spokefs.fuse import session
from spokefs.fuse.control import Control
from spokefs.fuse.kernel import KernelCache
from spokefs.fuse.ops import SpokeOps
from spokefs.fuse.workers import Workers
from spokefs.hub.client import HubClient
from spokefs.hub.link_model import LinkReach
from spokefs.hub.origins import HubOrigins
from spokefs.jobs import trace_file
from spokefs.jobs.control import JobControl
from spokefs.jobs.orders import Orders
from spokefs.jobs.pins import Pins
from spokefs.jobs.replay import Replayer
from spokefs.jobs.trace_file import Entry
from spokefs.mounttab import find_mount
from spokefs.namespace.refresher import Refresher
from spokefs.namespace.replica import Namespace, NamespaceInfo
from spokefs.read.block_source import BlockSource
from spokefs.read.prefetcher import Prefetcher
from spokefs.read.reader import Reader
from spokefs.read.trace import TraceRecorder
from spokefs.supervise import supervised
from spokefs.types import FileVersion

log = logging.getLogger(__name__)

T = TypeVar("T")

_FLUSH_AT_EXIT_S = 10.0  # the writer stores at least ~100 MB/s: 256 MiB staged at most
# An order's horizon: twice the replays' in-flight bound (6 x the link's bandwidth-delay
# product) plus this, past the furthest file of it the job has read (``jobs.orders``).
_ORDER_HORIZON_EXTRA = 32 << 20


def check_mountpoint(cfg: SpokeConfig) -> None:
    """Raise UserError unless the mountpoint is an existing directory we can mount on."""
    mnt = cfg.mountpoint
    try:
        st = os.stat(mnt)
    except FileNotFoundError:
        raise UserError(f"mountpoint {mnt} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise UserError(
                f"mountpoint {mnt} holds a dead mount; run `spokefs umount {mnt}` first"
            ) from None
        raise UserError(f"mountpoint {mnt}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"mountpoint {mnt} is not a directory")
    if os.path.ismount(mnt):
        raise UserError(f"mountpoint {mnt} is busy: something is already mounted there")
    if not os.path.exists("/dev/fuse"):
        raise UserError("/dev/fuse is missing: load the fuse kernel module (modprobe fuse)")


class _DirLister:
    """What directory fills ask the namespace, in a worker thread (a directory may be large).

    Fills ask for the siblings of every directory a reader touches: ``find`` over a root of
    10,000 directories asks 10,000 times for the same 10,000 ids. The subdirectories of the
    last ``_PARENTS_KEPT`` parents are therefore kept per namespace generation, and
    ``siblings`` answers with the parent's whole list (``dir_id`` itself included: fills
    skip directories they track already) instead of a filtered copy.

    The packs of the last ``_PACKS_KEPT`` directories are kept the same way, with an index
    of their members: a reader's miss on a small file looks its pack up there.
    """

    _PARENTS_KEPT = 16
    _PACKS_KEPT = 1024

    def __init__(self, ns: Namespace) -> None:
        self._ns = ns
        self._ordered: Callable[[], bool] = lambda: False
        self._subdirs: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()
        self._packs: OrderedDict[int, tuple[int, list[protocol.PackPlan],
                                            dict[int, protocol.PackPlan]]] = OrderedDict()

    async def packs(self, dir_id: int) -> list[protocol.PackPlan]:
        return (await self._packs_of(dir_id))[0]

    def defer_to(self, ordered: Callable[[], bool]) -> None:
        """While ``ordered()`` holds (a job's announced order is being fetched), a reader's
        miss fetches its file alone, not its directory's pack: the order brings the rest
        in the order the job reads it."""
        self._ordered = ordered

    async def pack_of(self, dir_id: int, fv: FileVersion) -> protocol.PackPlan | None:
        if self._ordered():
            return None
        plan = (await self._packs_of(dir_id))[1].get(fv.file_id)
        if plan is None or (fv.file_id, fv.version, fv.size) not in plan.members:
            return None  # listed elsewhere, or the namespace moved on since the open
        return plan

    async def _packs_of(self, dir_id: int) -> tuple[list[protocol.PackPlan],
                                                    dict[int, protocol.PackPlan]]:
        generation = self._ns.info.generation if self._ns.info else 0
        kept = self._packs.get(dir_id)
        if kept is None or kept[0] != generation:
            rows = await trio.to_thread.run_sync(self._ns.dir_files_named, dir_id)
            plans = protocol.plan_packs(dir_id, rows)
            index = {m[0]: p for p in plans for m in p.members}
            kept = self._packs[dir_id] = (generation, plans, index)
            if len(self._packs) > self._PACKS_KEPT:
                self._packs.popitem(last=False)
        self._packs.move_to_end(dir_id)
        return kept[1], kept[2]

    async def next_file(self, dir_id: int, file_id: int,
                        min_size: int) -> tuple[int, int, int] | None:
        return await trio.to_thread.run_sync(self._ns.next_file, dir_id, file_id, min_size)

    async def siblings(self, dir_id: int) -> tuple[int, list[int]]:
        parent = self._ns.parent_of(dir_id)  # one small get: inline
        if not parent:
            return 0, []
        generation = self._ns.info.generation if self._ns.info else 0
        kept = self._subdirs.get(parent)
        if kept is None or kept[0] != generation:
            ids = await trio.to_thread.run_sync(self._ns.subdirs, parent)
            kept = self._subdirs[parent] = (generation, ids)
            if len(self._subdirs) > self._PARENTS_KEPT:
                self._subdirs.popitem(last=False)
        self._subdirs.move_to_end(parent)
        return parent, kept[1]


def _fuse_options(cfg: SpokeConfig) -> set[str]:
    options = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
    # The source in the mount table is the hub URL, as in an fstab line, so `mount -a`
    # sees the line is mounted already (a comma would split the option: then "spokefs").
    fsname = cfg.hub_source if "," not in cfg.hub_source else "spokefs"
    options |= {"ro", "allow_other", f"fsname={fsname}", "subtype=spokefs"}
    return options


async def run_mount(cfg: SpokeConfig, on_ready: Callable[[NamespaceInfo], None]) -> None:
    """Mount and serve until unmounted or signalled; ``on_ready`` runs once mounted."""
    check_mountpoint(cfg)
    _start_metrics(cfg)  # before the hub: a port in use fails the mount at once
    async with AsyncExitStack() as stack:
        origins = HubOrigins(cfg.hub_urls)
        hub = await stack.enter_async_context(
            HubClient(
                origins, token=cfg.token, max_connections=cfg.hub_max_connections,
                request_timeout_s=cfg.hub_request_timeout_s, deadline_s=cfg.hub_deadline_s,
                tls=cfg.tls, tier_url=cfg.tier_url, failover_after_s=cfg.hub_failover_after_s,
            )
        )
        ns = _opened(Namespace, cfg.cache_dir / "namespace")
        stack.callback(ns.close)
        refresher = Refresher(hub, ns, cfg.refresh_interval_s, cfg.mount_deadline_s)
        info, replay = await _namespace_and_trace(cfg, hub, refresher)
        cache = _opened(BlockCache, cfg.cache_dir / "blocks", cfg.cache_max_bytes)
        stack.callback(cache.close)
        cachedir.harden(cfg.cache_dir)  # LMDB made its files 0700 under umask 0077: 0600
        lister = _DirLister(ns)
        # --no-prefetch: a miss fetches the file alone, not its pack's other members
        source = BlockSource(cache, hub, small_file_bytes=cfg.prefetch.small_file_bytes,
                             packs=lister if cfg.prefetch.enabled else None)
        prefetcher = None
        if cfg.prefetch.enabled:
            prefetcher = Prefetcher(source, lister, cfg.prefetch, cfg.cache_max_bytes)
        trace = TraceRecorder(cfg.cache_dir / "trace") if cfg.trace else None
        reader = Reader(source, prefetcher, cfg.hub_deadline_s, trace=trace)
        replayer, orders, jobs = _job_control(cfg, ns, cache, source, reader, prefetcher,
                                              trace)
        if orders is not None and prefetcher is not None:  # the mount's guesses stand aside
            prefetcher.defer_to(orders)
            lister.defer_to(orders.running)
        ops = SpokeOps(ns, reader, Control(ns, reader, refresher, jobs), cfg)
        options = _fuse_options(cfg)
        try:
            pyfuse3.init(ops, str(cfg.mountpoint), options)
        except RuntimeError as exc:
            raise UserError(f"cannot mount on {cfg.mountpoint}: {exc}") from None
        log.info("mounted %s at %s (open mode %s, %s%s)", cfg.hub_source, cfg.mountpoint,
                 cfg.open_mode, f"{cfg.workers} serving threads" if cfg.workers else
                 "served by this process", f", data through the tier {cfg.tier_url}"
                 if cfg.tier_url else "")
        clean = False
        try:
            workers = None
            if cfg.workers:  # its threads read requests once INIT is answered (``session``)
                session.receive_init()
                workers = Workers(cfg, ops, reader, ns, source)
            on_ready(info)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_terminate_on_signal)
                nursery.start_soon(_readahead_once_initialised, ops.initialised, cfg)
                refresher.mounted(KernelCache())
                # each restarted if it fails (``supervise``): a bug there must not unmount
                await nursery.start(supervised, "writer", cache.run)
                await nursery.start(supervised, "source", source.run)
                await nursery.start(supervised, "refresher", refresher.run)
                if trace is not None:
                    await nursery.start(supervised, "trace", trace.run)
                await nursery.start(supervised, "replayer", replayer.run)
                if orders is not None:
                    await nursery.start(supervised, "orders", orders.run)
                if replay is not None:  # epoch 1 of the next run reads warm data
                    replayer.start(replay, cfg.replay_path.name if cfg.replay_path else "")
                if origins.several:
                    await nursery.start(supervised, "origins", origins.watch_preferred,
                                        hub.probe)
                if prefetcher is not None:
                    await nursery.start(supervised, "prefetcher", prefetcher.run)
                    await nursery.start(supervised, "keep-warm", hub.keep_warm,
                                        prefetcher.warm_connections,
                                        cfg.prefetch.warm_interval_s)
                if workers is not None:
                    await nursery.start(workers.run)
                await pyfuse3.main(min_tasks=2, max_tasks=cfg.fuse_max_tasks)
                if workers is not None:
                    await workers.stop()  # before the unmount: they exit, not detach
                with trio.move_on_after(_FLUSH_AT_EXIT_S):
                    await cache.flush()  # keep what was fetched but not yet stored
                nursery.cancel_scope.cancel()
            clean = True
        finally:
            # unmount whether the loop ended cleanly or not: never leave a dead mount
            pyfuse3.close(unmount=True)
            log.info("unmounted %s (%s)", cfg.mountpoint, "clean" if clean else "after an error")


def _opened(store: Callable[..., T], path: Path, *args: object) -> T:
    """``store(path, *args)``: a namespace or a block cache opened, or one line that says
    why not (no room on the disk for its files, or a disk that fails).

    Raises:
        UserError: it cannot be opened.
    """
    try:
        return store(path, *args)
    except StoreFailed as exc:
        raise UserError(str(exc)) from None
    except lmdb.Error as exc:
        raise UserError(f"cannot open {path}: {exc}") from None


def _job_control(
    cfg: SpokeConfig, ns: Namespace, cache: BlockCache, source: BlockSource,
    reader: Reader, prefetcher: Prefetcher | None, trace: TraceRecorder | None,
) -> tuple[Replayer, Orders | None, JobControl]:
    """The replayer, the jobs' orders (with prefetch on), pins and their control
    attributes."""
    reach = prefetcher.reach if prefetcher is not None else LinkReach(
        source.received_bytes, source.rtt_s, cfg.prefetch.assumed_link_bytes_per_s)

    def budget() -> int:  # the cache less its fill window and the pins
        return max(0, cache.max_bytes - cache.window_bytes - cache.statistics().pinned_bytes)

    make = functools.partial(
        Replayer, source, reach, functools.partial(trace_file.resolve, ns),
        small_file_bytes=cfg.prefetch.small_file_bytes,
        request_bytes=cfg.prefetch.request_bytes,
        max_inflight_bytes=cfg.prefetch.max_inflight_bytes, budget_bytes=budget,
    )
    replayer = make()
    flight = replayer.flight
    orders = Orders(functools.partial(make, flight=flight, horizon_bytes=lambda: (
        2 * flight.target() + _ORDER_HORIZON_EXTRA)), replayer) if cfg.prefetch.enabled \
        else None
    if orders is not None:
        cache.order_passed = orders.passed
    pins = Pins(cache, reader, int(cfg.cache_max_bytes * cfg.max_pinned_share))
    jobs = JobControl(ns, trace, replayer, pins, cfg.cache_dir / "trace" / "saved.trace",
                      cfg.hub_url, orders)
    return replayer, orders, jobs


async def _namespace_and_trace(
    cfg: SpokeConfig, hub: HubClient, refresher: Refresher
) -> tuple[NamespaceInfo, list[Entry] | None]:
    """The namespace replicated, and the trace of ``--replay`` read beside it: parsing one
    costs ~17 ms per 6,000 entries on this machine, time the download's round trips leave
    idle. A bad trace fails the mount at once (the download cancelled), before anything is
    mounted."""
    trace: list[list[Entry]] = []

    async def read_trace(path: Path) -> None:
        trace.append((await trio.to_thread.run_sync(trace_file.read, path))[1])

    async def replicate() -> NamespaceInfo:
        if refresher.has_namespace:  # mount it now: the refresher catches up afterwards
            return await refresher.replicate()
        warm = cfg.prefetch.warm_connections if cfg.prefetch.enabled else 0
        return await _while_warming(hub, warm, cfg.mount_deadline_s, refresher.replicate)

    if cfg.replay_path is None:
        return await replicate(), None
    info = await _beside(replicate, read_trace, cfg.replay_path)
    return info, trace[0]


async def _while_warming(
    hub: HubClient, connections: int, deadline_s: float, fn: Callable[[], Awaitable[T]]
) -> T:
    """``fn()`` while ``connections`` connections to the hub open beside it: on a long link
    each costs 1.5 round trips before it carries a request, so they are set up while the
    namespace downloads, not when the first reads need them."""
    return await _beside(fn, hub.warm_up, connections, deadline_s)


async def _beside(fn: Callable[[], Awaitable[T]], other: Callable[..., Awaitable[None]],
                  *args: object) -> T:
    """``fn()`` with ``other(*args)`` run beside it; done when both are. Either's error
    cancels the other and is raised as it was (alone, not in a group)."""
    result: list[T] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other, *args)
            result.append(await fn())
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1 and isinstance(group.exceptions[0], Exception):
            raise group.exceptions[0] from None
        raise
    return result[0]


async def _readahead_once_initialised(initialised: trio.Event, cfg: SpokeConfig) -> None:
    await initialised.wait()
    set_kernel_readahead(cfg.mountpoint, cfg.kernel_readahead_kib)


def set_kernel_readahead(mountpoint: Path, kib: int) -> None:
    """Raise the kernel's read-ahead for this mount (its default is 128 KiB).

    With 128 KiB the kernel sends sequential readers' data in 128 KiB FUSE reads; with
    1 MiB it sends 1 MiB reads (FUSE's max_pages is 256), which halves the per-byte cost of
    the read path (measured: warm sequential 410 -> 710 MB/s). Larger values only add
    read-around waste for mmap readers. Needs root; without it the default stays.

    Call it only once the kernel's INIT has been answered (``SpokeOps.initialised``): the
    kernel applies the INIT reply's ``max_readahead`` as a cap on this very setting, and
    libfuse answers with what the kernel offered at mount time, the default 128 KiB. Written
    before that (as it was until issue 22), the value read back 128 once the mount served.
    Files opened before the write keep the read-ahead of their open.
    """
    entry = find_mount(mountpoint)
    if entry is None:
        return
    bdi = Path("/sys/class/bdi") / entry.device / "read_ahead_kb"
    try:
        bdi.write_text(f"{kib}\n")
    except OSError as exc:
        log.info("kernel read-ahead left at its default: %s: %s", bdi, exc.strerror)


async def _terminate_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


def _start_metrics(cfg: SpokeConfig) -> None:
    """Serve /metrics (prometheus_client's thread only reads metric values).

    Raises:
        UserError: the port is taken (a second mount on the node with the default port
            would otherwise run without metrics, unnoticed) or the address is unusable.
    """
    if not cfg.metrics_port:
        return
    where = f"{cfg.metrics_addr}:{cfg.metrics_port}"
    try:
        start_http_server(cfg.metrics_port, addr=cfg.metrics_addr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"--metrics-port {cfg.metrics_port} is in use on "
                            f"{cfg.metrics_addr} (another spokefs mount?): give this mount "
                            "its own --metrics-port, or 0 to turn metrics off") from None
        raise UserError(f"cannot serve metrics on {where}: "
                        f"{exc.strerror or exc}") from None
    log.info("metrics at http://%s/metrics", where)
