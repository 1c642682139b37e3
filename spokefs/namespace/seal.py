"""A digest of the namespace file, written at a clean close and checked at the next open.

The namespace's records carry no checksums (a million entries load in seconds because each
is a few plain fields), so a byte flipped in ``data.mdb`` while the node is down (a failing
disk, a stray write) would be served as it is: a name that vanished, or worse, a size that
shrank, so a read would end early. LMDB changes ``data.mdb`` only in write transactions,
so a file that was closed cleanly must be byte for byte what it was: ``seal`` stores the
xxh3-128 of the whole file beside it at close (about 0.2 s per GB; a million entries take
a few hundred MB), and ``check`` at the next open compares and removes the seal, so a
later write or crash can never be mistaken for a match.

A mismatch sets the file aside (``data.mdb.corrupt-<time>``) and the mount loads a fresh
snapshot from the hub, before it serves anything. No seal (the first mount, a kill, an
older version) means nothing to compare: the namespace is used as it is, as before.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

SEAL_NAME = "clean-digest"
_READ_BYTES = 8 << 20


def seal(env_dir: Path) -> None:
    """Store the digest of ``data.mdb`` (the environment must be closed)."""
    try:
        digest = _digest(env_dir / "data.mdb")
        tmp = env_dir / (SEAL_NAME + ".tmp")
        tmp.write_text(digest + "\n")
        os.replace(tmp, env_dir / SEAL_NAME)
    except OSError as exc:  # no seal: the next open checks nothing, which is safe
        log.warning("namespace: could not seal %s: %s", env_dir, exc)


def check(env_dir: Path) -> bool:
    """Whether ``data.mdb`` is as it was sealed (True when there is no seal); removes the
    seal, and sets a file that does not match aside."""
    seal_file = env_dir / SEAL_NAME
    data = env_dir / "data.mdb"
    try:
        want = seal_file.read_text().strip()
    except FileNotFoundError:
        return True
    except OSError as exc:
        log.warning("namespace: unreadable seal %s: %s", seal_file, exc)
        want = ""
    seal_file.unlink(missing_ok=True)
    try:
        if not data.exists() or _digest(data) == want:
            return True
    except OSError as exc:
        log.warning("namespace: cannot read %s: %s", data, exc)
    aside = data.with_name(f"data.mdb.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
    log.error("namespace %s changed since it was closed cleanly (a failing disk?): moved to "
              "%s, loading a fresh snapshot from the hub", data, aside.name)
    from spokefs import metrics  # here: the snapshot loader child imports this module,
    # and the metrics (prometheus_client, 40 ms) would delay the load it is started for
    metrics.NAMESPACE_CORRUPTIONS.inc()
    os.replace(data, aside)
    (env_dir / "lock.mdb").unlink(missing_ok=True)
    return False


def _digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
