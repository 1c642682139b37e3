"""The access trace's records file and the portable trace file, without a mount: first
accesses in order, a torn record cut off, a full trace that keeps its first records, a bad
file set aside; trace files that are not traces, or that escape the export, refused."""

from __future__ import annotations

import pytest

from spokefs import metrics
from spokefs.errors import UserError
from spokefs.jobs.trace_file import Entry, dumps, loads, summary
from spokefs.read.trace import EXTENT_BYTES, MAGIC, RECORD, WHOLE, TraceRecorder, load_records
from spokefs.types import FileVersion

SMALL = FileVersion(7, 1, 1000)
LARGE = FileVersion(8, 2, 10 * EXTENT_BYTES)


async def test_first_accesses_in_order_once_each(tmp_path):
    rec = TraceRecorder(tmp_path)
    rec.note(SMALL, 0, 1000)
    rec.note(LARGE, 5 * EXTENT_BYTES, 5 * EXTENT_BYTES + 4096)
    rec.note(SMALL, 0, 1000)
    rec.note(LARGE, 2 * EXTENT_BYTES - 10, 2 * EXTENT_BYTES + 10)  # spans extents 1 and 2
    rec.note(LARGE, 5 * EXTENT_BYTES + 8192, 5 * EXTENT_BYTES + 9000)
    assert await rec.saved_records() == [
        (7, 1, 1000, WHOLE), (8, 2, LARGE.size, 5), (8, 2, LARGE.size, 1),
        (8, 2, LARGE.size, 2)]
    # a remount goes on with the same trace, and records nothing twice
    again = TraceRecorder(tmp_path)
    assert again.records == 4
    again.note(SMALL, 0, 10)
    again.note(FileVersion(9, 1, 5), 0, 5)
    assert (await again.saved_records())[-1] == (9, 1, 5, WHOLE)
    assert again.records == 5
    again.clear()
    again.note(SMALL, 0, 10)
    assert await again.saved_records() == [(7, 1, 1000, WHOLE)]


def _append(path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


async def test_a_torn_record_is_cut_off_and_appends_stay_aligned(tmp_path):
    rec = TraceRecorder(tmp_path)
    rec.note(SMALL, 0, 10)
    await rec.flush()
    _append(rec.path, RECORD.pack(9, 9, 9, WHOLE)[:11])  # a crash in the middle of an append
    again = TraceRecorder(tmp_path)
    assert again.records == 1
    again.note(FileVersion(3, 1, 5), 0, 5)
    await again.flush()
    assert load_records(again.path) == [(7, 1, 1000, WHOLE), (3, 1, 5, WHOLE)]


async def test_a_full_trace_keeps_its_first_records(tmp_path):
    rec = TraceRecorder(tmp_path, max_records=3)
    dropped = metrics.TRACE_DROPPED._value.get()
    for fid in range(1, 6):
        rec.note(FileVersion(fid, 1, 10), 0, 10)
    assert [r[0] for r in await rec.saved_records()] == [1, 2, 3]
    assert metrics.TRACE_DROPPED._value.get() - dropped == 2


async def test_a_file_that_is_no_trace_is_set_aside(tmp_path, caplog):
    (tmp_path / "records").write_bytes(b"garbage" * 10)
    rec = TraceRecorder(tmp_path)
    assert rec.records == 0
    assert (tmp_path / "records.bad").exists()
    assert "set aside" in caplog.text
    caplog.clear()
    rec.note(SMALL, 0, 1)
    await rec.flush()
    assert (tmp_path / "records").read_bytes().startswith(MAGIC)


def test_trace_files_round_trip_and_bad_ones_are_refused():
    entries = [Entry("a/b.jpg", 3, 100, None), Entry("c.tar", 4, 9 * EXTENT_BYTES, (2, 0)),
               Entry("a/\udcff.bin", 0, 5, None)]
    head, back = loads(dumps(entries, hub="http://h"), "t")
    assert back == entries and head["hub"] == "http://h"
    assert summary(back) == {"files": 3, "bytes": 105 + 2 * EXTENT_BYTES, "directories": 2,
                             "ranged_files": 1}
    with pytest.raises(UserError, match="is not a spokefs trace"):
        loads(b"hello\n", "t")
    good_head = dumps([]).splitlines()[0]
    for line, why in ((b'["../etc/passwd", 1, 1, null]', "'..'"),
                      (b'["a", 1]', "not a trace entry"),
                      (b'["a", -1, 1, null]', "negative"),
                      (b'["a", 1, 1, "x"]', "not a trace entry")):
        with pytest.raises(UserError, match=why):
            loads(good_head + b"\n" + line + b"\n", "t")
    # one entry a line: two on a line, or one split over two, are not a trace
    for body in (b'["a", 1, 1, null], ["b", 1, 1, null]\n',
                 b'["a", 1\n1, null]\n'):
        with pytest.raises(UserError, match="line 2: not a trace entry"):
            loads(good_head + b"\n" + body, "t")
