"""``hubd.s3.client.S3Client`` against a real SeaweedFS (``weed mini``), and through a proxy
that injects 503 SlowDown."""

from __future__ import annotations

import asyncio
import gzip
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from hubd.s3.client import ObjectInfo, S3Client, S3Config
from hubd.s3.errors import (
    AccessDenied,
    BadS3Answer,
    BucketMissing,
    ObjectChanged,
    ObjectMissing,
    S3Unavailable,
)
from hubd.s3.sigv4 import Credentials
from tests.helpers.fault_proxy import FaultProxy
from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedServer

T = TypeVar("T")
CREDS = Credentials(ACCESS_KEY, SECRET_KEY, None, "test")


def run(endpoint: str, fn: Callable[[S3Client], Awaitable[T]], creds: Credentials = CREDS,
        **cfg: Any) -> T:
    async def main() -> T:
        async with S3Client(S3Config(endpoint, **cfg), creds) as client:
            return await fn(client)
    return asyncio.run(main())


async def list_all(client: S3Client, bucket: str, prefix: str = "") -> list[ObjectInfo]:
    out: list[ObjectInfo] = []
    token = None
    while True:
        page = await client.list_page(bucket, prefix, token=token)
        out += page.objects
        if page.next_token is None:
            return out
        token = page.next_token


def put_many(server: SeaweedServer, bucket: str, items: dict[str, bytes]) -> None:
    server.put_objects(bucket, items)


def test_pagination_over_1000_keys(seaweed: SeaweedServer, bucket: str) -> None:
    keys = {f"shard-{i // 700:02d}/sample-{i:05d}.bin": b"%d" % i for i in range(2_345)}
    put_many(seaweed, bucket, keys)

    async def go(client: S3Client) -> tuple[list[ObjectInfo], int]:
        return await list_all(client, bucket), client.stats.list_pages

    objects, pages = run(seaweed.endpoint, go)
    assert sorted(o.key for o in objects) == sorted(keys)
    assert pages == 3  # 1,000 + 1,000 + 345
    assert {o.key: o.size for o in objects} == {k: len(v) for k, v in keys.items()}
    now_ns = time.time_ns()
    assert all(now_ns - 600 * 10**9 < o.mtime_ns <= now_ns + 10**9 for o in objects)


def test_prefix_and_delimiter(seaweed: SeaweedServer, bucket: str) -> None:
    put_many(seaweed, bucket, {"top.txt": b"t", "a/1": b"1", "a/b/2": b"2", "c/3": b"3",
                               "ab": b"x"})

    async def go(client: S3Client) -> Any:
        root = await client.list_page(bucket, "", delimiter="/")
        under_a = await list_all(client, bucket, "a/")
        return root, under_a

    root, under_a = run(seaweed.endpoint, go)
    assert sorted(o.key for o in root.objects) == ["ab", "top.txt"]
    assert sorted(root.prefixes) == ["a/", "c/"]
    assert sorted(o.key for o in under_a) == ["a/1", "a/b/2"]


# Keys SeaweedFS stores as given. It refuses ``.``/``..`` segments and NUL, and folds ``//``,
# a leading ``/`` and ``\\`` (its filer keeps paths), and keeps no bytes in a ``dir/``
# object: the tree tests cover those names.
ODD_KEYS = [
    "with space.txt", "plus+sign", "percent%25literal%", "uni/ça/日本語.jpg", "emoji/🙂",
    "tab\there", "ctl\x01char", "amp&eq=q?hash#", "semi;colon,comma", "quote'\"",
    "~tilde", "*star(paren)[br]", "x" * 250,
]


def test_odd_keys_list_and_read_back(seaweed: SeaweedServer, bucket: str) -> None:
    items = {key: key.encode() * 3 for key in ODD_KEYS}
    put_many(seaweed, bucket, items)

    async def go(client: S3Client) -> dict[str, bytes]:
        objects = await list_all(client, bucket)
        return {o.key: await client.get(bucket, o.key, o.etag, 0, o.size) for o in objects}

    assert run(seaweed.endpoint, go) == items


def test_ranges_and_parallel_parts(seaweed: SeaweedServer, bucket: str) -> None:
    data = random.Random(7).randbytes(5 * 1024 * 1024 + 123)
    seaweed.writer().put_object(Bucket=bucket, Key="big.bin", Body=data)
    rng = random.Random(8)
    ranges = [(0, len(data)), (0, 1), (len(data) - 1, len(data)), (4096, 3 * 1024 * 1024)]
    ranges += [(a, a + rng.randrange(1, 2 * 1024 * 1024))
               for a in (rng.randrange(len(data) - 2 * 1024 * 1024) for _ in range(10))]

    async def go(client: S3Client) -> list[bytes]:
        [obj] = await list_all(client, bucket)
        return [await client.get(bucket, "big.bin", obj.etag, a, b) for a, b in ranges]

    # parts of 1 MiB: the 5 MiB read is six parallel GETs
    got = run(seaweed.endpoint, go, part_bytes=1024 * 1024)
    assert got == [data[a:b] for a, b in ranges]


