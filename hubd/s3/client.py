"""A thin S3 client on aiohttp: ListObjectsV2 pages and ranged GETs with ``If-Match``.

It runs inside hubd's asyncio loop (hubd is an aiohttp server), shares one connection pool
across requests, and signs every request itself (``sigv4.sign``). Nothing here blocks: the
only CPU work is signing (~20 µs) and parsing a LIST page's XML (~2 ms for 1,000 keys).

Retries: a connection error, a 5xx (500, 502, 503 incl. ``SlowDown``, 504) or a 429 is
retried with "full jitter" backoff (a random sleep of up to ``retry_base_s * 2**attempt``,
capped at ``retry_cap_s``), each request within ``deadline_s`` in total; when the deadline
passes, ``S3Unavailable`` carries the last failure. Every attempt is signed anew (a
signature is valid for 15 minutes; a retry must not reuse an old one). 4xx answers are
not retried: they become the exceptions of ``errors.py``.

Correctness of bytes: a GET carries ``If-Match`` with the ETag the snapshot recorded, so a
replaced object is a 412 (``ObjectChanged``), never the new bytes under the old version;
the answer's own ETag and length are checked too, for servers that ignore ``If-Match``.
Bodies are never decompressed (``auto_decompress=False``): an object stored with
``Content-Encoding: gzip`` is served as the bytes it holds. A range longer than
``part_bytes`` is fetched as parts in parallel (one S3 connection carries ~100 MB/s at
best), each part with the same ``If-Match``, so the parts are of one version.
``get_streamed`` hands a GET's body on in pieces as they arrive (the hub frames and sends
the first MiB while the rest is still coming); a connection lost mid-body is retried from
the first byte not yet handed on, with the same ``If-Match``, so the pieces are of one
version too.

State transitions are logged once ("unreachable" / "reachable again"), not every failure.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar
from urllib.parse import unquote_plus, urlsplit

import aiohttp
from yarl import URL

from hubd.s3.config import S3Config
from hubd.s3.errors import (
    AccessDenied,
    BadS3Answer,
    BucketMissing,
    ObjectChanged,
    ObjectMissing,
    S3Error,
    S3Unavailable,
    first_error,
)
from hubd.s3.sigv4 import EMPTY_SHA256, Credentials, host_header, sign, uri_encode

log = logging.getLogger(__name__)
_T = TypeVar("_T")

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_DENIED_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                           "InvalidToken", "ExpiredToken", "TokenRefreshRequired",
                           "AllAccessDisabled", "InvalidSecurity", "RequestTimeTooSkewed"})


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object of a listing. ``etag`` keeps its quotes, as S3 sends it (and as
    ``If-Match`` wants it); ``mtime_ns`` is LastModified in nanoseconds since the epoch."""

    key: str
    size: int
    etag: str
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class ListPage:
    """One ListObjectsV2 answer: objects, common prefixes (with a delimiter), and the token
    of the next page (None on the last one)."""

    objects: list[ObjectInfo]
    prefixes: list[str]
    next_token: str | None


@dataclass(slots=True)
class ClientStatistics:
    """Counters since the client was made (for benchmarks and metrics)."""

    requests: int = 0
    retries: int = 0
    list_pages: int = 0
    get_bytes: int = 0


def _tag(elem: ET.Element) -> str:
    return elem.tag.rpartition("}")[2]


def _child_text(elem: ET.Element, name: str) -> str:
    for child in elem:
        if _tag(child) == name:
            return child.text or ""
    return ""


def parse_timestamp_ns(text: str) -> int:
    """``2026-12-03T08:00:31.123Z`` -> nanoseconds since the epoch (exact, no float)."""
    moment = datetime.datetime.fromisoformat(text.strip())
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return (moment - _EPOCH) // datetime.timedelta(microseconds=1) * 1000


def _decode_key(text: str) -> str:
    """A key of an ``EncodingType=url`` answer (``+`` is a space, as botocore reads it)."""
    return unquote_plus(text) if "%" in text or "+" in text else text


