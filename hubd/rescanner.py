"""Rescans on a timer and on request (SIGHUP), one at a time, in a worker thread.

``Rescanner.run`` loops: wait until ``interval_s`` after the previous scan ended (forever if
0) or until ``request()`` is called, then run the export's ``rescan`` in a thread while the
current snapshot keeps serving. Requests made while a scan runs coalesce into one more
scan after it (it may miss changes made after the running scan passed them), so there are
never two scans at once. A failed scan is logged and retried at the next tick.

Cancelling ``run`` (shutdown) cancels the running scan through a ``threading.Event`` and
waits for its thread to return, so ROOT's fd is never closed under a scan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import TYPE_CHECKING

from hubd.export_root import ScanCancelled
from hubd.heap import release_free_memory
from hubd.metrics import HubMetrics
from hubd.s3.errors import S3Error

if TYPE_CHECKING:
    from hubd.source import Export

log = logging.getLogger(__name__)


class Rescanner:
    """Runs the rescans of one export (``source.Export``) and reports them to the metrics.

    Attributes:
        wake: set by ``request()`` (the SIGHUP handler) to rescan now.
    """

    def __init__(self, export: Export, metrics: HubMetrics, interval_s: float,
                 wake: asyncio.Event | None = None) -> None:
        self._export = export
        self._metrics = metrics
        self._interval_s = interval_s
        self.wake = wake if wake is not None else asyncio.Event()
        self._cancel = threading.Event()

    def request(self) -> None:
        """Rescan as soon as possible (coalesces with a pending request)."""
        self.wake.set()

    async def run(self) -> None:
        """Rescan until cancelled."""
        while True:
            await self._wait()
            self.wake.clear()
            await self._rescan_once()

    async def _wait(self) -> None:
        if self._interval_s <= 0:
            await self.wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._interval_s):
                await self.wake.wait()

    async def _rescan_once(self) -> None:
        loop = asyncio.get_running_loop()
        scan = loop.run_in_executor(None, self._export.rescan, self._cancel)
        try:
            snap = await asyncio.shield(scan)
        except asyncio.CancelledError:
            self._cancel.set()
            with contextlib.suppress(Exception):
                await scan  # the thread must be done before ROOT's fd is closed
            raise
        except ScanCancelled:
            return
        except OSError as exc:
            log.warning("rescan of %s failed: %s (the previous snapshot stays)",
                        self._export.root, exc.strerror)
            self._metrics.observe_rescan(None)
            return
        except S3Error as exc:  # a bucket's listing, after the client's own retries
            log.warning("listing of %s failed: %s (the previous snapshot stays)",
                        self._export.root, exc)
            self._metrics.observe_rescan(None)
            return
        except Exception:
            log.exception("rescan of %s failed (the previous snapshot stays)", self._export.root)
            self._metrics.observe_rescan(None)
            return
        self._metrics.observe_snapshot(snap)
        self._metrics.observe_rescan(self._export.last_rescan)
        del snap
        release_free_memory()
