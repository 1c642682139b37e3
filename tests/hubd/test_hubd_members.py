"""``hubd.members``: a pack's members read from their directory in one call, in C and in its
Python fallback, which must agree byte for byte; and packs and picks served either way,
including a member rewritten at its own size (read whole, then found another version: its
bytes leave the answer and the members after it still decode)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import xxhash
from aiohttp.test_utils import TestClient

from hubd import members
from spokefs import protocol
from tests.hubd import test_hubd_pack, test_hubd_pick
from tests.hubd.hubd_testlib import Tree

WAYS = [pytest.param(True, id="c"), pytest.param(False, id="python")]
RS = protocol.PACK_RECORD.size


def _need_c() -> None:
    if not members.NATIVE:
        pytest.skip("hubd.members_c is not built (deploy/setup.sh builds it)")


def awkward_dir(tmp_path: Path) -> tuple[int, list[bytes], list[int], dict[bytes, bytes]]:
    """A directory of every kind of member: its fd, names, the sizes the snapshot says, and
    the bytes of those that must be read whole."""
    d = tmp_path / "d"
    d.mkdir()
    data = {b"a.txt": b"x" * 1000, b"empty": b"", b"big": os.urandom(200 * 1024 + 17),
            b"odd \xff\nname": b"odd\n"}
    for name, body in data.items():
        (Path(os.fsdecode(d)) / os.fsdecode(name)).write_bytes(body)
    (d / "grew").write_bytes(b"12345")
    os.symlink("a.txt", d / "link")
    os.mkfifo(d / "fifo")
    (d / "subdir").mkdir()
    names = [b"a.txt", b"link", b"empty", b"missing", b"fifo", b"big", b"subdir", b"grew",
             b"unlisted", b"odd \xff\nname"]
    sizes = [1000, 4, 0, 10, 0, len(data[b"big"]), 0, 3, -1, 4]
    fd = os.open(d, os.O_PATH | os.O_DIRECTORY)
    return fd, names, sizes, data


def test_c_and_python_read_the_same(tmp_path: Path) -> None:
    _need_c()
    fd, names, sizes, data = awkward_dir(tmp_path)
    try:
        bodies, results = [], []
        for native in (True, False):
            body = bytearray(b"\xee" * (7 + sum(RS + max(s, 0) for s in sizes)))
            results.append(members.read_members(fd, names, sizes, body, 7, RS, native=native))
            bodies.append(body)
        assert results[0] == results[1]
        assert bodies[0] == bodies[1]
        codes = dict(zip(names, results[0], strict=True))
        assert codes[b"link"] == members.NOT_REGULAR  # lstat: a symlink is not followed
        assert codes[b"missing"] == errno.ENOENT
        assert codes[b"fifo"] == members.NOT_REGULAR  # never opened, so never blocks
        assert codes[b"subdir"] == members.NOT_REGULAR
        assert codes[b"grew"] == members.SIZE_DIFFERS
        assert codes[b"unlisted"] == members.NOT_LISTED
        # members read whole sit after their headers, the others take a header's room only
        pos = 7
        for name, got in zip(names, results[0], strict=True):
            if isinstance(got, members.Read):
                assert bodies[0][pos + RS : pos + RS + got.size] == data[name]
                assert got.digest == xxhash.xxh3_64_intdigest(data[name])
                assert (got.ino, got.size) == (got.ino_after, got.size_after)
                pos += RS + got.size
            else:
                pos += RS
        assert set(data) == {n for n, r in codes.items() if isinstance(r, members.Read)}
        assert bodies[0][:7] == b"\xee" * 7
    finally:
        os.close(fd)


@pytest.mark.parametrize("native", WAYS)
def test_bad_calls_are_refused(tmp_path: Path, native: bool) -> None:
    if native:
        _need_c()
    fd, names, sizes, _ = awkward_dir(tmp_path)
    try:
        small = bytearray(sum(RS + max(s, 0) for s in sizes) - 1)
        with pytest.raises(ValueError, match="too small"):
            members.read_members(fd, names, sizes, small, 0, RS, native=native)
        body = bytearray(1 << 20)
        with pytest.raises(ValueError, match="NUL"):
            members.read_members(fd, [b"a\0b"], [1], body, 0, RS, native=native)
        with pytest.raises(ValueError, match="length"):
            members.read_members(fd, [b"a.txt"], [1000, 1], body, 0, RS, native=native)
    finally:
        os.close(fd)
    # a closed directory: each member's errno, which the pack's reader answers 503
    got = members.read_members(fd, [b"a.txt"], [1000], bytearray(2000), 0, RS, native=native)
    assert got == [errno.EBADF]


@pytest.fixture(params=WAYS)
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Packs and picks served with the C part, then with the Python fallback."""
    if request.param:
        _need_c()
    monkeypatch.setattr(members, "NATIVE", request.param)
    return bool(request.param)


def test_packs_either_way(tree: Tree, way: bool) -> None:
    test_hubd_pack.test_packs_of_a_directory(tree)


def test_gone_members_either_way(tree: Tree, way: bool) -> None:
    test_hubd_pack.test_gone_members_keep_their_place(tree)


def test_picks_either_way(tree: Tree, way: bool) -> None:
    test_hubd_pick.test_a_pick_answers_its_files_in_its_order(tree)


def test_a_member_rewritten_at_its_size_leaves_the_pack(tree: Tree, way: bool) -> None:
    async def check(client: TestClient, paths: dict[bytes, protocol.Entry],
                    entries: list[protocol.Entry]) -> None:
        (plan,) = test_hubd_pack.plans_of(entries, paths[b""].file_id)
        plain = paths[b"plain.txt"]
        # same size, another mtime: read whole, then found to be another version
        (tree.root / "plain.txt").write_bytes(b"HELLO WORLD\n")
        os.utime(tree.root / "plain.txt", ns=(1, 123456789))
        got = await test_hubd_pack.decoded(await client.get(plan.path), plan)
        assert got[(plain.file_id, plain.version)] is None
        for (fid, _), body in got.items():
            if fid != plain.file_id:
                entry = next(e for e in entries if e.file_id == fid)
                path = next(p for p, e in paths.items() if e is entry)
                assert body == (tree.root / os.fsdecode(path)).read_bytes()

    test_hubd_pack.run_pack(tree, check)
