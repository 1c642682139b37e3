"""Parallel listing (``hubd.s3.listing``) and the tree built from it, on a real SeaweedFS."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from hubd.s3 import listing
from hubd.s3.client import S3Client, S3Config
from hubd.s3.errors import AccessDenied
from hubd.s3.listing import Listing, list_objects
from hubd.s3.tree import build_tree, export_prefix
from spokefs import protocol
from tests.helpers.fault_proxy import FaultProxy
from tests.helpers.seaweed import SeaweedServer
from tests.s3.test_client import CREDS, put_many

LAYOUT = ["top.txt", "train.csv", "train-x", "train/a/1", "train/a/2", "train/b/3", "train/4",
          "trainz", "val/5", "val/deep/er/6", "é/7", "z"]


def listed(server: SeaweedServer, bucket: str, prefix: str, workers: int) -> Listing:
    async def main() -> Listing:
        async with S3Client(S3Config(server.endpoint), CREDS) as client:
            return await list_objects(client, bucket, prefix, workers)
    return asyncio.run(main())


def keys_of(result: Listing) -> Counter[str]:
    return Counter(o.key for o in result.objects)


@pytest.mark.parametrize(("workers", "streams"), [
    (1, 1),  # flat
    (2, 2),  # train/, val/, é/: enough directories at the top, listed two at a time
    (8, 3),  # one level deeper: train/a/, train/b/, val/deep/ (é/7 comes with the split)
])
def test_parallel_listing_is_exact(seaweed: SeaweedServer, bucket: str, workers: int,
                                   streams: int) -> None:
    put_many(seaweed, bucket, {k: k.encode() for k in LAYOUT})
    result = listed(seaweed, bucket, "", workers)
    assert keys_of(result) == Counter(LAYOUT)  # every key once, none twice
    assert result.streams == streams
    assert result.pages >= result.streams


def test_prefix_listing_of_a_shallow_tree_is_all_split(seaweed: SeaweedServer, bucket: str) -> None:
    put_many(seaweed, bucket, {k: k.encode() for k in LAYOUT})
    result = listed(seaweed, bucket, "train/", 8)
    assert keys_of(result) == Counter(k for k in LAYOUT if k.startswith("train/"))
    # train/a/ and train/b/ are split (listed with a delimiter, in parallel): they hold no
    # directory, so their keys all came with the split and nothing is left to list
    assert (result.streams, result.pages) == (2, 3)


def test_many_directories_list_flat(seaweed: SeaweedServer, bucket: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listing, "MAX_SPLIT_PREFIXES", 5)
    keys = [f"sample-{i:03d}/data.bin" for i in range(12)] + ["readme"]
    put_many(seaweed, bucket, {k: b"x" for k in keys})
    result = listed(seaweed, bucket, "", 8)
    assert keys_of(result) == Counter(keys)
    assert result.streams == 1


def test_thousands_of_keys_in_parallel(seaweed: SeaweedServer, bucket: str) -> None:
    keys = [f"shard-{i % 6}/part-{i:05d}.tar" for i in range(3_100)]
    put_many(seaweed, bucket, {k: b"%d" % i for i, k in enumerate(keys)})
    result = listed(seaweed, bucket, "", 8)
    assert keys_of(result) == Counter(keys)
    # 6 shards < 8 workers: split one level deeper, which lists each shard (no
    # subdirectories, ~517 keys: one page) with a delimiter, the six at once
    assert (result.streams, result.pages) == (6, 1 + 6)


def test_bucket_to_tree(seaweed: SeaweedServer, bucket: str) -> None:
    put_many(seaweed, bucket, {k: k.encode() for k in LAYOUT})
    prefix = export_prefix("train")
    result = listed(seaweed, bucket, prefix, 8)
    tree = build_tree(bucket, prefix, result.objects)
    stats = tree.stats
    decoder = protocol.SnapshotDecoder()
    names = sorted(e.name for e in decoder.feed(tree.table.build(tree.root_id).encode(1, 1)))
    decoder.finish()
    assert names == [b"", b"1", b"2", b"3", b"4", b"a", b"b"]
    assert stats.files == 4 and not stats.skipped


@pytest.mark.parametrize("denied", ["prefix=train%2Fa%2F", "prefix=val%2F"])
def test_a_failing_parallel_listing_raises_the_s3_error(seaweed: SeaweedServer, bucket: str,
                                                        denied: str) -> None:
    put_many(seaweed, bucket, {k: k.encode() for k in LAYOUT})

    async def main() -> None:
        async with FaultProxy(seaweed.endpoint, deny_query=denied) as proxy, \
                S3Client(S3Config(proxy.endpoint), CREDS) as client:
            await list_objects(client, bucket, "", 8)

    with pytest.raises(AccessDenied, match="HTTP 403 AccessDenied"):  # not an ExceptionGroup
        asyncio.run(main())
