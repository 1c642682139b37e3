"""Keeps the replicated namespace in step with the hub.

At mount (``replicate``): a cache dir that already holds a namespace is mounted as it is, at
once, without asking the hub anything: a remount browses as fast with the hub up, slow or
down. The first poll of ``run`` then *catches up* in the background with the changes since
the stored generation (a full snapshot when the hub no longer has them, 410, or they do not
apply); until it has, the mount serves the stored generation, and a catch-up that fails is
retried every ``CATCH_UP_RETRY_S`` (at most ``refresh_interval_s``) until one succeeds. A
cache dir without a namespace needs the hub: the snapshot is loaded before the mount.

While mounted (``run``): polls ``/v2/changes`` every ``refresh_interval_s`` and whenever
``trigger`` is called (``spokefs refresh``). After each applied batch, the catch-up
included, the kernel is told to forget the names and inodes that changed (through the
``KernelCache`` the mount gives it once mounted, ``kernel.KernelCache``; this module knows no
FUSE), so the long entry and attribute timeouts never show stale metadata, and pages cached
under ``keep_cache`` are dropped for files whose bytes changed.
Open handles keep reading the version they opened with ``--open-mode handle``; with ``kernel``
reads follow the namespace (``inode_streams``).

Log lines a remount leaves: ``mounting the stored namespace`` at once, then ``caught up
with the hub`` (or ``catch-up failed ... retrying``) once the hub answered.

Hub replicas (``hub.origins``): the polls go to whichever hub is in use, and continue from
our generation on a new one, since replicas number the same tree alike (docs/protocol.md,
"Replicas"). A hub that answers 400, our generation newer than its own (``HubBehind``: a
replica one rescan behind the one we got it from), is *not* followed back in time: we keep
our namespace, so no file goes back to an older version, and poll again as usual; reads
of files it does not list yet go to a replica that does (``hub.client``). Only if it stays
"behind" for ``behind_grace_s`` (it numbered a tree differently, which the protocol allows
after a change that did not move the newest mtime) do we take its snapshot.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import trio

from spokefs import metrics, protocol
from spokefs.errors import (
    GenerationGone,
    HubBehind,
    HubProtocolError,
    HubUnavailable,
    StoreFailed,
    UserError,
)
from spokefs.hub.client import HubClient
from spokefs.log_limit import LogLimiter
from spokefs.namespace.replica import Applied, Namespace, NamespaceInfo
from spokefs.namespace.snapshot_load import ChildLoad, LoadFailed, reload_snapshot_apart

log = logging.getLogger(__name__)

# Seconds between tries of a catch-up that failed (the hub was down at the remount): sooner
# than the default 60 s poll, so a mount made during an outage is current soon after it.
CATCH_UP_RETRY_S = 10.0
# How long a hub may stay behind our generation before we take its snapshot: five of
# hubd's default 60 s rescans, so a replica one rescan behind always catches up first.
BEHIND_GRACE_S = 300.0


class KernelCache(Protocol):
    """The kernel's caches of the mount, to invalidate (``kernel.KernelCache``)."""

    def forget_entry(self, parent: int, name: bytes) -> None:
        """Drop a cached name; never blocks (called on the trio thread)."""

    def forget_inodes(self, inodes: list[int]) -> None:
        """Drop cached attributes and pages; may block (called in a worker thread)."""


