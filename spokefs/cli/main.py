"""Command line: ``spokefs mount``, ``umount``, ``status``, ``refresh``, ``warm``, ``trace``,
``pin`` and ``unpin``.

The only module that reads argv and files named on the command line; it builds a frozen
``SpokeConfig``. User errors print one line ``spokefs: error: ...`` and exit 1 (usage errors
exit 2, from argparse); never a traceback.

Secrets: the token is read from ``--token-file`` (so only the file's path is in argv and
``/proc/PID/cmdline``), never from the URL, and no message quotes it. ``https://`` hubs
are verified against the system's roots, or only against ``--ca-file``'s CA.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import os
import re
import shutil
import signal
import ssl
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import trio

from spokefs import cachedir
from spokefs.cachedir import CacheLock
from spokefs.cli import commands, job_commands, sdnotify
from spokefs.config import PrefetchConfig, SpokeConfig
from spokefs.errors import UserError
from spokefs.mounttab import find_mount
from spokefs.namespace.replica import NamespaceInfo

log = logging.getLogger("spokefs")

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_MIN_CACHE_BYTES = 1 << 20
_MAX_TOKEN_BYTES = 4096  # as hubd: a token is a secret string, not a file to slurp
# Visible ASCII, no spaces: sendable unchanged in ``Authorization: Bearer`` (hubd checks
# the same), and an HTTP library never echoes it back in a header-validation error.
_TOKEN_RE = re.compile(r"[\x21-\x7e]+")
_LOOPBACK = ("localhost", "127.0.0.1", "::1")


def parse_size(text: str) -> int:
    """``512M``, ``2G``, ``1.5T``, ``4096`` (binary units; a trailing ``B``/``iB`` is allowed)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use a number with K, M, G or T")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _hub_url(text: str, what: str = "hub") -> str:
    """Validate the hub (or tier) URL (a mount error, exit 1, like an unreachable hub)."""
    parts = urlsplit(text)
    if "@" in parts.netloc:
        # a secret in the URL would end up in argv, logs and metrics: never quote it
        raise UserError(f"bad {what} URL: no user or password in it; put the token in "
                        f"--token-file")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"bad {what} URL {text!r}: want http(s)://HOST:PORT")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise UserError(f"bad port in {what} URL {text!r}") from None
    if parts.query or parts.fragment:
        raise UserError(f"bad {what} URL {text!r}: no query or fragment allowed")
    return text.rstrip("/")


