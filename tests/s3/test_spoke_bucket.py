"""A real spoke (FUSE) on a hub that exports a real SeaweedFS bucket: bytes, ESTALE on an
object replaced under an open file, the new object on a new open, and 1 GiB byte for byte."""

from __future__ import annotations

import errno
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from tests.conftest import MountFactory
from tests.helpers.procs import run_spokefs
from tests.helpers.seaweed import SeaweedServer
from tests.hubd.hubd_testlib import Hub, start_hub_process
from tests.s3.test_hub_bucket import put

pytestmark = pytest.mark.fuse
MiB = 1024 * 1024


@pytest.fixture
def bucket_hub(tmp_path: Path, s3_env: None, seaweed: SeaweedServer,
               bucket: str) -> Iterator[Callable[[], Hub]]:
    hubs: list[Hub] = []

    def start() -> Hub:
        hub = start_hub_process(f"s3://{bucket}".encode(), tmp_path / "hubd.err",
                                "--s3-endpoint", seaweed.endpoint, "--rescan-interval", "0")
        hubs.append(hub)
        return hub

    yield start
    for hub in hubs:
        assert hub.stop() == 0, hub.stderr()


def generation(mnt: Path) -> int:
    res = run_spokefs("refresh", str(mnt))
    assert res.returncode == 0, res.stderr
    return int(res.stdout.split()[-1])


def refreshed(mnt: Path, after: int, timeout_s: float = 30.0) -> int:
    import time

    deadline = time.monotonic() + timeout_s
    while (gen := generation(mnt)) <= after and time.monotonic() < deadline:
        time.sleep(0.2)
    return gen


def test_reads_estale_and_new_object(seaweed: SeaweedServer, bucket: str,
                                     bucket_hub: Callable[[], Hub],
                                     mount_factory: MountFactory) -> None:
    rnd = random.Random(11)
    old = rnd.randbytes(8 * MiB + 3)
    small = {f"small/f{i:02}": rnd.randbytes(rnd.randrange(1, 70_000)) for i in range(30)}
    put(seaweed, bucket, {"shards/s0.bin": old, **small})
    hub = bucket_hub()
    spoke = mount_factory(hub.url, "--refresh-interval", "0", "--open-mode", "handle")
    for key, data in small.items():
        assert (spoke.mnt / key).read_bytes() == data
    path = spoke.mnt / "shards" / "s0.bin"
    before = generation(spoke.mnt)
    new = bytes(b ^ 0x5A for b in old)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 65536, 0) == old[:65536]
        put(seaweed, bucket, {"shards/s0.bin": new})  # replaced while open
        assert os.pread(fd, 65536, 0) == old[:65536]  # cached: the old version
        with pytest.raises(OSError) as info:  # not cached: S3 refuses the old ETag
            os.pread(fd, 4096, 7 * MiB)
        assert info.value.errno == errno.ESTALE
    finally:
        os.close(fd)
    # the hub's 412 asked for a listing: the spoke sees a new generation, a new open new bytes
    assert refreshed(spoke.mnt, before) > before
    assert path.read_bytes() == new


@pytest.mark.slow
def test_one_gib_object_byte_for_byte(seaweed: SeaweedServer, bucket: str,
                                      bucket_hub: Callable[[], Hub],
                                      mount_factory: MountFactory) -> None:
    part = 64 * MiB
    parts = 16  # 1 GiB, uploaded in multipart (an ETag "md5-16", as big objects have)
    writer = seaweed.writer()
    upload = writer.create_multipart_upload(Bucket=bucket, Key="big/one-gib.bin")
    expected = xxhash.xxh3_64()
    done = []
    for n in range(parts):
        data = random.Random(n).randbytes(part)
        expected.update(data)
        answer = writer.upload_part(Bucket=bucket, Key="big/one-gib.bin", PartNumber=n + 1,
                                    UploadId=upload["UploadId"], Body=data)
        done.append({"PartNumber": n + 1, "ETag": answer["ETag"]})
    writer.complete_multipart_upload(Bucket=bucket, Key="big/one-gib.bin",
                                     UploadId=upload["UploadId"],
                                     MultipartUpload={"Parts": done})
    hub = bucket_hub()
    spoke = mount_factory(hub.url, "--refresh-interval", "0")
    got = xxhash.xxh3_64()
    size = 0
    with open(spoke.mnt / "big" / "one-gib.bin", "rb") as f:
        while chunk := f.read(4 * MiB):
            got.update(chunk)
            size += len(chunk)
    assert size == part * parts
    assert got.hexdigest() == expected.hexdigest()
