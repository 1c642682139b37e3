"""The hubd command line: argv -> HubConfig, logging set-up, exit codes.

    python3 -m hubd serve ROOT --listen HOST:PORT [--token-file F] [--log-level LEVEL]
        [--tls-cert C --tls-key K] [--max-concurrent-reads N] [--read-wait SECONDS]
        [--rescan-interval SECONDS] [--idle-timeout SECONDS]
    python3 -m hubd serve s3://BUCKET[/PREFIX] --listen HOST:PORT [--s3-endpoint URL]
        [--s3-region R] [the options above]

ROOT is a directory, or ``s3://BUCKET[/PREFIX]``: a bucket or a prefix of one, listed into
the namespace (``hubd/s3/``). Its endpoint is ``--s3-endpoint``, else
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, else AWS's endpoint of the region; the
region ``--s3-region``, else ``AWS_REGION`` or ``AWS_DEFAULT_REGION``, else us-east-1; the
keys come from the environment or the AWS files (``hubd/s3/credentials.py``). Missing or
wrong keys, an unknown bucket or a denied listing end hubd at start with one line.

``--rescan-interval`` (default 60, 0: never) rescans ROOT that long after the previous
scan ended; SIGHUP triggers a rescan at once (requests made during a scan coalesce into
one more). ``--tls-cert``/``--tls-key`` (both or neither) serve HTTPS, TLS 1.2 or newer.
``--idle-timeout`` closes a connection that has not sent a whole request header that long
after it opened or after its last answer (slow-header clients, idle keep-alives).

Exit codes: 0 after SIGTERM/SIGINT; 1 for start-up errors (ROOT missing, port busy,
unreadable token file, unusable certificate or key), one ``hubd: error: ...`` line on
stderr; 2 for usage errors, one line too. Only this module reads argv and files named on
the command line; the token never appears in a message, only its file's path.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import re
import signal
import ssl
import stat
import sys
from typing import NoReturn

from hubd.config import DEFAULT_CONCURRENT_READS, DEFAULT_READ_WAIT_S, HubConfig
from hubd.errors import StartupError
from hubd.heap import keep_freed_buffers
from hubd.s3.config import AWS_DEFAULT_REGION, BucketSpec, S3Config, aws_endpoint
from hubd.s3.credentials import CredentialsError, find_credentials
from spokefs import protocol

log = logging.getLogger(__name__)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MAX_TOKEN_BYTES = 4096  # a token is a secret string, not a file to slurp
# Visible ASCII, no spaces: what any HTTP client can send in ``Authorization: Bearer``
# unchanged (RFC 6750's b64token is a subset), so hub and spoke agree byte for byte.
_TOKEN_RE = re.compile(rb"[\x21-\x7e]+")


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


def _timeout(text: str) -> float:
    value = _seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"want a number of seconds > 0, not {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hubd", description="Export a directory to spokefs over HTTP.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=_Parser)
    srv = sub.add_parser("serve", help="export ROOT read-only")
    srv.add_argument("root", metavar="ROOT",
                     help="the directory to export, or s3://BUCKET[/PREFIX]")
    srv.add_argument("--listen", required=True, type=_listen, metavar="HOST:PORT",
                     help="address to listen on; port 0 picks a free port")
    srv.add_argument("--token-file", metavar="F",
                     help="file holding a bearer token that clients must send")
    srv.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                     help="default: INFO")
    mib = protocol.PACK_MAX_BYTES / (1 << 20)
    srv.add_argument("--max-concurrent-reads", type=_positive, default=DEFAULT_CONCURRENT_READS,
                     metavar="N",
                     help=f"range and pack reads in flight, 1-4096; read buffers stay under "
                          f"N x {mib:g} MiB (a read holds one pack or one 1 MiB slice of a "
                          f"blob at a time, whatever the range; from a bucket up to 10 MiB); "
                          f"default: {DEFAULT_CONCURRENT_READS}")
    srv.add_argument("--read-wait", type=_timeout, default=DEFAULT_READ_WAIT_S,
                     metavar="SECONDS",
                     help="a request waits this long for a read slot, then gets 503 and the "
                          "spoke retries; keep it under the spoke's 30 s request timeout; "
                          f"default: {DEFAULT_READ_WAIT_S:g}")
    srv.add_argument("--rescan-interval", type=_seconds, default=60.0, metavar="SECONDS",
                     help="rescan ROOT this long after the previous scan ends; 0: only on "
                          "SIGHUP (which always triggers one); default: 60")
    srv.add_argument("--tls-cert", metavar="C",
                     help="PEM certificate (chain) to serve HTTPS with; needs --tls-key")
    srv.add_argument("--tls-key", metavar="K",
                     help="PEM private key (unencrypted) of --tls-cert; keep it mode 0600")
    srv.add_argument("--idle-timeout", type=_timeout, default=15.0, metavar="SECONDS",
                     help="close a connection that sends no whole request header for this "
                          "long (after connecting or after its last answer); default: 15")
    srv.add_argument("--s3-endpoint", metavar="URL",
                     help="S3 endpoint of an s3:// ROOT, http(s)://HOST[:PORT]; default: "
                          "AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS's for the region")
    srv.add_argument("--s3-region", metavar="R",
                     help="signing region of an s3:// ROOT; default: AWS_REGION, "
                          f"AWS_DEFAULT_REGION, else {AWS_DEFAULT_REGION}")
    return parser


def parse_s3_root(text: str) -> tuple[str, str]:
    """``s3://BUCKET[/PREFIX]`` -> (bucket, prefix); raises ``argparse.ArgumentTypeError``."""
    bucket, _, prefix = text.removeprefix("s3://").partition("/")
    if not bucket or not all(c.isascii() and (c.isalnum() or c in ".-_") for c in bucket):
        raise argparse.ArgumentTypeError(f"bad bucket in {text!r}: want s3://BUCKET[/PREFIX]")
    if "\0" in prefix:
        raise argparse.ArgumentTypeError("an S3 prefix cannot hold a NUL byte")
    return bucket, prefix


