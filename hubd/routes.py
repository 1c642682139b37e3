"""HTTP handlers: decode the request, call export_root / range_reader / changes, encode.

Routes (formats in docs/protocol.md): ``GET /v2/snapshot``, ``GET /v2/changes?since=G`` (the
``ChangeFeed``), ``GET /v2/blob/{id}/{version}`` (a framed answer streamed a slice at a
time) and ``GET /v2/pack/{dir}/{index}/{digest}`` (both through the ``RangeReader``'s slots
and executor: each holds one slot until its body is written), ``GET /healthz``, and
``/v1/...``: 400 ``protocol-version`` for spokes of the old protocol.

Handlers raise ``HubError``s; the error middleware (``app.py``) turns them into answers.
Once a response is prepared, a handler never raises: a client that goes away mid-body
only ends that response (logged at DEBUG).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable

from aiohttp import hdrs, web

from hubd.changes import ChangeFeed
from hubd.config import HubConfig
from hubd.errors import BadGeneration, BadId, BadPack, HubError, ProtocolVersion
from hubd.metrics import METRICS
from hubd.range_reader import Pack, parse_range
from hubd.source import Export, Reader
from spokefs import protocol

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", HubConfig)
# Either backend (source.py): protocols, which cannot be AppKey's second (class) argument
EXPORT = web.AppKey[Export]("export")
READER = web.AppKey[Reader]("reader")
FEED = web.AppKey("feed", ChangeFeed)
_MAX_GENERATION_DIGITS = 20  # 2**64 has 20 digits

# One year, the longest value caches honour: a blob or pack URL names file versions, so its
# bytes never change.
IMMUTABLE = "public, max-age=31536000, immutable"
BLOB_MEDIA_TYPE = "application/octet-stream"


def route_label(request: web.Request) -> str:
    """The route template of a request, a low-cardinality metrics label."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


async def healthz(request: web.Request) -> web.Response:
    """GET /healthz: liveness only (open even when a token is set)."""
    return web.Response(text="ok")


async def snapshot(request: web.Request) -> web.StreamResponse:
    """GET /v2/snapshot: stream the current generation's prebuilt compressed bytes."""
    snap = request.app[EXPORT].state.snapshot
    chunk = request.app[CONFIG].snapshot_chunk_bytes
    resp = web.StreamResponse(headers={
        hdrs.CONTENT_TYPE: protocol.SNAPSHOT_MEDIA_TYPE,
        protocol.HEADER_GENERATION: str(snap.generation),
        hdrs.CACHE_CONTROL: "no-cache",  # the URL names no generation: always revalidate
    })
    resp.content_length = len(snap.encoded)
    view = memoryview(snap.encoded)
    await _send(request, resp, (view[i : i + chunk] for i in range(0, len(view), chunk)))
    return resp


