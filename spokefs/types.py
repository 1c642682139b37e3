"""Small value types shared along the data path."""

from __future__ import annotations

from dataclasses import dataclass

from spokefs.config import BLOCK_SIZE, CHUNK_SIZE


@dataclass(frozen=True, slots=True)
class FileVersion:
    """What an open handle reads: one version of one file, fixed from open to close."""

    file_id: int
    version: int
    size: int

    def blocks(self) -> int:
        """Number of 4 KiB blocks (the last may be short)."""
        return -(-self.size // BLOCK_SIZE)

    def chunks(self) -> int:
        """Number of cache chunks (at least one, so an empty file still has a key)."""
        return max(1, -(-self.size // CHUNK_SIZE))
