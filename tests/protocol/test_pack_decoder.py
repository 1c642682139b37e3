"""The spoke's streaming pack decoder: whatever pieces the answer arrives in (a byte at a
time, the record headers split, several records per piece), the same records, in order."""

from __future__ import annotations

import random

import pytest
import xxhash

from spokefs import protocol


def _pack(n: int, seed: int) -> tuple[bytes, list[tuple[int, int]], dict]:
    rng = random.Random(seed)
    body, items, want = b"", [], {}
    for i in range(n):
        key = (100 + i, 7)
        items.append(key)
        if rng.random() < 0.2:
            body += protocol.encode_pack_record(*key, None, 0)
            want[key] = None
        else:
            data = rng.randbytes(rng.choice([0, 1, 4095, 4096, 70_000]))
            digest = xxhash.xxh3_64_intdigest(data)
            body += protocol.encode_pack_record(*key, data, digest)
            want[key] = (data, digest)
    return body, items, want


@pytest.mark.parametrize("seed", range(6))
def test_any_split_gives_the_same_records_as_views(seed: int) -> None:
    """The answer lands in one buffer in pieces of any size (a byte at a time, the record
    headers split, several records at once): the same records, in order, each once, and
    the members are views of that buffer."""
    body, items, want = _pack(12, seed)
    rng = random.Random(seed)
    for _ in range(5):
        buf = bytearray(len(body) + 100)
        view = memoryview(buf)
        decoder = protocol.PackDecoder(items)
        got: list = []
        end = 0
        while end < len(body):
            step = min(rng.choice([1, 7, protocol.PACK_RECORD.size, 5000, 1 << 20]),
                       len(body) - end)
            buf[end : end + step] = body[end : end + step]
            end += step
            got += decoder.scan(view, end)
        decoder.finish(end)
        assert [k for k, _ in got] == items
        assert all(rec is None or rec[0].obj is buf for _, rec in got)  # views, no copies
        assert {k: None if r is None else (bytes(r[0]), r[1]) for k, r in got} == want


def test_a_cut_answer_and_trailing_bytes_are_errors() -> None:
    body, items, _ = _pack(3, 1)
    view = memoryview(body + bytes(protocol.PACK_RECORD.size))
    decoder = protocol.PackDecoder(items)
    decoder.scan(view, len(body) - 1)
    with pytest.raises(protocol.WireError, match="cut short"):
        decoder.finish(len(body) - 1)
    decoder = protocol.PackDecoder(items)
    with pytest.raises(protocol.WireError, match="data after"):
        decoder.scan(view, len(view))
    decoder = protocol.PackDecoder(items)
    decoder.scan(view, len(body) + 3)  # less than a record header after the answer
    with pytest.raises(protocol.WireError, match="data after"):
        decoder.finish(len(body) + 3)
