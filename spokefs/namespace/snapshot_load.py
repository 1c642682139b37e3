"""Loading a full snapshot in a child process, so its memory goes back to the system.

A snapshot is loaded in one LMDB write transaction (the old namespace stays whole until it
commits). Without ``writemap`` LMDB builds the pages that transaction dirties in memory it
allocates, and after the commit it keeps them on its own free list: a million entries left
~250 MiB of anonymous memory in the spoke for as long as it ran. The load itself (decode,
``putmulti``) runs here in a child (``python -m spokefs.namespace.snapshot_load NAMESPACE_DIR``) on
the same LMDB environment, which LMDB supports across processes; the child's memory goes
when it exits, and the mount re-reads the namespace's info after it commits.

Protocol with the child: the compressed snapshot on stdin; on success exit 0 and a pickled
``namespace.Applied`` on stdout; a malformed or hostile snapshot exits ``_BAD_SNAPSHOT``
with the reason as the last line of stderr (nothing changed); anything else is a failure
of the child (its stderr's last line says what).
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import trio

from spokefs import protocol
from spokefs.errors import SpokeError
from spokefs.namespace.replica import Applied, Namespace

_BAD_SNAPSHOT = 3


class LoadFailed(SpokeError):
    """The loader child failed for a reason other than the snapshot itself."""


async def reload_snapshot_apart(ns: Namespace, compressed: bytes) -> Applied:
    """``ns.reload_snapshot(compressed)`` in a child process; ``ns.info`` is current after.

    Raises:
        protocol.WireError: the snapshot is malformed or hostile; nothing is changed.
        LoadFailed: the child could not load it (it died, or the disk failed).
    """
    done = await trio.run_process(
        [sys.executable, "-m", "spokefs.namespace.snapshot_load", str(ns.path)], stdin=compressed,
        capture_stdout=True, capture_stderr=True, check=False,
    )
    why = _last_line(done.stderr)
    if done.returncode == _BAD_SNAPSHOT:
        raise protocol.WireError(why)
    if done.returncode != 0:
        raise LoadFailed(f"the snapshot loader exited {done.returncode}: {why}")
    applied = pickle.loads(done.stdout)
    ns.refresh_info()
    return applied


def _last_line(raw: bytes) -> str:
    lines = raw.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no message"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m spokefs.namespace.snapshot_load NAMESPACE_DIR", file=sys.stderr)
        return 2
    compressed = sys.stdin.buffer.read()
    ns = Namespace(Path(argv[0]))
    try:
        applied = ns.reload_snapshot(compressed)
    except protocol.WireError as exc:
        print(exc, file=sys.stderr)
        return _BAD_SNAPSHOT
    finally:
        ns.close(seal=False)  # the mount's namespace is still open: it seals at its close
    sys.stdout.buffer.write(pickle.dumps(applied, protocol=pickle.HIGHEST_PROTOCOL))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