def _endpoint(text: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or \
            parts.path.strip("/") or parts.query or parts.username:
        raise argparse.ArgumentTypeError(f"bad --s3-endpoint {text!r}: want http(s)://HOST[:PORT]")
    return f"{parts.scheme}://{parts.netloc}"


def bucket_spec(args: argparse.Namespace, env: dict[str, str] | None = None) -> BucketSpec:
    """The bucket export of ``args`` (ROOT starts with ``s3://``).

    Raises:
        argparse.ArgumentTypeError: a malformed ROOT or endpoint (a usage error).
        StartupError: no usable credentials.
    """
    env = dict(os.environ) if env is None else env
    bucket, prefix = parse_s3_root(args.root)
    region = args.s3_region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") \
        or AWS_DEFAULT_REGION
    endpoint = _endpoint(args.s3_endpoint or env.get("AWS_ENDPOINT_URL_S3")
                         or env.get("AWS_ENDPOINT_URL") or aws_endpoint(region))
    try:
        creds = find_credentials(env)
    except CredentialsError as exc:
        raise StartupError(f"{args.root}: {exc}") from None
    return BucketSpec(bucket, prefix, S3Config(endpoint, region), creds)


def read_token(path: str) -> bytes:
    """The token in ``path``, surrounding whitespace stripped.

    Logs one warning when group or others may access the file (it should be mode 0600).
    No message ever quotes the file's contents.
    """
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            token = f.read(MAX_TOKEN_BYTES + 1).strip()
    except OSError as exc:
        raise StartupError(f"cannot read token file {path}: {exc.strerror}") from None
    if not token or len(token) > MAX_TOKEN_BYTES:
        raise StartupError(f"token file {path} is empty or longer than {MAX_TOKEN_BYTES} bytes")
    if not _TOKEN_RE.fullmatch(token):
        raise StartupError(f"token file {path} must hold one word of visible ASCII characters")
    warn_if_exposed(path, mode)
    return token


def warn_if_exposed(path: str, mode: int) -> None:
    """One warning when a secret file is open to group or others."""
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token file %s has mode %04o: group or others have access to it; "
                    "chmod 600 it", path, stat.S_IMODE(mode))


def load_tls(cert: str, key: str) -> ssl.SSLContext:
    """A server context for ``cert`` and ``key`` (PEM), TLS 1.2 or newer.

    Raises:
        StartupError: a file cannot be read, holds no certificate or no usable key, or
            the key does not belong to the certificate; one line naming the file.
    """
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise StartupError(f"cannot read {flag} {path}: {exc.strerror}") from None
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        probe.load_verify_locations(cafile=cert)
    except (ssl.SSLError, ValueError):
        raise StartupError(f"--tls-cert {cert} holds no PEM certificate") from None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # The callback answers a passphrase prompt with nothing: an encrypted key fails
        # here instead of hubd waiting on the terminal.
        ctx.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise StartupError(f"--tls-key {key} is not the key of --tls-cert {cert}") from None
        raise StartupError(f"--tls-key {key} holds no usable PEM private key "
                           "(or the certificate chain is broken; encrypted keys "
                           "are not supported)") from None
    return ctx


def config_from_args(args: argparse.Namespace) -> HubConfig:
    host, port = args.listen
    token = read_token(args.token_file) if args.token_file else None
    tls = load_tls(args.tls_cert, args.tls_key) if args.tls_cert else None
    s3 = bucket_spec(args) if args.root.startswith("s3://") else None
    return HubConfig(root=args.root, host=host, port=port, token=token, s3=s3,
                     log_level=args.log_level, max_concurrent_reads=args.max_concurrent_reads,
                     read_wait_s=args.read_wait,
                     rescan_interval_s=args.rescan_interval, tls=tls,
                     tls_cert_file=args.tls_cert, idle_timeout_s=args.idle_timeout)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> dumps every thread's stack


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hubd`` console script and ``python -m hubd``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together: give both or neither")
    if not args.root.startswith("s3://") and (args.s3_endpoint or args.s3_region):
        parser.error("--s3-endpoint and --s3-region are for an s3://BUCKET ROOT")
    if args.root.startswith("s3://"):
        try:
            parse_s3_root(args.root)
            if args.s3_endpoint:
                _endpoint(args.s3_endpoint)
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
    # Imported here, not at the top: a usage error should not wait for aiohttp to load.
    try:
        from hubd.server import serve
    except ImportError as exc:
        if exc.name != "aiohttp":
            raise
        print("hubd: error: aiohttp is not installed; install the hub with: "
              "pip install 'spokefs[hub]'", file=sys.stderr)
        return 1

    try:
        _setup_logging(args.log_level)  # first: reading the token may warn
        cfg = config_from_args(args)
        keep_freed_buffers()
        return asyncio.run(serve(cfg))
    except StartupError as exc:
        print(f"hubd: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # SIGINT before the loop installed its handler
        return 0
