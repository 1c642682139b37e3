"""Loading a full snapshot in a child process, so its memory goes back to the system.

A snapshot is loaded in one LMDB write transaction (the old namespace stays whole until it
commits). Without ``writemap`` LMDB builds the pages that transaction dirties in memory it
allocates, and after the commit it keeps them on its own free list: a million entries left
~250 MiB of anonymous memory in the spoke for as long as it ran. The load itself (decode,
``putmulti``) runs in a child (``snapshot_child``) on the same LMDB environment, which
LMDB supports across processes; the child's memory goes when it exits, and the mount
re-reads the namespace's info after it commits.

The child starts before the snapshot's first byte and decodes it as it arrives
(``ChildLoad`` is the hub client's ``SnapshotSink``): its start-up and the decoding overlap
the download (at 60 ms, about 0.8 s of a 1M-entry mount). An attempt of the download that
fails part way restarts the child.

Protocol with the child: the compressed snapshot on stdin, closed at its end; on success
exit 0 and a pickled ``namespace.Applied`` on stdout; a malformed or hostile snapshot exits
``snapshot_child.BAD_SNAPSHOT`` with the reason as the last line of stderr (nothing
changed); anything else is a failure of the child (its stderr's last line says what).
"""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
from collections.abc import Awaitable, Callable

import trio

from spokefs import protocol
from spokefs.errors import SpokeError
from spokefs.namespace.replica import Applied, Namespace
from spokefs.namespace.snapshot_child import BAD_SNAPSHOT


class LoadFailed(SpokeError):
    """The loader child failed for a reason other than the snapshot itself."""


async def reload_snapshot_apart(ns: Namespace,
                                fetch: Callable[[ChildLoad], Awaitable[object]]) -> Applied:
    """Load the snapshot that ``fetch`` feeds to a ``ChildLoad`` (as the hub client's
    ``stream_snapshot`` does) in a child process; ``ns.info`` is current after.

    Raises:
        protocol.WireError: the snapshot is malformed or hostile; nothing is changed.
        LoadFailed: the child could not load it (it died, or the disk failed).
        Whatever ``fetch`` raises (the child is stopped; nothing is changed).
    """
    child = ChildLoad(ns)
    try:
        await fetch(child)
        return await child.finish()
    finally:
        with trio.CancelScope(shield=True):
            await child.stop()


class ChildLoad:
    """A loader child fed the compressed snapshot as it arrives."""

    def __init__(self, ns: Namespace) -> None:
        self._ns = ns
        self._proc: trio.Process | None = None

    async def restart(self) -> None:
        """Start a child (stopping one fed by an earlier attempt)."""
        await self.stop()
        self._proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "spokefs.namespace.snapshot_child", str(self._ns.path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )

    async def feed(self, chunk: bytes) -> None:
        """The next piece; raises what ``finish`` would if the child stopped early."""
        proc = self._running()
        assert proc.stdin is not None
        try:
            await proc.stdin.send_all(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self._outcome(proc)  # it exited (a bad snapshot): raises why
            raise LoadFailed("the snapshot loader exited before the snapshot ended") from None

    async def finish(self) -> Applied:
        """The end of the snapshot: the child's outcome."""
        proc = self._running()
        assert proc.stdin is not None
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await proc.stdin.aclose()
        return await self._outcome(proc)

    async def stop(self) -> None:
        """Kill a child that has not finished; close its pipes."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.returncode is None:
            proc.kill()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                await stream.aclose()
        await proc.wait()

    def _running(self) -> trio.Process:
        if self._proc is None:
            raise RuntimeError("ChildLoad: restart() first")
        return self._proc

    async def _outcome(self, proc: trio.Process) -> Applied:
        assert proc.stdout is not None and proc.stderr is not None
        out: dict[str, bytes] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_read_all, proc.stdout, out, "stdout")
            nursery.start_soon(_read_all, proc.stderr, out, "stderr")
        returncode = await proc.wait()
        why = _last_line(out["stderr"])
        if returncode == BAD_SNAPSHOT:
            raise protocol.WireError(why)
        if returncode != 0:
            raise LoadFailed(f"the snapshot loader exited {returncode}: {why}")
        applied: Applied = pickle.loads(out["stdout"])
        self._ns.refresh_info()
        return applied


async def _read_all(stream: trio.abc.ReceiveStream, out: dict[str, bytes], key: str) -> None:
    parts = []
    while chunk := await stream.receive_some(1 << 16):
        parts.append(chunk)
    out[key] = b"".join(parts)


def _last_line(raw: bytes) -> str:
    lines = raw.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no message"
