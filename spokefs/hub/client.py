"""Trio-native HTTP client for hubd: the snapshot, framed range reads of blobs, and packs,
straight from the hub or through a regional tier (an HTTP cache in front of the hub).

Blob and pack answers (and the connections kept warm for them) go through ``hub.wire``, our
own HTTP/1.1 GET on trio that receives a body into one buffer; the snapshot, changes and
probes through httpx (anyio's trio backend). Each keeps its own keep-alive connections per
hub, at most ``hub_max_connections`` of them. Every call has a deadline; transient
failures (connection errors, timeouts, 5xx, 429, 408, a body that fails its checksum) are
retried with capped exponential backoff and full jitter until that deadline, then raised as
``HubUnavailable``. Answers that retrying cannot fix map straight to domain errors:
404/412 -> ``StaleExport``, 401 -> ``HubUnauthorized``, other 4xx -> ``HubProtocolError``.

Blob answers are framed (docs/protocol.md, "Why a version 2"): every 4 KiB frame is checked
against its seeded xxh3 before any byte of the answer is returned, and every pack member
against the sum in its record, so bytes damaged on the way (or by a cache) are never
cached; a blob or pack answer is never read past the bytes asked for (a lying hub cannot
fill memory). The snapshot is streamed to a sink (the namespace loader's child, which
decodes it as it arrives); an answer with another content type is a bad snapshot
(``protocol.WireError``). A hub that answers 404 for ``/v2/snapshot`` speaks an older protocol:
the mount fails with one line naming both versions.

Replicas (``hub.origins``): each hub attempt goes to ``HubOrigins.current()`` (one pooled
client per hub URL). A transient failure is reported there (which moves the mount to the
next hub) and the retry goes to the new current hub at once, without a backoff pause, as
long as this request has not tried it yet; once it has tried them all it backs off as with
one hub. With several hubs an attempt is also bounded by ``failover_after_s``, so a hub
that hangs (rather than refuses) costs a read that long, not the whole deadline. A 404/412
from one hub is asked again of each other reachable hub before it becomes ``StaleExport``
(a replica one rescan behind may not list a new file yet), and waited on within the
deadline while another hub is unreachable. A 400 to ``/v2/changes`` (``since`` newer than
the hub's generation) is ``HubBehind``: the refresher keeps its namespace for a while.

Tier (``tier_url``): blob and pack requests go to the tier first. A transport error, a
timeout, any status but 200/206, a short or over-long body or a failed checksum there is
counted (``spokefs_tier_fallbacks_total{reason}``) and the request goes to the hub itself,
with the hub's retries and deadline; after a transport error or a timeout the tier is left
alone for ``_TIER_PAUSE_S``. Snapshot and changes always go to the hub: they are not
cacheable (their URLs name no generation), and a tier would only add a hop. Received
bytes are counted by origin (``spokefs_fetched_bytes_total{origin}``: ``hub``, or the
tier's own cache status: ``tier_hit``, ``tier_miss``, ``tier`` when it says none), which
is what crossed the far link per spoke.

TLS: an ``https://`` hub is verified with the ``ssl.SSLContext`` from the CLI (system roots
or ``--ca-file``). A certificate that does not verify is not transient: it fails at once
as ``HubUnavailable`` ("certificate verify failed: ..."), without retries. The bearer token
is a default header of the client: it is never logged or put in a message.
"""

from __future__ import annotations

import contextlib
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

import httpcore
import httpx
import trio
import xxhash

from spokefs import metrics, protocol
from spokefs.errors import (
    CorruptBlock,
    GenerationGone,
    HubBehind,
    HubProtocolError,
    HubUnauthorized,
    HubUnavailable,
    SpokeError,
    StaleExport,
)
from spokefs.hub import wire
from spokefs.hub.bodies import FrameMismatch, origin_of, scanned, unframed
from spokefs.hub.link_model import WindowedMin
from spokefs.hub.origins import HubOrigins

log = logging.getLogger(__name__)