def test_range_past_the_end(seaweed: SeaweedServer, bucket: str) -> None:
    seaweed.writer().put_object(Bucket=bucket, Key="small", Body=b"0123456789")

    async def go(client: S3Client) -> bytes:
        [obj] = await list_all(client, bucket)
        return await client.get(bucket, "small", obj.etag, 20, 30)

    with pytest.raises(BadS3Answer, match="HTTP 416"):
        run(seaweed.endpoint, go)


def test_overwrite_is_412_never_new_bytes(seaweed: SeaweedServer, bucket: str) -> None:
    writer = seaweed.writer()
    writer.put_object(Bucket=bucket, Key="k", Body=b"old bytes")

    async def go(client: S3Client) -> tuple[bytes, ObjectInfo]:
        [old] = await list_all(client, bucket)
        first = await client.get(bucket, "k", old.etag, 0, old.size)
        writer.put_object(Bucket=bucket, Key="k", Body=b"new bytes!")
        with pytest.raises(ObjectChanged, match="HTTP 412"):
            await client.get(bucket, "k", old.etag, 0, 4)
        [new] = await list_all(client, bucket)
        assert new.etag != old.etag
        return first + await client.get(bucket, "k", new.etag, 0, new.size), new

    data, new = run(seaweed.endpoint, go)
    assert data == b"old bytesnew bytes!"
    assert new.size == 10


def test_overwrite_seen_by_every_parallel_part(seaweed: SeaweedServer, bucket: str) -> None:
    writer = seaweed.writer()
    writer.put_object(Bucket=bucket, Key="k", Body=b"a" * 100_000)

    async def go(client: S3Client) -> None:
        [old] = await list_all(client, bucket)
        writer.put_object(Bucket=bucket, Key="k", Body=b"b" * 100_000)
        await client.get(bucket, "k", old.etag, 0, old.size)  # 10 parts, all refused

    with pytest.raises(ObjectChanged, match="HTTP 412"):  # one exception, not a group
        run(seaweed.endpoint, go, part_bytes=10_000)


def test_deleted_object_and_missing_bucket(seaweed: SeaweedServer, bucket: str) -> None:
    writer = seaweed.writer()
    writer.put_object(Bucket=bucket, Key="gone", Body=b"bytes")

    async def go(client: S3Client) -> None:
        [obj] = await list_all(client, bucket)
        writer.delete_object(Bucket=bucket, Key="gone")
        with pytest.raises(ObjectMissing, match="HTTP 404"):
            await client.get(bucket, "gone", obj.etag, 0, obj.size)
        with pytest.raises(BucketMissing, match="NoSuchBucket"):
            await client.list_page("no-such-bucket-here", "")

    run(seaweed.endpoint, go)


@pytest.mark.parametrize("creds", [
    Credentials(ACCESS_KEY, "wrong-secret"),
    Credentials("UNKNOWNKEY", SECRET_KEY),
])
def test_wrong_credentials(seaweed: SeaweedServer, bucket: str, creds: Credentials) -> None:
    async def go(client: S3Client) -> None:
        await client.list_page(bucket, "")

    with pytest.raises(AccessDenied) as info:
        run(seaweed.endpoint, go, creds)
    message = str(info.value)
    assert "HTTP 403" in message and "\n" not in message
    assert SECRET_KEY not in message


def test_content_encoding_is_not_decoded(seaweed: SeaweedServer, bucket: str) -> None:
    raw = gzip.compress(b"plain text " * 100)
    seaweed.writer().put_object(Bucket=bucket, Key="z.gz", Body=raw, ContentEncoding="gzip")

    async def go(client: S3Client) -> bytes:
        [obj] = await list_all(client, bucket)
        return await client.get(bucket, "z.gz", obj.etag, 0, obj.size)

    assert run(seaweed.endpoint, go) == raw


def test_slowdown_is_retried(seaweed: SeaweedServer, bucket: str,
                             caplog: pytest.LogCaptureFixture) -> None:
    seaweed.writer().put_object(Bucket=bucket, Key="k", Body=b"through the proxy")

    async def main() -> tuple[bytes, int, int]:
        async with FaultProxy(seaweed.endpoint, fail_first=5) as proxy, \
                S3Client(S3Config(proxy.endpoint), CREDS) as client:
            [obj] = await list_all(client, bucket)  # 5 x 503 SlowDown, then the answer
            data = await client.get(bucket, "k", obj.etag, 0, obj.size)
            return data, proxy.seen, client.stats.retries

    with caplog.at_level(logging.INFO, logger="hubd.s3"):
        data, seen, retries = asyncio.run(main())
    assert (data, seen, retries) == (b"through the proxy", 7, 5)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("failing, retrying" in m and "SlowDown" in m for m in messages) == 1
    assert sum("reachable again" in m for m in messages) == 1