def parse_list_page(body: bytes) -> ListPage:
    """A ListObjectsV2 answer; keys are URL-decoded when the answer says ``EncodingType=url``.

    Cost: ~6-9 µs per key here, two thirds of it in ``ET.fromstring``; ``S3Client.list_page``
    runs it in a thread so a 1,000-key page (~8 ms) never stalls the event loop.

    Raises:
        BadS3Answer: not the XML of a ListBucketResult, or an object without its fields.
    """
    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        raise BadS3Answer(f"LIST answer is not XML: {exc}") from None
    if _tag(root) != "ListBucketResult":
        raise BadS3Answer(f"LIST answer is a {_tag(root)}, not a ListBucketResult")
    ns = root.tag[: -len("ListBucketResult")]  # "{http://s3.amazonaws.com/...}" or ""
    key_tag, size_tag, etag_tag, time_tag = (ns + "Key", ns + "Size", ns + "ETag",
                                             ns + "LastModified")
    decode = (root.findtext(ns + "EncodingType") or "").strip().lower() == "url"
    times: dict[str, int] = {}  # keys written together share LastModified values
    objects: list[ObjectInfo] = []
    try:
        for item in root.iterfind(ns + "Contents"):
            key, size = item.findtext(key_tag), item.findtext(size_tag)
            etag, stamp = item.findtext(etag_tag), item.findtext(time_tag)
            if key is None or size is None or etag is None or stamp is None:
                raise ValueError("Key, Size, ETag or LastModified missing")
            mtime = times.get(stamp)
            if mtime is None:
                mtime = times[stamp] = parse_timestamp_ns(stamp)
            objects.append(ObjectInfo(_decode_key(key) if decode else key, int(size), etag,
                                      mtime))
    except ValueError as exc:
        raise BadS3Answer(f"LIST answer has a malformed object entry ({exc})") from None
    prefixes = [p or "" for p in (c.findtext(ns + "Prefix")
                                  for c in root.iterfind(ns + "CommonPrefixes"))]
    if decode:
        prefixes = [_decode_key(p) for p in prefixes]
    truncated = (root.findtext(ns + "IsTruncated") or "").strip().lower() == "true"
    token = root.findtext(ns + "NextContinuationToken") or ""
    if truncated and not token:
        raise BadS3Answer("LIST answer is truncated but has no NextContinuationToken")
    return ListPage(objects, prefixes, token if truncated else None)


def error_of(status: int, body: bytes, what: str) -> S3Error:
    """The exception for a non-2xx answer to the request described by ``what``."""
    code = message = ""
    if body:
        try:
            root = ET.fromstring(body)
            code, message = _child_text(root, "Code"), _child_text(root, "Message")
        except ET.ParseError:
            pass
    text = f"{what}: HTTP {status}" + (f" {code}" if code else "") + \
        (f" ({message[:200]})" if message else "")
    if status == 412 or code == "PreconditionFailed":
        return ObjectChanged(text, status, code)
    if code == "NoSuchBucket":
        return BucketMissing(text, status, code)
    if status == 404:
        return ObjectMissing(text, status, code)
    if status in (401, 403) or code in _DENIED_CODES:
        return AccessDenied(text, status, code)
    if status in RETRY_STATUSES:
        return S3Unavailable(text, status, code)
    return BadS3Answer(text, status, code)


