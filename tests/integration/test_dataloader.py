"""A real PyTorch DataLoader with worker processes reads a dataset through the mount."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tests.helpers import treegen

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


def test_dataloader_reads_every_sample(tmp_path: Path, hub_factory, mount_factory) -> None:
    root = tmp_path / "dataset"
    samples = treegen.build_dataset(root, n=N_SAMPLES)
    hub = hub_factory(root)
    mnt = os.fsencode(mount_factory(hub.url).mnt)
    ds = MountedFiles([os.path.join(mnt, s.rel) for s in samples])
    loader = torch.utils.data.DataLoader(
        ds, batch_size=8, shuffle=True, num_workers=2, collate_fn=keep_as_list,
        multiprocessing_context="fork", generator=torch.Generator().manual_seed(0),
        timeout=120,  # a hung worker fails the test instead of hanging it
    )
    for epoch in range(2):  # cold, then served from the spoke's cache
        seen = []
        for batch in loader:
            for i, tensor in batch:
                digest = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
                assert digest == samples[i].sha256, (epoch, i, samples[i].rel)
                seen.append(i)
        assert sorted(seen) == list(range(N_SAMPLES)), epoch
