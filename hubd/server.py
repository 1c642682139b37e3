"""hubd's lifecycle: open ROOT, bind, first scan, serve until SIGTERM/SIGINT, tear down.

Order (teardown reverses it): signal handlers -> the soft file descriptor limit raised to
the hard one (``fd_limit``) -> ROOT's fd (for ``s3://``: the S3 client
and its connection pool) -> listening socket -> first scan (in a thread, abandoned cleanly
if a signal comes first; for a bucket, the first listing, where wrong keys, a denied
listing or an unknown bucket end hubd with one line) -> aiohttp runner -> the loop's
exception handler for failed accept() calls (``accept_errors``) -> the server on the
listening socket -> readiness line on stdout -> the rescanner task (timer and SIGHUP) -> wait for
SIGTERM/SIGINT -> rescanner cancelled (its scan thread joined) -> runner cleanup
(in-flight answers get a few seconds). SIGHUP never stops hubd: from the start it only
asks for a rescan (one that comes during the first scan causes a rescan right after it).

The listening socket is served by ``loop.create_server`` with hubd's own protocol factory
(aiohttp's ``AppRunner`` runs the app, its start-up and clean-up, but no site): each
connection is a ``malformed.HubRequestHandler``, counted by a ``conn_limit.ConnectionLimit``
that closes at once any connection over ``fd_limit.connection_cap`` (so a crowd of clients
cannot take the descriptors reads and the scan need). With ``cfg.tls`` it serves HTTPS and the
readiness line says ``https://``. Requests that aiohttp's parser rejects (malformed or
oversized lines, bad methods or versions) get a fixed 400 ``malformed-request`` that quotes
nothing and one DEBUG line, not an ERROR with a traceback: they are the client's fault, and
a flood of them must not flood the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from typing import Any, TypedDict

from aiohttp import web

from hubd.accept_errors import AcceptErrorHandler
from hubd.app import make_app
from hubd.config import HubConfig
from hubd.conn_limit import ConnectionLimit
from hubd.errors import StartupError
from hubd.export_root import ExportRoot, ScanCancelled
from hubd.fd_limit import connection_cap, raise_nofile_limit
from hubd.malformed import HubRequestHandler, install_log_filters
from hubd.metrics import HubMetrics
from hubd.rescanner import Rescanner
from hubd.s3.bucket import BucketExport
from hubd.s3.client import S3Client
from hubd.s3.errors import S3Error
from hubd.source import Export

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024  # many spokes connect at once after a job starts
SHUTDOWN_GRACE_S = 5.0  # in-flight answers get this long after SIGTERM
# After an answer to a request whose body was not read (no v2 route reads one: a v1
# spoke's POST /v1/pack gets 400 protocol-version, a 401 comes before any body), aiohttp
# keeps reading and dropping the body this long so the client sees the answer before the
# close; its default, 10 s, lets a slow client hold on.
LINGER_S = 2.0


class _HandlerArgs(TypedDict):
    """What the runner and each connection's ``HubRequestHandler`` are given alike."""

    access_log: logging.Logger | None  # None: no access log (aiohttp's documented value)
    keepalive_timeout: float
    lingering_time: float


