"""HTTP handlers: decode the request, call export_root / range_reader / changes, encode.

Routes (formats in wire.py): ``GET /v1/snapshot``, ``GET /v1/changes?since=G`` (the
``ChangeFeed``), ``GET /v1/blob/{id}/{version}`` and ``POST /v1/pack`` (both through the
``RangeReader``'s slots and executor: a pack holds one slot, like one range, and its body
is read up to ``MAX_PACK_FILES`` records and no further), ``GET /healthz``.

Handlers raise ``HubError``s; the error middleware (``app.py``) turns them into answers.
Once a response is prepared, a handler never raises: a client that goes away mid-body
only ends that response (logged at DEBUG).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from aiohttp import hdrs, web

from hubd import wire
from hubd.changes import ChangeFeed
from hubd.config import HubConfig
from hubd.errors import BadGeneration, BadId, BadPack, RequestTimeout
from hubd.export_root import ExportRoot
from hubd.metrics import METRICS
from hubd.range_reader import RangeReader, parse_range

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", HubConfig)
EXPORT = web.AppKey("export", ExportRoot)
READER = web.AppKey("reader", RangeReader)
FEED = web.AppKey("feed", ChangeFeed)
_MAX_GENERATION_DIGITS = 20  # 2**64 has 20 digits

# One year, the longest value caches honour: a blob URL names one version, so it never changes.
BLOB_CACHE_CONTROL = "public, max-age=31536000, immutable"
BLOB_MEDIA_TYPE = "application/octet-stream"


def route_label(request: web.Request) -> str:
    """The route template of a request, a low-cardinality metrics label."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


async def healthz(request: web.Request) -> web.Response:
    """GET /healthz: liveness only (open even when a token is set)."""
    return web.Response(text="ok")


async def snapshot(request: web.Request) -> web.StreamResponse:
    """GET /v1/snapshot: stream the current generation's prebuilt compressed bytes."""
    snap = request.app[EXPORT].state.snapshot
    chunk = request.app[CONFIG].snapshot_chunk_bytes
    resp = web.StreamResponse(headers={
        hdrs.CONTENT_TYPE: wire.SNAPSHOT_MEDIA_TYPE,
        wire.HEADER_GENERATION: str(snap.generation),
        hdrs.CACHE_CONTROL: "no-cache",  # the URL names no generation: always revalidate
    })
    resp.content_length = len(snap.encoded)
    view = memoryview(snap.encoded)
    await _send(request, resp, (view[i : i + chunk] for i in range(0, len(view), chunk)))
    return resp


async def changes(request: web.Request) -> web.StreamResponse:
    """GET /v1/changes?since=G: the changes from generation G to the current one."""
    since = _parse_generation(request.query.getall("since", []))
    state = request.app[EXPORT].state  # snapshot and history of one generation
    body = await request.app[FEED].answer(state.history, state.snapshot.root_id, since)
    resp = web.StreamResponse(headers={
        hdrs.CONTENT_TYPE: wire.CHANGES_MEDIA_TYPE,
        wire.HEADER_GENERATION: str(state.history.current),
        hdrs.CACHE_CONTROL: "no-cache",  # the URL names no target generation
    })
    resp.content_length = len(body)
    await _send(request, resp, (body,))
    return resp


def _parse_generation(values: list[str]) -> int:
    if len(values) != 1:
        raise BadGeneration("want exactly one since=GENERATION")
    text = values[0]
    if not text.isascii() or not text.isdigit() or len(text) > _MAX_GENERATION_DIGITS:
        raise BadGeneration(f"bad generation {text[:40]!r}: want a decimal number")
    value = int(text)
    if value > wire.U64_MAX:
        raise BadGeneration(f"generation {text} is not a 64-bit number")
    return value


