"""The snapshot loader's C part (``snapshot_items``) and its Python way store the same
namespace, byte for byte, and reject the same hostile snapshots with the same message."""

from __future__ import annotations

import random
import stat
import zlib

import pytest

from spokefs import protocol
from spokefs.namespace import replica
from spokefs.namespace.replica import ROOT_INODE, Namespace
from spokefs.protocol import Entry
from tests.helpers import wire

ROOT = 0x100
DIR = stat.S_IFDIR | 0o755
REG = stat.S_IFREG | 0o644
LNK = stat.S_IFLNK | 0o777


def big_tree(seed: int = 5) -> list[Entry]:
    """Directories with hashed ids (as hubd gives them), hard links across directories
    (each with other attributes: the first entry's must stay), symlinks, deep nesting."""
    rng = random.Random(seed)
    entries = [Entry(ROOT, 0, DIR, 0, 1, 3, 0, b"")]
    dirs = [ROOT]
    files: list[int] = []
    for d in range(60):
        did = rng.getrandbits(63) | 1 << 62
        entries.append(Entry(did, rng.choice(dirs), DIR, 0, d, 2, 0, b"d%03d" % d))
        dirs.append(did)
        for f in range(rng.randrange(0, 40)):
            fid = rng.getrandbits(64) | 2
            files.append(fid)
            entries.append(Entry(fid, did, REG, rng.randrange(1 << 40), -f, 1, rng.getrandbits(64),
                                 b"f%03d-" % f + bytes(rng.randrange(1, 256) for _ in range(5))
                                 .replace(b"/", b"_").replace(b"\0", b"_")))
        entries.append(Entry(did + 1, did, LNK, 4, 0, 1, 0, b"link", b"../x" * (d + 1)))
    for k, fid in enumerate(rng.sample(files, 50)):  # hard links, other attributes
        entries.append(Entry(fid, rng.choice(dirs), REG, 7, 7, 2, 7, b"hard%02d" % k))
    return entries


def dump(ns: Namespace) -> dict[str, list[tuple[bytes, bytes]]]:
    env = ns._env
    with env.begin() as txn:
        return {name: list(txn.cursor(db=db)) for name, db in
                (("attr", ns._attr), ("dent", ns._dent), ("dpos", ns._dpos), ("info", ns._info))}


def load(path, blob: bytes, native: bool, monkeypatch) -> Namespace:
    monkeypatch.setattr(replica, "NATIVE", native)
    ns = Namespace(path)
    ns.reload_snapshot(blob)
    return ns


def test_the_native_part_is_built() -> None:
    """deploy/setup.sh builds it; the Python way is for hosts without a compiler, not CI."""
    assert replica.NATIVE


@pytest.mark.parametrize("step", [1 << 20, 4096, 7])
def test_both_ways_store_the_same_namespace(tmp_path, monkeypatch, step):
    monkeypatch.setattr(replica._BulkLoader, "_STEP", step)
    blob = wire.snapshot(9, ROOT, big_tree())
    native = load(tmp_path / "c", blob, True, monkeypatch)
    python = load(tmp_path / "py", blob, False, monkeypatch)
    assert dump(native) == dump(python)
    assert native.info == python.info and native.info.entries == len(big_tree())
    native.close()
    python.close()


def test_items_stored_in_batches_keep_the_first_entry_of_an_id(tmp_path, monkeypatch):
    """Past the held limit items go in sorted batches among the stored ones: a hard link's
    first entry (an earlier batch) still gives the attributes, positions go on."""
    monkeypatch.setattr(replica._BulkLoader, "_STEP", 512)
    monkeypatch.setattr(replica._BulkLoader, "_HELD_MAX", 1)
    blob = wire.snapshot(9, ROOT, big_tree())
    batched = load(tmp_path / "c", blob, True, monkeypatch)
    python = load(tmp_path / "py", blob, False, monkeypatch)
    assert dump(batched) == dump(python)


def raw_snapshot(entries: list[Entry], count: int | None = None) -> bytes:
    """A stream as a hostile hub could send it: entries in the given order, unchecked."""
    n = len(entries) if count is None else count
    plain = b"".join([protocol.encode_header(3, ROOT, n),
                      *(protocol.encode_entry(e) for e in entries), protocol.encode_trailer(n)])
    return zlib.compress(plain)


