"""hubd's domain exceptions and the one table that maps them to HTTP answers.

Handlers and the modules below them raise ``HubError`` subclasses; the error middleware in
``app.py`` is the only place that turns them (and aiohttp's own HTTP exceptions, and any
unexpected exception) into a response: ``{"error": reason, "detail": one line}`` as JSON
with the reason repeated in the ``X-Spokefs-Error`` header. hubd never answers 500.
"""

from __future__ import annotations

from typing import ClassVar


class HubError(Exception):
    """Base class: ``status`` and ``reason`` are the HTTP status and machine-readable reason.

    Attributes:
        detail: one human-readable line (no newlines), sent to the client.
        headers: extra response headers (``Content-Range``, ``Retry-After``...).
    """

    status: ClassVar[int] = 400
    reason: ClassVar[str] = "bad-request"

    def __init__(self, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = " ".join(detail.split())  # one line, whatever the caller passed
        self.headers = dict(headers or {})


class MalformedRequest(HubError):
    """aiohttp's parser rejected the request (its line, a header, its framing); the answer
    quotes none of it (``malformed.HubRequestHandler``)."""

    status = 400
    reason = "malformed-request"


class BadId(HubError):
    """A file id or version in the URL is not 16 lowercase hex digits."""

    status = 400
    reason = "bad-id"


class BadRange(HubError):
    """The Range header is malformed (not ``bytes=``, not numeric, end before start...)."""

    status = 400
    reason = "bad-range"


class BadPack(HubError):
    """A pack body is malformed (empty, not whole records, too many) or names a non-file."""

    status = 400
    reason = "bad-pack"


class ProtocolVersion(HubError):
    """A route of another protocol version (``wire.ERROR_PROTOCOL_VERSION``)."""

    status = 400
    reason = "protocol-version"


class BadGeneration(HubError):
    """``since`` is missing, not a decimal number, or newer than the current generation."""

    status = 400
    reason = "bad-generation"


class Unauthorized(HubError):
    """A token is configured and the request does not carry it."""

    status = 401
    reason = "unauthorized"


class Forbidden(HubError):
    """The file exists in the snapshot but hubd may not open it (EACCES)."""

    status = 403
    reason = "forbidden"


class RouteNotFound(HubError):
    status = 404
    reason = "not-found"


class UnknownFile(HubError):
    """No regular file with that id in the current snapshot, or it vanished from disk."""

    status = 404
    reason = "unknown-file"


class MethodNotAllowed(HubError):
    status = 405
    reason = "method-not-allowed"


class GenerationGone(HubError):
    """The changes since that generation are not kept (unknown or too old): take a snapshot."""

    status = 410
    reason = "generation-gone"


class StaleVersion(HubError):
    """The file id is known but the requested version is not the current one."""

    status = 412
    reason = "stale-version"


class RangeNotSatisfiable(HubError):
    """The range starts at or after the end of the file (or the file is empty)."""

    status = 416
    reason = "range-not-satisfiable"

    def __init__(self, detail: str, size: int | None = None) -> None:
        super().__init__(detail, {"Content-Range": f"bytes */{size}"} if size is not None else None)


class MultipleRanges(RangeNotSatisfiable):
    """hubd serves exactly one range per request."""

    reason = "multiple-ranges"


class Overloaded(HubError):
    """Every read slot stayed busy for too long; the client should retry soon."""

    status = 503
    reason = "overloaded"

    def __init__(self, detail: str, retry_after_s: int = 1) -> None:
        super().__init__(detail, {"Retry-After": str(retry_after_s)})


class ReadFailed(Overloaded):
    """The disk returned an I/O error; transient from the client's point of view."""

    reason = "read-failed"


class InternalError(Overloaded):
    """A bug in hubd: logged with its traceback, answered 503 so clients retry."""

    reason = "internal-error"


class StartupError(Exception):
    """hubd cannot start (ROOT missing, port busy...): ``cli`` prints one line and exits 1."""
