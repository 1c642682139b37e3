"""A bucket (or a prefix of one) as a hub export: the S3 counterpart of ``ExportRoot``.

``BucketExport`` implements ``source.Export``, what the routes, the rescanner and the server
use of an export: ``state`` / ``snapshot`` (the current generation and its change history),
``rescan(cancel)`` (blocking: it runs in a worker thread, like a directory scan),
``last_rescan``, ``root`` (a printable name) and ``close()``; and, for ``BucketReader``,
``read(...)``: bytes of one object version.

Rescans: ``rescan`` runs in a worker thread. It hands the listing (``listing.list_objects``,
network I/O) to the event loop with ``run_coroutine_threadsafe`` (the client's connection
pool lives there) and waits for it, checking ``cancel`` every 0.2 s; then, still in the
thread, it builds the tree (``tree.build_tree``), diffs it against the current generation
(``changes.diff``) and encodes it: the CPU work never runs on the loop. As for a directory,
an unchanged listing keeps the generation, and a changed one becomes generation
``next_generation(previous, table)`` (a function of the listing, as for a directory) with
its changes in the history: a new ETag is an UPSERT with
a new version, a deleted key a REMOVE, a new key an UPSERT.

Versions: the snapshot's version of a file is ``tree.object_version(etag, size)``; the
export keeps each file's ETag (``_etags``, replaced with the state in one assignment), so a
read sends ``If-Match: <etag>`` and S3 itself refuses (412) an object replaced since the
listing: it becomes ``StaleVersion`` (412 ``stale-version``, ESTALE on the spoke), never
bytes of another version, and asks for a rescan (``on_stale``) so the new object appears.

Keys that cannot be POSIX paths are counted by reason in ``skipped`` (the
``hubd_s3_skipped_keys`` metric) and each reason is logged once per process.

Memory: the table as for a directory, plus one ETag string per file (~100 bytes each).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

from hubd.changes import Diff, History, diff
from hubd.errors import Forbidden, ReadFailed, StaleVersion, UnknownFile
from hubd.export_root import ExportState, Rescan, ScanCancelled, next_generation
from hubd.s3.client import ObjectInfo, S3Client
from hubd.s3.errors import AccessDenied, ObjectChanged, ObjectMissing, S3Error, S3Unavailable
from hubd.s3.listing import DEFAULT_WORKERS, list_objects
from hubd.s3.tree import build_tree, export_prefix, object_version
from hubd.snapshot import Snapshot

log = logging.getLogger(__name__)

_CANCEL_POLL_S = 0.2


class BucketExport:
    """``s3://bucket/prefix``, its current snapshot, change history and ETags.

    Attributes:
        root: ``s3://BUCKET/PREFIX`` for log lines.
        client: the S3 client (entered by the caller, used on the event loop only).
        last_rescan: the outcome of the latest listing (None before the first).
        skipped: keys of the latest listing left out, by reason (``tree.SKIP_REASONS``).
        on_stale: called (on the loop) when a read finds an object replaced; the server
            points it at the rescanner's ``request``.
    """

    def __init__(self, client: S3Client, bucket: str, prefix: str,
                 loop: asyncio.AbstractEventLoop, zlib_level: int = 6,
                 max_change_steps: int = 16, max_change_bytes: int = 64 * 1024 * 1024,
                 list_workers: int = DEFAULT_WORKERS) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = export_prefix(prefix)
        self.root = f"s3://{bucket}/{self.prefix}"
        self._loop = loop
        self._zlib_level = zlib_level
        self._max_steps = max_change_steps
        self._max_bytes = max_change_bytes
        self._workers = list_workers
        self._scan_lock = threading.Lock()
        self._state: ExportState | None = None
        self._etags: dict[int, str] = {}
        self._logged_reasons: set[str] = set()
        self.skipped: Counter[str] = Counter()
        self.last_rescan: Rescan | None = None
        self.on_stale: Callable[[], None] = lambda: None

    @property
    def state(self) -> ExportState:
        assert self._state is not None  # the app only serves after the first listing
        return self._state

    @property
    def snapshot(self) -> Snapshot | None:
        return self._state.snapshot if self._state is not None else None

    def close(self) -> None:
        """Nothing to release here: the client is closed by whoever entered it."""

    # -- rescans (worker thread) ----------------------------------------------------------

    def _list(self, cancel: threading.Event | None) -> list[ObjectInfo]:
        future = asyncio.run_coroutine_threadsafe(
            list_objects(self.client, self.bucket, self.prefix, self._workers), self._loop)
        while True:
            try:
                listing = future.result(timeout=_CANCEL_POLL_S)
            except concurrent.futures.TimeoutError:
                if cancel is not None and cancel.is_set():
                    future.cancel()
                    raise ScanCancelled from None
                continue
            log.debug("listed %s: %d objects, %d LIST requests, %.2f s", self.root,
                      len(listing.objects), listing.pages, listing.seconds)
            return listing.objects

    def rescan(self, cancel: threading.Event | None = None) -> Snapshot:
        """List the bucket; make a new generation current if anything changed (blocking).

        Raises:
            ScanCancelled: ``cancel`` was set; nothing changed.
            S3Error: the listing failed (after the client's retries); nothing changed.
        """
        with self._scan_lock:
            start = time.perf_counter()
            objects = self._list(cancel)
            listed = time.perf_counter()
            tree = build_tree(self.bucket, self.prefix, objects)
            del objects
            builder, root_id, etags = tree.table, tree.root_id, tree.etags
            self._note_skipped(tree.stats.skipped, tree.stats.examples)
            old = self._state
            if old is not None and builder.same_as(old.snapshot.table):
                self._etags = etags
                return self._unchanged(old.snapshot, listed - start)
            table = builder.build(root_id)  # ids are unique: build_tree skipped collisions
            del builder
            change = diff(old.snapshot.table, table, self._max_bytes) if old is not None \
                else Diff(len(table), 0, 0, None, 0)
            if old is not None and change.empty:
                self._etags = etags
                return self._unchanged(old.snapshot, time.perf_counter() - start)
            if cancel is not None and cancel.is_set():
                raise ScanCancelled
            generation = next_generation(old.snapshot.generation if old is not None else 0,
                                         table)
            encode_start = time.perf_counter()
            encoded = table.encode(generation, self._zlib_level)
            done = time.perf_counter()
            snap = Snapshot(generation, table, encoded, listed - start, done - encode_start)
            history = (old.history.advance(generation, change, self._max_steps, self._max_bytes)
                       if old is not None else History(generation))
            self._etags = etags  # versions before the state: a read checks both
            self._state = ExportState(snap, history)
        log.info("listed %s: %d entries, generation %d: %d added, %d changed, %d removed; "
                 "%.2f s listing + %.2f s tree, diff and encoding", self.root, snap.count,
                 generation, change.added, change.changed, change.removed, listed - start,
                 done - listed)
        self.last_rescan = Rescan(generation, snap.count, True, change.added, change.changed,
                                  change.removed, done - start)
        return snap

    def _unchanged(self, snap: Snapshot, seconds: float) -> Snapshot:
        log.info("listed %s: unchanged, %d entries, generation %d, %.2f s", self.root,
                 snap.count, snap.generation, seconds)
        self.last_rescan = Rescan(snap.generation, snap.count, False, 0, 0, 0, seconds)
        return snap

    def _note_skipped(self, skipped: Counter[str], examples: dict[str, str]) -> None:
        self.skipped = skipped
        for reason, count in sorted(skipped.items()):
            if reason not in self._logged_reasons:
                self._logged_reasons.add(reason)
                log.warning("%s: %d keys skipped (%s), e.g. %r; counted in "
                            "hubd_s3_skipped_keys, not logged again", self.root, count,
                            reason, examples[reason][:200])

    # -- reads (event loop) ---------------------------------------------------------------

    def key_of(self, snap: Snapshot, file_id: int) -> str:
        parts = snap.path_parts(file_id)
        assert parts  # a regular file is never the root
        return self.prefix + "/".join(p.decode() for p in parts)

    async def read(self, snap: Snapshot, file_id: int, version: int, start: int,
                   stop: int) -> bytes:
        """Bytes ``[start, stop)`` of file ``file_id`` at ``version`` (already checked against
        ``snap`` by the caller).

        Raises:
            StaleVersion: the export or S3 has another version of the object.
            UnknownFile: the object is gone. Forbidden: S3 denies the read.
            ReadFailed: S3 kept failing until the deadline, or answered nonsense.
        """
        etag, key = self._object_of(snap, file_id, version)
        with self._errors(file_id):
            data = await self.client.get(self.bucket, key, etag, start, stop)
        return data

    async def read_streamed(self, snap: Snapshot, file_id: int, version: int, start: int,
                            stop: int, chunk: int,
                            deliver: Callable[[list[memoryview]], None]) -> None:
        """Bytes ``[start, stop)`` as ``read``, handed to ``deliver`` in pieces of ``chunk``
        bytes as they arrive (``S3Client.get_streamed``).

        Raises:
            as ``read``; the pieces delivered before the error are of the version asked for.
        """
        etag, key = self._object_of(snap, file_id, version)
        with self._errors(file_id):
            await self.client.get_streamed(self.bucket, key, etag, start, stop, chunk, deliver)

    def _object_of(self, snap: Snapshot, file_id: int, version: int) -> tuple[str, str]:
        """(ETag, key) of ``file_id`` if it is at ``version``, else ``StaleVersion``."""
        etag = self._etags.get(file_id)
        entry = snap.lookup(file_id)
        if etag is None or entry is None or object_version(etag, entry.size) != version:
            raise StaleVersion(f"file {file_id:016x} is not at version {version:016x}")
        return etag, self.key_of(snap, file_id)

    @contextlib.contextmanager
    def _errors(self, file_id: int) -> Iterator[None]:
        """The S3 client's errors as the hub's: stale, gone, forbidden, failed."""
        try:
            yield
        except ObjectChanged:
            self.on_stale()
            raise StaleVersion(f"file {file_id:016x} was replaced in the bucket") from None
        except ObjectMissing:
            self.on_stale()
            raise UnknownFile(f"file {file_id:016x} is gone from the bucket") from None
        except AccessDenied as exc:
            log.warning("read denied: %s", exc)
            raise Forbidden("the bucket denies this read (s3:GetObject)") from None
        except S3Unavailable as exc:
            raise ReadFailed(f"the bucket did not answer: {exc.code or 'no answer'}") from None
        except S3Error as exc:
            log.warning("read failed: %s", exc)
            raise ReadFailed("the bucket's answer was unusable") from None