def _read_token(path: Path) -> str:
    """The token in ``path``, surrounding whitespace stripped; never quoted in an error."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_TOKEN_BYTES + 1).strip()
    except OSError as exc:
        raise UserError(f"cannot read --token-file {path}: {exc.strerror}") from None
    if not raw:
        raise UserError(f"--token-file {path} is empty")
    token = raw.decode("ascii", "replace")
    if len(raw) > _MAX_TOKEN_BYTES or not _TOKEN_RE.fullmatch(token):
        raise UserError(f"--token-file {path} must hold one word of at most "
                        f"{_MAX_TOKEN_BYTES} visible ASCII characters")
    return token


def _warn_exposed_token(path: Path | None) -> None:
    """One warning when the token file is open to group or others (it should be 0600)."""
    if path is None:
        return
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # it was readable a moment ago; the mount will say what goes wrong
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token file %s has mode %04o: group or others have access to it; "
                    "chmod 600 it",
                    path, stat.S_IMODE(mode))


def _hub_urls(source: str, more: list[str]) -> list[str]:
    """``URL1,URL2,...`` and the ``--hub`` URLs: the hub replicas, preferred first."""
    urls = [_hub_url(u) for u in [*source.split(","), *more]]
    if len(set(urls)) != len(urls):
        raise UserError(f"a hub URL is given twice in {','.join(urls)}")
    return urls


def _client_tls(hub_urls: list[str], ca_file: Path | None) -> ssl.SSLContext | None:
    """The TLS context for https hubs: the system roots, or only ``ca_file``'s CA."""
    if all(urlsplit(u).scheme != "https" for u in hub_urls):
        if ca_file is not None:
            raise UserError("--ca-file needs an https:// hub URL")
        return None
    try:
        ctx = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    except (ssl.SSLError, ValueError):  # before OSError: SSLError is one
        raise UserError(f"--ca-file {ca_file} holds no PEM certificate") from None
    except OSError as exc:
        raise UserError(f"cannot read --ca-file {ca_file}: {exc.strerror}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # create_default_context verifies host names
    return ctx


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spokefs", description="A read-only caching FUSE filesystem for a far-away dataset."
    )
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mount", help="mount a hub's export (foreground unless --daemon)")
    m.add_argument("hub_url", help="hubd base URL, e.g. http://hub:8600; replicas of one "
                   "export as URL1,URL2,... (the first preferred, the others used while it "
                   "fails)")
    m.add_argument("mountpoint", type=Path)
    m.add_argument("--cache-dir", type=Path, required=True, help="local dir for namespace + blocks")
    m.add_argument("--cache-size", type=parse_size, required=True, help="e.g. 500G")
    m.add_argument("--daemon", action="store_true", help="detach once the mount is ready")
    m.add_argument("--uid", type=int, default=0, help="owner shown for all entries (default 0)")
    m.add_argument("--gid", type=int, default=0, help="group shown for all entries (default 0)")
    m.add_argument("--metrics-port", type=int, default=9108,
                   help="port of /metrics (default 9108); 0 turns metrics off; a port in use "
                        "fails the mount")
    m.add_argument("--metrics-addr", default="127.0.0.1",
                   help="address /metrics listens on (default 127.0.0.1: this node only)")
    m.add_argument("--token-file", type=Path,
                   help="file holding the hub's bearer token (keep it mode 0600)")
    m.add_argument("--ca-file", type=Path,
                   help="PEM CA certificate(s) to trust for an https:// hub instead of the "
                        "system's roots")
    m.add_argument("--hub", action="append", metavar="URL",
                   help="one more hub replica (repeatable), tried after the others")
    m.add_argument("--tier", metavar="URL",
                   help="a regional HTTP cache in front of the hub (deploy/regional): file "
                        "data is read through it, and from the hub when it fails; the "
                        "bearer token is sent to it too")
    m.add_argument("--hub-deadline", type=float, default=60.0,
                   help="seconds an uncached read retries before EIO (default 60)")
    m.add_argument("--hub-failover-after", type=float, default=10.0,
                   help="with several hubs: seconds a request waits for a hub that does not "
                        "answer before it tries the next (default 10)")
    m.add_argument("--mount-deadline", type=float, default=5.0,
                   help="seconds a first mount (no stored namespace) tries to reach the hub "
                        "(default 5)")
    m.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper)
    m.add_argument("--log-file", type=Path,
                   help="log here (default: stderr; with --daemon: CACHE_DIR/spokefs.log)")
    m.add_argument("--refresh-interval", type=float, default=60.0,
                   help="seconds between polls of the hub for changes; 0: only on refresh")
    m.add_argument("--no-prefetch", action="store_true", help="turn read-ahead off")
    m.add_argument("--open-mode", choices=["auto", "kernel", "handle"], default="auto",
                   help="kernel: the kernel opens files itself, two FUSE requests fewer per "
                        "file, but a file changed on the hub while open is read in its new "
                        "version from then on; handle: one version per open file (ESTALE "
                        "when it is gone); auto (default): kernel where this pyfuse3 supports "
                        "it (deploy/build-pyfuse3.sh), else handle")
    m.add_argument("--workers", default="auto", metavar="N",
                   help="threads of the native read loop that serve the mount's requests "
                        "from the cache, in a worker process beside the mount's own (needs "
                        "--open-mode kernel); 0: the mount's own process serves alone; auto "
                        "(default): 4 per core, 8 to 64")
    m.add_argument("--replay", type=Path, metavar="TRACE",
                   help="replay a trace (spokefs trace save) from the mount on, in the "
                        "background: the next run's first epoch reads warm data")
    m.add_argument("--no-trace", action="store_true",
                   help="do not record the access trace in the cache dir")
    m.add_argument("--max-pinned-share", type=float, default=0.5,
                   help="share of --cache-size that pinned files may hold (default 0.5)")
    u = sub.add_parser("umount", help="unmount a spokefs mount")
    u.add_argument("mountpoint", type=Path)
    u.add_argument("--lazy", action="store_true", help="detach now even if busy (umount -l)")
    st = sub.add_parser("status", help="cache use, hit ratio, and how much of PATH is cached")
    st.add_argument("path", type=Path, nargs="?", default=Path("."))
    r = sub.add_parser("refresh", help="poll the hub for namespace changes now")
    r.add_argument("path", type=Path, help="the mount point or any path in it")
    w = sub.add_parser("warm", help="fill the cache with files or whole trees, a trace's "
                                    "working set, or a list of files")
    w.add_argument("paths", type=Path, nargs="*")
    w.add_argument("--jobs", type=int, default=8, help="files warmed at once (default 8)")
    w.add_argument("--trace", type=Path, help="replay this trace (spokefs trace save)")
    w.add_argument("--files-from", metavar="FILE", help="the paths to warm, one a line; - reads "
                                                        "them from stdin")
    w.add_argument("-0", "--null", action="store_true",
                   help="--files-from is NUL-separated (find -print0)")
    w.add_argument("--ordered", action="store_true",
                   help="--files-from is the order a job will read the files in: fetch them "
                        "in that order, at most a horizon ahead of the reads, and return at "
                        "once (the job's order; a new one replaces the last)")
    w.add_argument("--mount", type=Path, help="the mount (default: the one the files are on)")
    t = sub.add_parser("trace", help="save, show or clear the access trace of a mount")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    ts = tsub.add_parser("save", help="write the mount's current trace to a file")
    ts.add_argument("name", type=Path)
    ts.add_argument("--mount", type=Path, default=Path("."),
                    help="the mount or a path in it (default: .)")
    tw = tsub.add_parser("show", help="summarise a trace file (and how much is cached)")
    tw.add_argument("file", type=Path)
    tw.add_argument("--mount", type=Path, help="the mount to check it against (default: .)")
    tc = tsub.add_parser("clear", help="start a new trace")
    tc.add_argument("--mount", type=Path, default=Path("."))
    for verb in ("pin", "unpin"):
        pn = sub.add_parser(verb, help=f"{verb} files or trees (pinned data is never evicted)")
        pn.add_argument("paths", type=Path, nargs="+")
    return p


