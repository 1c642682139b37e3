"""Helpers for the hubd tests: a hub child process, an HTTP helper, the test tree, decoding.

Imported by the tests as ``tests.hubd.hubd_testlib``; fixtures live in ``conftest.py``.
"""

from __future__ import annotations

import http.client
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import xxhash

from spokefs import protocol

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_RE = re.compile(r"at (http://\S+) \(")
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0

# Names that must survive the trip as raw bytes.
ODD_NAMES = [b"new\nline", b"with space", "ünïcødé ✓".encode(), b"bad\xff\xfeutf8"]
DATA = bytes(range(256)) * 400  # 102,400 bytes with a recognisable pattern


def hub_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_hubd(*args: str, timeout: float = 15.0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m hubd ARGS`` to completion (for CLI error tests)."""
    return subprocess.run([sys.executable, "-m", "hubd", *args], capture_output=True,
                          text=True, env=hub_env(), cwd=REPO_ROOT, timeout=timeout)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


@dataclass
class Hub:
    """One running hub child: its process, URL and stderr log."""

    proc: subprocess.Popen[bytes]
    url: str
    ready_line: str
    stderr_path: Path
    _conn: http.client.HTTPConnection | None = field(default=None, repr=False)

    def request(self, path: str, headers: dict[str, str] | None = None,
                method: str = "GET") -> Answer:
        """One request on a kept-alive connection (reconnects if the server closed it)."""
        for attempt in (0, 1):
            if self._conn is None:
                parts = urlsplit(self.url)
                self._conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
            try:
                self._conn.request(method, path, headers=headers or {})
                resp = self._conn.getresponse()
                body = resp.read()
                return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, body)
            except (http.client.RemoteDisconnected, ConnectionError):
                self.close_conn()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the hub and wait; SIGKILL if it does not exit in time."""
        self.close_conn()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return self.proc.returncode


def start_hub_process(root: Path | bytes, stderr_path: Path, *args: str,
                      preexec_fn: Callable[[], None] | None = None) -> Hub:
    """Start ``python -m hubd serve ROOT --listen 127.0.0.1:0 ARGS`` and wait until ready.

    ``preexec_fn`` runs in the child before hubd (e.g. to lower its resource limits).
    """
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hubd", "serve", os.fsdecode(root),
             "--listen", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE, stderr=err, env=hub_env(), cwd=REPO_ROOT,
            preexec_fn=preexec_fn)
    try:
        line = _wait_ready(proc, stderr_path)
    except BaseException:
        assert proc.stdout is not None
        proc.stdout.close()
        raise
    match = READY_RE.search(line)
    assert match, f"bad readiness line {line!r}"
    return Hub(proc, match.group(1), line, stderr_path)


def _wait_ready(proc: subprocess.Popen[bytes], stderr_path: Path) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline().decode("utf-8", "replace")
            if line:
                return line.rstrip("\n")
        if proc.poll() is not None:
            break
    proc.kill()
    proc.wait()
    raise AssertionError(f"hubd did not become ready:\n{stderr_path.read_text()}")


@dataclass
class Tree:
    """The test tree: ``root`` is exported, ``outside`` is not."""

    root: Path
    outside: Path

    @property
    def broot(self) -> bytes:
        return os.fsencode(self.root)


def build_tree(base: Path) -> Tree:
    """Create the awkward tree under ``base`` (see the module docstring)."""
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"outside secret\n")
    (root / "plain.txt").write_bytes(b"hello world\n")
    (root / "empty").write_bytes(b"")
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "sub" / "deeper" / "data.bin").write_bytes(DATA)
    broot = os.fsencode(root)
    for name in ODD_NAMES:
        with open(os.path.join(broot, name), "wb") as f:
            f.write(name)
    os.mkdir(os.path.join(broot, b"dir\xff\n"))
    with open(os.path.join(broot, b"dir\xff\n", b"inner"), "wb") as f:
        f.write(b"inner")
    (root / "hard1").write_bytes(b"linked twice\n")
    os.link(root / "hard1", root / "sub" / "hard2")
    os.symlink("sub/deeper/data.bin", root / "link_in")
    os.symlink(outside / "secret.txt", root / "link_out")
    os.symlink("../outside/secret.txt", root / "link_up")
    os.symlink("nowhere", root / "dangling")
    os.mkfifo(root / "fifo")
    with open(root / "big.bin", "wb") as f:  # sparse: costs no disk
        f.truncate(protocol.MAX_RANGE_BYTES + 4096)
    return Tree(root, outside)


def decode_snapshot(body: bytes,
                    chunk: int = 4096) -> tuple[protocol.SnapshotHeader, list[protocol.Entry]]:
    """Decode a snapshot in small chunks, as a spoke would."""
    decoder = protocol.SnapshotDecoder()
    entries: list[protocol.Entry] = []
    for i in range(0, len(body), chunk):
        entries.extend(decoder.feed(body[i : i + chunk]))
    return decoder.finish(), entries


def paths_of(entries: list[protocol.Entry]) -> dict[bytes, protocol.Entry]:
    """Relative path (b"" for the root) -> entry, from a decoded snapshot."""
    dir_paths: dict[int, bytes] = {}
    out: dict[bytes, protocol.Entry] = {}
    for e in entries:
        path = b"" if e.parent_id == 0 else os.path.join(dir_paths[e.parent_id], e.name)
        out[path] = e
        if e.is_dir:
            dir_paths[e.file_id] = path
    return out



def framed(data: bytes, file_id: int, version: int) -> bytes:
    """The framed representation of a file version (docs/protocol.md, "Why a version 2"), built
    independently of hubd's own code."""
    out = bytearray()
    for index, pos in enumerate(range(0, len(data), protocol.FRAME_DATA_BYTES)):
        chunk = data[pos : pos + protocol.FRAME_DATA_BYTES]
        out += chunk
        seed = protocol.frame_seed(file_id, version, index)
        out += xxhash.xxh3_64_intdigest(chunk, seed).to_bytes(8, "little")
    return bytes(out)


def unframed(body: bytes) -> bytes:
    """The data of a framed body that starts on a frame boundary (sums not checked)."""
    return b"".join(bytes(chunk) for chunk, _ in protocol.split_frames(body))
