"""The app in-process (aiohttp's test client): the error boundary and the read slots."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hubd.app import make_app
from hubd.config import HubConfig
from hubd.export_root import ExportRoot
from hubd.metrics import HubMetrics
from hubd.range_reader import RangeReader
from hubd.routes import READER
from spokefs import protocol
from tests.hubd.hubd_testlib import Tree, paths_of, unframed

Check = Callable[[TestClient, ExportRoot], Awaitable[None]]


def run_app(tree: Tree, check: Check, max_concurrent_reads: int = 16,
            read_wait_s: float = 30.0) -> None:
    """Serve ``tree`` in-process and run ``check(client, export)`` against it."""
    export = ExportRoot(str(tree.root))
    export.rescan()
    config = HubConfig(root=str(tree.root), host="127.0.0.1", port=0,
                       max_concurrent_reads=max_concurrent_reads, read_wait_s=read_wait_s)

    async def main() -> None:
        app = make_app(config, export, HubMetrics())
        async with TestClient(TestServer(app)) as client:
            await check(client, export)

    try:
        asyncio.run(main())
    finally:
        export.close()


def test_a_bug_is_logged_and_answered_503_not_500(
        tree: Tree, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(RangeReader, "_open_framed_sync", broken)

    async def check(client: TestClient, export: ExportRoot) -> None:
        assert export.snapshot is not None
        plain = paths_of(list(export.snapshot.entries))[b"plain.txt"]
        resp = await client.get(protocol.blob_path(plain.file_id, plain.version))
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert resp.headers[protocol.HEADER_ERROR] == "internal-error"
        assert json.loads(await resp.read())["error"] == "internal-error"
        assert client.app[READER].in_flight == 0

    with caplog.at_level(logging.ERROR, logger="hubd"):
        run_app(tree, check)
    [record] = caplog.records
    assert record.exc_info is not None and "boom" in str(record.exc_info[1])


def test_no_free_read_slot_is_503_overloaded(tree: Tree) -> None:
    async def check(client: TestClient, export: ExportRoot) -> None:
        assert export.snapshot is not None
        plain = paths_of(list(export.snapshot.entries))[b"plain.txt"]
        reader = client.app[READER]
        async with reader.slot():  # the only slot
            resp = await client.get(protocol.blob_path(plain.file_id, plain.version))
            assert resp.status == 503 and resp.headers[protocol.HEADER_ERROR] == "overloaded"
            assert resp.headers["Retry-After"] == "1"
        resp = await client.get(protocol.blob_path(plain.file_id, plain.version))
        assert resp.status == 200 and unframed(await resp.read()) == b"hello world\n"
        assert reader.in_flight == 0

    run_app(tree, check, max_concurrent_reads=1, read_wait_s=0.05)
