"""The coordinator's copy of a worker's /dev/fuse clone (``fuse.device``): the replies it
writes are FUSE replies, and once the worker is gone (the copy closed) they go nowhere.
A pipe stands in for the device here; the real device is in tests/integration/test_workers.py
(every read a worker hands over is answered through it)."""

from __future__ import annotations

import errno
import os
import struct

from spokefs.fuse.device import WorkerDevice


def _pipe_device() -> tuple[WorkerDevice, int]:
    r, w = os.pipe()
    return WorkerDevice(w), r


def test_a_reply_is_the_fuse_header_then_the_bytes():
    device, r = _pipe_device()
    try:
        device.reply(0x1234_5678_9ABC, b"abc")
        assert os.read(r, 100) == struct.pack("<IiQ", 19, 0, 0x1234_5678_9ABC) + b"abc"
        device.reply_error(7, errno.EIO)
        assert os.read(r, 100) == struct.pack("<IiQ", 16, -errno.EIO, 7)
    finally:
        device.close()
        os.close(r)


def test_after_close_replies_go_nowhere_and_the_descriptor_is_closed():
    device, r = _pipe_device()
    device.close()
    assert device.fd == -1
    device.reply(1, b"late")  # a read that finished after its worker died: dropped
    device.reply_error(2, errno.EIO)
    device.close()  # twice is fine
    try:
        assert os.read(r, 100) == b""  # the write end is closed: end of file, nothing written
    finally:
        os.close(r)


def test_a_failed_write_is_logged_not_raised(caplog):
    device, r = _pipe_device()
    os.close(r)  # EPIPE on write (SIGPIPE is ignored by Python)
    try:
        device.reply(3, b"x")
    finally:
        device.close()
    assert "request 3" in caplog.text