class S3Client:
    """Signed requests to one endpoint through one aiohttp connection pool.

    Use as ``async with S3Client(cfg, creds) as client:`` inside a running loop.

    Attributes:
        stats: request counters (``ClientStatistics``).
    """

    def __init__(self, cfg: S3Config, creds: Credentials) -> None:
        parts = urlsplit(cfg.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname or \
                parts.path.strip("/") or parts.query:
            raise ValueError(f"bad S3 endpoint {cfg.endpoint!r}: want http(s)://HOST[:PORT]")
        self.cfg = cfg
        self._creds = creds
        self._base = f"{parts.scheme}://{parts.netloc}"
        self._session: aiohttp.ClientSession | None = None
        self._reachable = True
        self.stats = ClientStatistics()

    async def __aenter__(self) -> S3Client:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s,
                                        sock_read=self.cfg.read_timeout_s)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.cfg.max_connections),
            timeout=timeout, auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def url(self, bucket: str, key: str = "", query: str = "") -> str:
        """The encoded URL of ``key`` in ``bucket`` (of the bucket itself for ``key=""``)."""
        path = "/" + uri_encode(key, keep_slash=True)
        if self.cfg.virtual_hosted:
            scheme, _, host = self._base.partition("://")
            base = f"{scheme}://{bucket}.{host}"
        else:
            base = f"{self._base}/{uri_encode(bucket, keep_slash=False)}"
            path = path if key else ""
        return base + path + (f"?{query}" if query else "")

    async def list_page(self, bucket: str, prefix: str, *, delimiter: str = "",
                        token: str | None = None, start_after: str | None = None,
                        max_keys: int = 1000) -> ListPage:
        """One page of ListObjectsV2 (``max_keys`` at most 1,000: S3's own cap).

        Raises:
            BucketMissing, AccessDenied, BadS3Answer, S3Unavailable.
        """
        params = [("list-type", "2"), ("encoding-type", "url"), ("max-keys", str(max_keys)),
                  ("prefix", prefix)]
        if delimiter:
            params.append(("delimiter", delimiter))
        if token is not None:
            params.append(("continuation-token", token))
        if start_after is not None:
            params.append(("start-after", start_after))
        query = "&".join(f"{uri_encode(k, keep_slash=False)}={uri_encode(v, keep_slash=False)}"
                         for k, v in params)
        _, _, body = await self._request("GET", self.url(bucket, query=query), {}, (200,),
                                         f"LIST s3://{bucket}/{prefix}")
        self.stats.list_pages += 1
        return await asyncio.to_thread(parse_list_page, body)

    async def get(self, bucket: str, key: str, etag: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of the object at version ``etag`` (parts in parallel
        above ``part_bytes``).

        Raises:
            ObjectChanged: the object is no longer ``etag`` (412, or another ETag came back).
            ObjectMissing, AccessDenied, BadS3Answer (e.g. a range past the end),
            S3Unavailable.
        """
        if stop <= start:
            return b""
        part = self.cfg.part_bytes
        if stop - start <= part:
            return await self._get_part(bucket, key, etag, start, stop)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._get_part(bucket, key, etag, s,
                                                          min(s + part, stop)))
                         for s in range(start, stop, part)]
        except ExceptionGroup as group_error:
            raise first_error(group_error) from None
        return b"".join(t.result() for t in tasks)

    async def get_streamed(self, bucket: str, key: str, etag: str, start: int, stop: int,
                           chunk: int, deliver: Callable[[list[memoryview]], None]) -> None:
        """Bytes ``[start, stop)`` of the object at version ``etag``, handed to ``deliver``
        in consecutive pieces cut at the multiples of ``chunk`` (object offsets: the first
        and the last piece may be shorter), each as soon as it has arrived: one GET,
        resumed after the last piece delivered if it breaks.

        A piece is the list of views of the received buffers that hold its bytes, in order:
        never joined here (``protocol.encode_frames`` frames such a list as one).

        Raises:
            as ``get``; the pieces delivered before the error are good.
        """
        what = f"GET s3://{bucket}/{key} bytes {start}-{stop - 1}"
        pos = start

        def advance(piece: list[memoryview]) -> None:
            nonlocal pos
            size = sum(len(view) for view in piece)
            pos += size
            self.stats.get_bytes += size
            deliver(piece)

        if stop > start:
            await self._retrying(lambda: self._stream_attempt(
                bucket, key, etag, pos, stop, chunk, advance, what), what)

    async def _stream_attempt(self, bucket: str, key: str, etag: str, start: int, stop: int,
                              chunk: int, deliver: Callable[[list[memoryview]], None],
                              what: str) -> None:
        assert self._session is not None
        url = self.url(bucket, key)
        headers = {"Range": f"bytes={start}-{stop - 1}", "If-Match": etag}
        signed = sign("GET", url, headers, EMPTY_SHA256, self._creds, self.cfg.region,
                      datetime.datetime.now(datetime.UTC))
        self.stats.requests += 1
        try:
            async with self._session.request("GET", URL(url, encoded=True),
                                             headers={"Host": host_header(url), **headers,
                                                      **signed}) as resp:
                if resp.status not in (200, 206):
                    raise error_of(resp.status, await resp.read(), what)
                answer_etag = resp.headers.get("ETag", "")
                if answer_etag and answer_etag != etag:
                    raise ObjectChanged(f"{what}: ETag {answer_etag}, not {etag}", resp.status)
                pos = 0 if resp.status == 200 else start  # 200: the server ignored Range
                if resp.content_length is not None and resp.content_length < stop - pos:
                    raise BadS3Answer(f"{what}: {resp.content_length} bytes announced, not "
                                      f"{stop - start}", resp.status)
                self._note_reachable()
                piece: list[memoryview] = []
                edge = min((start // chunk + 1) * chunk, stop)  # where the piece ends
                while pos < stop:
                    received = await resp.content.readany()  # as it arrived: no copy
                    if not received:
                        raise asyncio.IncompleteReadError(b"", stop - pos)
                    view = memoryview(received)
                    if pos < start:  # before the range (a 200)
                        view = view[start - pos:]
                        pos = min(pos + len(received), start)
                    while view and pos < stop:
                        take = view[:edge - pos]
                        piece.append(take)
                        pos += len(take)
                        view = view[len(take):]
                        if pos == edge:
                            deliver(piece)
                            piece = []
                            edge = min(edge + chunk, stop)
        except (aiohttp.ClientError, asyncio.IncompleteReadError, TimeoutError) as exc:
            detail = str(exc) or type(exc).__name__
            raise S3Unavailable(f"{what}: {detail}") from None

    async def _get_part(self, bucket: str, key: str, etag: str, start: int,
                        stop: int) -> bytes:
        what = f"GET s3://{bucket}/{key} bytes {start}-{stop - 1}"
        headers = {"Range": f"bytes={start}-{stop - 1}", "If-Match": etag}
        status, answer_etag, body = await self._request("GET", self.url(bucket, key), headers,
                                                        (200, 206), what)
        if answer_etag and answer_etag != etag:
            raise ObjectChanged(f"{what}: ETag {answer_etag}, not {etag}", status)
        if status == 200 and len(body) >= stop:  # the server ignored Range: cut it out
            body = body[start:stop]
        if len(body) != stop - start:
            raise BadS3Answer(f"{what}: got {len(body)} bytes, not {stop - start}", status)
        self.stats.get_bytes += len(body)
        return body

    async def _request(self, method: str, url: str, headers: dict[str, str],
                       ok: tuple[int, ...], what: str) -> tuple[int, str, bytes]:
        """Send with retries until an ``ok`` status or the deadline: (status, ETag, body)."""
        return await self._retrying(lambda: self._attempt(method, url, headers, ok, what), what)

    async def _retrying(self, attempt_once: Callable[[], Awaitable[_T]], what: str) -> _T:
        """``attempt_once()`` again after each ``S3Unavailable``, with backoff and jitter,
        until it succeeds or the deadline passes."""
        assert self._session is not None, "use S3Client in 'async with'"
        attempt = 0
        last: S3Error | None = None
        try:
            async with asyncio.timeout(self.cfg.deadline_s):
                while True:
                    try:
                        return await attempt_once()
                    except S3Unavailable as exc:
                        last = exc
                        self._note_unreachable(exc)
                    ceiling = min(self.cfg.retry_cap_s, self.cfg.retry_base_s * 2**attempt)
                    attempt += 1
                    self.stats.retries += 1
                    await asyncio.sleep(random.uniform(0, ceiling))
        except TimeoutError:
            reason = str(last) if last is not None else "no answer"
            raise S3Unavailable(f"{what}: no answer within {self.cfg.deadline_s:g} s "
                                f"({attempt + 1} attempts; last: {reason})",
                                last.status if last else 0,
                                last.code if last else "") from None

    async def _attempt(self, method: str, url: str, headers: dict[str, str],
                       ok: tuple[int, ...], what: str) -> tuple[int, str, bytes]:
        assert self._session is not None
        signed = sign(method, url, headers, EMPTY_SHA256, self._creds, self.cfg.region,
                      datetime.datetime.now(datetime.UTC))
        all_headers = {"Host": host_header(url), **headers, **signed}
        self.stats.requests += 1
        try:
            async with self._session.request(method, URL(url, encoded=True),
                                             headers=all_headers) as resp:
                body = await resp.read()
                status, etag = resp.status, resp.headers.get("ETag", "")
        except (aiohttp.ClientError, TimeoutError) as exc:
            detail = str(exc) or type(exc).__name__
            raise S3Unavailable(f"{what}: {detail}") from None
        if status not in ok:
            raise error_of(status, body, what)
        self._note_reachable()
        return status, etag, body

    def _note_reachable(self) -> None:
        if not self._reachable:
            self._reachable = True
            log.info("S3 endpoint %s reachable again", self._base)

    def _note_unreachable(self, exc: S3Error) -> None:
        if self._reachable:
            self._reachable = False
            log.warning("S3 endpoint %s failing, retrying: %s", self._base, exc)
