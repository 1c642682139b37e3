"""``mount.spokefs``: mount(8)'s helper command line -> ``spokefs mount`` flags (no kernel)."""

from __future__ import annotations

import pytest

from spokefs.cli import main as cli
from spokefs.cli.mount_helper import HelperError, main, parse_args, spokefs_args

FSTAB_OPTIONS = ("cache_dir=/var/cache/spokefs,cache_size=500G,token_file=/etc/spokefs/token,"
                 "_netdev")


def test_the_readme_fstab_line() -> None:
    source, target, options, flags = parse_args(
        ["https://hub.example:8443", "/mnt/dataset", "-o", f"rw,{FSTAB_OPTIONS}",
         "-t", "fuse.spokefs"])
    assert (source, target, flags) == ("https://hub.example:8443", "/mnt/dataset", set())
    args = spokefs_args(options, sloppy=False)
    assert args == ["--cache-dir", "/var/cache/spokefs", "--cache-size", "500G",
                    "--token-file", "/etc/spokefs/token"]
    # and spokefs itself accepts what the helper makes of it
    parsed = cli._parser().parse_args(["mount", source, target, *args, "--daemon"])
    assert parsed.cache_size == 500 << 30 and parsed.daemon


def test_hub_replicas_in_the_source() -> None:
    """An fstab source ``URL1,URL2`` is passed through: spokefs mounts both replicas."""
    source, target, options, _ = parse_args(
        ["http://hub-a:8600,http://hub-b:8600", "/mnt/dataset", "-o",
         "cache_dir=/var/cache/spokefs,cache_size=500G,_netdev"])
    args = spokefs_args(options, sloppy=False)
    parsed = cli._parser().parse_args(["mount", source, target, *args])
    cfg = cli._config(parsed)
    assert cfg.hub_urls == ("http://hub-a:8600", "http://hub-b:8600")
    assert cfg.hub_source == source


@pytest.mark.parametrize(("argv", "message"), [
    (["http://a:1,http://a:1/"], "given twice"),
    (["http://a:1", "--hub", "http://a:1"], "given twice"),
    (["http://a:1,ftp://b:2"], "bad hub URL 'ftp://b:2'"),
    (["http://a:1,"], "bad hub URL ''"),
    (["http://a:1", "--hub-failover-after", "0"], "must be positive"),
])
def test_bad_hub_lists_are_one_line_errors(argv: list[str], message: str) -> None:
    parsed = cli._parser().parse_args(["mount", argv[0], "/m", "--cache-dir", "/c",
                                       "--cache-size", "1G", *argv[1:]])
    with pytest.raises(cli.UserError, match=message):
        cli._config(parsed)


def test_more_hubs_with_the_hub_flag() -> None:
    parsed = cli._parser().parse_args(["mount", "http://a:1", "/m", "--cache-dir", "/c",
                                       "--cache-size", "1G", "--hub", "http://b:2",
                                       "--hub", "http://c:3/"])
    assert cli._config(parsed).hub_urls == ("http://a:1", "http://b:2", "http://c:3")


def test_every_value_option_is_a_spokefs_flag() -> None:
    options = ["cache_dir=/c", "cache_size=1G", "token_file=/t", "ca_file=/ca.pem",
               "metrics_port=9200", "metrics_addr=10.0.0.7", "hub_deadline=120",
               "mount_deadline=10", "refresh_interval=300", "log_file=/var/log/s.log",
               "log_level=DEBUG", "uid=1000", "gid=1000", "no_prefetch",
               "hub_failover_after=5", "tier=http://tier.region:8700", "workers=4",
               "open_mode=kernel"]
    args = spokefs_args(options, sloppy=False)
    parsed = cli._parser().parse_args(["mount", "http://h:1", "/m", *args])
    assert parsed.hub_failover_after == 5.0
    assert parsed.metrics_port == 9200 and parsed.no_prefetch and parsed.uid == 1000
    assert parsed.refresh_interval == 300.0 and parsed.log_level == "DEBUG"
    assert parsed.tier == "http://tier.region:8700"
    assert parsed.workers == "4" and parsed.open_mode == "kernel"


@pytest.mark.parametrize(("tier", "error"), [
    ("tier.region:8700", "bad tier URL 'tier.region:8700': want http(s)://HOST:PORT"),
    ("http://user:pw@tier:1", "bad tier URL: no user or password in it"),
    ("http://tier:99999", "bad port in tier URL"),
])
def test_a_bad_tier_url_is_one_clear_line(tier: str, error: str, tmp_path) -> None:
    parsed = cli._parser().parse_args(["mount", "http://h:1", str(tmp_path), "--cache-dir",
                                       str(tmp_path / "c"), "--cache-size", "1G",
                                       "--tier", tier])
    with pytest.raises(cli.UserError, match=error.replace("(", r"\(").replace(")", r"\)")):
        cli._config(parsed)


@pytest.mark.parametrize("generic", [
    "defaults", "noauto", "nofail", "_netdev", "x-systemd.automount",
    "x-systemd.requires=network-online.target", "comment=x", "ro", "nosuid", "nodev",
    "noatime", "users",
])
def test_generic_options_are_dropped(generic: str) -> None:
    assert spokefs_args(["cache_dir=/c", "cache_size=1G", generic], sloppy=False) == [
        "--cache-dir", "/c", "--cache-size", "1G"]


@pytest.mark.parametrize(("options", "message"), [
    (["cache_dir=/c"], "missing option cache_size="),
    (["cache_size=1G"], "missing option cache_dir="),
    (["cache_dir=/c", "cache_size=1G", "cache_sise=2G"], "unknown option 'cache_sise'"),
    (["cache_dir=/c", "cache_size=1G", "token=s3cret"], "token_file=PATH"),
    (["cache_dir", "cache_size=1G"], "option cache_dir needs a value"),
    (["cache_dir=/c", "cache_size=1G", "no_prefetch=1"], "takes no value"),
])
def test_bad_options_are_refused(options: list[str], message: str) -> None:
    with pytest.raises(HelperError, match=message):
        spokefs_args(options, sloppy=False)


def test_sloppy_ignores_unknown_options() -> None:
    assert spokefs_args(["cache_dir=/c", "cache_size=1G", "bogus"], sloppy=True) == [
        "--cache-dir", "/c", "--cache-size", "1G"]


def test_switches_and_joined_options() -> None:
    _, _, options, flags = parse_args(["-sv", "http://h:1", "/m", f"-o{FSTAB_OPTIONS}"])
    assert flags == {"s", "v"} and "cache_size=500G" in options
    with pytest.raises(HelperError, match=r"usage: mount\.spokefs"):
        parse_args(["http://h:1"])
    with pytest.raises(HelperError, match="-N"):
        parse_args(["http://h:1", "/m", "-N", "/proc/1/ns/mnt"])


def test_errors_are_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["http://h:1", "/m", "-o", "cache_dir=/c"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mount.spokefs: error: missing option")


def test_fake_mount_does_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-fv", "http://h:1", "/nonexistent", "-o", FSTAB_OPTIONS]) == 0
    err = capsys.readouterr().err
    assert "spokefs mount http://h:1 /nonexistent --cache-dir /var/cache/spokefs" in err
    assert err.rstrip().endswith("--daemon")
