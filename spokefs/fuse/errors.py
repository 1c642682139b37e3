"""The errno boundary between the domain and FUSE: ``fuse_errors``, on every handler in
``fuse.ops``.

pyfuse3 turns only ``FUSEError`` into an errno reply; any other exception escaping a handler
ends ``pyfuse3.main()`` and takes the mount down for every reader. So domain code raises the
exceptions of ``errors`` (each with its errno in ``SpokeError.code``) and ``fuse_errors``
converts them: a domain error becomes its errno (counted in ``spokefs_fuse_errors_total``),
a bug a loud ``EIO`` that keeps the mount up. ``NoAttribute`` is an answer, not a failure:
its errno (ENOATTR) goes back uncounted, as for attributes outside ours. ``trio.Cancelled``
is a BaseException and passes through untouched.

Part of the FUSE layer (docs/contributing.md): only these modules import pyfuse3.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import pyfuse3

from spokefs import metrics
from spokefs.errors import NoAttribute, SpokeError

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


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
        except NoAttribute as exc:
            raise pyfuse3.FUSEError(exc.code) from None
        except SpokeError as exc:
            metrics.FUSE_ERRORS.labels(op=fn.__name__, errno=errno.errorcode[exc.code]).inc()
            log.debug("%s failed: %s: %s", fn.__name__, type(exc).__name__, exc)
            raise pyfuse3.FUSEError(exc.code) from exc
        except Exception:  # a bug: keep the mount alive, but make it loud
            log.exception("internal error in %s", fn.__name__)
            metrics.INTERNAL_ERRORS.labels(op=fn.__name__).inc()
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper
