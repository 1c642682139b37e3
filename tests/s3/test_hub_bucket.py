"""``hubd serve s3://BUCKET/PREFIX`` end to end: a real hubd child over a real SeaweedFS,
spoken to over HTTP as a spoke would (snapshot, blobs, packs, changes, errors)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from hubd import wire
from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedServer
from tests.hubd.hubd_testlib import (
    Hub,
    decode_snapshot,
    paths_of,
    run_hubd,
    start_hub_process,
)

FILES = {
    "data/train/a.bin": b"A" * 10_000,
    "data/train/sub/b.bin": bytes(range(256)) * 300,
    "data/train/empty": b"",
    "data/train/odd name+%.txt": "ünï cödé".encode(),
    "data/val/c.bin": b"not exported",
    "data/train/shadow": b"a file where a directory is",
    "data/train/shadow/inner": b"the directory wins",
    "data/train/marker/": b"",
}


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                 "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))


@pytest.fixture
def start_bucket_hub(tmp_path: Path, s3_env: None,
                     seaweed: SeaweedServer) -> Iterator[Callable[..., Hub]]:
    hubs: list[Hub] = []

    def start(root: str, *args: str) -> Hub:
        hub = start_hub_process(root.encode(), tmp_path / f"hubd-{len(hubs)}.err",
                                "--s3-endpoint", seaweed.endpoint, "--rescan-interval", "0",
                                *args)
        hubs.append(hub)
        return hub

    yield start
    for hub in hubs:
        assert hub.stop() == 0, hub.stderr()


def put(server: SeaweedServer, bucket: str, files: dict[str, bytes]) -> None:
    writer = server.writer()
    for key, body in files.items():
        writer.put_object(Bucket=bucket, Key=key, Body=body)


def tree_of(hub: Hub) -> tuple[int, dict[bytes, wire.Entry]]:
    answer = hub.request(wire.SNAPSHOT_PATH)
    assert answer.status == 200
    header, entries = decode_snapshot(answer.body)
    return header.generation, paths_of(entries)


def blob(hub: Hub, entry: wire.Entry, range_: str | None = None) -> tuple[int, bytes]:
    answer = hub.request(wire.blob_path(entry.file_id, entry.version),
                         {"Range": range_} if range_ else None)
    if answer.status in (200, 206):
        assert answer.header(wire.HEADER_CHECKSUM) == xxhash.xxh3_64_hexdigest(answer.body)
    return answer.status, answer.body


def wait_generation(hub: Hub, after: int, timeout_s: float = 20) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        generation, _ = tree_of(hub)
        if generation != after:
            return generation
        time.sleep(0.2)
    raise AssertionError(f"no new generation after {after}:\n{hub.stderr()}")


def test_prefix_export_snapshot_blobs_and_packs(seaweed: SeaweedServer, bucket: str,
                                                start_bucket_hub: Callable[..., Hub]) -> None:
    put(seaweed, bucket, FILES)
    hub = start_bucket_hub(f"s3://{bucket}/data/train")
    assert f"serving s3://{bucket}/data/train" in hub.ready_line
    _, tree = tree_of(hub)
    # "marker/" is a directory-marker object with nothing below it: no entry
    assert sorted(tree) == [b"", b"a.bin", b"empty", b"odd name+%.txt", b"shadow",
                            b"shadow/inner", b"sub", b"sub/b.bin"]
    for path, entry in tree.items():
        if not entry.is_dir:
            key = "data/train/" + path.decode()
            assert entry.size == len(FILES[key])
            assert blob(hub, entry) == (200, FILES[key])
    big = tree[b"sub/b.bin"]
    assert blob(hub, big, "bytes=1000-1999") == (206, FILES["data/train/sub/b.bin"][1000:2000])
    assert blob(hub, big, "bytes=76000-")[1] == FILES["data/train/sub/b.bin"][76000:]
    assert blob(hub, big, "bytes=90000-")[0] == 416
    names = ("a.bin", "empty", "sub/b.bin")
    items = [(tree[n.encode()].file_id, tree[n.encode()].version) for n in names]
    got = wire.decode_pack(_post(hub, wire.PACK_PATH, wire.encode_pack_request(items)), items)
    for item, name in zip(items, names, strict=True):
        record = got[item]
        assert record is not None
        assert record == (FILES[f"data/train/{name}"],
                          xxhash.xxh3_64_intdigest(FILES[f"data/train/{name}"]))
    # one warning per reason, and the metric
    err = hub.stderr()
    assert err.count("keys skipped (shadowed)") == 1
    assert err.count("keys skipped (directory-marker)") == 1
    metrics = hub.request(wire.METRICS_PATH).body.decode()
    assert 'hubd_s3_skipped_keys{reason="shadowed"} 1.0' in metrics
    assert "hubd_s3_list_pages" in metrics


def _post(hub: Hub, path: str, body: bytes) -> bytes:
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(hub.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("POST", path, body=body,
                     headers={"Content-Type": "application/octet-stream"})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data
        return data
    finally:
        conn.close()
