# The C part of spokefs.protocol.frames (frames_c.c): its signatures, for the type checker.

def unframe(body: bytes | bytearray | memoryview, file_id: int, version: int,
            first_frame: int, /) -> tuple[bytes | None, int]: ...

def frame(data: bytes | bytearray | memoryview, file_id: int, version: int,
          first_frame: int, /) -> bytes: ...

def frame_file(fd: int, offset: int, size: int, file_id: int, version: int,
               first_frame: int, /) -> bytes | None: ...
