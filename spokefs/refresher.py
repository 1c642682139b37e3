"""Keeps the replicated namespace in step with the hub.

At mount (``replicate``): a cache dir that already holds a namespace is brought up to date
with the changes since its generation (cheap), or with a full snapshot when the hub no longer
has them (410) or they do not apply; if the hub cannot be reached, the stored namespace is
mounted as it is (metadata and cached blocks work offline) and polling catches up later.
A cache dir without a namespace needs the hub.

While mounted (``run``): polls ``/v1/changes`` every ``refresh_interval_s`` and whenever
``trigger`` is called (``spokefs refresh``). After each applied batch the kernel is told to
forget the names and inodes that changed (``pyfuse3.invalidate_*``), so the long entry and
attribute timeouts never show stale metadata, and pages cached under ``keep_cache`` are
dropped for files whose bytes changed. Open handles keep reading the version they opened.
"""

from __future__ import annotations

import errno
import logging
import time

import pyfuse3
import trio

from hubd import wire
from spokefs import metrics
from spokefs.errors import GenerationGone, HubProtocolError, HubUnavailable, UserError
from spokefs.hub_client import HubClient
from spokefs.namespace import Applied, Namespace, NamespaceInfo

log = logging.getLogger(__name__)


class Refresher:
    """Replication of the hub's namespace into ``Namespace``, at mount and while mounted."""

    def __init__(self, hub: HubClient, ns: Namespace, interval_s: float, mount_deadline_s: float):
        self._hub = hub
        self._ns = ns
        self._interval_s = interval_s
        self._mount_deadline_s = mount_deadline_s
        self._wake = trio.Event()
        self._done = trio.Event()
        self._last_error: Exception | None = None
        self.mounted = False  # the kernel knows our inodes only once mounted

    # -- at mount ---------------------------------------------------------------------

    async def replicate(self) -> NamespaceInfo:
        """Bring the namespace up to date before mounting; raises UserError if impossible."""
        started = time.monotonic()
        try:
            if self._ns.info is not None:
                try:
                    await self._update(self._mount_deadline_s)
                except HubUnavailable as exc:
                    log.warning("hub unreachable (%s): mounting the stored namespace of "
                                "generation %d", exc.__cause__, self._ns.info.generation)
            else:
                await self._full(self._mount_deadline_s)
        except HubUnavailable as exc:
            raise UserError(
                f"cannot reach the hub at {self._hub.base_url}: {exc.__cause__}"
            ) from None
        except HubProtocolError as exc:
            raise UserError(
                f"the hub at {self._hub.base_url} refused the namespace: {exc}"
            ) from None
        except wire.WireError as exc:
            raise UserError(f"the hub at {self._hub.base_url} sent a bad snapshot: {exc}") from None
        info = self._ns.info
        assert info is not None
        log.info("namespace ready: entries=%d generation=%d seconds=%.2f",
                 info.entries, info.generation, time.monotonic() - started)
        return info

    # -- while mounted ----------------------------------------------------------------

    def trigger(self) -> None:
        """Poll now (``spokefs refresh``)."""
        self._wake.set()

    async def refresh_now(self) -> int:
        """Poll now and wait for it; returns the generation after the poll.

        Raises:
            HubUnavailable, HubProtocolError: the poll failed (the namespace is unchanged).
        """
        done = self._done
        self.trigger()
        await done.wait()
        if self._last_error is not None:
            raise HubUnavailable(f"refresh failed: {self._last_error}")
        return self._ns.info.generation if self._ns.info else 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            with trio.move_on_after(self._interval_s if self._interval_s > 0 else float("inf")):
                await self._wake.wait()
            self._wake = trio.Event()
            self._last_error = None
            try:
                await self._update(None)
            except (HubUnavailable, HubProtocolError, wire.WireError) as exc:
                self._last_error = exc
                metrics.REFRESH_ERRORS.inc()
                log.warning("namespace refresh failed: %s", exc)
            finally:
                done, self._done = self._done, trio.Event()
                done.set()

    # -- the work ---------------------------------------------------------------------

    async def _update(self, deadline_s: float | None) -> None:
        info = self._ns.info
        assert info is not None
        try:
            body = await self._hub.fetch_changes(info.generation, deadline_s=deadline_s)
            applied = await trio.to_thread.run_sync(self._ns.apply_changes, body)
        except GenerationGone:
            log.info("hub has no changes since generation %d: taking a full snapshot",
                     info.generation)
            await self._full(deadline_s)
            return
        except wire.WireError as exc:
            log.warning("changes since generation %d do not apply (%s): taking a full snapshot",
                        info.generation, exc)
            await self._full(deadline_s)
            return
        if applied.records:
            log.info("namespace changes applied: records=%d generation %d -> %d",
                     applied.records, info.generation, applied.info.generation)
        await self._forget(applied)

    async def _full(self, deadline_s: float | None) -> None:
        started = time.monotonic()
        body = await self._hub.fetch_snapshot(deadline_s=deadline_s)
        applied = await trio.to_thread.run_sync(self._ns.reload_snapshot, body)
        log.info("snapshot loaded: entries=%d generation=%d compressed=%d seconds=%.2f",
                 applied.info.entries, applied.info.generation, len(body),
                 time.monotonic() - started)
        await self._forget(applied)

    async def _forget(self, applied: Applied) -> None:
        metrics.NAMESPACE_ENTRIES.set(applied.info.entries)
        metrics.NAMESPACE_GENERATION.set(applied.info.generation)
        metrics.NAMESPACE_BYTES.set(applied.info.total_bytes)
        if not self.mounted:
            return
        for parent, name in applied.names:
            _quietly(pyfuse3.invalidate_entry_async, parent, name)
        if applied.inodes:
            # a synchronous write to /dev/fuse that may wait on the kernel's page locks
            # (held by a read we are serving): never on the trio thread
            await trio.to_thread.run_sync(_forget_inodes, applied.inodes)


def _forget_inodes(inodes: list[int]) -> None:
    for ino in inodes:
        _quietly(pyfuse3.invalidate_inode, ino)


def _quietly(fn: object, *args: object) -> None:
    """Kernel cache invalidation; ENOENT means the kernel had nothing cached: fine."""
    try:
        fn(*args)  # type: ignore[operator]
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            log.debug("invalidation %s%r failed: %s", getattr(fn, "__name__", fn), args, exc)
