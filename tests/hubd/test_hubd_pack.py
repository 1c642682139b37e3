"""GET /v2/pack in-process (aiohttp's test client): deterministic packs of a directory,
gone members, stale and unknown packs, auth; and ``protocol.plan_packs`` itself."""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Awaitable, Callable

import xxhash
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from hubd.app import make_app
from hubd.config import HubConfig
from hubd.export_root import ExportRoot
from hubd.metrics import HubMetrics
from spokefs import protocol
from tests.helpers import wire
from tests.hubd.hubd_testlib import DATA, Tree, paths_of

Check = Callable[[TestClient, dict[bytes, protocol.Entry], list[protocol.Entry]], Awaitable[None]]


def run_pack(tree: Tree, check: Check, token: bytes | None = None) -> None:
    """Serve ``tree`` in-process; ``check(client, paths, entries)`` with the first scan."""
    export = ExportRoot(str(tree.root))
    snap = export.rescan()
    config = HubConfig(root=str(tree.root), host="127.0.0.1", port=0, token=token)

    async def main() -> None:
        async with TestClient(TestServer(make_app(config, export, HubMetrics()))) as client:
            entries = list(snap.entries)
            await check(client, paths_of(entries), entries)

    try:
        asyncio.run(main())
    finally:
        export.close()


def plans_of(entries: list[protocol.Entry], dir_id: int) -> list[protocol.PackPlan]:
    """The packs of a directory as a spoke computes them from its snapshot."""
    return protocol.plan_packs(dir_id, [(e.name, e.file_id, e.version, e.size) for e in entries
                                    if e.parent_id == dir_id and not e.is_dir
                                    and not e.is_symlink])


async def decoded(resp: ClientResponse, plan: protocol.PackPlan) -> dict:
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"] == "application/octet-stream"
    assert resp.headers["Cache-Control"] == "public, max-age=31536000, immutable"
    assert resp.headers["ETag"] == protocol.pack_etag(plan.digest)
    out = wire.decode_pack(await resp.read(), plan.items)
    for value in out.values():
        if value is not None:
            data, digest = value
            assert digest == xxhash.xxh3_64_intdigest(data)
    return {key: None if value is None else value[0] for key, value in out.items()}


async def assert_error(resp: ClientResponse, status: int, reason: str) -> None:
    assert resp.status == status, await resp.text()
    assert resp.headers[protocol.HEADER_ERROR] == reason
    assert json.loads(await resp.read())["error"] == reason


def test_packs_of_a_directory(tree: Tree) -> None:
    async def check(client: TestClient, paths: dict[bytes, protocol.Entry],
                    entries: list[protocol.Entry]) -> None:
        root, deeper = paths[b""], paths[b"sub/deeper"]
        plans = plans_of(entries, root.file_id)
        assert len(plans) == 1
        members = {m[0] for m in plans[0].members}
        assert paths[b"plain.txt"].file_id in members and paths[b"hard1"].file_id in members
        assert paths[b"big.bin"].file_id not in members  # over PACK_FILE_MAX_BYTES: a blob
        assert paths[b"empty"].file_id not in members  # nothing to fetch
        got = await decoded(await client.get(plans[0].path), plans[0])
        assert got[(paths[b"plain.txt"].file_id, paths[b"plain.txt"].version)] == \
            b"hello world\n"
        assert got[(paths[b"hard1"].file_id, paths[b"hard1"].version)] == b"linked twice\n"
        (plan,) = plans_of(entries, deeper.file_id)
        data = paths[b"sub/deeper/data.bin"]
        assert await decoded(await client.get(plan.path), plan) == {
            (data.file_id, data.version): DATA}
        metrics = (await (await client.get(protocol.METRICS_PATH)).read()).decode()
        served = len(plans[0].members) + 1
        assert f'hubd_pack_files_total{{result="served"}} {served}.0' in metrics
        assert 'hubd_pack_files_total{result="gone"} 0.0' in metrics
        assert f"hubd_pack_file_bytes_total {plans[0].file_bytes + len(DATA)}.0" in metrics
        route = "/v2/pack/{dir_id}/{index}/{digest}"
        assert f'hubd_requests_total{{route="{route}",status="200"}} 2.0' in metrics

    run_pack(tree, check)


