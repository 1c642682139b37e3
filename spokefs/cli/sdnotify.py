"""systemd's readiness protocol (``Type=notify``), without a dependency.

When systemd starts a unit with ``Type=notify`` it puts a datagram socket's path in
``NOTIFY_SOCKET``; the service sends ``READY=1`` there once it serves, so units ordered
after it (the training job) start only once the mount is up. Outside systemd the variable is
unset and ``notify`` does nothing.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to ``$NOTIFY_SOCKET``; True if it was sent.

    A failure is logged and otherwise ignored: the mount works without systemd.
    """
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # an abstract socket
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(path)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", path, exc)
        return False
    return True
