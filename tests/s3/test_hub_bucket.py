"""``hubd serve s3://BUCKET/PREFIX`` end to end: a real hubd child over a real SeaweedFS,
spoken to over HTTP as a spoke would (snapshot, blobs, packs, changes, errors)."""

from __future__ import annotations

import http.client
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import xxhash

from spokefs import protocol
from tests.helpers import wire
from tests.helpers.seaweed import SeaweedServer
from tests.hubd.hubd_testlib import (
    Hub,
    decode_snapshot,
    framed,
    paths_of,
    run_hubd,
    start_hub_process,
    unframed,
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


def tree_of(hub: Hub) -> tuple[int, dict[bytes, protocol.Entry]]:
    answer = hub.request(protocol.SNAPSHOT_PATH)
    assert answer.status == 200
    header, entries = decode_snapshot(answer.body)
    return header.generation, paths_of(entries)


def blob(hub: Hub, entry: protocol.Entry, range_: str | None = None) -> tuple[int, bytes]:
    """(status, body) of a framed blob answer; a whole answer's frames are checked and its
    data returned."""
    answer = hub.request(protocol.blob_path(entry.file_id, entry.version),
                         {"Range": range_} if range_ else None)
    if answer.status == 200:
        data = unframed(answer.body)
        assert answer.body == framed(data, entry.file_id, entry.version)  # every sum right
        return 200, data
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
    whole = framed(FILES["data/train/sub/b.bin"], big.file_id, big.version)
    assert blob(hub, big, "bytes=1000-1999") == (206, whole[1000:2000])
    assert blob(hub, big, "bytes=76000-") == (206, whole[76000:])
    assert blob(hub, big, f"bytes={len(whole)}-")[0] == 416
    # the root's deterministic packs, planned as a spoke plans them
    root = tree[b""]
    files = [(p, e) for p, e in tree.items() if not e.is_dir and b"/" not in p]
    plans = protocol.plan_packs(root.file_id, [(p, e.file_id, e.version, e.size) for p, e in files])
    served = {}
    for plan in plans:
        answer = hub.request(plan.path)
        assert answer.status == 200, answer.body
        served |= wire.decode_pack(answer.body, plan.items)
    for path, entry in files:
        if protocol.packable(entry.size):
            data = FILES["data/train/" + path.decode()]
            assert served[(entry.file_id, entry.version)] == (data, xxhash.xxh3_64_intdigest(data))
    # a pick of files from two directories, in a job's order
    order = [tree[b"sub/b.bin"], *(e for _, e in reversed(files))]
    for plan in protocol.plan_picks((e.file_id, e.version, e.size) for e in order):
        answer = hub.request(plan.path)
        assert answer.status == 200, answer.body
        picked = wire.decode_pack(answer.body, plan.items)
        assert list(picked) == plan.items
        assert all(v == served.get(k, v) for k, v in picked.items())
    # one warning per reason, and the metric
    err = hub.stderr()
    assert err.count("keys skipped (shadowed)") == 1
    assert err.count("keys skipped (directory-marker)") == 1
    metrics = hub.request(protocol.METRICS_PATH).body.decode()
    assert 'hubd_s3_skipped_keys{reason="shadowed"} 1.0' in metrics
    assert "hubd_s3_list_pages" in metrics




def changes_since(hub: Hub, generation: int) -> list[protocol.Upsert | protocol.Remove]:
    answer = hub.request(f"{protocol.CHANGES_PATH}?since={generation}")
    assert answer.status == 200, answer.body
    decoder = protocol.ChangesDecoder()
    records = list(decoder.feed(answer.body))
    decoder.finish()
    return records


def test_replaced_deleted_and_new_objects(seaweed: SeaweedServer, bucket: str,
                                          start_bucket_hub: Callable[..., Hub]) -> None:
    put(seaweed, bucket, {"keep": b"same", "replace": b"old bytes", "delete": b"doomed"})
    hub = start_bucket_hub(f"s3://{bucket}")
    first, tree = tree_of(hub)
    old = tree[b"replace"]
    put(seaweed, bucket, {"replace": b"new bytes, longer", "added/file": b"fresh"})
    seaweed.writer().delete_object(Bucket=bucket, Key="delete")
    # the snapshot still names the old object: S3 refuses it (If-Match), never new bytes
    answer = hub.request(protocol.blob_path(old.file_id, old.version))
    assert (answer.status, answer.header(protocol.HEADER_ERROR)) == (412, "stale-version")
    gone = tree[b"delete"]
    answer = hub.request(protocol.blob_path(gone.file_id, gone.version))
    assert (answer.status, answer.header(protocol.HEADER_ERROR)) == (404, "unknown-file")
    # the 412 (and the 404) asked for a rescan: a new generation comes without SIGHUP
    second = wait_generation(hub, first)
    _, tree = tree_of(hub)
    assert sorted(tree) == [b"", b"added", b"added/file", b"keep", b"replace"]
    new = tree[b"replace"]
    assert new.file_id == old.file_id and new.version != old.version
    assert blob(hub, new) == (200, b"new bytes, longer")
    records = changes_since(hub, first)
    removes = {r.name for r in records if isinstance(r, protocol.Remove)}
    upserts = {r.entry.name for r in records if isinstance(r, protocol.Upsert)}
    assert removes == {b"delete"}
    assert {b"replace", b"added", b"file"} <= upserts and b"keep" not in upserts
    # SIGHUP with nothing changed: same generation
    hub.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "unchanged" not in hub.stderr() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "unchanged" in hub.stderr()
    assert tree_of(hub)[0] == second


@pytest.mark.parametrize(("env", "expect"), [
    ({"AWS_SECRET_ACCESS_KEY": "wrong"}, "HTTP 403 SignatureDoesNotMatch"),
    ({"AWS_ACCESS_KEY_ID": "NOSUCHKEY"}, "HTTP 403 InvalidAccessKeyId"),
    ({"AWS_ACCESS_KEY_ID": ""}, "AWS_ACCESS_KEY_ID is not set"),
])
def test_bad_credentials_fail_at_start(seaweed: SeaweedServer, bucket: str, s3_env: None,
                                       monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                       expect: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    done = run_hubd("serve", f"s3://{bucket}/x", "--listen", "127.0.0.1:0",
                    "--s3-endpoint", seaweed.endpoint, timeout=60)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("hubd: error:")]
    assert len(lines) == 1 and expect in lines[0], done.stderr
    assert "Traceback" not in done.stderr and "wrong" not in lines[0]


def test_missing_bucket_and_unreachable_endpoint(seaweed: SeaweedServer, s3_env: None) -> None:
    done = run_hubd("serve", "s3://no-such-bucket-here", "--listen", "127.0.0.1:0",
                    "--s3-endpoint", seaweed.endpoint, timeout=60)
    assert done.returncode == 1 and "NoSuchBucket" in done.stderr.splitlines()[-1]
    done = run_hubd("serve", "s3://bucket", "--listen", "127.0.0.1:0",
                    "--s3-endpoint", "http://127.0.0.1:9", timeout=60)
    assert done.returncode == 1, done.stderr
    assert "no answer within" in done.stderr.splitlines()[-1]
    assert "Traceback" not in done.stderr


def test_server_down_then_back(own_seaweed: SeaweedServer, tmp_path: Path, s3_env: None) -> None:
    own_seaweed.writer().create_bucket(Bucket="comeback")
    put(own_seaweed, "comeback", {"f": b"durable bytes"})
    hub = start_hub_process(b"s3://comeback", tmp_path / "hubd.err", "--s3-endpoint",
                            own_seaweed.endpoint, "--rescan-interval", "0")
    try:
        _, tree = tree_of(hub)
        entry = tree[b"f"]
        own_seaweed.stop()
        # the hub retries for its 10 s S3 deadline before it answers: wait longer than that
        parts = urlsplit(hub.url)
        hub.close_conn()
        hub._conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        answer = hub.request(protocol.blob_path(entry.file_id, entry.version))
        assert (answer.status, answer.header(protocol.HEADER_ERROR)) == (503, "read-failed")
        assert answer.header("Retry-After") == "1"
        own_seaweed.start()
        assert blob(hub, entry) == (200, b"durable bytes")
        err = hub.stderr()
        assert err.count("failing, retrying") == 1 and err.count("reachable again") == 1
        assert "Traceback" not in err
    finally:
        assert hub.stop() == 0, hub.stderr()


def test_framed_ranges_across_slices_and_gets(seaweed: SeaweedServer, bucket: str,
                                              start_bucket_hub: Callable[..., Hub]) -> None:
    """Ranges of a 9 MiB object (several slices, two GETs of the hub): each answer is the
    exact slice of the framed object, whether it starts and ends on a frame, a slice or a
    GET boundary or inside one; spoke-like 3.75 MiB ranges read it back whole."""
    data = random.Random(21).randbytes(9 * 1024 * 1024 + 1234)
    put(seaweed, bucket, {"big/obj.bin": data})
    hub = start_bucket_hub(f"s3://{bucket}")
    _, tree = tree_of(hub)
    entry = tree[b"big/obj.bin"]
    whole = framed(data, entry.file_id, entry.version)
    slice_, frame = protocol.SLICE_BYTES, protocol.FRAME_BYTES
    cuts = [(0, 1), (frame - 1, frame + 1), (slice_ - 5, slice_ + 5), (slice_, 4 * slice_),
            (3 * slice_ + 7, 5 * slice_ - 7), (4 * slice_ - 1, 8 * slice_ + 1),
            (len(whole) - 3, len(whole))]
    rng = random.Random(22)
    cuts += [(a, min(a + rng.randrange(1, 6 * slice_), len(whole)))
             for a in (rng.randrange(len(whole)) for _ in range(12))]
    for a, b in cuts:
        assert blob(hub, entry, f"bytes={a}-{b - 1}") == (206, whole[a:b]), (a, b)
    step = protocol.framed_size(3_932_160)  # 3.75 MiB of data: ranges off the slice grid
    got = b"".join(blob(hub, entry, f"bytes={a}-{min(a + step, len(whole)) - 1}")[1]
                   for a in range(0, len(whole), step))
    assert got == whole