async def blob(request: web.Request) -> web.StreamResponse:
    """GET /v1/blob/{file_id}/{version}: one byte range (206) or a small whole file (200)."""
    file_id = _parse_id(request.match_info["file_id"])
    version = _parse_id(request.match_info["version"])
    spec = parse_range(request.headers.getall(hdrs.RANGE, []))
    reader = request.app[READER]
    async with reader.slot():
        data = await reader.read(file_id, version, spec)
        headers = {
            hdrs.CONTENT_TYPE: BLOB_MEDIA_TYPE,
            hdrs.ETAG: wire.etag(file_id, version),
            hdrs.CACHE_CONTROL: BLOB_CACHE_CONTROL,
            hdrs.ACCEPT_RANGES: "bytes",
            wire.HEADER_CHECKSUM: data.checksum,
        }
        if data.partial:
            headers[hdrs.CONTENT_RANGE] = f"bytes {data.start}-{data.stop - 1}/{data.size}"
        resp = web.StreamResponse(status=206 if data.partial else 200, headers=headers)
        resp.content_length = len(data.data)
        # Written inside the slot, so the read buffer counts against the memory bound
        # until the transport has taken it.
        await _send(request, resp, (data.data,))
    return resp


async def pack(request: web.Request) -> web.StreamResponse:
    """POST /v1/pack: whole small files, one record each, in request order (no caching:
    a POST answer is never stored by HTTP caches, and the body names the files)."""
    items = await _read_pack_request(request)
    reader = request.app[READER]
    async with reader.slot():  # one slot: a pack reads at most MAX_RANGE_BYTES, like a range
        answer = await reader.read_pack(items)
        metrics = request.app[METRICS]
        metrics.pack_files.labels(result="served").inc(answer.served)
        metrics.pack_files.labels(result="gone").inc(answer.gone)
        metrics.pack_file_bytes.inc(answer.file_bytes)
        resp = web.StreamResponse(headers={hdrs.CONTENT_TYPE: BLOB_MEDIA_TYPE})
        resp.content_length = len(answer.body)
        await _send(request, resp, (answer.body,))
    return resp


async def _read_pack_request(request: web.Request) -> list[tuple[int, int]]:
    """The (file id, version) pairs of a pack request; never reads past the size limit,
    nor waits longer than the idle timeout for it (a client sending its body slowly)."""
    limit = wire.MAX_PACK_FILES * wire.PACK_ITEM.size
    declared = request.content_length
    body = bytearray()
    if declared is None or declared <= limit:
        wait_s = request.app[CONFIG].idle_timeout_s
        try:
            async with asyncio.timeout(wait_s):
                while len(body) <= limit:
                    chunk = await request.content.read(limit + 1 - len(body))
                    if not chunk:
                        break
                    body += chunk
        except TimeoutError:
            raise RequestTimeout(f"the pack body did not arrive within {wait_s:g} s") from None
    if len(body) > limit or (declared or 0) > limit:
        raise BadPack(f"a pack asks for at most {wire.MAX_PACK_FILES} files "
                      f"({limit} bytes of body)")
    try:
        return wire.decode_pack_request(bytes(body))
    except wire.WireError as exc:
        raise BadPack(str(exc)) from None


def _parse_id(text: str) -> int:
    try:
        return wire.parse_id(text)
    except wire.WireError as exc:
        raise BadId(str(exc)) from None


_SEND_GRACE_S = 30.0
_SEND_MIN_RATE = 256_000  # bytes per second


async def _send(request: web.Request, resp: web.StreamResponse,
                chunks: Iterable[bytes | memoryview]) -> None:
    """Prepare ``resp`` and write ``chunks``; a vanished client just ends the response.

    A client that reads too slowly is cut off: the answer must be taken within
    ``_SEND_GRACE_S`` plus its size at ``_SEND_MIN_RATE`` (16 MiB in about a minute, far below
    any real link), so a reader that stops reading cannot hold a read slot for long.
    """
    parts = list(chunks)
    budget = _SEND_GRACE_S + sum(len(c) for c in parts) / _SEND_MIN_RATE
    sent = 0
    try:
        async with asyncio.timeout(budget):
            await resp.prepare(request)
            for chunk in parts:
                await resp.write(chunk)
                sent += len(chunk)
            await resp.write_eof()
    except ConnectionError as exc:
        log.debug("client went away after %d bytes of %s: %s", sent, request.path, exc)
    except TimeoutError:
        log.debug("client too slow: %d bytes of %s in %.0fs, closing", sent, request.path, budget)
        if request.transport is not None:
            request.transport.close()
    finally:
        request.app[METRICS].bytes_served.labels(route=route_label(request)).inc(sent)
