"""hubd's defaults are sized for a fleet, and the command line says what they cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from hubd.cli import build_parser, config_from_args
from hubd.config import HubConfig
from spokefs import protocol
from spokefs.config import PrefetchConfig, SpokeConfig


def test_read_slots_cover_a_fleet_and_memory_is_bounded() -> None:
    cfg = HubConfig(root=".", host="127.0.0.1", port=0)
    assert cfg.max_concurrent_reads == 256
    # a slot holds one pack or one slice of a streamed blob, whatever the range asked
    assert cfg.max_concurrent_reads * protocol.PACK_MAX_BYTES == 960 << 20
    assert protocol.SLICE_BYTES < protocol.PACK_MAX_BYTES
    # spokes ask for at most request_bytes per read: ~960 MiB for 256 slots in flight
    assert 256 * PrefetchConfig().request_bytes < 1 << 30
    # a queued request hears 503 before the spoke's own request timeout would fire
    spoke = SpokeConfig("http://h:1", Path("/m"), Path("/c"), 1)
    assert cfg.read_wait_s < spoke.hub_request_timeout_s


def test_cli_flags() -> None:
    args = build_parser().parse_args(["serve", ".", "--listen", "127.0.0.1:0",
                                      "--max-concurrent-reads", "64", "--read-wait", "5"])
    cfg = config_from_args(args)
    assert (cfg.max_concurrent_reads, cfg.read_wait_s) == (64, 5.0)
    default = config_from_args(build_parser().parse_args(["serve", ".", "--listen",
                                                          "127.0.0.1:0"]))
    assert (default.max_concurrent_reads, default.read_wait_s) == (256, 20.0)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "x"])
def test_bad_read_wait_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", ".", "--listen", "127.0.0.1:0", "--read-wait", value])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("hubd: error: argument --read-wait")


def test_help_states_the_memory(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "read buffers stay under N x 3.75 MiB" in out and "default: 256" in out
    assert "--read-wait SECONDS" in out
