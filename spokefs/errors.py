"""Domain exceptions of the spoke, their errno table, and the one boundary that turns them into
FUSE replies.

pyfuse3 turns only ``FUSEError`` into an errno reply; any other exception escaping a handler
ends ``pyfuse3.main()`` and takes the mount down for every reader. So domain code raises the
exceptions below and ``fuse_errors`` (used on every handler in ``fuse_ops``) converts them.
``trio.Cancelled`` is a BaseException and passes through untouched.

| exception        | errno   | when                                                       |
| ---------------- | ------- | ---------------------------------------------------------- |
| NotFound         | ENOENT  | a name or inode is not in the namespace                    |
| NotADir          | ENOTDIR | a directory operation on a non-directory                   |
| ReadOnly         | EROFS   | any write-like call, or open for writing                   |
| StaleExport      | ESTALE  | the version an open handle reads is gone on the hub        |
| HubUnavailable   | EIO     | the hub deadline passed (unreachable, 5xx, timeouts)       |
| CorruptBlock     | EIO     | bytes from the hub failed their checksum twice             |
| HubProtocolError | EIO     | the hub answered something the protocol does not allow     |
| PinLimit         | ENOSPC  | a pin would take the pinned bytes over their bound         |
| BadRequest       | EINVAL  | a control attribute names an unusable trace file           |
| NotPermitted     | EACCES  | a control attribute names a file its caller cannot read    |
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, ClassVar, ParamSpec, TypeVar

import pyfuse3

from spokefs import metrics

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class SpokeError(Exception):
    """Base of every expected failure; ``code`` is the errno a FUSE caller sees."""

    code: ClassVar[int] = errno.EIO


class NotFound(SpokeError):
    code = errno.ENOENT


class NotADir(SpokeError):
    code = errno.ENOTDIR


class ReadOnly(SpokeError):
    code = errno.EROFS


class StaleExport(SpokeError):
    code = errno.ESTALE


class HubUnavailable(SpokeError):
    code = errno.EIO


class HubProtocolError(SpokeError):
    code = errno.EIO


class HubUnauthorized(HubProtocolError):
    """The hub refused our token (401)."""


class GenerationGone(HubProtocolError):
    """The hub cannot list changes since our generation (410): take a full snapshot."""


class HubBehind(HubProtocolError):
    """Our generation is newer than the hub's (400 to ``/v2/changes``): a replica a rescan
    behind the one we got it from, or a hub that numbered one tree differently."""


class CorruptBlock(SpokeError):
    code = errno.EIO


class StoreFailed(SpokeError):
    """A local store (the namespace, a trace) could not be written: the disk is full or
    failing. The mount goes on with what it has; the caller retries later."""

    code = errno.ENOSPC


class PinLimit(SpokeError):
    code = errno.ENOSPC


class BadRequest(SpokeError):
    code = errno.EINVAL


class NotPermitted(SpokeError):
    code = errno.EACCES


class UserError(Exception):
    """A problem the person running the CLI can fix; printed as one line, exit code 1."""


def _leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


@contextlib.contextmanager
def single_spoke_error() -> Iterator[None]:
    """Around a nursery: a group made only of domain errors becomes its first one.

    Trio wraps what a nursery's children raise in an ExceptionGroup; a read that fails
    because the hub said 412 must still reach ``fuse_errors`` as a StaleExport (ESTALE),
    not as a group (an internal error, EIO). Anything else in the group (a bug,
    cancellation) propagates unchanged.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if leaves and all(isinstance(exc, SpokeError) for exc in leaves):
            raise leaves[0] from None
        raise


def fuse_errors(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn domain errors into ``FUSEError``; turn bugs into a loud EIO that keeps the mount up.

    Typed with ``Coroutine``, not ``Awaitable``: pyfuse3's ``Operations`` handlers are
    coroutine functions, and a wrapped handler must still override one."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except SpokeError as exc:
            metrics.FUSE_ERRORS.labels(op=fn.__name__, errno=errno.errorcode[exc.code]).inc()
            log.debug("%s failed: %s: %s", fn.__name__, type(exc).__name__, exc)
            raise pyfuse3.FUSEError(exc.code) from exc
        except Exception:  # a bug: keep the mount alive, but make it loud
            log.exception("internal error in %s", fn.__name__)
            metrics.INTERNAL_ERRORS.labels(op=fn.__name__).inc()
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper
