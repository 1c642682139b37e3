"""The snapshot decoder's two outputs (``feed`` -> Entry, ``feed_rows`` -> tuples) agree,
whatever the chunking, and no entry is held back by zlib at a step boundary."""

from __future__ import annotations

import stat

import pytest

from spokefs import protocol
from spokefs.protocol import Entry, tree
from tests.helpers import wire

ROOT = 0x100
DIR = stat.S_IFDIR | 0o755
REG = stat.S_IFREG | 0o644
LNK = stat.S_IFLNK | 0o777


def entries() -> list[Entry]:
    return [
        Entry(ROOT, 0, DIR, 0, 1, 3, 0, b""),
        Entry(0x200, ROOT, DIR, 0, 2, 2, 0, b"sub dir"),
        Entry(0x300, ROOT, REG, 5, 3, 2, 0xAA, b"a\nb"),
        Entry(0x300, 0x200, REG, 5, 3, 2, 0xAA, b"hardlink"),
        Entry(0x400, 0x200, LNK, 6, 4, 1, 0, b"\xff\xfe", b"../a\nb"),
        *[Entry(0x1000 + i, 0x200, REG, i, 5, 1, i, f"f{i:05}".encode()) for i in range(3000)],
    ]


@pytest.mark.parametrize("chunk", [1, 333, 1 << 20])
def test_rows_and_entries_agree_in_any_chunking(chunk: int) -> None:
    blob = wire.snapshot(9, ROOT, entries())
    by_rows, by_entries = protocol.SnapshotDecoder(), protocol.SnapshotDecoder()
    rows: list[protocol.Row] = []
    got: list[Entry] = []
    for i in range(0, len(blob), chunk):
        rows.extend(by_rows.feed_rows(blob[i : i + chunk]))
        got.extend(by_entries.feed(blob[i : i + chunk]))
    assert by_rows.finish() == by_entries.finish() == protocol.SnapshotHeader(9, ROOT, len(got))
    assert got == entries()
    assert [Entry(*r) for r in rows] == got


def test_no_entry_is_held_back_at_a_full_inflate_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree, "_PLAIN_STEP", 64)  # every step fills its output exactly
    blob = wire.snapshot(9, ROOT, entries())
    decoder = protocol.SnapshotDecoder()
    rows = decoder.feed_rows(blob)  # one chunk: everything must come out of this call
    assert len(rows) == len(entries())
    decoder.finish()


def test_a_bad_entry_after_good_ones_fails_the_batch() -> None:
    bad = Entry(0x9999, ROOT, REG, 1, 1, 1, 1, b"a/b")
    blob = wire.snapshot(9, ROOT, [*entries(), bad])
    with pytest.raises(protocol.WireError, match="bad name"):
        protocol.SnapshotDecoder().feed_rows(blob)
