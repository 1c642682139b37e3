"""GET /v2/pick in-process (aiohttp's test client): the files a pick names, in its order,
from any directories; a member at another version or gone answered PACK_GONE in its place;
malformed and oversized picks refused; and ``protocol.plan_picks`` itself."""

from __future__ import annotations

import random

from aiohttp.test_utils import TestClient

from spokefs import protocol
from tests.helpers import wire
from tests.hubd.hubd_testlib import DATA, Tree
from tests.hubd.test_hubd_pack import assert_error, decoded, run_pack


def test_a_pick_answers_its_files_in_its_order(tree: Tree) -> None:
    async def check(client: TestClient, paths: dict[bytes, protocol.Entry],
                    entries: list[protocol.Entry]) -> None:
        order = [paths[b"sub/deeper/data.bin"], paths[b"plain.txt"], paths[b"hard1"]]
        (plan,) = protocol.plan_picks((e.file_id, e.version, e.size) for e in order)
        assert [m[0] for m in plan.members] == [e.file_id for e in order]
        resp = await client.get(plan.path)
        got = await decoded(resp, plan)
        assert list(got) == [(e.file_id, e.version) for e in order]  # the pick's order
        assert got[(order[0].file_id, order[0].version)] == DATA
        assert got[(order[1].file_id, order[1].version)] == b"hello world\n"
        # another version, and a file the snapshot does not have: gone, in their places
        plain = paths[b"plain.txt"]
        stale = protocol.PackPlan(0, 0, ((plain.file_id, plain.version + 1, 12),
                                         (0x1234, 1, 5), (order[0].file_id, order[0].version,
                                                          order[0].size)), "")
        answer = protocol.parse_pick(stale.path.rsplit("/", 1)[1])
        assert answer == [(m[0], m[1]) for m in stale.members]
        resp = await client.get(stale.path)
        assert resp.status == 200
        out = wire.decode_pack(await resp.read(), stale.items)
        assert [v is None for v in out.values()] == [True, True, False]
        metrics = (await (await client.get(protocol.METRICS_PATH)).read()).decode()
        assert 'hubd_requests_total{route="/v2/pick/{members}",status="200"} 2.0' in metrics

    run_pack(tree, check)


def test_malformed_and_oversized_picks_are_refused(tree: Tree) -> None:
    async def check(client: TestClient, paths: dict[bytes, protocol.Entry],
                    entries: list[protocol.Entry]) -> None:
        plain = paths[b"plain.txt"]
        one = f"{protocol.format_id(plain.file_id)}-{protocol.format_id(plain.version)}"
        too_many = ".".join(f"{protocol.format_id(2 + i)}-{protocol.format_id(1)}"
                            for i in range(protocol.PICK_MAX_FILES + 1))
        for bad in (f"{one}.{one}", one[:-1], one.replace("-", "+"), f"{one}.", too_many,
                    one.upper()):
            await assert_error(await client.get(f"/v2/pick/{bad}"), 400, "bad-pack")
        big = paths[b"big.bin"]  # over PACK_FILE_MAX_BYTES: a blob, never a member
        path = f"/v2/pick/{protocol.format_id(big.file_id)}-{protocol.format_id(big.version)}"
        await assert_error(await client.get(path), 400, "bad-pack")
        assert (await client.post(f"/v2/pick/{one}")).status == 405

    run_pack(tree, check)


def test_a_pick_needs_the_token(tree: Tree) -> None:
    async def check(client: TestClient, paths: dict[bytes, protocol.Entry],
                    entries: list[protocol.Entry]) -> None:
        plain = paths[b"plain.txt"]
        (plan,) = protocol.plan_picks([(plain.file_id, plain.version, plain.size)])
        await assert_error(await client.get(plan.path), 401, "unauthorized")
        resp = await client.get(plan.path, headers={"Authorization": "Bearer tok"})
        assert len(await decoded(resp, plan)) == 1

    run_pack(tree, check, token=b"tok")


def test_plan_picks_keeps_the_lists_order() -> None:
    """The list's order (not names, not directories), packable sizes only, each file once,
    cut at the byte and member limits; the same list gives the same picks."""
    q = protocol.PACK_MAX_BYTES // 4
    files = [(20, 1, q), (10, 1, q), (30, 1, 0), (40, 1, protocol.PACK_FILE_MAX_BYTES + 1),
             (10, 1, q), (50, 1, q), (60, 1, q), (70, 1, 1)]
    plans = protocol.plan_picks(files)
    assert [p.members for p in plans] == [((20, 1, q), (10, 1, q), (50, 1, q), (60, 1, q)),
                                          ((70, 1, 1),)]
    assert plans == protocol.plan_picks(list(files))
    assert plans[0].path.startswith("/v2/pick/" + protocol.format_id(20) + "-")
    many = [(100 + i, 1, 1) for i in range(protocol.PICK_MAX_FILES + 3)]
    assert [len(p.members) for p in protocol.plan_picks(many)] == [protocol.PICK_MAX_FILES, 3]
    assert len(protocol.plan_picks(many)[0].path) < 2300
    shuffled = list(many)
    random.Random(2).shuffle(shuffled)
    assert protocol.plan_picks(shuffled) != protocol.plan_picks(many)
