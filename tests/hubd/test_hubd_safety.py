"""End to end: changes after the scan, symlink swaps, and the bearer token."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

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
