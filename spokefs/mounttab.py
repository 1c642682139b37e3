"""The kernel's mount table, read from /proc/self/mountinfo (no stat: a dead FUSE mount
answers stat with ENOTCONN, and our own mount would ask us to answer it)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True, slots=True)
class MountEntry:
    mountpoint: str
    device: str  # "major:minor", as /sys/class/bdi names a mount's backing device
    fstype: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \\ooo
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def find_mount(path: Path | str) -> MountEntry | None:
    """The mount whose mount point is ``path`` (the last one mounted there), or None."""
    target = os.path.abspath(path)
    found = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(" ")
            if _unescape(fields[4]) == target:
                sep = fields.index("-", 6)
                found = MountEntry(target, fields[2], fields[sep + 1])
    return found
