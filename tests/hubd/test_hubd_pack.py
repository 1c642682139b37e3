"""POST /v1/pack in-process (aiohttp's test client): records, gone items, limits, auth."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable

import xxhash
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from hubd import wire
from hubd.app import make_app
from hubd.config import HubConfig
from hubd.export_root import ExportRoot
from hubd.metrics import HubMetrics
from tests.hubd.hubd_testlib import DATA, ODD_NAMES, Tree, paths_of

Check = Callable[[TestClient, dict[bytes, wire.Entry]], Awaitable[None]]
OCTETS = {"Content-Type": "application/octet-stream"}


def run_pack(tree: Tree, check: Check, token: bytes | None = None) -> None:
    """Serve ``tree`` in-process; ``check(client, paths)`` with paths of the first scan."""
    export = ExportRoot(str(tree.root))
    snap = export.rescan()
    config = HubConfig(root=str(tree.root), host="127.0.0.1", port=0, token=token)

    async def main() -> None:
        async with TestClient(TestServer(make_app(config, export, HubMetrics()))) as client:
            await check(client, paths_of(list(snap.entries)))

    try:
        asyncio.run(main())
    finally:
        export.close()


def item(entry: wire.Entry, version: int | None = None) -> tuple[int, int]:
    return entry.file_id, entry.version if version is None else version


async def post(client: TestClient, items: list[tuple[int, int]] | bytes,
               headers: dict[str, str] | None = None) -> ClientResponse:
    body = items if isinstance(items, bytes) else wire.encode_pack_request(items)
    return await client.post(wire.PACK_PATH, data=body, headers={**OCTETS, **(headers or {})})


async def decoded(resp: ClientResponse, items: list[tuple[int, int]]) -> dict:
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"] == "application/octet-stream"
    assert "Cache-Control" not in resp.headers and "ETag" not in resp.headers
    out = wire.decode_pack(await resp.read(), items)
    for value in out.values():
        if value is not None:
            data, digest = value
            assert digest == xxhash.xxh3_64_intdigest(data)
    return {key: None if value is None else value[0] for key, value in out.items()}


async def assert_error(resp: ClientResponse, status: int, reason: str) -> None:
    assert resp.status == status, await resp.text()
    assert resp.headers[wire.HEADER_ERROR] == reason
    assert json.loads(await resp.read())["error"] == reason


def test_pack_of_small_files(tree: Tree) -> None:
    async def check(client: TestClient, paths: dict[bytes, wire.Entry]) -> None:
        names = [b"plain.txt", *ODD_NAMES, b"dir\xff\n/inner", b"empty",
                 b"sub/deeper/data.bin", b"hard1", b"sub/hard2", b"plain.txt"]
        items = [item(paths[name]) for name in names]
        got = await decoded(await post(client, items), items)
        want = {b"plain.txt": b"hello world\n", b"dir\xff\n/inner": b"inner", b"empty": b"",
                b"sub/deeper/data.bin": DATA, b"hard1": b"linked twice\n",
                **{name: name for name in ODD_NAMES}}
        for name, key in zip(names, items, strict=True):
            assert got[key] == want.get(name, b"linked twice\n"), name
        metrics = (await (await client.get(wire.METRICS_PATH)).read()).decode()
        assert f'hubd_pack_files_total{{result="served"}} {len(items)}.0' in metrics
        assert 'hubd_pack_files_total{result="gone"} 0.0' in metrics
        total = sum(len(want.get(n, b"linked twice\n")) for n in names)
        assert f"hubd_pack_file_bytes_total {total}.0" in metrics
        assert 'hubd_requests_total{route="/v1/pack",status="200"} 1.0' in metrics

    run_pack(tree, check)


def test_gone_items_keep_their_place(tree: Tree) -> None:
    async def check(client: TestClient, paths: dict[bytes, wire.Entry]) -> None:
        plain, data, inner = paths[b"plain.txt"], paths[b"sub/deeper/data.bin"], paths[b"hard1"]
        with open(tree.root / "hard1", "ab") as f:  # changed on disk since the scan
            f.write(b"more")
        os.unlink(tree.root / "sub" / "deeper" / "data.bin")  # gone from disk
        items = [(123456789, 1), item(plain, plain.version ^ 1), item(plain), item(data),
                 item(inner), item(paths[b"empty"])]
        got = await decoded(await post(client, items), items)
        assert got == {items[0]: None, items[1]: None, items[2]: b"hello world\n",
                       items[3]: None, items[4]: None, items[5]: b""}
        metrics = (await (await client.get(wire.METRICS_PATH)).read()).decode()
        assert 'hubd_pack_files_total{result="gone"} 4.0' in metrics

    run_pack(tree, check)


def test_directories_and_symlinks_are_bad_packs(tree: Tree) -> None:
    async def check(client: TestClient, paths: dict[bytes, wire.Entry]) -> None:
        for name in (b"", b"sub", b"link_in"):
            items = [item(paths[b"plain.txt"]), item(paths[name])]
            await assert_error(await post(client, items), 400, "bad-pack")

    run_pack(tree, check)


def test_packs_larger_than_a_range_are_refused(tree: Tree) -> None:
    async def check(client: TestClient, paths: dict[bytes, wire.Entry]) -> None:
        big, plain = paths[b"big.bin"], paths[b"plain.txt"]
        await assert_error(await post(client, [item(plain), item(big)]), 413, "pack-too-large")
        # An old version of the big file is not read, so it does not count.
        items = [item(plain), item(big, big.version ^ 1)]
        assert await decoded(await post(client, items), items) == {
            items[0]: b"hello world\n", items[1]: None}

    run_pack(tree, check)


def test_malformed_bodies(tree: Tree) -> None:
    async def check(client: TestClient, paths: dict[bytes, wire.Entry]) -> None:
        one = wire.encode_pack_request([item(paths[b"plain.txt"])])
        limit = wire.MAX_PACK_FILES * wire.PACK_ITEM.size
        for body in (b"", one[:-1], one + b"x", bytes(limit + 16), bytes(10 * limit)):
            await assert_error(await post(client, body), 400, "bad-pack")

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked
            for _ in range(100):
                yield bytes(limit // 8)

        resp = await client.post(wire.PACK_PATH, data=chunks(), headers=OCTETS)
        await assert_error(resp, 400, "bad-pack")
        most = [(2 + i, 1) for i in range(wire.MAX_PACK_FILES)]  # the limit itself is fine
        got = await decoded(await post(client, most), most)
        assert len(got) == wire.MAX_PACK_FILES and set(got.values()) == {None}
        assert (await client.get(wire.PACK_PATH)).status == 405

    run_pack(tree, check)


def test_pack_needs_the_token(tree: Tree) -> None:
    async def check(client: TestClient, paths: dict[bytes, wire.Entry]) -> None:
        items = [item(paths[b"plain.txt"])]
        await assert_error(await post(client, items), 401, "unauthorized")
        await assert_error(await post(client, items, {"Authorization": "Bearer nope"}),
                           401, "unauthorized")
        resp = await post(client, items, {"Authorization": "Bearer tok"})
        assert await decoded(resp, items) == {items[0]: b"hello world\n"}

    run_pack(tree, check, token=b"tok")
