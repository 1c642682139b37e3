#!/usr/bin/env python3
"""One epoch of a PyTorch DataLoader over ROOT, for ``bench_pipeline.py``; prints
``{"samples": N, "seconds": S}`` as JSON. It imports only torch, torchvision (``jpeg``) and
PIL, so that it runs in an interpreter that has torchvision and nothing of this project.

- ``io``: a dataset returning each ``*.jpg`` file's size after reading it whole (open, read,
  close): the I/O of a pipeline;
- ``jpeg``: ``torchvision.datasets.ImageFolder`` with the ImageNet training transforms
  (``RandomResizedCrop(224)``, ``RandomHorizontalFlip``, ``ToTensor``, ``Normalize``).

    python benchmarks/pipeline_epoch.py io|jpeg ROOT [--loader-workers 4]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

BATCH = 64


class FileBytes(Dataset):  # type: ignore[type-arg]
    def __init__(self, root: Path) -> None:
        self.paths = sorted(root.rglob("*.jpg"))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> int:
        with open(self.paths[i], "rb") as f:
            return len(f.read())


def epoch(mode: str, root: Path, loader_workers: int) -> dict[str, Any]:
    if mode == "io":
        ds: Any = FileBytes(root)
    else:
        from torchvision import datasets, transforms
        ds = datasets.ImageFolder(str(root), transforms.Compose([
            transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
    torch.manual_seed(0)
    loader = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=loader_workers)
    t0, n = time.perf_counter(), 0
    for batch in loader:
        n += len(batch[0]) if mode == "jpeg" else len(batch)
    return {"samples": n, "seconds": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["io", "jpeg"])
    ap.add_argument("root", type=Path)
    ap.add_argument("--loader-workers", type=int, default=4)
    args = ap.parse_args()
    print(json.dumps(epoch(args.mode, args.root, args.loader_workers)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
