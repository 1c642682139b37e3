"""Keys -> namespace (``hubd.s3.tree``): POSIX-name rules, directory wins, stable ids and
versions; every table is checked by the spoke's own validating snapshot decoder."""

from __future__ import annotations

import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hubd.s3.client import ObjectInfo
from hubd.s3.tree import (
    DIR_MODE,
    FILE_MODE,
    build_tree,
    export_prefix,
    object_id,
    object_version,
    skip_reason,
)
from spokefs import protocol

T0 = 1_700_000_000_000_000_000


def obj(key: str, size: int = 1, etag: str = '"e"', mtime_ns: int = T0) -> ObjectInfo:
    return ObjectInfo(key, size, etag, mtime_ns)


def decoded(objects: list[ObjectInfo], prefix: str = "",
            bucket: str = "bkt") -> tuple[dict[str, protocol.Entry], int, object]:
    """Build, encode, decode with the spoke's decoder: {path: entry}, root id, stats."""
    tree = build_tree(bucket, prefix, objects)
    builder, root_id, stats = tree.table, tree.root_id, tree.stats
    table = builder.build(root_id)
    decoder = protocol.SnapshotDecoder()
    entries = list(decoder.feed(table.encode(1, 1)))
    decoder.finish()
    paths: dict[int, str] = {}
    out: dict[str, protocol.Entry] = {}
    for e in entries:
        path = "" if e.parent_id == 0 else f"{paths[e.parent_id]}/{e.name.decode()}".lstrip("/")
        paths[e.file_id] = path
        out[path] = e
    assert set(tree.etags) == {e.file_id for e in out.values() if stat.S_ISREG(e.mode)}
    return out, root_id, stats


def test_plain_tree() -> None:
    tree, root_id, stats = decoded([obj("a/b/c.txt", 5), obj("a/d", 7), obj("top", 9)])
    assert sorted(tree) == ["", "a", "a/b", "a/b/c.txt", "a/d", "top"]
    assert tree[""].file_id == root_id and tree[""].mode == DIR_MODE
    assert tree["a"].mode == DIR_MODE and tree["a"].nlink == 3
    assert tree["a/b/c.txt"].mode == FILE_MODE and tree["a/b/c.txt"].size == 5
    assert tree["a/b/c.txt"].file_id == object_id("bkt", "a/b/c.txt")
    assert tree["a/b"].file_id == object_id("bkt", "a/b/")
    assert (stats.files, stats.dirs, sum(stats.skipped.values())) == (3, 3, 0)


@pytest.mark.parametrize(("key", "reason"), [
    ("a//b", "empty-segment"), ("/lead", "empty-segment"), ("a/./b", "dot-segment"),
    ("..", "dot-segment"), ("a/../b", "dot-segment"), ("nul\0byte", "nul"),
    ("dir/", "directory-marker"), ("", "directory-marker"),
    ("x" * 256, "long-segment"), ("d/" + "é" * 128, "long-segment"),
])
def test_keys_that_are_no_posix_path(key: str, reason: str) -> None:
    assert skip_reason(key) == reason
    tree, _, stats = decoded([obj(key), obj("ok")])
    assert sorted(tree) == ["", "ok"]  # no directory is made for a skipped key
    assert stats.skipped == {reason: 1}
    assert stats.examples[reason] == key


@pytest.mark.parametrize("key", ["x" * 255, "é" * 127, ".hidden", "...", "a b", "tab\tx",
                                 "日本語", "🙂" * 63, "back\\slash", "ctl\x01"])
def test_odd_but_valid_names(key: str) -> None:
    assert skip_reason(key) is None
    tree, _, _ = decoded([obj(key)])
    assert tree[key].name == key.encode()


def test_marker_with_content_below_keeps_the_directory() -> None:
    tree, _, stats = decoded([obj("d/"), obj("d/f"), obj("empty/")])
    assert sorted(tree) == ["", "d", "d/f"]
    assert stats.skipped == {"directory-marker": 2}


