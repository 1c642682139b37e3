"""A regional tier: Debian's nginx with ``deploy/regional/nginx.conf.template`` between one
hubd (behind the long-link emulator, standing in for the far link) and three spokes.

- Three spokes read the same dataset at once (sequential shards, shuffled small files):
  right bytes everywhere, and the far link carries the dataset about once, not three times.
- A tier that damages what it passes on (a flipped byte, a cut answer, another slice's
  bytes) is caught by the spoke's frame sums: the read still returns the right bytes (from
  the hub), nothing damaged is cached, and the fallbacks are counted.
- The version errors both ways: an old (v1) spoke's requests to a new hub, and a new spoke
  against a server that has no /v2 routes.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.helpers.procs import free_port, mount_fails, scrape_metrics
from tests.helpers.tier import BadTier, NginxTier, nginx_skip_reason

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from longlink import LongLinkProcess

pytestmark = [pytest.mark.fuse,
              pytest.mark.skipif(nginx_skip_reason() is not None,
                                 reason=str(nginx_skip_reason()))]

MiB = 1 << 20


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """Shards (sequential reads, one of an odd size) and two directories of small files."""
    root = tmp_path / "src"
    rnd = random.Random(11)
    (root / "shards").mkdir(parents=True)
    for i, size in enumerate([12 * MiB, 12 * MiB, 7 * MiB + 12345]):
        (root / "shards" / f"shard-{i:03}.tar").write_bytes(rnd.randbytes(size))
    for d in ("train/cat", "train/dog"):
        (root / d).mkdir(parents=True)
        for i in range(150):
            (root / d / f"{i:05}.jpg").write_bytes(rnd.randbytes(rnd.randrange(4 << 10,
                                                                               96 << 10)))
    return root


def files_of(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def read_like_a_trainer(mnt: Path, src: Path, seed: int, errors: list[str]) -> None:
    """Shards start to end in 1 MiB reads, then every small file in a shuffled order."""
    try:
        for rel in sorted((src / "shards").iterdir()):
            digest = hashlib.sha256()
            with open(mnt / "shards" / rel.name, "rb") as f:
                while chunk := f.read(MiB):
                    digest.update(chunk)
            if digest.digest() != hashlib.sha256(rel.read_bytes()).digest():
                errors.append(f"shards/{rel.name}")
        small = [p for p in files_of(src) if p.parts[0] == "train"]
        random.Random(seed).shuffle(small)
        for rel in small:
            if (mnt / rel).read_bytes() != (src / rel).read_bytes():
                errors.append(str(rel))
    except OSError as exc:
        errors.append(f"{exc}")


def link_bytes(link: LongLinkProcess) -> int:
    time.sleep(0.5)  # the status file is rewritten every 0.2 s
    return int(link.statistics()["bytes_down"])


def test_three_spokes_through_nginx_move_the_dataset_about_once(dataset, hub_factory,
                                                                 mount_factory, tmp_path):
    hub = hub_factory(root=dataset)
    parts = urlsplit(hub.url)
    with LongLinkProcess((parts.hostname, parts.port), delay_ms=10, rate_mbit=0) as link:
        far = f"127.0.0.1:{link.port}"
        tier = NginxTier(far, tmp_path / "nginx").start()
        try:
            ports = [free_port() for _ in range(3)]
            spokes = [mount_factory(f"http://{far}", "--tier", tier.url,
                                    "--metrics-port", str(port)) for port in ports]
            before = link_bytes(link)
            errors: list[str] = []
            readers = [threading.Thread(target=read_like_a_trainer,
                                        args=(s.mnt, dataset, n, errors))
                       for n, s in enumerate(spokes)]
            for t in readers:
                t.start()
            for t in readers:
                t.join(timeout=300)
            assert not errors, errors[:10]
            moved = link_bytes(link) - before
            total = sum((dataset / p).stat().st_size for p in files_of(dataset))
            # every byte at least once; at most 1.05 x (frame sums are 0.2 %)
            assert total <= moved <= 1.05 * total, (moved, total)
            fetched = [scrape_metrics(p) for p in ports]
            assert all(m.get("spokefs_tier_fallbacks_total", 0) == 0 for m in fetched)
            assert tier.cached_bytes() >= total
        finally:
            tier.stop()
        for s in spokes:
            assert "Traceback" not in s.stderr()


@pytest.mark.parametrize("mode", ["flip", "truncate", "other-slice"])
def test_a_tier_that_damages_bytes_is_caught_and_the_hub_answers(mode, dataset, hub_factory,
                                                                  mount_factory, tmp_path):
    hub = hub_factory(root=dataset)
    parts = urlsplit(hub.url)
    bad = BadTier(f"{parts.hostname}:{parts.port}", mode, tmp_path / "bad").start()
    try:
        port = free_port()
        spoke = mount_factory(hub.url, "--tier", bad.url, "--metrics-port", str(port))
        shard = dataset / "shards" / "shard-002.tar"
        want = shard.read_bytes()
        with open(spoke.mnt / "shards" / shard.name, "rb") as f:
            f.seek(3 * MiB + 100)
            assert f.read(2 * MiB) == want[3 * MiB + 100 : 5 * MiB + 100]
        small = sorted((dataset / "train" / "cat").iterdir())[:20]
        for p in small:
            assert (spoke.mnt / "train" / "cat" / p.name).read_bytes() == p.read_bytes()
        metrics = scrape_metrics(port)
        assert metrics["spokefs_tier_fallbacks_total"] >= 1
        assert metrics["spokefs_fetched_bytes_total"] > 0
        stderr = spoke.stderr()
        assert f"tier {bad.url} failed" in stderr
    finally:
        bad.stop()
    # Nothing damaged was kept: with the tier gone, the whole shard reads right from the
    # cache and the hub (a damaged block in the cache would be served as it is).
    assert (spoke.mnt / "shards" / shard.name).read_bytes() == want
    for p in small:
        assert (spoke.mnt / "train" / "cat" / p.name).read_bytes() == p.read_bytes()


def test_an_old_spoke_and_a_new_hub_say_which_versions(hub):
    """A v1 spoke's routes get one clear reason; they never return bytes."""
    for path in ("/v1/snapshot", "/v1/changes?since=1", "/v1/blob/0000000000000002/"
                 "0000000000000002"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(hub.url + path, timeout=10)
        assert err.value.code == 400
        assert err.value.headers["X-Spokefs-Error"] == "protocol-version"
        assert b"speaks protocol v2" in err.value.read()


def test_a_new_spoke_and_an_old_hub_fail_the_mount_naming_both_versions(tmp_path):
    """An older hubd has no /v2 routes: 404 for /v2/snapshot. Stood in for by a plain HTTP
    server over an empty directory (404 for every path)."""
    www = tmp_path / "www"
    www.mkdir()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                               "127.0.0.1", "--directory", str(www)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "http.server did not start"
                time.sleep(0.05)
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        err = mount_fails(f"http://127.0.0.1:{port}", mnt, tmp_path / "cache")
        assert "does not speak protocol v2" in err and "protocol v1" in err, err
        assert "Traceback" not in err
        assert not os.path.ismount(mnt)
    finally:
        server.terminate()
        server.wait(timeout=10)
