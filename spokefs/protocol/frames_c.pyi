# The C part of spokefs.protocol.frames (frames_c.c): its signatures, for the type checker.

from collections.abc import Sequence

_Buffer = bytes | bytearray | memoryview

def unframe(body: bytes | bytearray | memoryview, file_id: int, version: int,
            first_frame: int, /) -> tuple[bytes | None, int]: ...

def frame(data: _Buffer | Sequence[_Buffer], file_id: int, version: int,
          first_frame: int, /) -> bytes: ...

def frame_file(fd: int, offset: int, size: int, file_id: int, version: int,
               first_frame: int, /) -> bytes | None: ...

def receive_buffer(size: int, /) -> bytearray: ...
