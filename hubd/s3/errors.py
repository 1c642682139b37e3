"""What can go wrong talking to S3, as exceptions the hub maps to its own answers.

- ``ObjectChanged``: 412 PreconditionFailed (``If-Match`` failed), or an answer with another
  ETag. The hub answers 412 ``stale-version``: the spoke's open file gets ESTALE.
- ``ObjectMissing``: 404 NoSuchKey; the hub answers 404 ``unknown-file``.
- ``BucketMissing``: 404 NoSuchBucket; at start an error line, in a rescan the old
  snapshot stays.
- ``AccessDenied``: 403 (AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch...); at
  start an error line, on a read 403 ``forbidden``.
- ``BadS3Answer``: any other 4xx, or a body that is not what S3 sends; the hub logs it and
  answers 503, which the spoke retries.
- ``S3Unavailable``: 5xx, 503 SlowDown, connection errors, until the deadline passed; the
  hub answers 503 ``read-failed``, which the spoke retries.
"""

from __future__ import annotations


class S3Error(Exception):
    """Base class. ``str(exc)`` is one line for logs and users, never a secret.

    Attributes:
        status: the HTTP status of the last answer (0: no answer, a connection error).
        code: S3's error code (``NoSuchKey``...), or "" when the answer had none.
    """

    def __init__(self, message: str, status: int = 0, code: str = "") -> None:
        super().__init__(" ".join(message.split()))
        self.status = status
        self.code = code


class ObjectChanged(S3Error):
    """The object is no longer the version (ETag) the snapshot recorded."""


class ObjectMissing(S3Error):
    """The key does not exist (any more)."""


class BucketMissing(S3Error):
    """The bucket does not exist."""


class AccessDenied(S3Error):
    """The credentials are wrong, or lack a permission (s3:ListBucket, s3:GetObject)."""


class BadS3Answer(S3Error):
    """An answer the client cannot use (another 4xx, a malformed body, a short body)."""


class S3Unavailable(S3Error):
    """The endpoint kept failing (5xx, throttling, no connection) until the deadline."""


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The exception to raise for a failed ``asyncio.TaskGroup``: its first ``S3Error``
    (an ``ObjectChanged`` before any other, so a replaced object is always reported as
    such), else its first exception. Callers catch single exceptions, never groups."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for kind in (ObjectChanged, S3Error):
        for exc in leaves:
            if isinstance(exc, kind):
                return exc
    return leaves[0]