async def serve(cfg: HubConfig) -> int:
    """Run hubd until SIGTERM/SIGINT; returns the exit status (0).

    Raises:
        StartupError: ROOT cannot be opened or scanned, or the address cannot be bound.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    hup = asyncio.Event()
    loop.add_signal_handler(signal.SIGHUP, hup.set)
    install_log_filters()
    nofile = raise_nofile_limit()
    async with contextlib.AsyncExitStack() as stack:
        export = await _open_source(cfg, stack)
        stack.callback(export.close)
        with bind(cfg.host, cfg.port) as sock:
            if await _first_scan(export, stop):
                await _serve_until(stop, hup, cfg, export, sock, nofile)
    log.info("stopped")
    return 0


async def _open_source(cfg: HubConfig, stack: contextlib.AsyncExitStack) -> Export:
    """The export of ``cfg.root``: a directory, or a bucket with its S3 client in ``stack``."""
    if cfg.s3 is None:
        return _open_export(cfg)
    spec = cfg.s3
    client = await stack.enter_async_context(S3Client(spec.client, spec.creds))
    log.info("exporting %s from %s (region %s, credentials from %s)", spec.url,
             spec.client.endpoint, spec.client.region, spec.creds.source)
    return BucketExport(client, spec.bucket, spec.prefix, asyncio.get_running_loop(),
                        cfg.snapshot_zlib_level, cfg.changes_max_steps, cfg.changes_max_bytes,
                        spec.list_workers)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family = infos[0][0]
        return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    except socket.gaierror as exc:
        raise StartupError(f"cannot resolve {host!r}: {exc.strerror}") from None
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def url_of(host: str, sock: socket.socket, *, tls: bool = False) -> str:
    port = sock.getsockname()[1]
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _open_export(cfg: HubConfig) -> ExportRoot:
    root = cfg.root
    try:
        return ExportRoot(root, cfg.snapshot_zlib_level, cfg.changes_max_steps,
                          cfg.changes_max_bytes)
    except FileNotFoundError:
        raise StartupError(f"{_printable(root)}: no such directory") from None
    except NotADirectoryError:
        raise StartupError(f"{_printable(root)}: not a directory") from None
    except OSError as exc:
        raise StartupError(f"cannot open {_printable(root)}: {exc.strerror}") from None


async def _first_scan(export: Export, stop: asyncio.Event) -> bool:
    """Scan in a thread; False if ``stop`` is set first (the scan is then cancelled)."""
    cancel = threading.Event()
    loop = asyncio.get_running_loop()
    scan = asyncio.ensure_future(loop.run_in_executor(None, export.rescan, cancel))
    stopped = asyncio.ensure_future(stop.wait())
    either: set[asyncio.Future[Any]] = {scan, stopped}
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not scan.done():
        cancel.set()
        with contextlib.suppress(ScanCancelled):
            await scan
        return False
    try:
        scan.result()  # not kept: a rescan must be able to free this snapshot
        return True
    except OSError as exc:
        raise StartupError(f"cannot scan {_printable(export.root)}: {exc.strerror}") from None
    except S3Error as exc:
        raise StartupError(f"cannot list {_printable(export.root)}: {exc}") from None


async def _serve_until(stop: asyncio.Event, hup: asyncio.Event, cfg: HubConfig,
                       export: Export, sock: socket.socket, nofile: int) -> None:
    """Serve on ``sock`` until ``stop``; ``nofile`` is the soft file descriptor limit."""
    metrics = HubMetrics()
    metrics.observe_snapshot(export.state.snapshot)
    metrics.observe_rescan(export.last_rescan)
    app = make_app(cfg, export, metrics)
    access_log = logging.getLogger("hubd.access") if cfg.log_level == "DEBUG" else None
    # keepalive_timeout: aiohttp arms it when a connection opens and after each answer and
    # closes the connection if no whole request header has arrived by then, so it is also
    # the bound on a client that sends its header slowly.
    handler_args = _HandlerArgs(access_log=access_log, keepalive_timeout=cfg.idle_timeout_s,
                                lingering_time=LINGER_S)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE_S,
                           **handler_args)
    limit = ConnectionLimit(connection_cap(nofile, cfg.max_concurrent_reads), metrics)
    log.info("at most %d connections at once (file descriptor limit %d; the other %d are for "
             "files being read, the scan and the rest)", limit.cap, nofile, nofile - limit.cap)
    await runner.setup()
    server = runner.server
    assert server is not None  # set by setup()
    loop = asyncio.get_running_loop()
    accept_errors = AcceptErrorHandler(metrics)
    accept_errors.install(loop)
    listener: asyncio.Server | None = None
    try:
        # What web.SockSite does, with hubd's handler class (aiohttp's Server builds plain
        # RequestHandlers) behind the connection limit. Each handler registers with
        # ``server``, which closes them on runner.cleanup().
        listener = await loop.create_server(
            # aiohttp annotates RequestHandler's access_log as Logger, though its documented
            # None (no access log) is what the handler itself tests for
            limit.factory(lambda: HubRequestHandler(server, loop=loop,
                                                    **handler_args)),  # type: ignore[arg-type]
            sock=sock, ssl=cfg.tls, backlog=LISTEN_BACKLOG)
        log.info("config: %r", cfg)  # the token and TLS fields are repr=False
        first = export.state.snapshot
        url = url_of(cfg.host, sock, tls=cfg.tls is not None)
        announce(f"hubd: serving {_printable(cfg.root)} at {url} "
                 f"({first.count} entries, generation {first.generation})")
        del first  # a rescan must be able to free it
        rescanner = Rescanner(export, metrics, cfg.rescan_interval_s, hup)
        if isinstance(export, BucketExport):
            export.on_stale = rescanner.request  # an object replaced: list again soon
            metrics.watch_bucket(export)
        async with asyncio.TaskGroup() as tasks:
            rescans = tasks.create_task(rescanner.run())
            await stop.wait()
            log.info("signal received: shutting down")
            rescans.cancel()
    finally:
        if listener is not None:
            listener.close()  # accept no more; runner.cleanup() ends the connections
            accept_errors.listener_closed()
        await runner.cleanup()


def announce(line: str) -> None:
    """The one readiness line on stdout, flushed."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _printable(path: str) -> str:
    """``path`` with undecodable bytes escaped, safe to print on any terminal."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
