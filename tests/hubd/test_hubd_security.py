"""hubd's token handling: constant-time comparison, token file rules, no token in any log."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

import hubd.app
from hubd.app import make_app
from hubd.cli import read_token
from hubd.config import HubConfig
from hubd.errors import StartupError
from hubd.export_root import ExportRoot
from hubd.metrics import HubMetrics
from spokefs import protocol
from tests.hubd.hubd_testlib import Hub, Tree

StartHub = Callable[..., Hub]
TOKEN = "Zq7-secret_token.value"


def test_every_guarded_request_is_compared_in_constant_time(
        tree: Tree, monkeypatch: pytest.MonkeyPatch) -> None:
    """The auth middleware compares with hmac.compare_digest, for every guarded request
    (right, wrong, missing), and /healthz and /metrics skip it."""
    calls: list[tuple[bytes, bytes]] = []
    real = hubd.app.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hubd.app.hmac, "compare_digest", counting)
    export = ExportRoot(str(tree.root))
    export.rescan()
    cfg = HubConfig(root=str(tree.root), host="127.0.0.1", port=0, token=TOKEN.encode())
    good = {"Authorization": f"Bearer {TOKEN}"}

    async def main() -> list[int]:
        async with TestClient(TestServer(make_app(cfg, export, HubMetrics()))) as client:
            statuses = []
            for headers in (good, {}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
                for path in (protocol.SNAPSHOT_PATH, f"{protocol.CHANGES_PATH}?since=0",
                             protocol.blob_path(2, 2), "/nowhere"):
                    statuses.append((await client.get(path, headers=headers)).status)
                pack = f"/v2/pack/{protocol.format_id(2)}/0/{'0' * 16}"
                statuses.append((await client.get(pack, headers=headers)).status)
            for path in (protocol.HEALTH_PATH, protocol.METRICS_PATH):
                assert (await client.get(path)).status == 200
            return statuses

    try:
        statuses = asyncio.run(main())
    finally:
        export.close()
    assert 401 not in statuses[:5] and statuses[5:] == [401] * 15
    assert len(calls) == 20  # every guarded request, none for /healthz and /metrics
    assert all(b == b"Bearer " + TOKEN.encode() for _, b in calls)


def test_token_file_rules(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        assert read_token(str(path)) == TOKEN.encode()
    assert not caplog.records
    path.chmod(0o640)
    with caplog.at_level(logging.WARNING):
        read_token(str(path))
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "0640" in message and str(path) in message and TOKEN not in message
    for bad in (f"{TOKEN} {TOKEN}", f"{TOKEN}\x7f", f"{TOKEN}é", "x" * 4097):
        path.write_text(bad)
        with pytest.raises(StartupError) as err:
            read_token(str(path))
        assert TOKEN not in str(err.value) and "xxxx" not in str(err.value)


def test_no_token_in_logs_even_from_malformed_requests(
        tree: Tree, start_hub: StartHub, tmp_path: Path) -> None:
    """At DEBUG, with access logs: requests with the token that aiohttp's parser rejects
    (it quotes the offending bytes) and wrong tokens leave no trace of the token."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    hub = start_hub(tree.root, "--token-file", str(token_file), "--log-level", "DEBUG")
    port = int(hub.url.rsplit(":", 1)[1])
    bad_requests = [
        f"GET /v1/snapshot HTTP/1.1\r\nHost: x\r\nAuthorization : Bearer {TOKEN}\r\n\r\n",
        f"GET /v1/snapshot HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\x7f\r\n\r\n",
        f"GET /v1/snapshot?t={TOKEN} HTTP/9.9\r\nHost: x\r\n\r\n",
        f"GET /{TOKEN}\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
        f"GET /v1/snapshot HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"X: a\r\n folded\r\n\r\n",
    ]
    for raw in bad_requests:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(raw.encode("latin-1"))
            assert sock.recv(4096).startswith(b"HTTP/1.")
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert hub.request(protocol.SNAPSHOT_PATH, good).status == 200
    assert hub.request(protocol.SNAPSHOT_PATH, {"Authorization": f"Bearer {TOKEN}x"}).status == 401
    assert TOKEN.encode() not in hub.request(protocol.METRICS_PATH).body
    hub.stop()
    log = hub.stderr()
    assert "rejected a malformed request" in log  # the DEBUG line is there ...
    assert TOKEN not in log and TOKEN[:8] not in log  # ... without what the client sent
    assert "Traceback" not in log


MALFORMED = [  # (what, raw request); every one carries the token somewhere
    ("request line", f"GET /v2/snapshot?t={TOKEN} HTTP/9.9\r\nHost: x\r\n\r\n"),
    ("method", f"{TOKEN}\x01 /v2/snapshot HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("control char", f"GET /v2/snapshot HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\x7f"
                     "\r\n\r\n"),
    ("space before colon", f"GET /v2/snapshot HTTP/1.1\r\nHost: x\r\nAuthorization : Bearer "
                           f"{TOKEN}\r\n\r\n"),
    ("smuggling CL+TE", f"POST /v2/snapshot HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}"
                        f"\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    ("smuggling two CLs", f"POST /v2/snapshot HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                          f"Content-Length: 6\r\nAuthorization: Bearer {TOKEN}\r\n\r\n{TOKEN}"),
    ("obs-fold", f"GET /v2/snapshot HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                 f"X: a\r\n {TOKEN}\r\n\r\n"),
    ("oversized header", f"GET /v2/snapshot HTTP/1.1\r\nHost: x\r\nX-Big: {TOKEN * 400}\r\n\r\n"),
    ("oversized line", f"GET /{TOKEN * 400} HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("bare LF", f"GET /v2/snapshot HTTP/1.1\nHost: x\nAuthorization: Bearer {TOKEN}\n\n"),
    ("garbage", f"\x16\x03\x01\x00{TOKEN}\r\n\r\n"),
]


def _answer_to(port: int, raw: bytes) -> bytes:
    """Everything hubd sends back to ``raw`` on a fresh connection, until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(raw)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_malformed_requests_get_a_fixed_answer_that_echoes_nothing(
        tree: Tree, start_hub: StartHub, tmp_path: Path) -> None:
    """aiohttp's own 400 quoted the offending bytes back (the token with them); hubd's is
    the same bytes whatever was sent (but the Date), in its usual error shape."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    hub = start_hub(tree.root, "--token-file", str(token_file), "--log-level", "DEBUG")
    port = int(hub.url.rsplit(":", 1)[1])
    reference = re.sub(rb"\r\nDate: [^\r]*", b"", _answer_to(port, b"\x00\r\n\r\n"))
    head, _, body = reference.partition(b"\r\n\r\n")
    assert re.match(rb"HTTP/1\.[01] 400 ", head), head
    assert b"\r\nX-Spokefs-Error: malformed-request\r\n" in head + b"\r\n"
    assert json.loads(body) == {"error": "malformed-request", "detail": "malformed HTTP request"}
    for what, raw in MALFORMED:
        answer = _answer_to(port, raw.encode("latin-1"))
        assert TOKEN.encode() not in answer and TOKEN[:6].encode() not in answer, what
        assert re.sub(rb"\r\nDate: [^\r]*", b"", answer) == reference, (what, answer)
    assert hub.request(protocol.HEALTH_PATH).status == 200
    hub.stop()
    log = hub.stderr()
    assert log.count("rejected a malformed request") == len(MALFORMED) + 1
    assert TOKEN[:6] not in log and "Traceback" not in log
