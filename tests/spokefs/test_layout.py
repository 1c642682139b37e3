"""A new chunk's ``head`` record built in one native call (``layout_c``) and in Python: the
same bytes for every size, slot and field, and what ``ChunkHead.decode`` reads back."""

from __future__ import annotations

import os
import random

import pytest
import xxhash

from spokefs.cache import layout
from spokefs.cache.layout import PINNED, PROBATION, PROTECTED, ChunkHead
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS


def test_the_native_part_is_built() -> None:
    """deploy/setup.sh installs a compiler: the C part must be there (the Python record is
    the fallback for hosts without one, not for CI)."""
    assert layout.NATIVE


@pytest.mark.parametrize("page", [4096, 8192])
def test_native_and_python_records_are_the_same_and_decode_to_the_piece(page: int) -> None:
    rng = random.Random(page)
    sizes = [1, 15, 16, 17, 4080, 4095, 4096, 4097, 8176, 8192, 60_000, 65_520, 65_536]
    for size in sizes + [rng.randrange(1, 65_537) for _ in range(40)]:
        blocks = -(-size // BLOCK_SIZE)
        for slot in {0, CHUNK_BLOCKS - blocks, rng.randrange(CHUNK_BLOCKS - blocks + 1)}:
            piece = os.urandom(size)
            seg = rng.choice([PROBATION, PROTECTED, PINNED])
            args = (slot, rng.randrange(4), seg, rng.getrandbits(64), rng.getrandbits(64), page)
            native = layout.new_chunk_record(memoryview(piece), *args)
            assert native == layout.new_chunk_record_py(piece, *args)
            record, cut = native
            head = ChunkHead.decode(record)
            assert (head.slots(), head.origin, head.segment, head.seq, head.stored_tick) == (
                tuple(range(slot, slot + blocks)), *args[1:5])
            assert head.sums == [xxhash.xxh3_64_intdigest(piece[o : o + BLOCK_SIZE])
                                 for o in range(0, size, BLOCK_SIZE)]
            assert head.chunk_sum == xxhash.xxh3_64_intdigest(piece)
            assert piece[:cut] + head.tail == piece
            assert cut % page == (page - 16) % page or cut == size  # the value fits its pages


@pytest.mark.parametrize("build", [layout.new_chunk_record, layout.new_chunk_record_py])
def test_a_piece_that_does_not_fit_its_chunk_is_refused(build) -> None:
    with pytest.raises(ValueError):
        build(b"", 0, 0, PROBATION, 1, 1, 4096)
    with pytest.raises(ValueError):
        build(bytes(2 * BLOCK_SIZE), CHUNK_BLOCKS - 1, 0, PROBATION, 1, 1, 4096)
    assert build(bytes(BLOCK_SIZE), CHUNK_BLOCKS - 1, 0, PROBATION, 1, 1, 4096)


def test_the_store_writes_the_same_records_either_way(tmp_path, monkeypatch) -> None:
    """ChunkStore.put_pieces through the C part and through the fallback: the same data and
    head records, which read back as the bytes stored."""
    from spokefs.cache.layout import KEY, bound_bytes
    from spokefs.cache.policy import Plan
    from spokefs.cache.store import ChunkStore, chunk_pieces

    data = os.urandom(5 * 65_536 + 3 * BLOCK_SIZE + 100)
    runs = [(0, data[: 2 * 65_536]), (40, data[40 * BLOCK_SIZE :])]
    got = []
    for native in (True, False):
        monkeypatch.setattr(layout, "NATIVE", native)
        store = ChunkStore(tmp_path / str(native), 1 << 26, 1 << 24, bound_bytes(1 << 26))
        plan = Plan(1, 10, 10, 10, 1 << 30, 0, [], {}, lambda k, t: False, lambda k: 0)
        store.put_pieces([(k, s, v, 0) for k, s, v in chunk_pieces(7, 1, runs)], plan)
        with store._env.begin() as txn:
            got.append([(bytes(k), bytes(v)) for db in (store._head, store._data)
                        for k, v in txn.cursor(db=db)])
        assert store.read(7, 1, 40 * BLOCK_SIZE, len(data), lambda key: None).data == \
            data[40 * BLOCK_SIZE :]
        assert KEY.pack(7, 1, 0) in dict(got[-1])
        store.close()
    assert got[0] == got[1]
