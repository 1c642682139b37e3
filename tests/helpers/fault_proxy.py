"""An HTTP proxy in front of a real S3 server that injects failures (for retry tests).

``FaultProxy(upstream)`` runs in the test's own asyncio loop (``async with``), listens on
127.0.0.1, and forwards every request unchanged (``Host`` and ``Authorization`` included, so
SigV4 still verifies upstream) except the first ``fail_first`` ones, answered with
``fail_status`` and S3's ``SlowDown`` error body. ``seen`` counts the requests received.
With ``cut_gets``, the first ``cut_gets`` ranged GETs answered 206 are cut: their headers
(the full ``Content-Length`` included) and ``cut_after`` bytes of the body are sent, then
the connection is dropped, as a broken connection mid-body does. ``ranges`` lists the
``Range`` header of every ranged GET received. With ``whole_object``, a ranged GET answered
206 is answered 200 with those bytes (the whole object, which the test gives) instead, as a
server that ignores ``Range`` does.
"""

from __future__ import annotations

from types import TracebackType

import aiohttp
from aiohttp import web
from yarl import URL

SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 b"<Message>Please reduce your request rate.</Message></Error>")
DENIED_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
               b"<Message>Access Denied</Message></Error>")
_HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})


class FaultProxy:
    """Forwards to ``upstream``; fails the first ``fail_first`` requests.

    Attributes:
        endpoint: ``http://127.0.0.1:PORT`` once entered.
        seen: requests received so far.
    """

    def __init__(self, upstream: str, fail_first: int = 0, fail_status: int = 503,
                 deny_query: str | None = None, cut_gets: int = 0,
                 cut_after: int = 0, whole_object: bytes | None = None) -> None:
        self.upstream = upstream
        self.whole_object = whole_object
        self.cut_gets = cut_gets
        self.cut_after = cut_after
        self.ranges: list[str] = []
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.deny_query = deny_query
        self.seen = 0
        self.endpoint = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> FaultProxy:
        self._session = aiohttp.ClientSession(auto_decompress=False,
                                              skip_auto_headers=("Accept-Encoding",
                                                                 "User-Agent", "Content-Type"))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.seen += 1
        if self.seen <= self.fail_first:
            return web.Response(status=self.fail_status, body=SLOWDOWN_BODY,
                                content_type="application/xml")
        if self.deny_query is not None and self.deny_query in request.raw_path:
            return web.Response(status=403, body=DENIED_BODY, content_type="application/xml")
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        body = await request.read()
        url = URL(self.upstream + request.raw_path, encoded=True)
        if "Range" in request.headers:
            self.ranges.append(request.headers["Range"])
        async with self._session.request(request.method, url, headers=headers,
                                         data=body or None) as resp:
            data = await resp.read()
            out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
            if resp.status == 206 and self.cut_gets > 0:
                self.cut_gets -= 1
                return await self._cut(request, resp.status, out, data)
            if resp.status == 206 and self.whole_object is not None:
                out.pop("Content-Range", None)
                return web.Response(status=200, body=self.whole_object, headers=out)
            return web.Response(status=resp.status, body=data, headers=out)

    async def _cut(self, request: web.Request, status: int, headers: dict[str, str],
                   data: bytes) -> web.StreamResponse:
        """Announce all of ``data``, send ``cut_after`` bytes of it, drop the connection."""
        cut = web.StreamResponse(status=status, headers=headers)
        cut.content_length = len(data)
        await cut.prepare(request)
        await cut.write(data[: self.cut_after])
        assert request.transport is not None
        request.transport.abort()
        return cut
