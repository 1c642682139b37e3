"""Requests aiohttp's parser rejects (a bad request line, a bad or oversized header, bad
framing): one fixed answer and one DEBUG line, neither quoting what the client sent.

aiohttp answers them itself, in ``RequestHandler.handle_error``, with a 400 whose text is
the parser's message, and that message quotes the offending bytes (``b'Bearer <token>'``
for a bad header); it logs the same message as an ERROR with a traceback. A client's
malformed request is not hubd's error and the bytes may hold a secret (a token sent to a
hub that echoes it into a proxy's log or a shared terminal), so:

- ``HubRequestHandler`` (aiohttp's per-connection protocol, as hubd runs it) answers 400
  ``malformed-request`` in hubd's usual error shape (``errors.MalformedRequest``), the same
  bytes whatever was sent, and closes the connection (the stream cannot be trusted after a
  framing error);
- ``ClientErrorFilter`` on the ``aiohttp.server`` logger turns any record aiohttp still
  logs about such a request into the same DEBUG line.
"""

from __future__ import annotations

import logging
import re

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from hubd.app import error_response
from hubd.errors import MalformedRequest

log = logging.getLogger(__name__)

MALFORMED_DETAIL = "malformed HTTP request"
# aiohttp's messages put the bytes after a colon, a new line or a space and a quote ("Bad
# status line 'GET ...'", "Invalid header value char:\n\n  b'...'"); what precedes them is
# the reason.
_QUOTED = re.compile(r":|\n| b?['\"]")
_MAX_REASON_CHARS = 100


class HubRequestHandler(web.RequestHandler):
    """aiohttp's ``RequestHandler`` with hubd's answer to requests its parser rejects."""

    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):  # a timeout or a bug: aiohttp's answer
            return super().handle_error(request, status, exc, message)
        log.debug("rejected a malformed request (%d): %s", exc.code, reason_of(exc))
        resp = error_response(MalformedRequest(MALFORMED_DETAIL))
        resp.force_close()
        return resp


def reason_of(exc: HttpProcessingError) -> str:
    """The parser's reason, without the bytes it quotes."""
    reason = _QUOTED.split(str(exc.message), maxsplit=1)[0]
    return " ".join(reason.split())[:_MAX_REASON_CHARS] or type(exc).__name__


class ClientErrorFilter(logging.Filter):
    """On ``aiohttp.server``: a record about a request the parser rejected becomes one DEBUG
    line, without the traceback and the bytes aiohttp quotes, dropped unless DEBUG is on."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        record.msg = "rejected a malformed request (%d): %s"
        record.args = (exc.code, reason_of(exc))
        record.exc_info = None
        record.exc_text = None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return log.isEnabledFor(logging.DEBUG)


def install_log_filters() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ClientErrorFilter) for f in server_log.filters):
        server_log.addFilter(ClientErrorFilter())
