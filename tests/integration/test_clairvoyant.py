"""``spokefs.torch.clairvoyant`` on a real mount of a real hub, with a real DataLoader (two
worker processes): each epoch's order reaches the mount as the sampler draws it, the mount
fetches it ahead of the workers (their reads hit blocks of the replay's origin), and every
sample is the source file's bytes; the epoch's first files are announced before a worker
reads one, so the mount makes no guesses of its own. A job that stops early leaves an order
whose fetching stays within the data set (the bound beyond that is the spoke's to decide)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
import urllib.request
from pathlib import Path

import pytest

from spokefs import torch as spokefs_torch
from spokefs.torch import clairvoyant
from tests.helpers.procs import free_port

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

KiB = 1 << 10
N_FILES, N_DIRS = 300, 20


class Folder(torch.utils.data.Dataset):
    """ImageFolder-like: ``samples`` of (path, class), a sample (index, the file's bytes).
    Made from the names of the files rather than by listing the mount, which would have the
    spoke fill each directory listed before a sample is read (``dir_fill``)."""

    def __init__(self, root: Path, names: list[str]) -> None:
        self.samples = [(str(root / n), int(n[1:3])) for n in sorted(names)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        with open(self.samples[i][0], "rb") as f:
            return i, torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)


def keep_as_list(batch):
    """Samples have different lengths, so they are not stacked."""
    return batch


@pytest.fixture
def export(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The data set: its root, and each file's sha256 by path relative to it."""
    rnd = random.Random(29)
    root = tmp_path / "export"
    digests = {}
    for i in range(N_FILES):
        rel = f"c{i % N_DIRS:02}/{i:04}.jpg"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        raw = rnd.randbytes(rnd.randint(4 * KiB, 100 * KiB))
        (root / rel).write_bytes(raw)
        digests[rel] = hashlib.sha256(raw).hexdigest()
    return root, digests


def loader_of(mnt: Path, names: list[str]) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        Folder(mnt, names), batch_size=16, shuffle=True, num_workers=2, collate_fn=keep_as_list,
        multiprocessing_context="fork",
        timeout=120)  # a hung worker fails the test


def orders(mnt: Path) -> list[dict]:
    return json.loads(os.getxattr(mnt, "user.spokefs.order"))


def our_order(mnt: Path, wait_s: float = 10.0) -> dict | None:
    """This process's order (the whole epoch's, not its head's), once the mount has it and
    has resolved it."""
    deadline = time.monotonic() + wait_s
    while True:
        mine = [p for p in orders(mnt)
                if f":{os.getpid()}:" in p["job"] and not p["job"].endswith(":head")]
        if (mine and mine[-1]["state"] != "resolving") or time.monotonic() > deadline:
            return mine[-1] if mine else None
        time.sleep(0.05)


def metric(port: int, series: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines()
                   if line and not line.startswith("#"))
    return float(samples[series])


def test_an_epoch_read_in_its_announced_order(export, hub_factory, mount_factory,
                                              monkeypatch):
    root, digests = export
    # the head of the epoch goes at once, the whole order late (as a million files would)
    monkeypatch.setattr(spokefs_torch, "HEAD_FILES", 64)
    announce = spokefs_torch._announce

    def late_whole(where: str, raw: bytes) -> int:
        if b':head"' not in raw.split(b"\n", 1)[0]:
            time.sleep(0.5)
        return announce(where, raw)

    monkeypatch.setattr(spokefs_torch, "_announce", late_whole)
    hub = hub_factory(root=root)
    port = free_port()
    mnt = mount_factory(hub.url, "--metrics-port", str(port)).mnt
    assert orders(mnt) == []
    loader = clairvoyant(loader_of(mnt, list(digests)))
    assert len(loader) == -(-N_FILES // 16)
    seen = []
    for batch in loader:
        for i, tensor in batch:
            rel = str(Path(loader.dataset.samples[i][0]).relative_to(mnt))
            assert hashlib.sha256(tensor.numpy().tobytes()).hexdigest() == digests[rel], rel
            seen.append(i)
    assert sorted(seen) == list(range(N_FILES))
    order = our_order(mnt)
    assert order is not None, orders(mnt)
    assert order["entries"] == N_FILES and order["missing"] == order["changed"] == 0, order
    assert order["state"] in ("running", "done"), order
    assert order["name"].startswith("spokefs-order-"), order
    mine = [p for p in orders(mnt) if f":{os.getpid()}:" in p["job"]]  # the head's too
    assert sum(p["fetched_bytes"] for p in mine) > 0, mine
    assert metric(port, 'spokefs_block_hits_total{origin="replay"}') > 0
    # the order came before the workers' first reads: the mount made no guesses of its own
    # (a miss's directory pack, the fills of the directories the first misses touch)
    assert metric(port, "spokefs_prefetch_issued_bytes_total") == 0


def test_a_job_that_stops_early_fetches_within_the_data_set(export, hub_factory,
                                                            mount_factory):
    root, digests = export
    total = sum(p.stat().st_size for p in root.rglob("*.jpg"))
    hub = hub_factory(root=root)
    mnt = mount_factory(hub.url).mnt
    loader = clairvoyant(loader_of(mnt, list(digests)))
    for n, _ in enumerate(loader, start=1):
        if n * 16 >= N_FILES // 10:
            break
    # quiet: the order is over, or its bytes have not moved for 2 s
    last, still_since, deadline = None, time.monotonic(), time.monotonic() + 60
    while time.monotonic() < deadline:
        order = our_order(mnt)
        assert order is not None, orders(mnt)
        if order["state"] not in ("resolving", "running"):
            break
        if order["done_bytes"] != last:
            last, still_since = order["done_bytes"], time.monotonic()
        elif time.monotonic() - still_since > 2:
            break
        time.sleep(0.1)
    assert order["entries"] == N_FILES, order
    assert order["fetched_bytes"] <= total, (order, total)
