"""The hubd command line: exit codes, one-line errors, signals, the readiness line."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.hubd.hubd_testlib import Hub, Tree, run_hubd

StartHub = Callable[..., Hub]


def assert_one_error_line(stderr: str) -> None:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hubd: error: "), stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("root", ["does-not-exist", "file"])
def test_bad_root_exits_1(tmp_path: Path, root: str) -> None:
    (tmp_path / "file").write_text("x")
    result = run_hubd("serve", str(tmp_path / root), "--listen", "127.0.0.1:0")
    assert result.returncode == 1
    assert_one_error_line(result.stderr)
    assert result.stdout == ""


@pytest.mark.parametrize("args", [
    ["serve", ".", "--listen", "nohostport"],
    ["serve", ".", "--listen", "127.0.0.1:"],
    ["serve", ".", "--listen", ":8080"],
    ["serve", ".", "--listen", "127.0.0.1:99999"],
    ["serve", ".", "--listen", "127.0.0.1:-1"],
    ["serve", "."],
    ["serve", ".", "--listen", "127.0.0.1:0", "--max-concurrent-reads", "0"],
    ["serve", ".", "--listen", "127.0.0.1:0", "--log-level", "LOUD"],
    ["serve", ".", "--listen", "127.0.0.1:0", "--bogus"],
    ["serve", ".", "--listen", "127.0.0.1:0", "--rescan-interval", "-1"],
    ["serve", ".", "--listen", "127.0.0.1:0", "--rescan-interval", "soon"],
    ["serve", ".", "--listen", "127.0.0.1:0", "--rescan-interval", "nan"],
    [],
])
def test_usage_errors_exit_2(args: list[str]) -> None:
    result = run_hubd(*args)
    assert result.returncode == 2
    assert_one_error_line(result.stderr)


def test_busy_port_exits_1(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_hubd("serve", str(tmp_path), "--listen", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert_one_error_line(result.stderr)
    assert "cannot listen" in result.stderr


@pytest.mark.parametrize("content", [None, ""])
def test_bad_token_file_exits_1(tmp_path: Path, content: str | None) -> None:
    token = tmp_path / "token"
    if content is not None:
        token.write_text(content)
    result = run_hubd("serve", str(tmp_path), "--listen", "127.0.0.1:0",
                      "--token-file", str(token))
    assert result.returncode == 1
    assert_one_error_line(result.stderr)


def test_help_exits_0() -> None:
    result = run_hubd("serve", "--help")
    assert result.returncode == 0 and "--listen" in result.stdout
    assert "--rescan-interval" in result.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_stop_cleanly(tree: Tree, start_hub: StartHub, sig: int) -> None:
    hub = start_hub(tree.root)
    assert hub.request("/healthz").status == 200
    assert hub.stop(sig) == 0
    assert "Traceback" not in hub.stderr()


def test_readiness_line_escapes_an_undecodable_root(tmp_path: Path, start_hub: StartHub) -> None:
    root = os.path.join(os.fsencode(tmp_path), b"r\xff")
    os.mkdir(root)
    hub = start_hub(root)
    assert hub.ready_line.startswith(f"hubd: serving {tmp_path}/r\\xff at http://127.0.0.1:")
    assert " (1 entries, generation " in hub.ready_line