@pytest.mark.parametrize("order", [1, -1])
def test_directory_wins_over_an_object_of_the_same_name(order: int) -> None:
    objects = [obj("a", 3), obj("a/b", 4), obj("a/c/d", 5)][::order]
    tree, _, stats = decoded(objects)
    assert sorted(tree) == ["", "a", "a/b", "a/c", "a/c/d"]
    assert stats.skipped == {"shadowed": 1}
    assert stats.examples["shadowed"] == "a"


def test_prefix_export() -> None:
    prefix = export_prefix("/data/train/")
    assert prefix == "data/train/"
    tree, root_id, stats = decoded([obj("data/train/x/1"), obj("data/train/2"),
                                    obj("data/train/")], prefix)
    assert sorted(tree) == ["", "2", "x", "x/1"]
    assert root_id == object_id("bkt", "data/train/")
    assert tree["x/1"].file_id == object_id("bkt", "data/train/x/1")  # the full key
    assert stats.skipped == {"directory-marker": 1}
    with pytest.raises(ValueError, match="not under the prefix"):
        build_tree("bkt", prefix, [obj("data/other")])


def test_ids_are_stable_and_bucket_scoped() -> None:
    a, _, _ = decoded([obj("k/1"), obj("k/2")])
    b, _, _ = decoded([obj("k/2", 99, '"new"'), obj("zzz"), obj("k/1")])
    assert a["k/1"].file_id == b["k/1"].file_id and a["k"].file_id == b["k"].file_id
    other, _, _ = decoded([obj("k/1")], bucket="another")
    assert other["k/1"].file_id != a["k/1"].file_id
    assert all(e.file_id >= protocol.MIN_FILE_ID for e in a.values())


def test_version_from_etag_and_size() -> None:
    assert object_version('"e1"', 5) != object_version('"e2"', 5)
    assert object_version('"e1"', 5) != object_version('"e1"', 6)
    a, _, _ = decoded([obj("f", 5, '"e1"', T0)])
    b, _, _ = decoded([obj("f", 5, '"e1"', T0 + 10**9)])  # only LastModified moved
    c, _, _ = decoded([obj("f", 5, '"e2"', T0)])
    assert a["f"].version == b["f"].version != c["f"].version
    assert a["f"].mtime_ns == T0 and b["f"].mtime_ns == T0 + 10**9


def test_directory_mtime_is_the_newest_below() -> None:
    tree, _, _ = decoded([obj("a/b/old", mtime_ns=T0), obj("a/b/new", mtime_ns=T0 + 5),
                          obj("c", mtime_ns=T0 + 1)])
    assert tree["a/b"].mtime_ns == tree["a"].mtime_ns == T0 + 5
    assert tree[""].mtime_ns == T0 + 5


def test_same_listing_same_bytes_in_any_order() -> None:
    objects = [obj(f"d{i % 7}/s{i % 3}/f{i}", i, f'"{i}"', T0 + i) for i in range(500)]
    one = build_tree("bkt", "", objects)
    two = build_tree("bkt", "", list(reversed(objects)))
    assert one.table.build(one.root_id).records == two.table.build(two.root_id).records
    assert one.etags == two.etags and len(one.etags) == 500


_segment = st.sampled_from(["a", "b", "", ".", "..", "c d", "é", "x" * 256, "n\0"])


@given(st.lists(st.lists(_segment, min_size=1, max_size=4).map("/".join), max_size=40))
def test_any_key_set_gives_a_valid_tree(keys: list[str]) -> None:
    objects = [obj(k, len(k)) for k in dict.fromkeys(keys)]
    tree, _, stats = decoded(objects)
    files = {p for p, e in tree.items() if stat.S_ISREG(e.mode)}
    dirs = {p for p, e in tree.items() if stat.S_ISDIR(e.mode)}
    assert files.isdisjoint(dirs)
    assert len(files) + sum(stats.skipped.values()) == len(objects)
    for path in files:
        assert skip_reason(path) is None
        assert all(path.rsplit("/", n)[0] in dirs for n in range(1, path.count("/") + 1))
