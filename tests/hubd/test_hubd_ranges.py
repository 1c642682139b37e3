"""parse_range / resolve_range: the Range header rules (applied to the framed
representation's size), without any I/O."""

from __future__ import annotations

import pytest

from hubd.errors import BadRange, MultipleRanges, RangeNotSatisfiable
from hubd.range_reader import RangeSpec, parse_range, resolve_range
from spokefs import protocol

MAX = protocol.MAX_RANGE_BYTES


@pytest.mark.parametrize(("header", "size", "want"), [
    ("bytes=0-9", 100, (0, 10, True)),
    ("bytes=10-", 100, (10, 100, True)),
    ("bytes=-10", 100, (90, 100, True)),
    ("bytes=-1000", 100, (0, 100, True)),          # suffix longer than the file: all of it
    ("bytes=90-1000", 100, (90, 100, True)),       # end clamped to the file
    ("bytes=99-99", 100, (99, 100, True)),
    (" Bytes = 5-6 ", 100, (5, 7, True)),          # the unit is case-insensitive
    ("bytes=0-999999999999", 100, (0, 100, True)),  # clamped to the representation
])
def test_satisfiable_ranges(header: str, size: int, want: tuple[int, int, bool]) -> None:
    got = resolve_range(parse_range([header]), size)
    assert (got.start, got.stop, got.partial) == want
    assert got.total == size


def test_no_range_means_the_whole_representation_whatever_its_size() -> None:
    assert parse_range([]) is None
    for total in (0, MAX, 100 * MAX):  # streamed a slice at a time: no size limit
        got = resolve_range(None, total)
        assert (got.start, got.stop, got.partial) == (0, total, False)


@pytest.mark.parametrize("header", [
    "bytes 0-1", "items=0-1", "bytes=", "bytes=-", "bytes=a-b", "bytes=1-a", "bytes=--1",
    "bytes=5-4", "bytes=-5-", "bytes=0x10-20", "bytes=+1-2", "bytes=1 - 2", "bytes=\u0661-\u0662",
    "bytes=0-" + "9" * 20, "bytes=" + "1" * 20 + "-",
])
def test_malformed_ranges_are_bad_range(header: str) -> None:
    with pytest.raises(BadRange):
        parse_range([header])


@pytest.mark.parametrize("values", [["bytes=0-1,5-6"], ["bytes=0-1,"], ["bytes=0-1", "bytes=2-3"]])
def test_multiple_ranges(values: list[str]) -> None:
    with pytest.raises(MultipleRanges):
        parse_range(values)


@pytest.mark.parametrize(("spec", "size"), [
    (RangeSpec(100, None), 100),   # starts at EOF
    (RangeSpec(200, 300), 100),
    (RangeSpec(0, 0), 0),          # any range of an empty file
    (RangeSpec(None, 5), 0),
    (RangeSpec(None, 0), 100),     # "bytes=-0"
])
def test_unsatisfiable_ranges_name_the_size(spec: RangeSpec, size: int) -> None:
    with pytest.raises(RangeNotSatisfiable) as err:
        resolve_range(spec, size)
    assert err.value.headers["Content-Range"] == f"bytes */{size}"


@pytest.mark.parametrize("spec", [RangeSpec(0, MAX), RangeSpec(0, None), RangeSpec(None, MAX + 1)])
def test_ranges_longer_than_the_spokes_limit_are_answered(spec: RangeSpec) -> None:
    got = resolve_range(spec, 2 * MAX)
    assert got.partial and got.stop - got.start > MAX