def test_gone_members_keep_their_place(tree: Tree) -> None:
    async def check(client: TestClient, paths: dict[bytes, protocol.Entry],
                    entries: list[protocol.Entry]) -> None:
        (plan,) = plans_of(entries, paths[b""].file_id)
        # changed on disk since the scan; a blocking 4-byte write that must land before the GET
        with open(tree.root / "hard1", "ab") as f:  # noqa: ASYNC230
            f.write(b"more")
        os.unlink(tree.root / "plain.txt")  # gone from disk
        got = await decoded(await client.get(plan.path), plan)
        gone = {paths[b"hard1"].file_id, paths[b"plain.txt"].file_id}
        for (fid, _), data in got.items():
            assert (data is None) == (fid in gone)
        metrics = (await (await client.get(protocol.METRICS_PATH)).read()).decode()
        assert 'hubd_pack_files_total{result="gone"} 2.0' in metrics

    run_pack(tree, check)


def test_stale_unknown_and_malformed_packs(tree: Tree) -> None:
    async def check(client: TestClient, paths: dict[bytes, protocol.Entry],
                    entries: list[protocol.Entry]) -> None:
        (plan,) = plans_of(entries, paths[b""].file_id)
        root = protocol.format_id(plan.dir_id)
        other = "0" * 16 if plan.digest != "0" * 16 else "1" * 16
        await assert_error(await client.get(f"/v2/pack/{root}/0/{other}"), 412, "stale-version")
        await assert_error(await client.get(f"/v2/pack/{root}/1/{plan.digest}"), 412,
                           "stale-version")
        for not_a_dir in (123456789, paths[b"plain.txt"].file_id):
            path = f"/v2/pack/{protocol.format_id(not_a_dir)}/0/{plan.digest}"
            await assert_error(await client.get(path), 404, "unknown-file")
        for bad in (f"/v2/pack/{root}/x/{plan.digest}", f"/v2/pack/{root}/-1/{plan.digest}",
                    f"/v2/pack/{root}/0/{plan.digest[:-1]}", f"/v2/pack/{root}/0/ABCDEF0123456789",
                    f"/v2/pack/{root[:-1]}/0/{plan.digest}", f"/v2/pack/{root}/{'9' * 11}/"
                    f"{plan.digest}"):
            await assert_error(await client.get(bad), 400, "bad-pack")
        assert (await client.post(plan.path)).status == 405

    run_pack(tree, check)


def test_pack_needs_the_token(tree: Tree) -> None:
    async def check(client: TestClient, paths: dict[bytes, protocol.Entry],
                    entries: list[protocol.Entry]) -> None:
        (plan,) = plans_of(entries, paths[b""].file_id)
        await assert_error(await client.get(plan.path), 401, "unauthorized")
        await assert_error(await client.get(plan.path, headers={"Authorization": "Bearer no"}),
                           401, "unauthorized")
        resp = await client.get(plan.path, headers={"Authorization": "Bearer tok"})
        assert len(await decoded(resp, plan)) == len(plan.members)

    run_pack(tree, check, token=b"tok")


def test_plan_packs_is_a_pure_function_of_the_directory() -> None:
    """Name order, packable sizes only, a hard link once, cut at the byte and file limits;
    the same packs whatever order the listing comes in."""
    q = protocol.PACK_MAX_BYTES // 4  # four of them fill a pack exactly
    assert q <= protocol.PACK_FILE_MAX_BYTES
    files = [(b"b", 10, 1, q), (b"a", 11, 1, q), (b"d", 15, 1, q), (b"c", 16, 1, q),
             (b"e", 12, 1, 1),  # one byte more than a pack: cut
             (b"big", 13, 1, protocol.PACK_FILE_MAX_BYTES + 1), (b"empty", 14, 1, 0),
             (b"z-link", 11, 1, q)]  # another name of file 11
    plans = protocol.plan_packs(7, files)
    assert [p.members for p in plans] == [((11, 1, q), (10, 1, q), (16, 1, q), (15, 1, q)),
                                          ((12, 1, 1),)]
    assert [p.index for p in plans] == [0, 1]
    assert plans[0].path == f"/v2/pack/{protocol.format_id(7)}/0/{plans[0].digest}"
    shuffled = list(files)
    random.Random(1).shuffle(shuffled)
    assert protocol.plan_packs(7, shuffled) == plans
    assert protocol.plan_packs(7, [(b"a", 11, 2, q), *files[:1]])[0].digest != plans[0].digest
    many = [(b"%06d" % i, 100 + i, 1, 1) for i in range(protocol.MAX_PACK_FILES + 1)]
    assert [len(p.members) for p in protocol.plan_packs(7, many)] == [protocol.MAX_PACK_FILES, 1]