# httpcore receives 64 KiB per socket read, and every read is a trip through httpcore's and
# h11's Python: the snapshot (tens of MB for a large namespace) takes a 16th of the trips at
# 1 MiB. (Blob and pack answers do not go through httpx: ``hub.wire``.)
httpcore.AsyncHTTP11Connection.READ_NUM_BYTES = 1 << 20

T = TypeVar("T")

_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 5.0  # a hub back from an outage is noticed within this long
_MIN_ATTEMPT_S = 0.05  # no attempt starts with less time than this before the deadline
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})  # 408: our body came too slowly
# OpenSSL's X509_V_ERR_* for an issuer we do not trust (unknown, missing or self-signed)
_ISSUER_CODES = frozenset({2, 18, 19, 20, 21})
_SPARE_BUFFERS = 8  # receive buffers kept for the next blob answers (a few MiB each)
_ERROR_BODY_MAX = 64 << 10  # hubd's JSON errors are one line; read them so the connection stays
_TIER_PAUSE_S = 5.0  # a tier that did not answer is left alone this long, then tried again
_PROBE_TIMEOUT_S = 5.0  # a /healthz probe of a hub not in use: a few bytes, a few round trips


class SnapshotSink(Protocol):
    """Where ``HubClient.stream_snapshot`` feeds the compressed snapshot as it arrives."""

    async def restart(self) -> None:
        """A new attempt begins: what was fed before (if anything) is to be forgotten."""

    async def feed(self, chunk: bytes) -> None:
        """The next piece of the compressed snapshot."""


