"""HTTP handlers: decode the request, call export_root / range_reader, encode the answer.

Handlers raise ``HubError``s; the error middleware (``app.py``) turns them into answers.
Once a response is prepared, a handler never raises: a client that goes away mid-body
only ends that response (logged at DEBUG).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from aiohttp import hdrs, web

from hubd import wire
from hubd.config import HubConfig
from hubd.errors import BadId
from hubd.export_root import ExportRoot
from hubd.metrics import METRICS
from hubd.range_reader import RangeReader, parse_range

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", HubConfig)
EXPORT = web.AppKey("export", ExportRoot)
READER = web.AppKey("reader", RangeReader)

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
    snap = request.app[EXPORT].snapshot
    assert snap is not None  # the app only serves after the first scan
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


def _parse_id(text: str) -> int:
    try:
        return wire.parse_id(text)
    except wire.WireError as exc:
        raise BadId(str(exc)) from None


async def _send(request: web.Request, resp: web.StreamResponse,
                chunks: Iterable[bytes | memoryview]) -> None:
    """Prepare ``resp`` and write ``chunks``; a vanished client just ends the response."""
    sent = 0
    try:
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(chunk)
            sent += len(chunk)
        await resp.write_eof()
    except ConnectionError as exc:
        log.debug("client went away after %d bytes of %s: %s", sent, request.path, exc)
    finally:
        request.app[METRICS].bytes_served.labels(route=route_label(request)).inc(sent)
