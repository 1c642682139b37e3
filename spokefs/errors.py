"""Domain exceptions of the spoke and their errno table. Nothing here knows FUSE: the one
boundary that turns these exceptions into FUSE replies is ``fuse_errors`` (the FUSE layer), so
the CLI and the domain modules import this module without pyfuse3.

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
| NoAttribute      | ENODATA | an attribute of ours that does not exist (ENOATTR)         |
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from typing import ClassVar


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


class NoAttribute(SpokeError):
    """An extended attribute in our namespace (``user.spokefs.``) that does not exist. An
    answer rather than a failure: the boundary neither counts nor logs it.

    ``ENODATA`` is what Linux calls ENOATTR (pyfuse3.ENOATTR is ENODATA there)."""

    code = errno.ENODATA


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

