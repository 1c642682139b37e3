"""End to end against a real hubd child: the snapshot and every blob status (blobs in the
framed representation of protocol v2)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from spokefs import protocol
from tests.hubd.hubd_testlib import (
    DATA,
    ODD_NAMES,
    Answer,
    Hub,
    Tree,
    build_tree,
    decode_snapshot,
    framed,
    paths_of,
    start_hub_process,
    unframed,
)

CACHE_CONTROL = "public, max-age=31536000, immutable"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hub, Tree, dict]]:
    """One hub for the whole module (nothing here changes the tree)."""
    tree = build_tree(tmp_path_factory.mktemp("tree"))
    hub = start_hub_process(tree.root, tree.root.parent / "hubd.err")
    try:
        answer = hub.request(protocol.SNAPSHOT_PATH)
        yield hub, tree, paths_of(decode_snapshot(answer.body)[1])
    finally:
        assert hub.stop() == 0, hub.stderr()


def blob(hub: Hub, entry: protocol.Entry, rng: str | None = None,
         version: int | None = None) -> Answer:
    headers = {"Range": rng} if rng is not None else {}
    return hub.request(protocol.blob_path(entry.file_id, entry.version if version is None
                                      else version), headers)


def assert_error(answer: Answer, status: int, reason: str) -> None:
    assert answer.status == status, answer
    assert answer.header(protocol.HEADER_ERROR) == reason
    assert answer.header("Content-Type").startswith("application/json")
    body = json.loads(answer.body)
    assert body["error"] == reason and body["detail"] and "\n" not in body["detail"]


def test_readiness_line_and_snapshot(served: tuple[Hub, Tree, dict]) -> None:
    hub, tree, _ = served
    answer = hub.request(protocol.SNAPSHOT_PATH)
    assert answer.status == 200
    assert answer.header("Content-Type") == protocol.SNAPSHOT_MEDIA_TYPE
    header, entries = decode_snapshot(answer.body, chunk=7)  # awkward chunking on purpose
    assert answer.header(protocol.HEADER_GENERATION) == str(header.generation)
    assert hub.ready_line == (f"hubd: serving {tree.root} at {hub.url} "
                              f"({len(entries)} entries, generation {header.generation})")
    paths = paths_of(entries)
    assert {*ODD_NAMES, b"dir\xff\n/inner", b"link_out", b"empty"} <= paths.keys()
    assert b"fifo" not in paths
    assert paths[b"hard1"].file_id == paths[b"sub/hard2"].file_id


def test_range_reads(served: tuple[Hub, Tree, dict]) -> None:
    """Any range of the framed representation is those bytes, whatever range was asked:
    the same bytes a cache would cut from slices it holds."""
    hub, _, paths = served
    data = paths[b"sub/deeper/data.bin"]
    want = framed(DATA, data.file_id, data.version)
    total = len(want)
    assert total == protocol.framed_size(len(DATA))
    for rng, start, stop in [("bytes=0-9", 0, 10), ("bytes=100000-", 100000, total),
                             ("bytes=-300", total - 300, total),
                             ("bytes=5-999999999", 5, total),
                             (f"bytes={protocol.FRAME_BYTES - 3}-{protocol.FRAME_BYTES + 9}",
                              protocol.FRAME_BYTES - 3, protocol.FRAME_BYTES + 10)]:
        answer = blob(hub, data, rng)
        assert answer.status == 206, answer
        assert answer.body == want[start:stop]
        assert answer.header("Content-Range") == f"bytes {start}-{stop - 1}/{total}"
        assert answer.header("Content-Length") == str(stop - start)
        assert answer.header("ETag") == protocol.etag(data.file_id, data.version)
        assert answer.header("Cache-Control") == CACHE_CONTROL
        assert answer.header("Accept-Ranges") == "bytes"
        assert answer.header("X-Spokefs-XXH3") is None  # v1's per-answer sum is gone


def test_whole_files_without_range_whatever_their_size(served: tuple[Hub, Tree, dict]) -> None:
    hub, _, paths = served
    data = paths[b"sub/deeper/data.bin"]
    answer = blob(hub, data)
    assert answer.status == 200 and answer.header("Content-Range") is None
    assert answer.body == framed(DATA, data.file_id, data.version)
    for name in ODD_NAMES:
        assert unframed(blob(hub, paths[name]).body) == name
    assert unframed(blob(hub, paths[b"dir\xff\n/inner"]).body) == b"inner"
    empty = blob(hub, paths[b"empty"])
    assert (empty.status, empty.body) == (200, b"")
    big = paths[b"big.bin"]  # over MAX_RANGE_BYTES: streamed a slice at a time
    assert big.size > protocol.MAX_RANGE_BYTES
    whole = blob(hub, big)
    assert whole.status == 200 and len(whole.body) == protocol.framed_size(big.size)
    assert whole.body == framed(bytes(big.size), big.file_id, big.version)


def test_a_range_longer_than_max_range_bytes_is_served(served: tuple[Hub, Tree, dict]) -> None:
    """MAX_RANGE_BYTES bounds what a spoke asks for, not what hubd serves (README, Hostile
    input): a range of 16 MiB + 1 is streamed like any other."""
    hub, _, paths = served
    big = paths[b"big.bin"]
    want = framed(bytes(big.size), big.file_id, big.version)
    most = protocol.MAX_RANGE_BYTES
    for rng, start, stop in [(f"bytes=0-{most}", 0, most + 1),
                             (f"bytes=-{protocol.MAX_RANGE_BYTES + 1}",
                              len(want) - protocol.MAX_RANGE_BYTES - 1, len(want))]:
        answer = blob(hub, big, rng)
        assert answer.status == 206, answer.status
        assert answer.header("Content-Range") == f"bytes {start}-{stop - 1}/{len(want)}"
        assert answer.body == want[start:stop]


def test_ranges_across_slices_are_their_framed_bytes(served: tuple[Hub, Tree, dict]) -> None:
    """An answer goes out a slice, then three at a time (``hubd.framed``): ranges that start
    and end anywhere around those edges are the right framed bytes (each frame's sum is
    seeded with its index, so a piece read from the wrong place fails here)."""
    hub, _, paths = served
    big = paths[b"big.bin"]
    want = framed(bytes(big.size), big.file_id, big.version)
    s = protocol.SLICE_BYTES
    for start, stop in [(0, 4 * s), (s - 5, 5 * s + 7), (s, 2 * s), (2 * s + 1, 4 * s - 1),
                        (3 * s - 8, 7 * s + 3), (5, 5 * s), (4 * s, len(want))]:
        answer = blob(hub, big, f"bytes={start}-{stop - 1}")
        assert answer.status == 206, answer.status
        assert answer.body == want[start:stop], (start, stop)


def test_unsatisfiable_ranges(served: tuple[Hub, Tree, dict]) -> None:
    hub, _, paths = served
    data, empty = paths[b"sub/deeper/data.bin"], paths[b"empty"]
    total = protocol.framed_size(len(DATA))
    for entry, rng, reason in [
        (data, f"bytes={total}-", "range-not-satisfiable"),
        (data, "bytes=-0", "range-not-satisfiable"),
        (empty, "bytes=0-", "range-not-satisfiable"),
        (data, "bytes=0-1,4-5", "multiple-ranges"),
    ]:
        answer = blob(hub, entry, rng)
        assert_error(answer, 416, reason)
        if reason != "multiple-ranges":
            assert answer.header("Content-Range") == f"bytes */{protocol.framed_size(entry.size)}"


def test_bad_requests(served: tuple[Hub, Tree, dict]) -> None:
    hub, _, paths = served
    data = paths[b"sub/deeper/data.bin"]
    for rng in ["bytes=9-1", "bytes=a-b", "pages=0-1", "bytes=-", "bytes=0-" + "9" * 30,
                "bytes=-5-6"]:
        assert_error(blob(hub, data, rng), 400, "bad-range")
    good = protocol.format_id(data.version)
    for fid in ["0123", "ABCDEF0123456789", "zzzzzzzzzzzzzzzz", "0" * 17]:
        assert_error(hub.request(f"/v2/blob/{fid}/{good}"), 400, "bad-id")
    assert_error(hub.request(f"/v2/blob/{protocol.format_id(data.file_id)}/xyz"), 400, "bad-id")


def test_old_protocol_routes_answer_a_version_error(served: tuple[Hub, Tree, dict]) -> None:
    """A spoke of protocol v1 gets one clear reason, never bytes it would misread."""
    hub, _, paths = served
    data = paths[b"sub/deeper/data.bin"]
    fid, ver = protocol.format_id(data.file_id), protocol.format_id(data.version)
    for path, method in [("/v1/snapshot", "GET"), ("/v1/changes?since=1", "GET"),
                         (f"/v1/blob/{fid}/{ver}", "GET"), ("/v1/pack", "POST")]:
        answer = hub.request(path, method=method)
        assert_error(answer, 400, "protocol-version")
        assert "v2" in json.loads(answer.body)["detail"]


def test_unknown_and_stale(served: tuple[Hub, Tree, dict]) -> None:
    hub, _, paths = served
    data = paths[b"sub/deeper/data.bin"]
    assert_error(hub.request(protocol.blob_path(123456789, data.version)), 404, "unknown-file")
    for not_a_file in (b"", b"sub", b"link_in"):
        assert_error(blob(hub, paths[not_a_file], "bytes=0-1"), 404, "unknown-file")
    assert_error(blob(hub, data, "bytes=0-1", version=data.version ^ 1), 412, "stale-version")


def test_other_routes(served: tuple[Hub, Tree, dict]) -> None:
    hub, _, _ = served
    health = hub.request(protocol.HEALTH_PATH)
    assert (health.status, health.body) == (200, b"ok")
    assert hub.request(protocol.HEALTH_PATH, method="HEAD").status == 200
    assert_error(hub.request("/v2/nothing"), 404, "not-found")
    assert_error(hub.request(protocol.SNAPSHOT_PATH, method="POST"), 405, "method-not-allowed")
    assert_error(hub.request(protocol.blob_path(1, 1), method="DELETE"), 405, "method-not-allowed")
    metrics = hub.request(protocol.METRICS_PATH)
    assert metrics.status == 200
    text = metrics.body.decode()
    for needle in ['hubd_requests_total{route="/v2/snapshot",status="200"}',
                   'hubd_requests_total{route="unmatched",status="404"}',
                   "hubd_request_seconds_bucket", 'hubd_bytes_served_total{route="/v2/blob',
                   "hubd_snapshot_entries", "hubd_snapshot_generation", "hubd_scan_seconds",
                   "hubd_reads_in_flight 0.0"]:
        assert needle in text, needle


def test_parallel_ranges(served: tuple[Hub, Tree, dict]) -> None:
    """Many ranges at once, each client on its own connection, all correct."""
    hub, _, paths = served
    data = paths[b"sub/deeper/data.bin"]
    want = framed(DATA, data.file_id, data.version)

    def fetch(i: int) -> bool:
        one = Hub(hub.proc, hub.url, hub.ready_line, hub.stderr_path)
        try:
            start = (i * 997) % len(want)
            answer = blob(one, data, f"bytes={start}-{start + 9999}")
            return answer.status == 206 and answer.body == want[start : start + 10000]
        finally:
            one.close_conn()

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(fetch, range(64)))