def _config(args: argparse.Namespace) -> SpokeConfig:
    if args.cache_size < _MIN_CACHE_BYTES:
        raise UserError(f"--cache-size {args.cache_size} is too small (at least 1M)")
    token = _read_token(args.token_file) if args.token_file is not None else None
    hub_urls = _hub_urls(args.hub_url, args.hub or [])
    tls = _client_tls(hub_urls, args.ca_file)
    if not 0 <= args.metrics_port <= 65535:
        raise UserError(f"--metrics-port {args.metrics_port} is not a port")
    if args.refresh_interval < 0:
        raise UserError("--refresh-interval must not be negative")
    for name in ("hub_deadline", "mount_deadline", "hub_failover_after"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= args.max_pinned_share <= 0.9:  # the rest must keep the cache working
        raise UserError("--max-pinned-share must be between 0 and 0.9")
    open_mode = _open_mode(args.open_mode)
    return SpokeConfig(
        hub_url=hub_urls[0], hub_fallback_urls=tuple(hub_urls[1:]),
        hub_failover_after_s=args.hub_failover_after, mountpoint=args.mountpoint.absolute(),
        cache_dir=args.cache_dir.absolute(), cache_max_bytes=args.cache_size,
        uid=args.uid, gid=args.gid, metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr, token=token, tls=tls, hub_deadline_s=args.hub_deadline,
        mount_deadline_s=args.mount_deadline, daemon=args.daemon, log_level=args.log_level,
        refresh_interval_s=args.refresh_interval,
        prefetch=PrefetchConfig(enabled=not args.no_prefetch),
        open_mode=open_mode,
        workers=_workers(args.workers, open_mode),
        tier_url=_hub_url(args.tier, "tier") if args.tier else None,
        trace=not args.no_trace,
        replay_path=args.replay.absolute() if args.replay is not None else None,
        max_pinned_share=args.max_pinned_share,
    )


_MAX_WORKERS = 64
# --workers auto: threads sleep in read(2) until a request comes, so more threads than cores
# cost nothing idle and keep disk reads in flight while others wait (bench_workers.py on
# 2 cores: 8 threads served 1.3x what 2 did); README "Sizing the workers"
_AUTO_PER_CORE, _AUTO_MIN_WORKERS = 4, 8


def _workers(asked: str, open_mode: str) -> int:
    """The serving threads for ``--workers`` (see ``fuse.workers``)."""
    from spokefs.fuse import session  # the FUSE layer (pyfuse3): only mounting needs it

    if asked == "auto":
        if open_mode != "kernel" or not session.supported() or not session.read_loop_built():
            return 0
        return max(_AUTO_MIN_WORKERS, min(_MAX_WORKERS, _AUTO_PER_CORE * (os.cpu_count() or 1)))
    try:
        n = int(asked)
    except ValueError:
        raise UserError(f"--workers {asked!r}: give a number of threads, 0, or auto") from None
    if not 0 <= n <= _MAX_WORKERS:
        raise UserError(f"--workers {n}: give 0 to {_MAX_WORKERS}")
    if n and open_mode != "kernel":
        raise UserError(f"--workers {n} needs --open-mode kernel (the worker reads by inode; "
                        "a handle is the mount's own process's)")
    if n and not session.supported():
        raise UserError(f"--workers {n} needs the pyfuse3 that deploy/build-pyfuse3.sh builds")
    if n and not session.read_loop_built():
        raise UserError(f"--workers {n} needs the native read loop (spokefs.fuse.read_loop), "
                        "which this install lacks: deploy/setup.sh builds it (it needs "
                        "Debian's liblmdb-dev and libxxhash-dev)")
    return n


def _open_mode(asked: str) -> str:
    from spokefs.fuse.kernel import (
        reads_by_inode,  # the FUSE layer (pyfuse3): only mounting needs it
    )

    supported = reads_by_inode()
    if asked == "kernel" and not supported:
        raise UserError("--open-mode kernel needs the pyfuse3 that deploy/build-pyfuse3.sh "
                        "builds (this one cannot tell which file a read is for)")
    if asked == "auto":
        return "kernel" if supported else "handle"
    return asked


def _setup_logging(level: str, log_file: Path | None) -> None:
    handler: logging.Handler
    try:
        handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    except OSError as exc:
        raise UserError(f"cannot open the log file {log_file}: {exc.strerror}") from None
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "hpack"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stack dump on demand


def _warn_plain_token(cfg: SpokeConfig) -> None:
    for url in cfg.hub_urls:
        parts = urlsplit(url)
        if cfg.token is not None and parts.scheme != "https" and parts.hostname not in _LOOPBACK:
            log.warning("the token goes to %s over plain HTTP: anyone on the path can read "
                        "it; serve hubd with --tls-cert/--tls-key and use https://", url)


# The mount's cyclic garbage collector: a young collection after this many new container
# objects, not CPython's 700. A cold read's objects (tasks, frames, answers) live across a
# few awaits, so at 700 most of them were examined and promoted before they died: 0.13 s of
# the event loop per 0.8 GB of cold small files (198 young, 18 middle collections, timed
# with gc.callbacks), 0.04 s at 10,000. Cycles are rare here; they wait a little longer.
_GC_YOUNG = 10_000


def _mount(cfg: SpokeConfig, ready_fd: int | None) -> int:
    from spokefs.fuse.mount import run_mount  # pyfuse3 loads only for mount

    gc.set_threshold(_GC_YOUNG, *gc.get_threshold()[1:])

    def on_ready(info: NamespaceInfo) -> None:
        gc.freeze()  # what the start made stays: no full collection walks it again
        print(
            f"spokefs: mounted {cfg.hub_source} at {cfg.mountpoint} "
            f"({info.entries} entries, generation {info.generation})",
            flush=True,
        )
        sdnotify.notify("READY=1")
        if ready_fd is not None:
            os.write(ready_fd, b"1")
            os.close(ready_fd)
            _detach_stdio()

    trio.run(run_mount, cfg, on_ready)
    return 0


def _log_file(args: argparse.Namespace, cfg: SpokeConfig) -> Path | None:
    """``--log-file``; with ``--daemon`` and none given, ``CACHE_DIR/spokefs.log``: a daemon
    has no stderr, and its log must survive it."""
    if args.log_file is not None:
        return args.log_file
    return cfg.cache_dir / cachedir.LOG_NAME if cfg.daemon else None


def _run_mount(args: argparse.Namespace) -> int:
    """Check the arguments, detach if asked, claim the cache dir, log, and mount."""
    cfg = _config(args)
    ready_fd = _daemonize() if cfg.daemon else None
    cachedir.prepare(cfg.cache_dir)  # umask 0077, the dir 0700 and its files 0600
    lock = CacheLock(cfg.cache_dir)
    lock.acquire(cfg.mountpoint)  # held until this process exits
    try:
        _setup_logging(cfg.log_level, _log_file(args, cfg))
        _warn_exposed_token(args.token_file)
        _warn_plain_token(cfg)
        return _mount(cfg, ready_fd)
    finally:
        lock.release()


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


def _warm(args: argparse.Namespace) -> int:
    sources = [bool(args.paths), args.trace is not None, args.files_from is not None]
    if sum(sources) != 1:
        raise UserError("warm takes PATHS, --trace FILE or --files-from FILE (one of them)")
    if args.null and args.files_from is None:
        raise UserError("-0 goes with --files-from")
    if args.ordered and args.files_from is None:
        raise UserError("--ordered goes with --files-from")
    if args.trace is not None:
        return job_commands.warm_trace(args.trace, args.mount or Path("."))
    if args.files_from is not None:
        return job_commands.warm_list(args.files_from, args.null, args.mount,
                                      ordered=args.ordered)
    if args.jobs < 1:
        raise UserError("--jobs must be at least 1")
    return commands.warm(args.paths, args.jobs)


def _trace(args: argparse.Namespace) -> int:
    if args.trace_command == "save":
        return job_commands.trace_save(args.name, args.mount)
    if args.trace_command == "show":
        return job_commands.trace_show(args.file, args.mount)
    return job_commands.trace_clear(args.mount)


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
            return _warm(args)
        if args.command == "trace":
            return _trace(args)
        if args.command in ("pin", "unpin"):
            return job_commands.pin(args.paths, unpin=args.command == "unpin")
        return _run_mount(args)
    except UserError as exc:
        print(f"spokefs: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
