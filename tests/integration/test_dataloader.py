"""A real PyTorch DataLoader with worker processes reads a dataset through the mount: the
first epoch from the hub, the next ones from the caches with not a byte from the hub."""

from __future__ import annotations

import hashlib
import os
import re
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import page_cache, treegen
from tests.helpers.procs import free_port

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.fuse

N_SAMPLES = 200


class MountedFiles(torch.utils.data.Dataset):
    """Sample i is (i, the bytes of file i as a uint8 tensor), read from the mount."""

    def __init__(self, paths: list[bytes]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        with open(self.paths[i], "rb") as f:
            data = f.read()
        return i, torch.frombuffer(bytearray(data), dtype=torch.uint8)


def keep_as_list(batch):
    """Samples have different lengths, so they are not stacked."""
    return batch


def spoke_counts(mnt: bytes, port: int) -> dict[str, float]:
    """From a spoke's /metrics: its FUSE reads, block hits and misses, data (blob and pack)
    requests to the hub and bytes from it. The bytes include the ``GET /healthz`` touches
    that keep connections open (every 10 s), so only the requests say "nothing came".
    Every read answered before the call is counted (``procs.counted_metrics``)."""
    os.getxattr(mnt, "user.spokefs.cached")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    counts = dict.fromkeys(("reads", "hits", "misses", "data_requests", "link_bytes"), 0.0)
    names = {"spokefs_reads_total": "reads", "spokefs_block_hits_total": "hits",
             "spokefs_block_misses_total": "misses", "spokefs_link_bytes_total": "link_bytes"}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        if name in names:
            counts[names[name]] += float(value)
        elif name == "spokefs_hub_requests_total" and re.search(r'kind="(blob|pack)"', series):
            counts["data_requests"] += float(value)
    return counts


def drop_pages(paths: list[bytes]) -> None:
    """Drop the kernel's pages of the files (clean pages: the next reads reach the spoke)."""
    for path in paths:
        page_cache.drop_pages(path)


def test_dataloader_reads_every_sample(tmp_path: Path, hub_factory, mount_factory) -> None:
    root = tmp_path / "dataset"
    samples = treegen.build_dataset(root, n=N_SAMPLES)
    hub = hub_factory(root)
    port = free_port()
    mnt = os.fsencode(mount_factory(hub.url, "--metrics-port", str(port)).mnt)
    ds = MountedFiles([os.path.join(mnt, s.rel) for s in samples])
    total = sum(os.path.getsize(os.path.join(os.fsencode(root), s.rel)) for s in samples)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=8, shuffle=True, num_workers=2, collate_fn=keep_as_list,
        multiprocessing_context="fork", generator=torch.Generator().manual_seed(0),
        timeout=120,  # a hung worker fails the test instead of hanging it
    )
    # 0: cold, from the hub. 1: from the kernel's pages, which the spoke lets it keep across
    # opens (keep_cache): next to no read reaches the spoke. 2: those pages dropped, every
    # file is read through the spoke, from its block cache. In 1 and 2 nothing comes from the
    # hub. "Next to no read": a host may take clean pages back while memory is plentiful (the
    # CI VM runs DAMON's proactive reclaim, a kdamond "pageout" scheme: traced through
    # filemap:mm_filemap_delete_from_page_cache, it took 20 pages of two files of this test
    # during its first epoch), and the files those belong to are read again, from the spoke's
    # cache. Without keep_cache every file would be (N_SAMPLES reads).
    for epoch in range(3):
        if epoch == 2:
            drop_pages(ds.paths)
        before = spoke_counts(mnt, port)
        seen = []
        for batch in loader:
            for i, tensor in batch:
                digest = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
                assert digest == samples[i].sha256, (epoch, i, samples[i].rel)
                seen.append(i)
        assert sorted(seen) == list(range(N_SAMPLES)), epoch
        moved = {k: v - before[k] for k, v in spoke_counts(mnt, port).items()}
        if epoch == 0:
            assert moved["data_requests"] > 0 and moved["link_bytes"] >= total, moved
            continue
        assert moved["data_requests"] == 0 and moved["misses"] == 0, (epoch, moved)
        if epoch == 1:
            assert moved["reads"] <= N_SAMPLES // 20, moved
        else:
            assert moved["reads"] >= N_SAMPLES and moved["hits"] * 4096 >= total, moved
