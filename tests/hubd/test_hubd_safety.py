"""End to end: changes after the scan, symlink swaps, and the bearer token."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from hubd.export_root import file_id_of, version_of
from spokefs import protocol
from tests.hubd.hubd_testlib import DATA, Answer, Hub, Tree, decode_snapshot, paths_of, unframed

StartHub = Callable[..., Hub]


def snapshot_paths(hub: Hub, headers: dict[str, str] | None = None) -> dict[bytes, protocol.Entry]:
    answer = hub.request(protocol.SNAPSHOT_PATH, headers)
    assert answer.status == 200, answer
    return paths_of(decode_snapshot(answer.body)[1])


def reason(answer: Answer) -> tuple[int, str | None]:
    return answer.status, answer.header(protocol.HEADER_ERROR)


def test_changed_file_is_stale_and_gone_file_unknown(tree: Tree, start_hub: StartHub) -> None:
    hub = start_hub(tree.root)
    paths = snapshot_paths(hub)
    plain, data = paths[b"plain.txt"], paths[b"sub/deeper/data.bin"]
    url = protocol.blob_path(plain.file_id, plain.version)
    assert unframed(hub.request(url).body) == b"hello world\n"
    with open(tree.root / "plain.txt", "ab") as f:
        f.write(b"changed")
    assert reason(hub.request(protocol.blob_path(plain.file_id, plain.version))) == (
        412, "stale-version")
    new_version = version_of(os.stat(tree.root / "plain.txt"))
    # The snapshot (until a rescan) knows only the old version, but the disk has the new
    # one: served, as a replica one rescan behind its peer must (docs/protocol.md, "Replicas").
    answer = hub.request(protocol.blob_path(plain.file_id, new_version))
    assert (answer.status, unframed(answer.body)) == (200, b"hello world\nchanged")
    (tree.root / "late.txt").write_bytes(b"created after the scan")
    st = os.stat(tree.root / "late.txt")
    assert reason(hub.request(protocol.blob_path(file_id_of(st), version_of(st)))) == (
        404, "unknown-file")
    # (Created before the unlink below: a new file may reuse a freed inode, and so its id.)
    os.unlink(tree.root / "sub" / "deeper" / "data.bin")
    assert reason(hub.request(protocol.blob_path(data.file_id, data.version))) == (
        404, "unknown-file")


def test_symlink_swapped_in_after_the_scan_is_not_followed(
        tree: Tree, start_hub: StartHub) -> None:
    """Outside ROOT sits a hard link to the very same inode, so ids and versions match:
    only the O_NOFOLLOW walk from ROOT's fd stops the hub from reading through the link."""
    hub = start_hub(tree.root)
    data = snapshot_paths(hub)[b"sub/deeper/data.bin"]
    url = protocol.blob_path(data.file_id, data.version)
    assert hub.request(url, {"Range": "bytes=0-3"}).body == DATA[:4]
    escape = tree.outside / "deeper"
    escape.mkdir()
    os.link(tree.root / "sub" / "deeper" / "data.bin", escape / "data.bin")
    os.rename(tree.root / "sub", tree.root / "old-sub")
    os.symlink(tree.outside, tree.root / "sub")  # ROOT/sub/deeper/data.bin now leads outside
    answer = hub.request(url, {"Range": "bytes=0-3"})
    assert reason(answer) == (412, "stale-version") and DATA[:4] not in answer.body
    os.unlink(tree.root / "sub")
    os.rename(tree.root / "old-sub", tree.root / "sub")
    assert hub.request(url, {"Range": "bytes=0-3"}).body == DATA[:4]  # back in place: served


def test_an_old_version_past_the_new_end_is_stale_not_unsatisfiable(
        tree: Tree, start_hub: StartHub) -> None:
    """The version is checked before the range: a spoke asking for a range of the version it
    knows, past the end of the file that has shrunk since, is told 412 (its listing is
    stale), not 416 (which would blame its request)."""
    hub = start_hub(tree.root)
    data = snapshot_paths(hub)[b"sub/deeper/data.bin"]
    with open(tree.root / "sub" / "deeper" / "data.bin", "r+b") as f:
        f.truncate(protocol.FRAME_DATA_BYTES)
    start = protocol.framed_size(8 * protocol.FRAME_DATA_BYTES)
    answer = hub.request(protocol.blob_path(data.file_id, data.version),
                         {"Range": f"bytes={start}-{start + 99}"})
    assert reason(answer) == (412, "stale-version")


def test_a_write_during_a_long_answer_cuts_it_short(tree: Tree, start_hub: StartHub) -> None:
    """The hub checks the version again after each slice it reads: a file written while a
    long answer streams ends that answer short (the spoke, which knows the length it asked
    for, refuses it) instead of splicing the new bytes into the old version's answer.

    The client stops reading after the first bytes, so the hub (which writes a slice only
    when the transport has taken the last one) is at most the socket buffers, a few MiB,
    into the 64 MiB answer when the file changes."""
    path = tree.root / "long.bin"
    with open(path, "wb") as f:
        f.truncate(64 * protocol.SLICE_DATA_BYTES)  # sparse: costs no disk
    hub = start_hub(tree.root)
    entry = snapshot_paths(hub)[b"long.bin"]
    total = protocol.framed_size(entry.size)
    url = urlsplit(hub.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(f"GET {protocol.blob_path(entry.file_id, entry.version)} HTTP/1.1\r\n"
                     f"Host: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        got = sock.recv(1 << 16)
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new version
        with contextlib.suppress(ConnectionResetError):
            while more := sock.recv(1 << 20):
                got += more
    head, _, body = got.partition(b"\r\n\r\n")
    assert f"content-length: {total}".encode() in head.lower(), head
    assert 0 < len(body) < total, f"{len(body)} of {total} framed bytes"


def test_token_guards_everything_but_health_and_metrics(
        tree: Tree, start_hub: StartHub, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cr3t-token\n")
    hub = start_hub(tree.root, "--token-file", str(token_file), "--log-level", "DEBUG")
    good = {"Authorization": "Bearer s3cr3t-token"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cr3t-token"},
                    {"Authorization": "Bearer s3cr3t-token-and-more"},
                    {"Authorization": "Bearer s3cr3t-tokeñ"}):
        for path in (protocol.SNAPSHOT_PATH, protocol.blob_path(2, 2), "/no/such/route"):
            answer = hub.request(path, headers)
            assert reason(answer) == (401, "unauthorized"), (path, headers)
            assert json.loads(answer.body)["error"] == "unauthorized"
    paths = snapshot_paths(hub, good)
    plain = paths[b"plain.txt"]
    assert unframed(hub.request(protocol.blob_path(plain.file_id, plain.version), good).body) == (
        b"hello world\n")
    assert reason(hub.request("/no/such/route", good)) == (404, "not-found")
    assert hub.request(protocol.HEALTH_PATH).status == 200
    assert hub.request(protocol.METRICS_PATH).status == 200
    hub.stop()
    assert "s3cr3t" not in hub.stderr()  # even at DEBUG, with access logs