class Refresher:
    """Replication of the hub's namespace into ``Namespace``, at mount and while mounted."""

    def __init__(self, hub: HubClient, ns: Namespace, interval_s: float, mount_deadline_s: float,
                 behind_grace_s: float = BEHIND_GRACE_S):
        self._hub = hub
        self._behind_grace_s = behind_grace_s
        self._behind_since: float | None = None  # when a hub first said it is behind us
        self._ns = ns
        self._interval_s = interval_s
        self._mount_deadline_s = mount_deadline_s
        self._wake = trio.Event()
        self._done = trio.Event()
        self._last_error: Exception | None = None
        self._catching_up = False  # a stored namespace was mounted: poll at once
        self._log = LogLimiter(log)
        # the kernel knows our inodes only once mounted: until then nothing to invalidate
        self._kernel: KernelCache | None = None

    # -- at mount ---------------------------------------------------------------------

    @property
    def has_namespace(self) -> bool:
        """Whether a stored namespace can be mounted without the hub."""
        return self._ns.info is not None

    async def replicate(self) -> NamespaceInfo:
        """The namespace to mount: the stored one at once (``run`` catches up after the
        mount), or else a snapshot from the hub.

        Raises:
            UserError: no stored namespace, and the hub cannot be reached or sent a bad one.
        """
        stored = self._ns.info
        if stored is not None:
            log.info("mounting the stored namespace: entries=%d generation=%d; catching up "
                     "with the hub after the mount", stored.entries, stored.generation)
            self._catching_up = True
            _publish(stored)
            return stored
        started = time.monotonic()
        try:
            await self._full(self._mount_deadline_s)
        except HubUnavailable as exc:
            raise UserError(
                f"cannot reach the hub at {self._hubs()}: {exc.__cause__}"
            ) from None
        except HubProtocolError as exc:
            raise UserError(
                f"the hub at {self._hubs()} refused the namespace: {exc}"
            ) from None
        except protocol.WireError as exc:
            raise UserError(f"the hub at {self._hubs()} sent a bad snapshot: {exc}") from None
        except LoadFailed as exc:
            raise UserError(f"cannot store the namespace in {self._ns.path}: {exc}") from None
        info = self._ns.info
        assert info is not None
        log.info("namespace ready: entries=%d generation=%d seconds=%.2f",
                 info.entries, info.generation, time.monotonic() - started)
        return info

    def _hubs(self) -> str:
        return " or ".join(self._hub.origins.urls)

    # -- while mounted ----------------------------------------------------------------

    def mounted(self, kernel: KernelCache) -> None:
        """The mount is up: from now on tell ``kernel`` what changed."""
        self._kernel = kernel

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
        """Poll until cancelled: at once while catching up, then every interval."""
        task_status.started()
        while True:
            if not self._catching_up:
                with trio.move_on_after(self._wait_s()):
                    await self._wake.wait()
            self._wake = trio.Event()
            self._last_error = None
            try:
                await self._poll()
            except (HubUnavailable, HubProtocolError, protocol.WireError, LoadFailed,
                    StoreFailed) as exc:
                self._last_error = exc
                metrics.REFRESH_ERRORS.inc()
                if isinstance(exc, (StoreFailed, LoadFailed)):
                    metrics.STORE_ERRORS.labels(store="namespace").inc()
                self._log_failure(exc)
            finally:
                done, self._done = self._done, trio.Event()
                done.set()
            if self._catching_up:  # it failed: try again soon, or at once when triggered
                with trio.move_on_after(min(CATCH_UP_RETRY_S, self._wait_s())):
                    await self._wake.wait()

    def _wait_s(self) -> float:
        return self._interval_s if self._interval_s > 0 else float("inf")

    async def _poll(self) -> None:
        before = self._ns.info
        await self._update(None)
        if self._catching_up:
            self._catching_up = False
            after = self._ns.info
            assert before is not None and after is not None
            log.info("caught up with the hub: generation %d -> %d, entries=%d",
                     before.generation, after.generation, after.entries)

    def _log_failure(self, exc: Exception) -> None:
        """One line per failure, at a bounded rate (``spokefs refresh`` in a loop, or a
        short interval against a full disk, must not flood the log)."""
        info = self._ns.info
        generation = info.generation if info else 0
        if not self._catching_up:
            self._log.warning("refresh", "namespace refresh failed: %s; serving generation %d",
                              exc, generation)
            return
        self._log.warning("catch-up", "catch-up with the hub failed (%s): serving the stored "
                          "namespace of generation %d, retrying in %.0f s", exc, generation,
                          min(CATCH_UP_RETRY_S, self._wait_s()))

    # -- the work ---------------------------------------------------------------------

    async def _update(self, deadline_s: float | None) -> None:
        info = self._ns.info
        assert info is not None
        try:
            body = await self._hub.fetch_changes(info.generation, deadline_s=deadline_s)
            applied = await trio.to_thread.run_sync(self._ns.apply_changes, body)
        except HubBehind as exc:
            if self._keep_while_behind(info.generation, exc):
                return
            await self._full(deadline_s)
            return
        except GenerationGone:
            log.info("hub has no changes since generation %d: taking a full snapshot",
                     info.generation)
            await self._full(deadline_s)
            return
        except protocol.WireError as exc:
            log.warning("changes since generation %d do not apply (%s): taking a full snapshot",
                        info.generation, exc)
            await self._full(deadline_s)
            return
        self._behind_since = None
        if applied.records:
            log.info("namespace changes applied: records=%d generation %d -> %d",
                     applied.records, info.generation, applied.info.generation)
        await self._forget(applied)

    def _keep_while_behind(self, generation: int, exc: HubBehind) -> bool:
        """Whether to keep our namespace although the hub is behind it (see the module
        docstring); False once it has been behind for ``behind_grace_s``."""
        now = time.monotonic()
        if self._behind_since is None:
            self._behind_since = now
            log.info("%s: keeping generation %d until it catches up (a snapshot after "
                     "%.0f s)", exc, generation, self._behind_grace_s)
        if now - self._behind_since < self._behind_grace_s:
            return True
        log.warning("%s for %.0f s: taking its snapshot", exc, now - self._behind_since)
        return False

    async def _full(self, deadline_s: float | None) -> None:
        started = time.monotonic()
        received = 0

        async def fetch(sink: ChildLoad) -> None:
            nonlocal received
            received = await self._hub.stream_snapshot(sink, deadline_s=deadline_s)

        applied = await reload_snapshot_apart(self._ns, fetch)
        self._behind_since = None
        log.info("snapshot loaded: entries=%d generation=%d compressed=%d seconds=%.2f",
                 applied.info.entries, applied.info.generation, received,
                 time.monotonic() - started)
        await self._forget(applied)

    async def _forget(self, applied: Applied) -> None:
        _publish(applied.info)
        kernel = self._kernel
        if kernel is None:
            return
        for parent, name in applied.names:
            kernel.forget_entry(parent, name)
        if applied.inodes:
            # a synchronous write to /dev/fuse that may wait on the kernel's page locks
            # (held by a read we are serving): never on the trio thread
            await trio.to_thread.run_sync(kernel.forget_inodes, applied.inodes)


def _publish(info: NamespaceInfo) -> None:
    metrics.NAMESPACE_ENTRIES.set(info.entries)
    metrics.NAMESPACE_GENERATION.set(info.generation)
    metrics.NAMESPACE_BYTES.set(info.total_bytes)

