"""The control attributes of job-aware prefetch: traces, replays and pins (``control`` has
the rest and the protocol's rules; ``commands`` is the client side).

| attribute                          | on    | value (ASCII)                                  |
| ---------------------------------- | ----- | ---------------------------------------------- |
| ``user.spokefs.trace.save``        | any   | JSON: resolves the trace to paths and keeps the |
|                                    |       | portable file for paging; its size and counts   |
| ``user.spokefs.trace.page.N``      | any   | bytes ``[N * PAGE, (N + 1) * PAGE)`` of it      |
| ``user.spokefs.trace.clear``       | any   | starts a new trace; ``0``                       |
| ``user.spokefs.trace.check:PATH``  | any   | JSON: a trace file against the namespace and    |
|                                    |       | the cache (files, bytes, cached, changed, gone) |
| ``user.spokefs.replay:PATH``       | any   | starts replaying a trace file; the replay's id  |
| ``user.spokefs.replay``            | any   | JSON: the replay's progress (``replay``)        |
| ``user.spokefs.replay.stop``       | any   | stops it; ``0``                                 |
| ``user.spokefs.order:PATH``        | any   | fetches a job's announced order (a list file,   |
|                                    |       | ``orders``); the order's id                     |
| ``user.spokefs.order``             | any   | JSON: every job's order and its progress        |
| ``user.spokefs.pin``               | file  | pins it (fetching it first); bytes pinned       |
| ``user.spokefs.unpin``             | file  | unpins every version of it; bytes unpinned      |

``PATH`` is an absolute path on the node (an attribute name holds up to 255 bytes; the CLI
copies a trace with a longer path to a short temporary one). The daemon reads it as root,
so it checks that the caller may read it (owner, or readable by others, or the caller is
root), opens it without following it into a FIFO, and caps its size; it is only ever parsed
as a trace. Nothing is ever *written* where a caller says: a saved trace is paged out
through ``trace.page.N`` and written by the CLI with the caller's own rights.

An order's list names its job in its header (``"job"``; ``spokefs.torch`` writes its host
and process id): a job's new order replaces its last one, other jobs' orders go on.

Starting a replay or an order answers at once (a short value: ``getxattr`` asks once with a small
buffer, and again with a large one only when the value does not fit, so a long answer would
start it twice); the client polls ``replay`` for progress.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import trio

from spokefs import metrics
from spokefs.errors import BadRequest, NotPermitted, StoreFailed, UserError
from spokefs.jobs.orders import Orders
from spokefs.jobs.pins import Pins
from spokefs.jobs.replay import Replayer
from spokefs.jobs.trace_file import Entry, dumps, entries_of, read, resolve, summary
from spokefs.namespace.replica import Attr, Namespace
from spokefs.read.trace import EXTENT_BYTES, TraceRecorder
from spokefs.types import FileVersion

PREFIX = b"user.spokefs."
TRACE_SAVE = PREFIX + b"trace.save"
TRACE_PAGE = PREFIX + b"trace.page."
TRACE_CLEAR = PREFIX + b"trace.clear"
TRACE_CHECK = PREFIX + b"trace.check:"
REPLAY = PREFIX + b"replay"
REPLAY_START = PREFIX + b"replay:"
REPLAY_STOP = PREFIX + b"replay.stop"
ORDER = PREFIX + b"order"
ORDER_START = PREFIX + b"order:"
PIN = PREFIX + b"pin"
UNPIN = PREFIX + b"unpin"
PAGE = 60_000  # under XATTR_SIZE_MAX (64 KiB)


class JobControl:
    """Answers the attributes above."""

    def __init__(self, ns: Namespace, trace: TraceRecorder | None, replayer: Replayer,
                 pins: Pins, export_path: Path, hub_url: str,
                 orders: Orders | None = None) -> None:
        self._ns = ns
        self._trace = trace
        self._replayer = replayer
        self._orders = orders
        self._pins = pins
        self._export = export_path
        self._hub_url = hub_url

    async def getxattr(self, attr: Attr, name: bytes, uid: int) -> bytes | None:
        """The attribute's value; None if ``name`` is not one of these."""
        if name in (PIN, UNPIN):
            if not stat.S_ISREG(attr.mode):
                raise BadRequest("pins name regular files")
            if name == PIN:
                await self._pins.pin(FileVersion(attr.file_id, attr.version, attr.size))
                return str(attr.size).encode()
            return str(await self._pins.unpin(attr.file_id)).encode()
        if name == REPLAY:
            return json.dumps(self._replayer.progress().as_dict(), sort_keys=True).encode()
        if name == REPLAY_STOP:
            self._replayer.stop()
            return b"0"
        if name.startswith(REPLAY_START):
            path = _path(name[len(REPLAY_START):])
            _, entries = await self._load(path, uid)
            return str(self._replayer.start(entries, path.name)).encode()
        if name == ORDER or name.startswith(ORDER_START):
            return await self._order(name, uid)
        if name.startswith(TRACE_CHECK):
            return json.dumps(await self._check(_path(name[len(TRACE_CHECK):]), uid),
                              sort_keys=True).encode()
        if name.startswith(TRACE_PAGE):
            return await self._page(name[len(TRACE_PAGE):])
        if name == TRACE_SAVE:
            return json.dumps(await self._save(), sort_keys=True).encode()
        if name == TRACE_CLEAR:
            if self._trace is not None:
                self._trace.clear()
            return b"0"
        return None

    def status(self) -> dict[str, object]:
        p = self._replayer.progress()
        return {
            "pinned_limit_bytes": self._pins.limit_bytes,
            "trace_records": self._trace.records if self._trace is not None else None,
            "replay": {"state": p.state, "name": p.name, "total_bytes": p.total_bytes,
                       "done_bytes": p.done_bytes},
        }

    async def _order(self, name: bytes, uid: int) -> bytes:
        if self._orders is None:
            raise BadRequest("this mount takes no orders (prefetch is off)")
        if name == ORDER:
            return json.dumps(self._orders.progress(), sort_keys=True).encode()
        path = _path(name[len(ORDER_START):])
        head, entries = await self._load(path, uid)
        job = str(head.get("job") or path.name)[:200]
        return str(self._orders.start(job, entries, path.name,
                                      head=head.get("part") == "head")).encode()

    async def _load(self, path: Path, uid: int) -> tuple[dict[str, object], list[Entry]]:
        """A trace file the caller may read, parsed (in a worker thread)."""
        try:
            return await trio.to_thread.run_sync(read, path, uid)
        except PermissionError as exc:
            raise NotPermitted(str(exc)) from None
        except UserError as exc:
            raise BadRequest(str(exc)) from None

    async def _check(self, path: Path, uid: int) -> dict[str, object]:
        _, entries = await self._load(path, uid)
        resolved = await trio.to_thread.run_sync(resolve, self._ns, entries)
        replayer = self._replayer
        whole = [t.fv for t in resolved.targets if t.extents is None]
        cached = await replayer.cached_bytes(whole)  # one thread hop for all
        for t in resolved.targets:  # large files read in ranges: few
            if t.extents is not None:  # the file's cached bytes, at most its extents' bytes
                cached += min(await replayer.cached_bytes([t.fv]), t.nbytes(EXTENT_BYTES))
        return {**summary(entries), "cached_bytes": cached, "changed": resolved.changed,
                "missing": resolved.missing,
                "current_bytes": sum(t.nbytes(EXTENT_BYTES) for t in resolved.targets)}

    async def _save(self) -> dict[str, object]:
        if self._trace is None:
            raise BadRequest("this mount records no trace")
        records = await self._trace.saved_records()
        entries, gone = await trio.to_thread.run_sync(entries_of, self._ns, records)
        info = self._ns.info
        raw = dumps(entries, hub=self._hub_url,
                    generation=info.generation if info is not None else 0)
        try:
            await trio.to_thread.run_sync(self._export.write_bytes, raw)
        except OSError as exc:
            metrics.STORE_ERRORS.labels(store="trace").inc()
            raise StoreFailed(f"cannot save the trace to {self._export}: "
                              f"{exc.strerror}") from None
        return {"size": len(raw), "page": PAGE, "gone": gone, **summary(entries)}

    async def _page(self, number: bytes) -> bytes:
        try:
            n = int(number)
        except ValueError:
            raise BadRequest("a page number") from None

        def chunk() -> bytes:
            with open(self._export, "rb") as f:
                f.seek(n * PAGE)
                return f.read(PAGE)

        try:
            return await trio.to_thread.run_sync(chunk)
        except OSError as exc:
            raise BadRequest(f"no saved trace: {exc.strerror}") from None


def _path(raw: bytes) -> Path:
    path = Path(os.fsdecode(raw))
    if not path.is_absolute():
        raise BadRequest("the trace path must be absolute")
    return path

