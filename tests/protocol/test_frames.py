"""Framed blobs: the native part (``frames_c``) and the Python loop give the same bytes and
the same errors, for every length and id; corruption, a cut sum and a wrong offset fail."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest

from spokefs.protocol import frames
from spokefs.protocol.base import U64_MAX, WireError
from spokefs.protocol.frames import FRAME_BYTES, FRAME_DATA_BYTES, FrameSumError

LENGTHS = (0, 1, 4095, 4096, 4097, 3 * 4096, (1 << 20) + 17)
IDS = ((1, 1, 0), (0x1234_5678_9ABC, 7, 3), (U64_MAX, U64_MAX, U64_MAX - 5), (2, 3, 1 << 40))


@pytest.fixture(params=["native", "python"])
def way(request, monkeypatch):
    """Run the test through the C part and through the Python fallback."""
    if request.param == "python":
        monkeypatch.setattr(frames, "NATIVE", False)
    return request.param


def test_the_native_part_is_built() -> None:
    """deploy/setup.sh installs a compiler and xxHash's header: the C part must be there
    (the Python loop is the fallback for hub hosts without a compiler, not for CI)."""
    assert frames.NATIVE


def test_the_hashes_run_on_the_widest_unit_and_both_units_agree() -> None:
    """The C parts hash on AVX2 where the CPU has it (spokefs/native/xxh3_dispatch.c), and
    ``SPOKEFS_XXH3=baseline`` picks the baseline build: each unit frames every length and id
    as python-xxhash's loop does, and checks the other's frames."""
    assert frames.frames_c.xxh3_unit() == ("avx2" if _cpu_has_avx2() else "baseline")
    script = textwrap.dedent("""
        import os, random, sys
        from spokefs.protocol import frames
        lengths, ids = eval(sys.argv[1]), eval(sys.argv[2])
        rng = random.Random(7)
        for length in lengths + (100, 239, 240, 241, 8191):
            data = rng.randbytes(length)
            for i in ids:
                native = frames.encode_frames(data, *i)
                assert frames.unframe(native, *i) == data
                frames.NATIVE = False
                assert native == frames.encode_frames(data, *i)
                frames.NATIVE = True
                sys.stdout.buffer.write(native)
        print(frames.frames_c.xxh3_unit(), file=sys.stderr)
    """)
    outs = {}
    for unit in ("default", "baseline"):
        env = {**os.environ, "SPOKEFS_XXH3": unit}
        done = subprocess.run([sys.executable, "-c", script, repr(LENGTHS), repr(IDS)], env=env,
                              capture_output=True, check=True)
        outs[done.stderr.decode().strip()] = done.stdout
    assert "baseline" in outs
    assert len(set(outs.values())) == 1  # (one entry where the CPU has no AVX2)


def _cpu_has_avx2() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " avx2" in line for line in f)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("ids", IDS)
def test_native_and_python_agree(length, ids, monkeypatch) -> None:
    data = os.urandom(length)
    native_framed = frames.encode_frames(data, *ids)
    native_data = frames.unframe(native_framed, *ids)
    monkeypatch.setattr(frames, "NATIVE", False)
    python_framed = frames.encode_frames(data, *ids)
    assert native_framed == python_framed
    assert len(python_framed) == frames.framed_size(length)
    assert frames.unframe(python_framed, *ids) == native_data == data


def test_a_body_in_pieces_is_framed_as_the_pieces_joined(way) -> None:
    """``encode_frames`` takes the pieces a body arrived in (a list or tuple of buffers, cut
    anywhere, empty ones included) and frames them as one, without joining them first."""
    rng = random.Random(3)
    for length in (0, 1, 4096, 3 * 4096 + 1234, (1 << 20) + 17):
        data = rng.randbytes(length)
        want = frames.encode_frames(data, 9, 2, 40)
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, length), max(0, min(length - 1, rng.randint(0, 9)))))
            pieces: list[bytes | memoryview] = [
                data[a:b] for a, b in zip([0, *cuts], [*cuts, length], strict=True)]
            pieces.insert(rng.randint(0, len(pieces)), b"")
            if rng.random() < 0.5:
                pieces = [memoryview(p) for p in pieces]
            assert frames.encode_frames(pieces, 9, 2, 40) == want
            assert frames.encode_frames(tuple(pieces), 9, 2, 40) == want


def test_pieces_that_are_not_buffers_are_refused(way) -> None:
    with pytest.raises(TypeError):
        frames.encode_frames([b"data", 3], 1, 1, 0)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        frames.encode_frames(5, 1, 1, 0)  # type: ignore[arg-type]


def test_a_damaged_frame_names_its_index(way) -> None:
    data = os.urandom(10 * FRAME_DATA_BYTES + 100)
    framed = bytearray(frames.encode_frames(data, 9, 2, 40))
    for k in (0, 4, 10):
        damaged = bytearray(framed)
        frame_len = min(FRAME_BYTES, len(framed) - k * FRAME_BYTES)
        damaged[k * FRAME_BYTES + random.Random(k).randrange(frame_len - 8)] ^= 0x40
        with pytest.raises(FrameSumError) as caught:
            frames.unframe(bytes(damaged), 9, 2, 40)
        assert caught.value.index == 40 + k
    damaged = bytearray(framed)
    damaged[FRAME_BYTES - 1] ^= 1  # the first frame's sum itself
    with pytest.raises(FrameSumError):
        frames.unframe(memoryview(damaged), 9, 2, 40)


def test_frames_of_another_offset_file_or_version_fail(way) -> None:
    framed = frames.encode_frames(os.urandom(3 * FRAME_DATA_BYTES), 9, 2, 40)
    for ids in ((9, 2, 41), (10, 2, 40), (9, 3, 40)):
        with pytest.raises(FrameSumError):
            frames.unframe(framed, *ids)


def test_a_body_cut_inside_a_sum_is_a_wire_error(way) -> None:
    framed = frames.encode_frames(os.urandom(2 * FRAME_DATA_BYTES), 1, 1, 0)
    for cut in (FRAME_BYTES + 1, FRAME_BYTES + 8):
        with pytest.raises(WireError, match="has no data"):
            frames.unframe(framed[:cut], 1, 1, 0)
    # cut after a data byte: the short last frame fails its sum instead
    with pytest.raises(FrameSumError):
        frames.unframe(framed[: FRAME_BYTES + 9], 1, 1, 0)


@pytest.mark.parametrize("length", LENGTHS)
def test_frames_read_from_a_file_are_the_frames_of_its_bytes(length, way, tmp_path) -> None:
    """hubd's directory reader: bytes read straight into their frames (at any frame offset
    of the file), the same as framing what a pread gives."""
    data = os.urandom(length + 3 * FRAME_DATA_BYTES)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for frame in (0, 3):
            start = frame * FRAME_DATA_BYTES
            got = frames.read_frames(fd, start, length, 0x1234, 9, frame)
            assert got == frames.encode_frames(data[start : start + length], 0x1234, 9, frame)
        # past the end: the file ended first
        assert frames.read_frames(fd, 3 * FRAME_DATA_BYTES, length + 1, 1, 1, 3) is None
    finally:
        os.close(fd)


def test_a_failed_read_is_an_os_error(way, tmp_path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: pread fails with EISDIR
    try:
        with pytest.raises(OSError):
            frames.read_frames(fd, 0, 4096, 1, 1, 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [0, 1, 4096, (3 << 20) + 7])
def test_a_receive_buffer_has_the_size_asked_and_takes_bytes(size, way) -> None:
    buf = frames.receive_buffer(size)
    assert isinstance(buf, bytearray) and len(buf) == size
    view = memoryview(buf)
    view[:] = b"\x5a" * size
    assert bytes(buf) == b"\x5a" * size


def test_a_receive_buffer_of_negative_size_is_refused() -> None:
    with pytest.raises(ValueError):
        frames.frames_c.receive_buffer(-1)
