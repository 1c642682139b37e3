"""A hostile or broken hub cannot crash, mislead or fill a spoke.

A fake hub (``http.server`` in a thread of this process) serves crafted ``/v2/snapshot``
bytes, built with ``spokefs.protocol``'s encoders or by hand. ``spokefs mount`` must refuse each
one with one line ``spokefs: error: the hub at URL sent a bad snapshot: ...``, exit 1, no
traceback, nothing mounted. Then a hub that lies about a file's checksums (a frame's sum in
its blob, the sum in its pack record): reads fail with EIO and never return its bytes, and
nothing bad is cached (once the hub tells the truth, the same read returns the right bytes).
"""

from __future__ import annotations

import contextlib
import errno
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import xxhash

from spokefs import protocol
from tests.helpers import procs
from tests.helpers.procs import SpokeMount

pytestmark = pytest.mark.fuse

ROOT_ID = 2
GEN = 7
DIR = stat.S_IFDIR | 0o755
REG = stat.S_IFREG | 0o644
FILE_BYTES = bytes(range(256)) * 40  # 10,240 bytes


def entry(fid: int, parent: int, name: bytes, mode: int = REG, size: int = 0,
          target: bytes = b"", version: int = 1) -> protocol.Entry:
    return protocol.Entry(fid, parent, mode, size, 1_700_000_000 * 10**9, 1, version, name, target)


ROOT = entry(ROOT_ID, 0, b"", DIR)


def snapshot(*entries: protocol.Entry, count: int | None = None) -> bytes:
    """A snapshot of ROOT plus ``entries``; ``count`` overrides the declared entry count."""
    items = [ROOT, *entries]
    n = len(items) if count is None else count
    plain = (protocol.encode_header(GEN, ROOT_ID, n) + b"".join(map(protocol.encode_entry, items))
             + protocol.encode_trailer(n))
    return zlib.compress(plain)


def zlib_bomb() -> bytes:
    """A valid header, then 512 MiB of zeros: ~0.5 MB on the wire."""
    comp = zlib.compressobj(9)
    parts = [comp.compress(protocol.encode_header(GEN, ROOT_ID, 2))]
    zeros = bytes(1 << 20)
    parts += [comp.compress(zeros) for _ in range(512)]
    return b"".join(parts) + comp.flush()


GOOD = snapshot(entry(3, ROOT_ID, b"f", size=len(FILE_BYTES)))

# name -> (snapshot bytes or a factory, content type, what the error line must mention)
HOSTILE: dict[str, tuple[bytes | Callable[[], bytes], str, str]] = {
    "slash-in-name": (snapshot(entry(3, ROOT_ID, b"a/b")), "", "bad name"),
    "nul-in-name": (snapshot(entry(3, ROOT_ID, b"a\0b")), "", "bad name"),
    "dotdot-name": (snapshot(entry(3, ROOT_ID, b"..")), "", "bad name"),
    "empty-name": (snapshot(entry(3, ROOT_ID, b"")), "", "name"),
    "absurd-size": (snapshot(entry(3, ROOT_ID, b"big", size=2**62 + 1)), "", "absurd size"),
    "negative-size": (snapshot(entry(3, ROOT_ID, b"neg", size=2**64 - 1)), "", "absurd size"),
    "cycle": (snapshot(entry(3, ROOT_ID, b"a", DIR), entry(4, 3, b"b", DIR),
                       entry(3, 4, b"a-again", DIR)), "", "cycle"),
    "parent-later": (snapshot(entry(4, 3, b"child"), entry(3, ROOT_ID, b"dir", DIR)), "",
                     "not seen yet"),
    "parent-is-file": (snapshot(entry(3, ROOT_ID, b"f"), entry(4, 3, b"under-a-file")), "",
                       "not seen yet"),
    "duplicate-names": (snapshot(entry(3, ROOT_ID, b"x"), entry(4, ROOT_ID, b"x")), "",
                        "listed twice"),
    "device-node": (snapshot(entry(3, ROOT_ID, b"dev", stat.S_IFCHR | 0o666)), "",
                    "unsupported file type"),
    "symlink-nul": (snapshot(entry(3, ROOT_ID, b"l", stat.S_IFLNK | 0o777, target=b"a\0b")),
                    "", "symlink"),
    "id-zero": (snapshot(entry(0, ROOT_ID, b"zero")), "", "below"),
    "truncated-zlib": (GOOD[:-12], "", "truncated"),
    "garbage": (bytes(range(256)) * 64, "", "not a zlib stream"),
    "empty-body": (b"", "", "truncated"),
    "bad-magic": (zlib.compress(b"XXXX" + protocol.encode_header(GEN, ROOT_ID, 1)[4:]), "",
                  "not a v1 snapshot"),
    "wrong-content-type": (GOOD, "text/html; charset=utf-8", "content type"),
    "enormous-count": (snapshot(count=2**63), "", "absurd snapshot header"),
    "count-too-high": (snapshot(count=49_999_999), "", "truncated"),
    "data-after-trailer": (GOOD + zlib.compress(b"more"), "", "after the snapshot"),
    "zlib-bomb": (zlib_bomb, "", "unsupported file type"),
}


