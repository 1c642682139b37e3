"""Command line: ``spokefs mount``, ``umount``, ``status``, ``refresh`` and ``warm``.

The only module that reads argv and files named on the command line; it builds a frozen
``SpokeConfig``. User errors print one line ``spokefs: error: ...`` and exit 1 (usage errors
exit 2, from argparse); never a traceback.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import trio

from spokefs import commands
from spokefs.config import PrefetchConfig, SpokeConfig
from spokefs.errors import UserError
from spokefs.mounttab import find_mount
from spokefs.namespace import NamespaceInfo

log = logging.getLogger("spokefs")

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_MIN_CACHE_BYTES = 1 << 20


def parse_size(text: str) -> int:
    """``512M``, ``2G``, ``1.5T``, ``4096`` (binary units; a trailing ``B``/``iB`` is allowed)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use a number with K, M, G or T")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _hub_url(text: str) -> str:
    """Validate the hub URL (a mount error, exit 1, like an unreachable hub)."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"bad hub URL {text!r}: want http(s)://HOST:PORT")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise UserError(f"bad port in hub URL {text!r}") from None
    if parts.query or parts.fragment:
        raise UserError(f"bad hub URL {text!r}: no query or fragment allowed")
    return text.rstrip("/")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spokefs", description="A read-only caching FUSE filesystem for a far-away dataset."
    )
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mount", help="mount a hub's export (foreground unless --daemon)")
    m.add_argument("hub_url", help="hubd base URL, e.g. http://hub:8600")
    m.add_argument("mountpoint", type=Path)
    m.add_argument("--cache-dir", type=Path, required=True, help="local dir for namespace + blocks")
    m.add_argument("--cache-size", type=parse_size, required=True, help="e.g. 500G")
    m.add_argument("--daemon", action="store_true", help="detach once the mount is ready")
    m.add_argument("--uid", type=int, default=0, help="owner shown for all entries (default 0)")
    m.add_argument("--gid", type=int, default=0, help="group shown for all entries (default 0)")
    m.add_argument("--metrics-port", type=int, default=9108, help="0 turns metrics off")
    m.add_argument("--metrics-addr", default="0.0.0.0", help="address /metrics listens on")
    m.add_argument("--token-file", type=Path, help="file holding the hub's bearer token")
    m.add_argument("--hub-deadline", type=float, default=60.0,
                   help="seconds an uncached read retries before EIO (default 60)")
    m.add_argument("--mount-deadline", type=float, default=5.0,
                   help="seconds mount tries to reach the hub (default 5)")
    m.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper)
    m.add_argument("--log-file", type=Path, help="log here (with --daemon, else stderr)")
    m.add_argument("--refresh-interval", type=float, default=60.0,
                   help="seconds between polls of the hub for changes; 0: only on refresh")
    m.add_argument("--no-prefetch", action="store_true", help="turn read-ahead off")
    u = sub.add_parser("umount", help="unmount a spokefs mount")
    u.add_argument("mountpoint", type=Path)
    u.add_argument("--lazy", action="store_true", help="detach now even if busy (umount -l)")
    st = sub.add_parser("status", help="cache use, hit ratio, and how much of PATH is cached")
    st.add_argument("path", type=Path, nargs="?", default=Path("."))
    r = sub.add_parser("refresh", help="poll the hub for namespace changes now")
    r.add_argument("path", type=Path, help="the mount point or any path in it")
    w = sub.add_parser("warm", help="fill the cache with files or whole trees")
    w.add_argument("paths", type=Path, nargs="+")
    w.add_argument("--jobs", type=int, default=8, help="files warmed at once (default 8)")
    return p


def _config(args: argparse.Namespace) -> SpokeConfig:
    if args.cache_size < _MIN_CACHE_BYTES:
        raise UserError(f"--cache-size {args.cache_size} is too small (at least 1M)")
    token = None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise UserError(f"cannot read --token-file {args.token_file}: {exc.strerror}") from None
        if not token:
            raise UserError(f"--token-file {args.token_file} is empty")
    if not 0 <= args.metrics_port <= 65535:
        raise UserError(f"--metrics-port {args.metrics_port} is not a port")
    if args.refresh_interval < 0:
        raise UserError("--refresh-interval must not be negative")
    for name in ("hub_deadline", "mount_deadline"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    return SpokeConfig(
        hub_url=_hub_url(args.hub_url), mountpoint=args.mountpoint.absolute(),
        cache_dir=args.cache_dir.absolute(), cache_max_bytes=args.cache_size,
        uid=args.uid, gid=args.gid, metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr, token=token, hub_deadline_s=args.hub_deadline,
        mount_deadline_s=args.mount_deadline, daemon=args.daemon, log_level=args.log_level,
        refresh_interval_s=args.refresh_interval,
        prefetch=PrefetchConfig(enabled=not args.no_prefetch),
    )


def _setup_logging(level: str, log_file: Path | None) -> None:
    handler: logging.Handler = (
        logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    )
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "hpack"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stack dump on demand


def _mount(cfg: SpokeConfig, ready_fd: int | None) -> int:
    from spokefs.mount import run_mount  # pyfuse3 loads only for mount

    def on_ready(info: NamespaceInfo) -> None:
        print(
            f"spokefs: mounted {cfg.hub_url} at {cfg.mountpoint} "
            f"({info.entries} entries, generation {info.generation})",
            flush=True,
        )
        if ready_fd is not None:
            os.write(ready_fd, b"1")
            os.close(ready_fd)
            _detach_stdio()

    cfg.cache_dir.mkdir(parents=True, exist_ok=True)
    trio.run(run_mount, cfg, on_ready)
    return 0


def _detach_stdio() -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def _daemonize() -> int | None:
    """Fork; the parent waits for readiness and exits; the child returns its ready fd."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        os.setsid()
        return wfd
    os.close(wfd)
    ready = os.read(rfd, 1)
    if ready == b"1":
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code > 0 else 1)


def _umount(mountpoint: Path, lazy: bool) -> int:
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        raise UserError("fusermount3 not found: install Debian's fuse3")
    if find_mount(mountpoint) is None:
        raise UserError(f"{mountpoint} is not mounted")
    cmd = [tool, "-u", *(["-z"] if lazy else []), str(mountpoint)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        msg = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"
        raise UserError(f"cannot unmount {mountpoint}: {msg}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "umount":
            return _umount(args.mountpoint, args.lazy)
        if args.command == "status":
            return commands.status(args.path)
        if args.command == "refresh":
            return commands.refresh(args.path)
        if args.command == "warm":
            if args.jobs < 1:
                raise UserError("--jobs must be at least 1")
            return commands.warm(args.paths, args.jobs)
        cfg = _config(args)
        ready_fd = _daemonize() if cfg.daemon else None
        _setup_logging(cfg.log_level, args.log_file)
        return _mount(cfg, ready_fd)
    except UserError as exc:
        print(f"spokefs: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
