# The C part of hubd.members (members_c.c): its signatures, for the type checker.

NOT_REGULAR: int
SIZE_DIFFERS: int
SHRANK: int
NOT_LISTED: int

def read_members(dir_fd: int, names: list[bytes], sizes: list[int], body: bytearray,
                 pos: int, record_size: int, /) -> list[
                     tuple[int, int, int, int, int, int, int, int] | int]: ...