async def changes(request: web.Request) -> web.StreamResponse:
    """GET /v2/changes?since=G: the changes from generation G to the current one."""
    since = _parse_generation(request.query.getall("since", []))
    state = request.app[EXPORT].state  # snapshot and history of one generation
    body = await request.app[FEED].answer(state.history, state.snapshot.root_id, since)
    resp = web.StreamResponse(headers={
        hdrs.CONTENT_TYPE: protocol.CHANGES_MEDIA_TYPE,
        protocol.HEADER_GENERATION: str(state.history.current),
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
    if value > protocol.U64_MAX:
        raise BadGeneration(f"generation {text} is not a 64-bit number")
    return value


async def blob(request: web.Request) -> web.StreamResponse:
    """GET /v2/blob/{file_id}/{version}: the framed representation, a range of it (206) or
    all of it (200), streamed a slice at a time."""
    file_id = _parse_id(request.match_info["file_id"])
    version = _parse_id(request.match_info["version"])
    spec = parse_range(request.headers.getall(hdrs.RANGE, []))
    reader = request.app[READER]
    async with reader.slot():
        framed = await reader.open_framed(file_id, version, spec)
        try:
            rng = framed.range
            # the first piece before the headers: a file that changed is still a clean 412
            first = await reader.read_piece(framed, 0) if framed.pieces else b""
            headers = {
                hdrs.CONTENT_TYPE: BLOB_MEDIA_TYPE,
                hdrs.ETAG: protocol.etag(file_id, version),
                hdrs.CACHE_CONTROL: IMMUTABLE,
                hdrs.ACCEPT_RANGES: "bytes",
            }
            if rng.partial:
                headers[hdrs.CONTENT_RANGE] = f"bytes {rng.start}-{rng.stop - 1}/{rng.total}"
            resp = web.StreamResponse(status=206 if rng.partial else 200, headers=headers)
            resp.content_length = rng.stop - rng.start

            async def pieces() -> AsyncIterator[bytes | memoryview]:
                yield first
                for i in range(1, framed.pieces):
                    yield await reader.read_piece(framed, i)

            # Written inside the slot, so each piece counts against the memory bound until
            # the transport has taken it.
            await _send(request, resp, pieces(), rng.stop - rng.start)
        finally:
            framed.close()
    return resp


async def pack(request: web.Request) -> web.StreamResponse:
    """GET /v2/pack/{dir_id}/{index}/{digest}: the members of one deterministic pack, one
    record each, in ``protocol.plan_packs`` order (immutable: the URL names every member)."""
    try:
        dir_id = protocol.parse_id(request.match_info["dir_id"])
        index = protocol.parse_pack_index(request.match_info["index"])
        digest = protocol.parse_digest(request.match_info["digest"])
    except protocol.WireError as exc:
        raise BadPack(str(exc)) from None
    reader = request.app[READER]
    async with reader.slot():  # one slot: a pack reads at most PACK_MAX_BYTES of files
        answer = await reader.read_pack(dir_id, index, digest)
        return await _send_pack(request, answer, protocol.pack_etag(digest))


async def pick(request: web.Request) -> web.StreamResponse:
    """GET /v2/pick/{members}: the files a pick names (``ID-VERSION`` joined by ``.``, in the
    order of a job's list), one pack record each, in that order (immutable: the URL names
    every member)."""
    try:
        items = protocol.parse_pick(request.match_info["members"])
    except protocol.WireError as exc:
        raise BadPack(str(exc)) from None
    reader = request.app[READER]
    async with reader.slot():  # one slot: a pick reads at most PACK_MAX_BYTES of files
        answer = await reader.read_pick(items)
        digest = protocol.pack_digest((fid, ver, 0) for fid, ver in items)
        return await _send_pack(request, answer, protocol.pack_etag(digest))


async def _send_pack(request: web.Request, answer: Pack, etag: str) -> web.StreamResponse:
    """A pack or pick answer, counted (call inside the read slot: its body counts against
    the memory bound until the transport has taken it)."""
    metrics = request.app[METRICS]
    metrics.pack_files.labels(result="served").inc(answer.served)
    metrics.pack_files.labels(result="gone").inc(answer.gone)
    metrics.pack_file_bytes.inc(answer.file_bytes)
    resp = web.StreamResponse(headers={
        hdrs.CONTENT_TYPE: BLOB_MEDIA_TYPE,
        hdrs.ETAG: etag,
        hdrs.CACHE_CONTROL: IMMUTABLE,
    })
    resp.content_length = len(answer.body)
    await _send(request, resp, _once(answer.body), len(answer.body))
    return resp


async def old_protocol(request: web.Request) -> web.StreamResponse:
    """Any /v1/ route: a spoke of protocol v1 learns why, in one line, and reads nothing."""
    raise ProtocolVersion(f"this hub speaks protocol v{protocol.API_VERSION} only, the spoke "
                          f"asked for v1 ({request.path[:60]}): upgrade spokefs")


async def _once(body: bytes | bytearray) -> AsyncIterator[bytes | bytearray]:
    yield body


def _parse_id(text: str) -> int:
    try:
        return protocol.parse_id(text)
    except protocol.WireError as exc:
        raise BadId(str(exc)) from None


_SEND_GRACE_S = 30.0
_SEND_MIN_RATE = 256_000  # bytes per second


async def _send(request: web.Request, resp: web.StreamResponse,
                chunks: Iterable[bytes | bytearray | memoryview]
                | AsyncIterator[bytes | bytearray | memoryview],
                total: int | None = None) -> None:
    """Prepare ``resp`` and write ``chunks`` (``total`` bytes); a vanished client just ends
    the response, and so does a file that changed after the first piece (the client, who
    knows the length to expect, sees a short answer).

    A client that reads too slowly is cut off: the answer must be taken within
    ``_SEND_GRACE_S`` plus its size at ``_SEND_MIN_RATE`` (16 MiB in about a minute, far below
    any real link), so a reader that stops reading cannot hold a read slot for long.
    """
    if not isinstance(chunks, AsyncIterator):
        parts = list(chunks)
        total = sum(len(c) for c in parts)
        chunks = _iterate(parts)
    budget = _SEND_GRACE_S + (total or 0) / _SEND_MIN_RATE
    sent = 0
    try:
        async with asyncio.timeout(budget):
            await resp.prepare(request)
            async for chunk in chunks:
                await resp.write(chunk)
                sent += len(chunk)
            await resp.write_eof()
    except ConnectionError as exc:
        log.debug("client went away after %d bytes of %s: %s", sent, request.path, exc)
    except HubError as exc:  # after the headers: only closing the connection tells the client
        log.info("answer to %s cut after %d bytes: %s", request.path, sent, exc.detail)
        if request.transport is not None:
            request.transport.close()
    except TimeoutError:
        log.debug("client too slow: %d bytes of %s in %.0fs, closing", sent, request.path, budget)
        if request.transport is not None:
            request.transport.close()
    finally:
        request.app[METRICS].bytes_served.labels(route=route_label(request)).inc(sent)


async def _iterate(parts: list[bytes | bytearray | memoryview]
                   ) -> AsyncIterator[bytes | bytearray | memoryview]:
    for part in parts:
        yield part
