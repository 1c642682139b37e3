"""The snapshot loader child (``python -m spokefs.namespace.snapshot_child NAMESPACE_DIR``),
which ``snapshot_load.ChildLoad`` starts and feeds: the compressed snapshot on stdin, closed
at its end; exit 0 and a pickled ``namespace.Applied`` on stdout once it is loaded; exit
``BAD_SNAPSHOT`` with the reason as the last line of stderr for a malformed or hostile one.

It imports what the load needs and nothing more (no trio, no metrics): the child starts
when the download does, and on this machine the mount's modules took it 0.14 s to import,
more than the download's two round trips at 60 ms, so the mount waited for its loader.
"""

from __future__ import annotations

import os
import pickle
import sys
from functools import partial
from pathlib import Path

from spokefs import protocol
from spokefs.namespace.replica import Namespace

BAD_SNAPSHOT = 3
_PIECE = 1 << 20  # at most this much of the snapshot read from stdin at a time


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m spokefs.namespace.snapshot_child NAMESPACE_DIR",
              file=sys.stderr)
        return 2
    pieces = iter(partial(os.read, sys.stdin.fileno(), _PIECE), b"")  # as they arrive
    ns = Namespace(Path(argv[0]))
    try:
        applied = ns.reload_snapshot(pieces)
    except protocol.WireError as exc:
        print(exc, file=sys.stderr)
        return BAD_SNAPSHOT
    finally:
        ns.close(seal=False)  # the mount's namespace is still open: it seals at its close
    sys.stdout.buffer.write(pickle.dumps(applied, protocol=pickle.HIGHEST_PROTOCOL))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