def framed_file() -> bytes:
    """FILE_BYTES (file 3, version 1) in the framed representation of protocol v2."""
    out = bytearray()
    for i, pos in enumerate(range(0, len(FILE_BYTES), protocol.FRAME_DATA_BYTES)):
        chunk = FILE_BYTES[pos : pos + protocol.FRAME_DATA_BYTES]
        out += chunk + protocol.FRAME_SUM.pack(
            xxhash.xxh3_64_intdigest(chunk, protocol.frame_seed(3, 1, i)))
    return bytes(out)


class FakeHub:
    """A tiny hub whose answers the test sets: ``snapshot``, ``content_type``, and blob and
    pack routes that can lie about the checksums (``lie``)."""

    def __init__(self) -> None:
        self.snapshot = GOOD
        self.content_type = protocol.SNAPSHOT_MEDIA_TYPE
        self.lie = False
        self.blob_requests = 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == protocol.SNAPSHOT_PATH:
                    self._send(200, hub.snapshot, {"Content-Type": hub.content_type,
                                                   protocol.HEADER_GENERATION: str(GEN)})
                elif self.path == protocol.blob_path(3, 1):
                    hub.blob_requests += 1
                    first, last = map(int, self.headers["Range"].removeprefix("bytes=").split("-"))
                    framed = bytearray(framed_file())
                    if hub.lie:
                        framed[5] ^= 1  # a data byte: its frame's sum no longer matches
                    self._send(206, bytes(framed[first : last + 1]), {
                        "Content-Type": "application/octet-stream",
                        "Content-Range": f"bytes {first}-{last}/{len(framed)}"})
                elif self.path.startswith("/v2/pack/"):
                    hub.blob_requests += 1
                    digest = xxhash.xxh3_64_intdigest(FILE_BYTES) + (1 if hub.lie else 0)
                    self._send(200, protocol.encode_pack_record(3, 1, FILE_BYTES, digest % 2**64),
                               {"Content-Type": "application/octet-stream"})
                else:
                    self._send(404, b'{"error": "not-found"}', {protocol.HEADER_ERROR: "not-found"})

            def do_POST(self) -> None:
                self._send(404, b'{"error": "not-found"}', {protocol.HEADER_ERROR: "not-found"})

            def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    @contextlib.contextmanager
    def running(self) -> Iterator[FakeHub]:
        thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()
            thread.join(timeout=10)


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    with FakeHub().running() as hub:
        yield hub




def test_hostile_snapshots_are_refused(fake_hub: FakeHub, tmp_path: Path,
                                       make_mountpoint: Callable[[str], Path]) -> None:
    mnt = make_mountpoint("hostile")
    refused = []
    for name, (body, ctype, why) in HOSTILE.items():
        fake_hub.snapshot = body() if callable(body) else body
        fake_hub.content_type = ctype or protocol.SNAPSHOT_MEDIA_TYPE
        started = time.monotonic()
        line = procs.mount_fails(fake_hub.url, mnt, tmp_path / f"cache-{name}")
        prefix = f"spokefs: error: the hub at {fake_hub.url} sent a bad snapshot: "
        assert line.startswith(prefix), (name, line)
        assert why in line, (name, line)
        assert len(line) < 400, (name, line)
        refused.append((name, time.monotonic() - started))
    print(f"\nhostile snapshots refused: {len(refused)} "
          f"({', '.join(f'{n} {s:.1f}s' for n, s in refused)})")


def test_lying_blob_checksum_is_eio_and_never_cached(
        fake_hub: FakeHub, tmp_path: Path, make_mountpoint: Callable[[str], Path]) -> None:
    spoke = SpokeMount(fake_hub.url, make_mountpoint("liar"), tmp_path / "cache",
                       tmp_path / "spoke", ("--hub-deadline", "2", "--no-prefetch"))
    fake_hub.lie = True
    try:
        spoke.start()
        path = spoke.mnt / "f"
        assert path.stat().st_size == len(FILE_BYTES)
        with pytest.raises(OSError) as err:
            path.read_bytes()
        assert err.value.errno == errno.EIO
        assert fake_hub.blob_requests >= 2  # a bad body is fetched again before giving up
        with open(path, "rb", buffering=0) as f, pytest.raises(OSError) as err:
            f.seek(4096)  # a read in the middle: through the blob, whose frame 0 lies
            f.read(4096)
        assert err.value.errno == errno.EIO
        fake_hub.lie = False
        with open(path, "rb", buffering=0) as f:  # nothing of the lie was cached
            assert f.read() == FILE_BYTES
    finally:
        spoke.unmount()
    spoke.assert_clean_exit()
    assert "Traceback" not in spoke.stderr()
