"""hubd's file descriptors: the soft limit raised to the hard one at start, how many
connections that leaves room for, and how many descriptors are open.

Every connection is a descriptor, and so is every file a read holds open. A hub that runs
out of them cannot accept, open a file or list a directory; ``connection_cap`` keeps the
connections below the limit so reads and the scan still find descriptors when a crowd
connects (``conn_limit.ConnectionLimit`` refuses the excess).
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger(__name__)

FD_RESERVE = 64
"""Descriptors kept for everything but connections and the files reads hold: stdio (3),
the listening socket, epoll and the event loop's self-pipe (3), ROOT (1), the directories
the scan holds open (one per level of the tree it is in; real trees are 5-30 deep) and
those a confined open walks through for a moment, a bucket export's listing connections,
and slack for the interpreter and logging. A tree deeper than this leaves fewer for the
scan while every connection is taken, and its opens fail as ``EMFILE`` instead."""

MIN_CONNECTIONS = 8
"""The cap never goes below this: with so few descriptors hubd cannot serve a fleet
anyway, but a health check and a spoke or two still get through."""


def raise_nofile_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; returns the soft limit in force.

    One INFO line when it changed. Never fails: when the limit cannot be read or raised
    (a hard limit of "unlimited", which the kernel refuses as a soft limit), hubd keeps the
    one it has.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.debug("cannot raise the file descriptor limit from %d to %d: %s", soft, hard, exc)
        return soft
    log.info("file descriptor limit raised from %d to %d (the hard limit)", soft, hard)
    return hard


def connection_cap(soft: int, reads: int) -> int:
    """How many connections hubd holds at once with ``soft`` descriptors and ``reads`` read
    slots.

    A read holds one connection and at most one file (a bucket's: one S3 connection), so C
    connections need C + min(C, reads) descriptors beside ``FD_RESERVE``; the cap is the
    largest C for which that fits in ``soft``.
    """
    if soft == resource.RLIM_INFINITY:
        return soft
    room = soft - FD_RESERVE
    return max(MIN_CONNECTIONS, room // 2, room - reads)


def open_fds() -> int | None:
    """Descriptors open in this process, or None when ``/proc/self/fd`` cannot be listed
    (listing it takes a descriptor, so it fails exactly when none is left)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # not the listing's own
    except OSError:
        return None
