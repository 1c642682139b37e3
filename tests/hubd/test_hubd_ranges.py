"""parse_range / resolve_range: the Range header rules, without any I/O."""

from __future__ import annotations

import pytest

from hubd import wire
from hubd.errors import BadRange, MultipleRanges, RangeNotSatisfiable, RangeTooLarge
from hubd.range_reader import RangeSpec, parse_range, resolve_range

MAX = wire.MAX_RANGE_BYTES


@pytest.mark.parametrize(("header", "size", "want"), [
    ("bytes=0-9", 100, (0, 10, True)),
    ("bytes=10-", 100, (10, 100, True)),
    ("bytes=-10", 100, (90, 100, True)),
    ("bytes=-1000", 100, (0, 100, True)),          # suffix longer than the file: all of it
    ("bytes=90-1000", 100, (90, 100, True)),       # end clamped to the file
    ("bytes=99-99", 100, (99, 100, True)),
    (" Bytes = 5-6 ", 100, (5, 7, True)),          # the unit is case-insensitive
    ("bytes=0-999999999999", 100, (0, 100, True)),  # clamped before the size limit applies
])
def test_satisfiable_ranges(header: str, size: int, want: tuple[int, int, bool]) -> None:
    assert resolve_range(parse_range([header]), size) == want


def test_no_range_means_whole_file_when_small() -> None:
    assert parse_range([]) is None
    assert resolve_range(None, 0) == (0, 0, False)
    assert resolve_range(None, MAX) == (0, MAX, False)
    with pytest.raises(RangeTooLarge) as err:
        resolve_range(None, MAX + 1)
    assert err.value.headers["Content-Range"] == f"bytes */{MAX + 1}"


@pytest.mark.parametrize("header", [
    "bytes 0-1", "items=0-1", "bytes=", "bytes=-", "bytes=a-b", "bytes=1-a", "bytes=--1",
    "bytes=5-4", "bytes=-5-", "bytes=0x10-20", "bytes=+1-2", "bytes=1 - 2", "bytes=١-٢",
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
    assert not isinstance(err.value, RangeTooLarge)
    assert err.value.headers["Content-Range"] == f"bytes */{size}"


@pytest.mark.parametrize("spec", [RangeSpec(0, MAX), RangeSpec(0, None), RangeSpec(None, MAX + 1)])
def test_ranges_longer_than_the_limit(spec: RangeSpec) -> None:
    with pytest.raises(RangeTooLarge):
        resolve_range(spec, 2 * MAX)
    assert resolve_range(RangeSpec(0, MAX - 1), 2 * MAX) == (0, MAX, True)
