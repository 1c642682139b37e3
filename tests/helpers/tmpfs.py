"""A small tmpfs for a test's cache dir (a disk that fills up), always unmounted."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``mount -o size=``, e.g. "48m") on ``where`` (created)."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                   check=True)
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=False)
