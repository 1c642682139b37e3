"""The framed representation of a blob: every 4 KiB of data followed by its xxh3, seeded with
the file, version and frame index (docs/protocol.md, "Why a version 2"). ``encode_frames`` is the
one place frames are written (hubd's directory and bucket readers, the benchmarks); the spoke
checks them with ``split_frames``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import xxhash

from spokefs.protocol.base import U64_MAX, WireError

FRAME_DATA_BYTES = 4096  # = the spoke cache's block (see "Why 4 KiB frames")
FRAME_SUM = struct.Struct("<Q")
FRAME_BYTES = FRAME_DATA_BYTES + FRAME_SUM.size
SLICE_FRAMES = 256
SLICE_BYTES = SLICE_FRAMES * FRAME_BYTES  # 1,050,624: a tier's cache slice (nginx `slice`)
SLICE_DATA_BYTES = SLICE_FRAMES * FRAME_DATA_BYTES  # 1 MiB of file data per slice


def framed_size(size: int) -> int:
    """The length of the framed representation of ``size`` bytes of data; also the framed
    offset of a data offset that lies on a frame boundary."""
    return size + -(-size // FRAME_DATA_BYTES) * FRAME_SUM.size


def frame_seed(file_id: int, version: int, index: int) -> int:
    """The xxh3 seed of frame ``index`` of a file version: a frame served at another offset
    or for another file fails its sum (odd multipliers keep distinct inputs apart)."""
    return (file_id * 0x9E3779B97F4A7C15 + version * 0xC2B2AE3D27D4EB4F + index) & U64_MAX


def split_frames(framed: bytes | memoryview) -> Iterator[tuple[memoryview, int]]:
    """``(data, sum)`` of each frame of a framed body that starts on a frame boundary;
    the last frame may be short (the end of the file).

    Raises:
        WireError: a frame with no data byte (the body was cut inside a sum).
    """
    view = memoryview(framed)
    unpack = FRAME_SUM.unpack_from
    for pos in range(0, len(view), FRAME_BYTES):
        frame = view[pos : pos + FRAME_BYTES]
        if len(frame) <= FRAME_SUM.size:
            raise WireError(f"a frame of {len(frame)} bytes has no data")
        yield frame[: -FRAME_SUM.size], unpack(frame, len(frame) - FRAME_SUM.size)[0]


def encode_frames(data: bytes | memoryview, file_id: int, version: int, first_frame: int) -> bytes:
    """``data``, file bytes that start at frame ``first_frame`` of a file version, in the
    framed representation: each 4 KiB frame followed by its seeded xxh3."""
    parts: list[bytes | memoryview] = []
    view = memoryview(data)
    for k, pos in enumerate(range(0, len(view), FRAME_DATA_BYTES)):
        chunk = view[pos : pos + FRAME_DATA_BYTES]
        parts.append(chunk)
        parts.append(FRAME_SUM.pack(
            xxhash.xxh3_64_intdigest(chunk, frame_seed(file_id, version, first_frame + k))))
    return b"".join(parts)
