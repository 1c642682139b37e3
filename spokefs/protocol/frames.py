"""The framed representation of a blob: every 4 KiB of data followed by its xxh3, seeded with
the file, version and frame index (docs/protocol.md, "Why a version 2"). ``encode_frames`` is the
one place frames are written (hubd's bucket reader, the benchmarks; ``read_frames`` reads a
file's bytes straight into their frames for hubd's directory reader and frames them the
same way); ``unframe`` is the one place they are checked (the spoke's hub client).

Each runs in one native call per body (``frames_c``, C, built with the package where a
compiler and xxHash's header are found: ``deploy/setup.sh`` installs them) and fall back to
the same loop in Python when it is not built (``NATIVE`` is False). Both ways give the same
bytes and the same errors; the tests run both.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence

import xxhash

from spokefs.protocol.base import U64_MAX, WireError

try:  # C, optional: see the module docstring
    import spokefs.protocol.frames_c as frames_c  # not "from spokefs.protocol": no cycle

    NATIVE = True
except ImportError:  # pragma: no cover - the package was installed without its C part
    NATIVE = False

FRAME_DATA_BYTES = 4096  # = the spoke cache's block (see "Why 4 KiB frames")
FRAME_SUM = struct.Struct("<Q")
FRAME_BYTES = FRAME_DATA_BYTES + FRAME_SUM.size
SLICE_FRAMES = 256
SLICE_BYTES = SLICE_FRAMES * FRAME_BYTES  # 1,050,624: a tier's cache slice (nginx `slice`)
SLICE_DATA_BYTES = SLICE_FRAMES * FRAME_DATA_BYTES  # 1 MiB of file data per slice
Buffer = bytes | bytearray | memoryview


def framed_size(size: int) -> int:
    """The length of the framed representation of ``size`` bytes of data; also the framed
    offset of a data offset that lies on a frame boundary."""
    return size + -(-size // FRAME_DATA_BYTES) * FRAME_SUM.size


def frame_seed(file_id: int, version: int, index: int) -> int:
    """The xxh3 seed of frame ``index`` of a file version: a frame served at another offset
    or for another file fails its sum (odd multipliers keep distinct inputs apart)."""
    return (file_id * 0x9E3779B97F4A7C15 + version * 0xC2B2AE3D27D4EB4F + index) & U64_MAX


class FrameSumError(Exception):
    """A frame of a framed body failed its seeded sum: damaged, or served for another offset,
    file or version. ``index`` is the frame's index in the file."""

    def __init__(self, index: int) -> None:
        super().__init__(f"frame {index} failed its checksum")
        self.index = index


def unframe(framed: bytes | bytearray | memoryview, file_id: int, version: int,
            first_frame: int) -> bytes:
    """The file data of a framed body that starts at frame ``first_frame``, every frame
    checked against its seeded sum.

    Raises:
        FrameSumError: a frame failed its sum.
        WireError: a frame with no data byte (the body was cut inside a sum).
    """
    if NATIVE:
        try:
            data, bad = frames_c.unframe(framed, file_id & U64_MAX, version & U64_MAX,
                                       first_frame & U64_MAX)
        except ValueError as exc:
            raise WireError(str(exc)) from None
        if data is None:
            raise FrameSumError(first_frame + bad)
        return data
    pieces: list[memoryview] = []
    digest = xxhash.xxh3_64_intdigest
    for k, (chunk, want) in enumerate(split_frames(framed)):
        if digest(chunk, frame_seed(file_id, version, first_frame + k)) != want:
            raise FrameSumError(first_frame + k)
        pieces.append(chunk)
    return b"".join(pieces)


def receive_buffer(size: int) -> bytearray:
    """A buffer of ``size`` bytes for an answer to be received into, not zeroed where the C
    part is built: only the bytes received are ever read, and ``bytearray(size)`` writes
    every byte first, a pack's 3.75 MiB at a time (with this the event loop spent 0.3-0.6
    CPU-s less per cold GB of small files in three of four sets of runs, the same in the
    fourth: benchmarks/README.md, "At 28a13d2")."""
    return frames_c.receive_buffer(size) if NATIVE else bytearray(size)


def split_frames(framed: bytes | bytearray | memoryview) -> Iterator[tuple[memoryview, int]]:
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


def read_frames(fd: int, offset: int, size: int, file_id: int, version: int,
                first_frame: int) -> bytes | None:
    """``size`` bytes of the file open on ``fd`` from ``offset`` (a frame boundary: frame
    ``first_frame``) in the framed representation, read straight into their frames (one
    copy); None if the file ends first.

    Raises:
        OSError: the read failed.
    """
    if NATIVE:
        return frames_c.frame_file(fd, offset, size, file_id & U64_MAX, version & U64_MAX,
                                   first_frame & U64_MAX)
    data = pread_all(fd, offset, size)
    return None if data is None else encode_frames(data, file_id, version, first_frame)


def pread_all(fd: int, offset: int, size: int) -> bytes | None:
    """``size`` bytes of the file open on ``fd`` from ``offset``, however many reads it
    takes; None if the file ends first.

    Raises:
        OSError: a read failed.
    """
    parts: list[bytes] = []
    got = 0
    while got < size:
        more = os.pread(fd, size - got, offset + got)
        if not more:
            return None
        parts.append(more)
        got += len(more)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def encode_frames(data: Buffer | Sequence[Buffer], file_id: int, version: int,
                  first_frame: int) -> bytes:
    """``data``, file bytes that start at frame ``first_frame`` of a file version, in the
    framed representation: each 4 KiB frame followed by its seeded xxh3. ``data`` may be a
    list or tuple of buffers whose bytes follow each other (a body as it arrived): they are
    framed as one, without being joined first."""
    if NATIVE:
        return frames_c.frame(data, file_id & U64_MAX, version & U64_MAX,
                              first_frame & U64_MAX)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        if not isinstance(data, (list, tuple)):
            raise TypeError(f"encode_frames takes a buffer or a list of buffers, not "
                            f"{type(data).__name__}")
        data = b"".join(data)
    parts: list[bytes | memoryview] = []
    view = memoryview(data)
    for k, pos in enumerate(range(0, len(view), FRAME_DATA_BYTES)):
        chunk = view[pos : pos + FRAME_DATA_BYTES]
        parts.append(chunk)
        parts.append(FRAME_SUM.pack(
            xxhash.xxh3_64_intdigest(chunk, frame_seed(file_id, version, first_frame + k))))
    return b"".join(parts)