def test_streamed_get_resumes_after_a_broken_body(seaweed: SeaweedServer,
                                                  bucket: str) -> None:
    """A GET cut after 2.5 MiB: the two pieces before are delivered (cut at the object's
    MiB boundaries), then one new GET for the rest from the first byte not delivered; the
    pieces are the object's bytes, in order."""
    mib = 1024 * 1024
    data = random.Random(11).randbytes(5 * mib + 77)
    seaweed.writer().put_object(Bucket=bucket, Key="cut.bin", Body=data)

    async def main() -> tuple[list[bytes], list[str], int]:
        pieces: list[bytes] = []
        async with FaultProxy(seaweed.endpoint, cut_gets=1, cut_after=5 * mib // 2) as proxy, \
                S3Client(S3Config(proxy.endpoint), CREDS) as client:
            [obj] = await list_all(client, bucket)
            await client.get_streamed(bucket, "cut.bin", obj.etag, 100, len(data), mib,
                                      lambda views: pieces.append(b"".join(views)))
            return pieces, proxy.ranges, client.stats.retries

    pieces, ranges, retries = asyncio.run(main())
    assert b"".join(pieces) == data[100:]
    assert [len(p) for p in pieces] == [mib - 100] + [mib] * 4 + [77]
    assert ranges == [f"bytes=100-{len(data) - 1}", f"bytes={2 * mib}-{len(data) - 1}"]
    assert retries == 1


def test_streamed_get_from_a_server_that_ignores_range(seaweed: SeaweedServer,
                                                       bucket: str) -> None:
    """A 200 with the whole object for a ranged GET: the bytes before the range are
    skipped and those after it never delivered; the pieces are cut as from a 206."""
    mib = 1024 * 1024
    data = random.Random(13).randbytes(3 * mib + 500)
    seaweed.writer().put_object(Bucket=bucket, Key="whole.bin", Body=data)

    async def main() -> list[bytes]:
        pieces: list[bytes] = []
        async with FaultProxy(seaweed.endpoint, whole_object=data) as proxy, \
                S3Client(S3Config(proxy.endpoint), CREDS) as client:
            [obj] = await list_all(client, bucket)
            await client.get_streamed(bucket, "whole.bin", obj.etag, mib + 7, 3 * mib + 100,
                                      mib, lambda views: pieces.append(b"".join(views)))
        return pieces

    pieces = asyncio.run(main())
    assert b"".join(pieces) == data[mib + 7 : 3 * mib + 100]
    assert [len(p) for p in pieces] == [mib - 7, mib, 100]


def test_streamed_get_of_a_replaced_object_is_never_mixed(seaweed: SeaweedServer,
                                                         bucket: str) -> None:
    """The object replaced while its GET was cut: the resumed GET is a 412, so only the
    old version's first pieces were delivered, never a byte of the new one."""
    mib = 1024 * 1024
    old = random.Random(12).randbytes(3 * mib)
    writer = seaweed.writer()
    writer.put_object(Bucket=bucket, Key="swap.bin", Body=old)

    async def main() -> list[bytes]:
        pieces: list[bytes] = []
        async with FaultProxy(seaweed.endpoint, cut_gets=1, cut_after=mib + 10) as proxy, \
                S3Client(S3Config(proxy.endpoint), CREDS) as client:
            [obj] = await list_all(client, bucket)

            def deliver(views: list[memoryview]) -> None:
                pieces.append(b"".join(views))
                if len(pieces) == 1:  # before the retry: a new version of the object
                    writer.put_object(Bucket=bucket, Key="swap.bin", Body=b"n" * (3 * mib))

            with pytest.raises(ObjectChanged, match="412"):
                await client.get_streamed(bucket, "swap.bin", obj.etag, 0, len(old), mib,
                                          deliver)
        return pieces

    assert asyncio.run(main()) == [old[:mib]]


def test_slowdown_past_the_deadline(seaweed: SeaweedServer, bucket: str) -> None:
    async def main() -> None:
        async with FaultProxy(seaweed.endpoint, fail_first=10**6) as proxy, \
                S3Client(S3Config(proxy.endpoint, deadline_s=1.0), CREDS) as client:
            await client.list_page(bucket, "")

    start = time.monotonic()
    with pytest.raises(S3Unavailable, match=r"no answer within 1 s .*SlowDown"):
        asyncio.run(main())
    assert time.monotonic() - start < 3


def test_server_down_and_back(own_seaweed: SeaweedServer) -> None:
    writer = own_seaweed.writer()
    writer.create_bucket(Bucket="durable")
    data = os.urandom(300_000)
    writer.put_object(Bucket="durable", Key="obj", Body=data)

    async def main() -> bytes:
        async with S3Client(S3Config(own_seaweed.endpoint, deadline_s=30.0), CREDS) as client:
            [obj] = await list_all(client, "durable")
            own_seaweed.stop()
            with pytest.raises(S3Unavailable, match="no answer within 1 s"):
                await _down_read(own_seaweed.endpoint, obj)  # down, and nobody restarts it
            loop = asyncio.get_running_loop()
            restart = loop.run_in_executor(None, own_seaweed.start)
            read = await client.get("durable", "obj", obj.etag, 0, obj.size)  # retried
            await restart
            return read

    assert asyncio.run(main()) == data


async def _down_read(endpoint: str, obj: ObjectInfo) -> bytes:
    async with S3Client(S3Config(endpoint, deadline_s=1.0), CREDS) as client:
        return await client.get("durable", obj.key, obj.etag, 0, obj.size)
