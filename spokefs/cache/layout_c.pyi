# The C part of spokefs.cache.layout (layout_c.c): its signature, for the type checker.

def new_chunk_record(piece: bytes | bytearray | memoryview, slot: int, origin: int,
                     segment: int, seq: int, tick: int, page_size: int,
                     /) -> tuple[bytes, int]: ...