class _Retry(Exception):
    """A transient failure inside one attempt; ``reason`` labels the error metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class HubClient:
    """One pooled HTTP client for one hub.

    Attributes:
        base_url: the hub URL without a trailing slash.
        reachable: False after a request failed for a transient reason, True after one
            succeeded; transitions are logged once, not every failure.
    """

    def __init__(
        self,
        origins: HubOrigins | str,
        *,
        token: str | None,
        max_connections: int,
        request_timeout_s: float,
        deadline_s: float,
        tls: ssl.SSLContext | None = None,
        tier_url: str | None = None,
        failover_after_s: float = 10.0,
    ) -> None:
        self.origins = origins if isinstance(origins, HubOrigins) else HubOrigins([origins])
        self._deadline_s = deadline_s
        self._failover_after_s = failover_after_s
        # identity: bodies are read raw and capped, so nothing may inflate them on the way
        headers = {"User-Agent": "spokefs/0.1", "Accept-Encoding": "identity"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        def client(url: str) -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=url,
                headers=headers,
                timeout=httpx.Timeout(request_timeout_s, connect=min(request_timeout_s, 10.0)),
                limits=httpx.Limits(
                    max_connections=max_connections, max_keepalive_connections=max_connections
                ),
                trust_env=False,  # never route hub traffic through an HTTP_PROXY from the env
                follow_redirects=False,
                # https: the CLI's context (system roots by default); plain http has no
                # certificate, and True would load certifi's bundle for nothing (18-90 ms)
                verify=tls if tls is not None else urlsplit(url).scheme == "https",
            )

        def data_origin(url: str) -> wire.Origin:
            return wire.Origin(url, headers, timeout_s=request_timeout_s,
                               connect_timeout_s=min(request_timeout_s, 10.0),
                               max_connections=max_connections, tls=tls)

        self._hubs = {url: client(url) for url in self.origins.urls}
        # blob and pack answers (and the connections kept warm for them): hub.wire
        self._data_hubs = {url: data_origin(url) for url in self.origins.urls}
        self.tier_url = tier_url.rstrip("/") if tier_url else None
        self._tier = data_origin(self.tier_url) if self.tier_url else None
        self._tier_timeout_s = request_timeout_s
        self._tier_paused_until = 0.0
        self._tier_ok = True
        self.received_bytes = 0  # answer bytes from the hub so far (all kinds)
        self._waits = WindowedMin()  # answer waits: the round trip is their recent minimum
        self._spare_buffers: list[bytearray] = []  # receive buffers of answers checked

    @property
    def base_url(self) -> str:
        """The URL of the hub in use now."""
        return self.origins.current()

    @property
    def through_tier(self) -> bool:
        """Whether data goes through a regional tier, whose cache shares answers among
        spokes by URL (so a spoke asks for what others ask for: packs, not its own picks)."""
        return self._tier is not None

    @property
    def align_bytes(self) -> int:
        """The grid data ranges start and end on: a tier's cache slice (1 MiB of data), or
        one 4 KiB frame straight to the hub (a random read moves 4 KiB, not 1 MiB)."""
        return protocol.SLICE_DATA_BYTES if self._tier is not None else protocol.FRAME_DATA_BYTES

    def _receive_buffer(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes to receive a blob answer into: a spare one
        if one fits (a fresh one costs its pages' faults: 7 % of the samples of a cold GB of
        shards in one profile; the reuse measured within the spread)."""
        for i, buf in enumerate(self._spare_buffers):
            if size <= len(buf) <= 2 * size:
                return self._spare_buffers.pop(i)
        return protocol.receive_buffer(size)

    def _received(self, nbytes: int, origin: str = "hub") -> None:
        self._landed(nbytes)
        self._count(nbytes, origin)

    def _landed(self, nbytes: int) -> None:
        """Answer bytes as they arrive: the running total the link's rate is measured from."""
        self.received_bytes += nbytes

    @staticmethod
    def _count(nbytes: int, origin: str) -> None:
        metrics.LINK_BYTES.inc(nbytes)
        _FETCHED[origin].inc(nbytes)

    @property
    def rtt_s(self) -> float | None:
        """The shortest round trip of the last minute that a blob or pack request, or a
        touch that keeps a connection warm, measured (``wire.Answer.round_trip_s``): the
        path's round trip plus the hub's own time; the touches at mount give the first,
        before any data is asked for (None before any answer)."""
        return self._waits.value()

    async def __aenter__(self) -> HubClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            for http in self._hubs.values():
                await http.aclose()
            for pool in self._data_hubs.values():
                await pool.aclose()
            if self._tier is not None:
                await self._tier.aclose()

    async def stream_snapshot(self, sink: SnapshotSink, *,
                              deadline_s: float | None = None) -> int:
        """The compressed snapshot, fed to ``sink`` as it arrives; the bytes received.

        Each attempt begins with ``sink.restart()``: an attempt that fails part way is
        tried again from the snapshot's start.
        """

        async def attempt(base: str) -> int:
            await sink.restart()
            sent = time.monotonic()
            received = 0
            async with self._hubs[base].stream("GET", protocol.SNAPSHOT_PATH) as resp:
                self._waits.append(time.monotonic() - sent)
                self._check_status(resp, "snapshot")
                ctype = resp.headers.get("content-type", "")
                if not ctype.startswith(protocol.SNAPSHOT_MEDIA_TYPE):
                    raise protocol.WireError(f"content type {ctype[:60]!r}, not "
                                         f"{protocol.SNAPSHOT_MEDIA_TYPE}")
                async for chunk in resp.aiter_raw():
                    received += len(chunk)
                    await sink.feed(chunk)
            self._received(received)
            return received

        # The deadline bounds the attempts, not the transfer: a large namespace over a slow
        # link takes as long as it takes, and httpx's read timeout catches a stalled one.
        return await self._with_retries("snapshot", attempt, deadline_s, bound_attempt=False)

    async def fetch_changes(self, since: int, *, deadline_s: float | None = None) -> bytes:
        """The compressed changes since generation ``since``.

        Raises:
            GenerationGone: the hub no longer knows that generation (take a snapshot).
            HubBehind: that generation is newer than the hub's (a replica a rescan behind).
        """

        async def attempt(base: str) -> bytes:
            resp = await self._hubs[base].get(protocol.CHANGES_PATH, params={"since": str(since)})
            if resp.status_code == 410:
                metrics.HUB_REQUESTS.labels(kind="changes", status="410").inc()
                raise GenerationGone(f"hub has no changes since generation {since} (410)")
            if resp.status_code == 400:
                # we never send a malformed generation: ours is newer than the hub's
                metrics.HUB_REQUESTS.labels(kind="changes", status="400").inc()
                raise HubBehind(f"hub {base} is behind generation {since} (400)")
            self._check_status(resp, "changes")
            self._received(len(resp.content))
            return resp.content

        # bounded like a blob: a changes answer is small, and a stalled link must not hold
        # `spokefs refresh` for httpx's whole read timeout
        return await self._with_retries("changes", attempt, deadline_s, bound_attempt=True)

    async def fetch_frames(self, file_id: int, version: int, size: int,
                           start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of one version of a file of ``size`` bytes, verified frame
        by frame. ``start`` lies on a frame boundary, ``stop`` too or at ``size``.

        Raises StaleExport when the hub no longer has that version, HubUnavailable after
        the deadline, CorruptBlock when the frames fail their sums on every attempt.
        """
        assert start % protocol.FRAME_DATA_BYTES == 0 and start < stop <= size
        assert stop % protocol.FRAME_DATA_BYTES == 0 or stop == size
        path = protocol.blob_path(file_id, version)
        fstart, fstop = protocol.framed_size(start), protocol.framed_size(stop)
        headers = {"Range": f"bytes={fstart}-{fstop - 1}"}
        first_frame = start // protocol.FRAME_DATA_BYTES

        async def attempt(http: wire.Origin, origin: str) -> bytes:
            buf = self._receive_buffer(fstop - fstart)
            try:
                with memoryview(buf)[: fstop - fstart] as body:
                    async with http.get(path, headers) as resp:
                        origin = self._answered(resp, origin)
                        await self._check_streamed(resp, "blob")
                        # landed bytes count as they arrive: counted at the end, a few dozen
                        # answers that share the link ending together looked like a burst at
                        # several times its rate, and the bandwidth-delay product
                        # (link_model) with it. The metrics count once, at the end.
                        with _refusing_too_long():
                            got = await resp.read_into(body, self._landed)
                    self._count(got, origin)
                    if resp.status_code != 206 or got != fstop - fstart:
                        raise HubProtocolError(f"asked {fstop - fstart} framed bytes at "
                                               f"{fstart}, got {resp.status_code} with {got}")
                    try:
                        return unframed(body, file_id, version, first_frame)
                    except FrameMismatch as exc:
                        raise _Retry("checksum", str(exc)) from None
            finally:
                if len(self._spare_buffers) < _SPARE_BUFFERS:
                    self._spare_buffers.append(buf)

        try:
            return await self._data("blob", attempt)
        except HubUnavailable as exc:
            if isinstance(exc.__cause__, _Retry) and exc.__cause__.reason == "checksum":
                raise CorruptBlock(str(exc)) from exc
            raise

    async def fetch_pack(
        self, plan: protocol.PackPlan,
        on_file: Callable[[tuple[int, int], bytes | memoryview | None], None] | None = None,
    ) -> dict[tuple[int, int], bytes | memoryview | None]:
        """The members of one pack, ``(file_id, version) -> bytes`` (None: gone on the hub).

        The answer is decoded as it streams: each file is verified against the checksum in
        its record and handed to ``on_file`` the moment its last byte is in, so a reader
        waiting for one file does not wait for the rest of the pack. A retry fetches the
        pack again (its URL is fixed) and hands over only the files not handed over yet.

        Raises StaleExport when the hub's packs of the directory differ (412: another
        generation) or the directory is gone (404).
        """
        out: dict[tuple[int, int], bytes | memoryview | None] = {}
        items = plan.items
        # members add up to at most PACK_MAX_BYTES, plus one record header each
        cap = plan.file_bytes + len(items) * protocol.PACK_RECORD.size

        async def attempt(http: wire.Origin, origin: str) -> dict[
                tuple[int, int], bytes | memoryview | None]:
            decoder = protocol.PackDecoder(items)
            got = 0

            def landed(n: int) -> None:  # the members complete so far, handed over
                nonlocal got
                got += n
                self._received(n, origin)
                for key, rec in scanned(decoder, view, got):
                    if rec is not None and xxhash.xxh3_64_intdigest(rec[0]) != rec[1]:
                        raise _Retry("checksum", f"file {key[0]:x} in a pack failed its checksum")
                    if key in out:
                        continue  # handed over by an earlier attempt
                    data = None if rec is None else rec[0]
                    out[key] = data
                    if on_file is not None:
                        on_file(key, data)

            async with http.get(plan.path) as resp:
                origin = self._answered(resp, origin)
                await self._check_streamed(resp, "pack")
                # received in place into one buffer, the members handed over as views of it
                # (a copy, or three, per member was a tenth of a cold small file's CPU)
                size = cap if resp.length is None or resp.length > cap else resp.length
                view = memoryview(protocol.receive_buffer(size))
                with _refusing_too_long():
                    await resp.read_into(view, landed)
            try:
                decoder.finish(got)
            except protocol.WireError as exc:
                raise HubProtocolError(f"bad pack answer: {exc}") from None
            return out

        return await self._data("pack", attempt)

    def _answered(self, resp: wire.Answer, origin: str) -> str:
        """The answer's origin (``_origin``); its wait counts as a far round trip unless the
        tier answered from its cache (fills size their bytes in flight by the far link)."""
        origin = origin_of(resp, origin)
        if origin != "tier_hit":
            self._waits.append(resp.round_trip_s)
        return origin

    async def _data(
        self, kind: str, attempt: Callable[[wire.Origin, str], Awaitable[T]]
    ) -> T:
        """One data request: through the tier if there is one and it is not paused, else (or
        if the tier fails it in any way) from the hub, with retries until the deadline."""
        if self._tier is not None and time.monotonic() >= self._tier_paused_until:
            try:
                with trio.fail_after(self._tier_timeout_s):
                    result = await attempt(self._tier, "tier")
            except trio.TooSlowError:
                self._tier_failed(kind, "timeout", "no answer in time", pause=True)
            except wire.TransportError as exc:
                self._tier_failed(kind, "transport", f"{type(exc).__name__}: {exc}", pause=True)
            except _Retry as exc:
                reason = "checksum" if exc.reason == "checksum" else "status"
                self._tier_failed(kind, reason, str(exc), pause=False)
            except (HubProtocolError, protocol.WireError) as exc:
                self._tier_failed(kind, "protocol", str(exc), pause=False)
            except SpokeError as exc:  # 404, 412, 401 and the like from the tier
                self._tier_failed(kind, "status", str(exc), pause=False)
            else:
                if not self._tier_ok:
                    self._tier_ok = True
                    log.warning("tier %s serves good answers again", self.tier_url)
                return result
        return await self._with_retries(kind,
                                        lambda base: attempt(self._data_hubs[base], "hub"),
                                        None, bound_attempt=True)

    def _tier_failed(self, kind: str, reason: str, detail: str, *, pause: bool) -> None:
        metrics.TIER_FALLBACKS.labels(kind=kind, reason=reason).inc()
        if pause:
            self._tier_paused_until = time.monotonic() + _TIER_PAUSE_S
        if self._tier_ok:
            self._tier_ok = False
            log.warning("tier %s failed a %s request (%s: %s): reading from the hub %s",
                        self.tier_url, kind, reason, detail[:200], self.base_url)

    async def keep_warm(self, connections: Callable[[], int], interval_s: float, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep about ``connections()`` connections to the hub open: ``warm_up`` at once and
        every quarter of ``interval_s``, touching the idle connections unused for half of it
        (so none waits longer than three quarters of it: under the hub's keep-alive timeout).

        On a long link a new connection costs 1.5 round trips before its first request goes
        out (1.35 s at 900 ms): a burst of fills or reads that finds its connections open
        starts that much sooner. The requests are ``GET /healthz``: a few bytes each.
        """
        task_status.started()
        while True:
            await self.warm_up(connections(), interval_s, idle_s=interval_s / 2)
            await trio.sleep(interval_s / 4)

    async def warm_up(self, connections: int, deadline_s: float, idle_s: float = 0.0) -> None:
        """Bring the connections to the hub up to ``connections``, and touch the idle ones
        unused for ``idle_s``, all at once; never raises. Only those: a touch holds its
        connection for a round trip, and a reader's request that finds none idle meanwhile
        opens one (at 900 ms, touching every connection as a job started cost its first
        batch a round trip)."""
        origin = self._data_hubs[self.origins.current()]
        open_now, stale = origin.usage(idle_s)
        with trio.move_on_after(deadline_s):
            async with trio.open_nursery() as nursery:
                for _ in range(stale):
                    nursery.start_soon(self._touch, origin, "oldest")
                for _ in range(max(0, connections - open_now)):
                    nursery.start_soon(self._touch, origin, "new")

    async def _touch(self, origin: wire.Origin, on: wire.Which) -> None:
        try:
            async with origin.get(protocol.HEALTH_PATH, on=on) as resp:
                self._waits.append(resp.round_trip_s)  # at mount: the first round trips
                self._received(len(await resp.read(_ERROR_BODY_MAX)))
        except (wire.TransportError, wire.AnswerTooLong):
            pass  # a hub that is away is noticed by real requests

    async def probe(self, base: str) -> bool:
        """Whether the hub at ``base`` answers ``GET /healthz`` with 200; never raises."""
        try:
            with trio.fail_after(_PROBE_TIMEOUT_S):
                resp = await self._hubs[base].get(protocol.HEALTH_PATH)
        except (httpx.HTTPError, trio.TooSlowError):
            return False
        self._received(len(resp.content))
        return resp.status_code == 200

    async def _check_streamed(self, resp: wire.Answer, kind: str) -> None:
        """``_check_status`` for a data answer; an error's short body is read first so the
        connection can be reused."""
        if resp.status_code not in (200, 206):
            # an over-long error body: the connection is closed instead
            with contextlib.suppress(wire.AnswerTooLong):
                await resp.read(_ERROR_BODY_MAX)
        self._check_status(resp, kind)

    def _check_status(self, resp: httpx.Response | wire.Answer, kind: str) -> None:
        status = resp.status_code
        metrics.HUB_REQUESTS.labels(kind=kind, status=str(status)).inc()
        if status in (200, 206):
            return
        reason = resp.headers.get(protocol.HEADER_ERROR, "") or str(status)
        if status == 404 and kind == "snapshot":
            raise HubProtocolError(
                f"{self.base_url} does not speak protocol v{protocol.API_VERSION} (it answered "
                f"404 for {protocol.SNAPSHOT_PATH}): it is an older hubd (protocol v1?); this "
                f"spokefs needs a hubd of protocol v{protocol.API_VERSION}")
        if reason == protocol.ERROR_PROTOCOL_VERSION:
            raise HubProtocolError(f"hub answered {status} {reason}")
        if status in _RETRY_STATUSES:
            raise _Retry(f"http_{status}", f"hub answered {status} {reason}")
        if status in (404, 412):
            raise StaleExport(f"hub answered {status} {reason}")
        if status == 401:
            raise HubUnauthorized("hub refused the token (401): check --token-file")
        raise HubProtocolError(f"hub answered {status} {reason}")

    async def _with_retries(
        self,
        kind: str,
        attempt: Callable[[str], Awaitable[T]],
        deadline_s: float | None,
        *,
        bound_attempt: bool,
    ) -> T:
        deadline = time.monotonic() + (self._deadline_s if deadline_s is None else deadline_s)
        delay = _BACKOFF_FIRST_S
        tried: set[str] = set()  # hubs this request tried since its last backoff pause
        stale: set[str] = set()  # hubs that answered 404/412
        base = self.origins.current()
        while True:
            started = time.monotonic()
            # no attempt may run past the deadline: a hung hub must not hang the reader,
            # nor, with replicas, hold it from the next hub for long
            limit = max(deadline - started, 0.001) if bound_attempt else float("inf")
            if bound_attempt and self.origins.several:
                limit = min(limit, self._failover_after_s)
            tried.add(base)
            try:
                with trio.fail_after(limit):
                    result = await attempt(base)
            except trio.TooSlowError:
                failure = _Retry("timeout", f"no answer within {limit:.1f}s")
            except (httpx.TransportError, wire.TransportError, _Retry) as exc:
                if (untrusted := _certificate_failure(exc)) is not None:
                    # retrying cannot make a certificate verify: fail now, clearly
                    metrics.HUB_ERRORS.labels(reason="tls").inc()
                    raise HubUnavailable(f"hub {base}: {untrusted}") from _Retry(
                        "tls", untrusted)
                failure = exc if isinstance(exc, _Retry) else _Retry(type(exc).__name__, str(exc))
            except StaleExport as exc:
                stale.add(base)
                base, delay = await self._after_stale(exc, base, stale, deadline, delay)
                continue
            else:
                metrics.HUB_SECONDS.labels(kind=kind).observe(time.monotonic() - started)
                self.origins.worked(base)
                return result
            metrics.HUB_ERRORS.labels(reason=failure.reason).inc()
            self.origins.failed(base, f"{failure.reason}: {failure}")
            remaining = deadline - time.monotonic()
            if remaining <= _MIN_ATTEMPT_S:
                raise HubUnavailable(
                    f"hub {base} unavailable ({failure.reason}: {failure})"
                ) from failure
            metrics.HUB_RETRIES.inc()
            base = self.origins.current()
            if base not in tried:
                continue  # failed over to a hub this request has not tried: at once
            tried.clear()
            # full jitter: spread the retries of many readers over the whole interval; the
            # last pause ends at the deadline, for one last attempt there
            pause = min(random.uniform(0, delay), remaining - _MIN_ATTEMPT_S)
            await trio.sleep(pause)
            delay = min(delay * 2, _BACKOFF_MAX_S)
            base = self.origins.current()

    async def _after_stale(self, exc: StaleExport, base: str, stale: set[str],
                           deadline: float, delay: float) -> tuple[str, float]:
        """The hub to ask next (and the backoff) after ``base`` answered 404/412 (``exc``);
        raises ``exc`` when that answer is final.

        A replica a rescan behind its peer may not list a new file yet: ask the others. If
        every reachable hub says so but one is unreachable, that one (or these, after their
        next rescan) may list it: wait and ask again, as for an outage, until the deadline.
        """
        self.origins.worked(base)
        if deadline - time.monotonic() <= _MIN_ATTEMPT_S:
            raise exc
        if (other := self.origins.other_than(stale)) is not None:
            return other, delay
        if self.origins.all_reachable():
            raise exc
        stale.clear()
        await trio.sleep(min(random.uniform(0, delay),
                             deadline - time.monotonic() - _MIN_ATTEMPT_S))
        return self.origins.current(), min(delay * 2, _BACKOFF_MAX_S)


@contextlib.contextmanager
def _refusing_too_long() -> Iterator[None]:
    """A body longer than was asked for is a protocol error, not retried."""
    try:
        yield
    except wire.AnswerTooLong as exc:
        raise HubProtocolError(str(exc)) from None


_FETCHED = {origin: metrics.FETCHED_BYTES.labels(origin=origin)
            for origin in ("hub", "tier", "tier_hit", "tier_miss")}


def _certificate_failure(exc: BaseException) -> str | None:
    """The reason when ``exc`` comes from a server certificate that did not verify."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ssl.SSLCertVerificationError):
            why = cur.verify_message or cur.reason or "unknown reason"
            untrusted_issuer = cur.verify_code in _ISSUER_CODES
            hint = " (trust the hub's CA with --ca-file)" if untrusted_issuer else ""
            return f"certificate verify failed: {why}{hint}"
        cur = cur.__cause__ or cur.__context__
    return None
