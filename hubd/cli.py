"""The hubd command line: argv -> HubConfig, logging set-up, exit codes.

    python3 -m hubd serve ROOT --listen HOST:PORT [--token-file F] [--log-level LEVEL]
        [--max-concurrent-reads N] [--rescan-interval SECONDS]

``--rescan-interval`` (default 60, 0: never) rescans ROOT that long after the previous
scan ended; SIGHUP triggers a rescan at once (requests made during a scan coalesce into
one more). Exit codes: 0 after SIGTERM/SIGINT; 1 for start-up errors (ROOT missing, port
busy, unreadable token file), one ``hubd: error: ...`` line on stderr; 2 for usage
errors, one line too. Only this module reads argv and files named on the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import signal
import sys
from typing import NoReturn

from hubd.config import HubConfig
from hubd.errors import StartupError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MAX_TOKEN_BYTES = 4096  # a token is a secret string, not a file to slurp


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"hubd: error: {' '.join(message.split())} (see hubd serve --help)\n")


def _listen(text: str) -> tuple[str, int]:
    host, sep, port_s = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port_s.isdigit() or int(port_s) > 65535:
        raise argparse.ArgumentTypeError(f"bad address {text!r}: want HOST:PORT")
    return host, int(port_s)


def _positive(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 4096:
        raise argparse.ArgumentTypeError(f"want a number from 1 to 4096, not {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 365 * 86400:  # also rejects nan and inf
        raise argparse.ArgumentTypeError(f"want a number of seconds >= 0, not {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hubd", description="Export a directory to spokefs over HTTP.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=_Parser)
    srv = sub.add_parser("serve", help="export ROOT read-only")
    srv.add_argument("root", metavar="ROOT", help="the directory to export")
    srv.add_argument("--listen", required=True, type=_listen, metavar="HOST:PORT",
                     help="address to listen on; port 0 picks a free port")
    srv.add_argument("--token-file", metavar="F",
                     help="file holding a bearer token that clients must send")
    srv.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                     help="default: INFO")
    srv.add_argument("--max-concurrent-reads", type=_positive, default=16, metavar="N",
                     help="range reads in flight, 1-4096 (read memory: N x 16 MiB); default: 16")
    srv.add_argument("--rescan-interval", type=_seconds, default=60.0, metavar="SECONDS",
                     help="rescan ROOT this long after the previous scan ends; 0: only on "
                          "SIGHUP (which always triggers one); default: 60")
    return parser


def read_token(path: str) -> bytes:
    """The token in ``path``, surrounding whitespace stripped."""
    try:
        with open(path, "rb") as f:
            token = f.read(MAX_TOKEN_BYTES + 1).strip()
    except OSError as exc:
        raise StartupError(f"cannot read token file {path}: {exc.strerror}") from None
    if not token or len(token) > MAX_TOKEN_BYTES:
        raise StartupError(f"token file {path} is empty or longer than {MAX_TOKEN_BYTES} bytes")
    return token


def config_from_args(args: argparse.Namespace) -> HubConfig:
    host, port = args.listen
    token = read_token(args.token_file) if args.token_file else None
    return HubConfig(root=args.root, host=host, port=port, token=token,
                     log_level=args.log_level, max_concurrent_reads=args.max_concurrent_reads,
                     rescan_interval_s=args.rescan_interval)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> dumps every thread's stack


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hubd`` console script and ``python -m hubd``."""
    args = build_parser().parse_args(argv)
    # Imported here, not at the top: a usage error should not wait for aiohttp to load.
    from hubd.server import serve

    try:
        cfg = config_from_args(args)
        _setup_logging(cfg.log_level)
        return asyncio.run(serve(cfg))
    except StartupError as exc:
        print(f"hubd: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # SIGINT before the loop installed its handler
        return 0
