"""AWS Signature Version 4 for S3 requests, as one pure function.

``sign(...)`` takes everything the signature depends on (method, URL, headers, payload hash,
credentials, region, time) and returns the headers to add to the request; it does no I/O and
reads no clock, so the tests check it against botocore's ``S3SigV4Auth`` case by case.

S3's flavour of SigV4 (what differs from the generic algorithm):

- The canonical URI is the request path exactly as sent (already percent-encoded once), not
  normalised and not encoded a second time: a key ``a/./b`` or ``a//b`` is signed as is.
- The payload hash is always sent as ``x-amz-content-sha256`` and signed; a GET or a LIST has
  an empty body, so its hash is ``EMPTY_SHA256``.
- Every header the caller passes is signed (``range``, ``if-match``...), plus ``host``,
  ``x-amz-date``, ``x-amz-content-sha256`` and, with temporary credentials,
  ``x-amz-security-token``. A header the server sees but was not signed is allowed; one
  that was signed but changed on the way (a proxy rewriting ``Host``) fails the signature.

The caller must send the URL byte for byte as signed: with aiohttp, as
``yarl.URL(url, encoded=True)``, or yarl re-encodes the path and the query.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

ALGORITHM = "AWS4-HMAC-SHA256"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_TIMESTAMP = "%Y%m%dT%H%M%SZ"
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class Credentials:
    """An access key pair, with a session token for temporary credentials.

    Attributes:
        source: where the keys came from (for log lines; never the keys themselves).
    """

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)
    source: str = ""


def uri_encode(text: str, *, keep_slash: bool) -> str:
    """Percent-encode ``text`` (UTF-8) as SigV4 wants: only ``A-Za-z0-9-_.~`` stay as they
    are (and ``/`` in a path)."""
    return quote(text, safe="/~" if keep_slash else "~")


def canonical_query(query: str) -> str:
    """The canonical form of an already encoded query string: pairs sorted by name, then
    value (``a&b=1`` -> ``a=&b=1``)."""
    if not query:
        return ""
    pairs = sorted(pair.partition("=")[::2] for pair in query.split("&"))
    return "&".join(f"{name}={value}" for name, value in pairs)


def host_header(url: str) -> str:
    """The ``Host`` value of ``url``: lowercase, ``[...]`` around IPv6, the port only when it
    is not the scheme's default (what HTTP clients send, and what botocore signs)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None and parts.port != _DEFAULT_PORTS.get(parts.scheme):
        host = f"{host}:{parts.port}"
    return host


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode("utf-8"), hashlib.sha256).digest()


def signing_key(secret: str, day: str, region: str, service: str) -> bytes:
    """The derived key of one day, region and service (cacheable for the day)."""
    k_date = _hmac(("AWS4" + secret).encode("utf-8"), day)
    return _hmac(_hmac(_hmac(k_date, region), service), "aws4_request")


def sign(method: str, url: str, headers: Mapping[str, str], payload_sha256: str,
         creds: Credentials, region: str, now: datetime.datetime,
         service: str = "s3") -> dict[str, str]:
    """The headers that authenticate one request.

    Args:
        method: the HTTP method (any case).
        url: the full URL exactly as it will be sent: path and query already encoded.
        headers: the request's other headers, all of which are signed (names in any case;
            no ``Host``: it comes from ``url``).
        payload_sha256: the hex SHA-256 of the body (``EMPTY_SHA256`` for none).
        now: the signing time, timezone-aware (the server allows 15 minutes of skew).

    Returns:
        ``Authorization``, ``X-Amz-Date``, ``X-Amz-Content-SHA256`` and, with a session
        token, ``X-Amz-Security-Token``: add them to ``headers`` and send.
    """
    parts = urlsplit(url)
    stamp = now.astimezone(datetime.UTC).strftime(_TIMESTAMP)
    added = {"X-Amz-Date": stamp, "X-Amz-Content-SHA256": payload_sha256}
    if creds.session_token:
        added["X-Amz-Security-Token"] = creds.session_token
    signed: dict[str, str] = {"host": host_header(url)}
    for name, value in (*headers.items(), *added.items()):
        signed[name.lower()] = " ".join(value.split())
    names = sorted(signed)
    signed_names = ";".join(names)
    canonical = "\n".join((
        method.upper(), parts.path or "/", canonical_query(parts.query),
        "".join(f"{n}:{signed[n]}\n" for n in names), signed_names, payload_sha256,
    ))
    scope = f"{stamp[:8]}/{region}/{service}/aws4_request"
    to_sign = "\n".join((ALGORITHM, stamp, scope,
                         hashlib.sha256(canonical.encode("utf-8")).hexdigest()))
    key = signing_key(creds.secret_access_key, stamp[:8], region, service)
    signature = hmac.new(key, to_sign.encode("utf-8"), hashlib.sha256).hexdigest()
    added["Authorization"] = (f"{ALGORITHM} Credential={creds.access_key_id}/{scope}, "
                              f"SignedHeaders={signed_names}, Signature={signature}")
    return added
