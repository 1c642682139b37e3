"""Results: the JSON line's common head (``run_info``: time, commit, whether the tree was
dirty, kernel, Python, CPUs, argv, the FUSE open mode and readdir kind), appending it
(``append_jsonl``), and ``Figure``: samples over runs, summarised as median (min-max)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import REPO


def git_info(repo: Path = REPO) -> dict[str, Any]:
    """{"commit": full SHA or None, "dirty": whether ``git status --porcelain`` lists anything}."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                  check=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    status = git("status", "--porcelain")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None
            else None, "dirty_files": status.splitlines()[:50] if status else []}


def fuse_path() -> dict[str, Any]:
    """The FUSE request path that a spoke and the ceiling mounted by this run take: their
    default open mode (``kernel``: the kernel opens files itself, where the patched pyfuse3
    of deploy/build-pyfuse3.sh is installed; else ``handle``) and readdir kind; None for
    both without pyfuse3 (a hub-only run)."""
    try:
        import pyfuse3
    except ImportError:
        return {"open_mode": None, "readdir": None}
    return {"open_mode": "kernel" if getattr(pyfuse3, "SPOKEFS_READ_INODE", False) else "handle",
            "readdir": "plain" if getattr(pyfuse3, "SPOKEFS_PLAIN_READDIR", False) else "plus"}


def run_info(script: str) -> dict[str, Any]:
    """The head of every benchmark's JSON line."""
    return {"script": script, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **git_info(),
            "kernel": platform.release(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "host": platform.node(), "argv": sys.argv[1:],
            **fuse_path()}


def jsonable(value: Any) -> Any:
    """Paths and other odd values as strings, recursively."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(jsonable(record)) + "\n")


def save_record(path: Path, record: dict[str, Any], note: str = "") -> None:
    """Append the record (whose head is ``run_info``'s) and say where, at which commit."""
    append_jsonl(path, record)
    print(f"\n{note}appended to {path} (commit {str(record.get('commit'))[:7]}"
          f"{', dirty tree' if record.get('dirty') else ''})", flush=True)


@dataclass
class Figure:
    """Samples of one measurement over runs; summarised as median (min-max)."""

    samples: list[float] = field(default_factory=list)
    unit: str = ""

    def add(self, value: float | None) -> None:
        if value is not None:
            self.samples.append(float(value))

    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    def summary(self) -> dict[str, Any]:
        s = self.samples
        out = {"median": self.median(), "min": min(s), "max": max(s), "samples": s} if s else {}
        return out | ({"unit": self.unit} if self.unit else {})

    def text(self, fmt: str = "{:.0f}") -> str:
        if not self.samples:
            return "-"
        med = fmt.format(self.median())
        if len(self.samples) == 1:
            return med
        return f"{med} ({fmt.format(min(self.samples))}-{fmt.format(max(self.samples))})"


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
