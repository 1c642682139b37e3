"""What every part of the protocol shares: its version, ids as they appear in URLs, the
limits of a name, and ``WireError`` (docs/protocol.md has the whole protocol)."""

from __future__ import annotations

API_VERSION = 2
FORMAT_VERSION = 1  # of the snapshot and changes streams, unchanged since protocol v1
MIN_FILE_ID = 2  # FUSE reserves inode 1 for the root, 0 is invalid
U64_MAX = 2**64 - 1
NAME_MAX = 255  # bytes, as on Linux filesystems
TARGET_MAX = 4095  # PATH_MAX - 1


class WireError(ValueError):
    """Data from the other side breaks the protocol (truncated, hostile or malformed)."""


def format_id(value: int) -> str:
    """A file id or version as it appears in a URL."""
    return f"{value:016x}"


def parse_id(text: str) -> int:
    """Parse a URL id; raises WireError unless it is exactly 16 lowercase hex digits."""
    if len(text) != 16 or text.strip("0123456789abcdef"):
        raise WireError(f"bad id {text[:40]!r}: want 16 lowercase hex digits")
    return int(text, 16)