GOOD = [Entry(ROOT, 0, DIR, 0, 1, 2, 0, b""), Entry(0x200, ROOT, DIR, 0, 1, 2, 0, b"sub")]
HOSTILE = {
    "root not first": [Entry(0x200, ROOT, DIR, 0, 1, 2, 0, b"sub")],
    "root a file": [Entry(ROOT, 0, REG, 0, 1, 2, 0, b"")],
    "root named": [Entry(ROOT, 0, DIR, 0, 1, 2, 0, b"r")],
    "root with a parent": [Entry(ROOT, 7, DIR, 0, 1, 2, 0, b"")],
    "root a fifo": [Entry(ROOT, 0, stat.S_IFIFO, 0, 1, 2, 0, b"")],
    "root id low": [Entry(1, 0, DIR, 0, 1, 2, 0, b"")],
    "root with a target": [Entry(ROOT, 0, DIR, 0, 1, 2, 0, b"", b"x")],
    "root absurd size": [Entry(ROOT, 0, DIR, 2**62 + 1, 1, 2, 0, b"")],
    "slash": [*GOOD, Entry(0x500, ROOT, REG, 1, 1, 1, 1, b"a/b")],
    "dotdot": [*GOOD, Entry(0x500, ROOT, REG, 1, 1, 1, 1, b"..")],
    "dot": [*GOOD, Entry(0x500, ROOT, REG, 1, 1, 1, 1, b".")],
    "nul": [*GOOD, Entry(0x500, ROOT, REG, 1, 1, 1, 1, b"a\0\xff'\"")],
    "empty name": [*GOOD, Entry(0x500, ROOT, REG, 1, 1, 1, 1, b"")],
    "orphan": [*GOOD, Entry(0x500, 0x999, REG, 1, 1, 1, 1, b"orphan\n")],
    "parent a file": [*GOOD, Entry(0x500, ROOT, REG, 1, 1, 1, 1, b"f"),
                      Entry(0x501, 0x500, REG, 1, 1, 1, 1, b"g")],
    "cycle": [*GOOD, Entry(ROOT, 0x200, DIR, 0, 1, 1, 1, b"cycle")],
    "low id": [*GOOD, Entry(1, ROOT, REG, 1, 1, 1, 1, b"lowid")],
    "fifo": [*GOOD, Entry(0x500, ROOT, stat.S_IFIFO | 0o644, 0, 1, 1, 1, b"fifo")],
    "file with a target": [*GOOD, Entry(0x500, ROOT, REG, 1, 1, 1, 1, b"f", b"t")],
    "symlink without one": [*GOOD, Entry(0x500, ROOT, LNK, 1, 1, 1, 1, b"l")],
    "symlink with a NUL": [*GOOD, Entry(0x500, ROOT, LNK, 1, 1, 1, 1, b"l", b"a\0b")],
    "absurd size": [*GOOD, Entry(0x500, ROOT, REG, 2**62 + 1, 1, 1, 1, b"big")],
    "name twice": [*GOOD, Entry(0x500, 0x200, REG, 1, 1, 1, 1, b"n"),
                   Entry(0x501, 0x200, REG, 1, 1, 1, 1, b"n")],
    "over-long name": [*GOOD, Entry(0x500, ROOT, REG, 1, 1, 1, 1, b"n" * 256)],
    "over-long target": [*GOOD, Entry(0x500, ROOT, LNK, 1, 1, 1, 1, b"l", b"t" * 4096)],
}


def rejection(tmp_path, blob: bytes, native: bool, monkeypatch) -> str:
    monkeypatch.setattr(replica, "NATIVE", native)
    ns = Namespace(tmp_path)
    ns.reload_snapshot(wire.snapshot(7, ROOT, GOOD))
    before = dump(ns)
    with pytest.raises(protocol.WireError) as caught:
        ns.reload_snapshot(blob)
    assert dump(ns) == before  # nothing changed
    assert ns.lookup(ROOT_INODE, b"sub").ino == 0x200
    ns.close()
    return str(caught.value)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_both_ways_reject_the_same_snapshots_with_the_same_message(tmp_path, monkeypatch, case):
    blob = raw_snapshot(HOSTILE[case])
    native = rejection(tmp_path / "c", blob, True, monkeypatch)
    python = rejection(tmp_path / "py", blob, False, monkeypatch)
    assert native == python


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("count", [1, 3])
def test_a_count_other_than_the_entries_is_rejected(tmp_path, monkeypatch, native, count):
    """Fewer entries than the header says (the trailer is read as an entry, or cut short),
    or more (the trailer is not where it should be)."""
    assert rejection(tmp_path, raw_snapshot(GOOD, count=count), native, monkeypatch)


def test_a_name_twice_in_two_batches_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setattr(replica._BulkLoader, "_STEP", 64)
    monkeypatch.setattr(replica._BulkLoader, "_HELD_MAX", 1)
    twice = [*big_tree(), Entry(0x9000, ROOT, REG, 1, 1, 1, 1, b"d000")]
    message = rejection(tmp_path, wire.snapshot(7, ROOT, twice), True, monkeypatch)
    assert "listed twice" in message
