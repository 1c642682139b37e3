"""make_app(cfg, export, metrics) -> web.Application: state keys, routes, middlewares.

Middlewares, outermost first:

1. ``metrics``: counts every answer by route and status and times it.
2. ``errors``: the one boundary that turns ``HubError``s, aiohttp's HTTP exceptions and any
   unexpected exception into ``{"error", "detail"}`` JSON with ``X-Spokefs-Error``; never a
   500 (a bug is logged with its traceback and answered 503 ``internal-error``).
3. ``auth`` (only with a token): every route but /healthz and /metrics needs
   ``Authorization: Bearer <token>``, else 401 before anything else is looked at.

The reader (``source.make_reader``: a directory's ``RangeReader`` or a bucket's ``BucketReader``)
and the ``ChangeFeed`` (and their thread pools) live in ``cleanup_ctx``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

from hubd import routes
from hubd.changes import ChangeFeed
from hubd.config import HubConfig
from hubd.errors import HubError, InternalError, MethodNotAllowed, RouteNotFound, Unauthorized
from hubd.metrics import METRICS, HubMetrics, metrics_handler
from hubd.source import Export, make_reader
from spokefs import protocol

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({protocol.HEALTH_PATH, protocol.METRICS_PATH})


def make_app(cfg: HubConfig, export: Export, metrics: HubMetrics) -> web.Application:
    """The hubd application; ``export`` must already hold a snapshot."""
    middlewares: list[Middleware] = [_metrics_middleware, _error_middleware]
    if cfg.token is not None:
        middlewares.append(_auth_middleware(cfg.token))
    app = web.Application(middlewares=middlewares)
    app[routes.CONFIG] = cfg
    app[routes.EXPORT] = export
    app[METRICS] = metrics
    app.cleanup_ctx.append(_reader_ctx)
    app.cleanup_ctx.append(_feed_ctx)
    add = app.router.add_get
    add(protocol.SNAPSHOT_PATH, routes.snapshot, allow_head=False)
    add(protocol.CHANGES_PATH, routes.changes, allow_head=False)
    add(protocol.BLOB_PATH, routes.blob, allow_head=False)
    add(protocol.PACK_PATH, routes.pack, allow_head=False)
    add(protocol.PICK_PATH, routes.pick, allow_head=False)
    app.router.add_route("*", protocol.OLD_PATHS, routes.old_protocol)
    add(protocol.HEALTH_PATH, routes.healthz)  # HEAD too, for load balancers
    add(protocol.METRICS_PATH, metrics_handler, allow_head=False)
    return app


async def _reader_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[routes.CONFIG]
    reader = make_reader(app[routes.EXPORT], cfg.max_concurrent_reads, cfg.read_wait_s)
    app[routes.READER] = reader
    app[METRICS].reads_in_flight.set_function(lambda: reader.in_flight)
    yield
    await asyncio.get_running_loop().run_in_executor(None, reader.close)


async def _feed_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[routes.CONFIG]
    feed = ChangeFeed(cfg.snapshot_zlib_level, cfg.changes_max_bytes)
    app[routes.FEED] = feed
    yield
    await asyncio.get_running_loop().run_in_executor(None, feed.close)


def error_response(exc: HubError) -> web.Response:
    """The JSON answer for a domain error."""
    return _json_error(exc.status, exc.reason, exc.detail, exc.headers)


def _json_error(status: int, reason: str, detail: str,
                headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": reason, "detail": detail}, status=status,
                             headers={protocol.HEADER_ERROR: reason, **(headers or {})})


def _http_exception_response(exc: web.HTTPException) -> web.Response:
    """An error aiohttp raised itself (no route, wrong method, body too large...)."""
    if exc.status == 404:
        return error_response(RouteNotFound("no such route"))
    if exc.status == 405:
        allow = exc.headers.get(hdrs.ALLOW, "")
        return error_response(MethodNotAllowed(f"allowed: {allow}", {hdrs.ALLOW: allow}))
    status = exc.status if 400 <= exc.status < 500 else 400
    return _json_error(status, f"http-{status}", " ".join(str(exc.reason).split()))


@web.middleware
async def _metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    start = time.perf_counter()
    status: int | str = "aborted"  # kept only if the handler was cancelled
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    finally:
        request.app[METRICS].observe_request(routes.route_label(request), status,
                                             time.perf_counter() - start)


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except HubError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_exception_response(exc)
    except Exception:
        log.exception("internal error answering %s %r", request.method, request.path)
        return error_response(InternalError("internal error (logged by hubd)"))


def _auth_middleware(token: bytes) -> Middleware:
    expected = b"Bearer " + token

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            given = request.headers.get(hdrs.AUTHORIZATION, "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                raise Unauthorized("missing or wrong bearer token",
                                   {hdrs.WWW_AUTHENTICATE: "Bearer"})
        return await handler(request)

    return auth
