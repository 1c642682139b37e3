"""``spokefs trace save|show|clear``, ``warm --trace|--files-from`` and ``pin``/``unpin``:
clients of a running mount's job attributes (``jobs.control``). Plain blocking calls, like
``commands``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from spokefs.cli.commands import human_bytes, read_attribute, regular_files
from spokefs.errors import UserError
from spokefs.jobs import trace_file
from spokefs.jobs.trace_file import Entry
from spokefs.mounttab import find_mount

_P = "user.spokefs."
_STATUS = _P + "status"
_POLL_S = 0.5
_CLI_JOB = "spokefs warm"  # the job an ordered list from the command line is announced as
_NAME_ROOM = 255 - len(_P + "trace.check:")  # XATTR_NAME_MAX


def mount_root(path: Path) -> Path:
    """The spokefs mount point at or above ``path``.

    Raises:
        UserError: ``path`` is not on a spokefs mount.
    """
    p = Path(os.path.abspath(path))
    for candidate in (p, *p.parents):
        entry = find_mount(candidate)
        if entry is not None:
            if entry.fstype != "fuse.spokefs":
                break
            return candidate
    raise UserError(f"{path} is not on a spokefs mount (give --mount)")


def _call(path: Path, name: str) -> str:
    """An attribute of the mount, with the job attributes' errors spelled out."""
    try:
        return os.getxattr(path, _P + name).decode()
    except OSError as exc:
        if exc.errno == errno.EACCES:
            raise UserError(f"the mount may not read that file for you ({name})") from None
        if exc.errno == errno.EINVAL:
            raise UserError(f"the mount refused {name.split(':')[0]}: a bad trace or "
                            "request; see the mount's log") from None
    return read_attribute(path, _P + name)  # the generic messages


# -- traces -----------------------------------------------------------------------------


def trace_save(dest: Path, mount: Path) -> int:
    root = mount_root(mount)
    try:
        info = json.loads(os.getxattr(root, _P + "trace.save"))
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # the one refusal of trace.save
            raise UserError(f"{root} records no trace (mounted with --no-trace)") from None
        info = json.loads(_call(root, "trace.save"))  # the generic messages
    data = bytearray()
    for n in range(-(-int(info["size"]) // int(info["page"]))):
        data += os.getxattr(root, f"{_P}trace.page.{n}")
    if len(data) != info["size"]:
        raise UserError("the saved trace changed while it was read (another `trace save`?); "
                        "run it again")
    try:
        dest.write_bytes(bytes(data))
    except OSError as exc:
        raise UserError(f"cannot write {dest}: {exc.strerror}") from None
    gone = f"; {info['gone']} files read are gone from the hub" if info["gone"] else ""
    print(f"spokefs: saved trace {dest}: {info['files']} files, {human_bytes(info['bytes'])} "
          f"in {info['directories']} directories{gone}")
    return 0


def trace_show(path: Path, mount: Path | None) -> int:
    head, entries = trace_file.read(path)
    s = trace_file.summary(entries)
    print(f"trace:       {path} (hub {head.get('hub', '?')}, generation "
          f"{head.get('generation', '?')})")
    print(f"files:       {s['files']} ({s['ranged_files']} read in ranges)")
    print(f"bytes:       {human_bytes(s['bytes'])} (the working set)")
    print(f"directories: {s['directories']}")
    try:
        root = mount_root(mount if mount is not None else Path.cwd())
    except UserError:
        if mount is not None:
            raise
        print("cached now:  unknown (not on a spokefs mount; give --mount)")
        return 0
    with _short_copy(path) as short:
        c = json.loads(_call(root, f"trace.check:{short}"))
    share = f"{c['cached_bytes'] / c['current_bytes']:.1%}" if c["current_bytes"] else "-"
    print(f"cached now:  {human_bytes(c['cached_bytes'])} of {human_bytes(c['current_bytes'])} "
          f"({share}) on {root}")
    print(f"mismatches:  {c['changed']} changed on the hub, {c['missing']} gone")
    return 0


def trace_clear(mount: Path) -> int:
    _call(mount_root(mount), "trace.clear")
    print("spokefs: trace cleared; a new one starts now")
    return 0


# -- replay -----------------------------------------------------------------------------


def warm_trace(path: Path, mount: Path) -> int:
    trace_file.read(path)  # a bad file fails here, with the reason
    return _replay(path, mount_root(mount))


def warm_list(source: str, nul: bool, mount: Path | None, *, ordered: bool = False) -> int:
    """``warm --files-from``: the listed files and trees as a trace, replayed (in the list's
    order); ``ordered``: announced as the order a job will read them in (fetched at most a
    horizon ahead of its reads, ``jobs.orders``), without waiting."""
    raw = sys.stdin.buffer.read() if source == "-" else _read_list(Path(source))
    names = [n for n in raw.split(b"\0" if nul else b"\n") if n.strip(b"\n")]
    if not names:
        raise UserError(f"--files-from {source}: no paths in it")
    paths = [Path(os.fsdecode(n)) for n in names]
    root = mount_root(mount if mount is not None else paths[0])
    entries = list(_list_entries(root, paths))
    with tempfile.NamedTemporaryFile(prefix="spokefs-list-", suffix=".trace") as tmp:
        # one job for the command line: a new ordered list replaces the last one
        tmp.write(trace_file.dumps(entries, source=source, job=_CLI_JOB))
        tmp.flush()
        if not ordered:
            return _replay(Path(tmp.name), root)
        with _short_copy(Path(tmp.name)) as short:
            order_id = int(_call(root, f"order:{short}"))
    print(f"spokefs: order {order_id} of {len(entries)} files sent to {root}; it is fetched "
          "in that order ahead of the reads (progress: getfattr -n user.spokefs.order)")
    return 0


def _read_list(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read --files-from {path}: {exc.strerror}") from None


def _list_entries(root: Path, paths: list[Path]) -> Iterator[Entry]:
    for p, size in regular_files(paths):
        try:
            rel = Path(os.path.abspath(p)).relative_to(root)
        except ValueError:
            raise UserError(f"{p} is not on the mount {root}") from None
        yield Entry(rel.as_posix(), 0, size, None)


def _replay(path: Path, root: Path) -> int:
    with _short_copy(path) as short:
        rid = int(_call(root, f"replay:{short}"))
        progress = _Bar()
        try:
            while True:
                p = json.loads(_call(root, "replay"))
                if p["id"] != rid:
                    progress.end()
                    raise UserError("another replay replaced this one")
                progress.draw(p)
                if p["state"] not in ("resolving", "running"):
                    break
                time.sleep(_POLL_S)
        except KeyboardInterrupt:
            _call(root, "replay.stop")
            progress.end()
            print("spokefs: replay stopped; run it again to go on", file=sys.stderr)
            return 130
    progress.end()
    if p["state"] != "done":
        raise UserError(f"replay {p['state']}; see the mount's log")
    cached = p["done_bytes"] - p["fetched_bytes"] - p["failed_bytes"]
    print(f"spokefs: replayed {p['entries'] - p['missing']} files, "
          f"{human_bytes(p['total_bytes'])} ({human_bytes(p['fetched_bytes'])} fetched, "
          f"{human_bytes(max(0, cached))} cached already) in {p['seconds']:.1f}s")
    if p["changed"] or p["missing"]:
        print(f"spokefs: {p['changed']} entries changed on the hub (their current version was "
              f"fetched), {p['missing']} no longer on it")
    if p["over_budget_bytes"]:
        print(f"spokefs: {human_bytes(p['over_budget_bytes'])} left out: more than the cache holds")
    if p["failed_bytes"]:
        raise UserError(f"{human_bytes(p['failed_bytes'])} could not be fetched; run it again")
    return 0


@contextlib.contextmanager
def _short_copy(path: Path) -> Iterator[str]:
    """The trace's absolute path, or a copy at a short temporary path when the attribute
    name would be too long for it."""
    full = Path(os.path.abspath(path))
    if len(os.fsencode(full)) <= _NAME_ROOM:
        yield str(full)
        return
    with tempfile.NamedTemporaryFile(prefix="spokefs-", suffix=".trace") as tmp:
        tmp.write(full.read_bytes())
        tmp.flush()
        yield tmp.name


class _Bar:
    """The replay's progress on stderr: bytes, rate, ETA."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._first: int | None = None
        self._drawn = False

    def draw(self, p: dict[str, object]) -> None:
        done, total = int(p["done_bytes"]), int(p["total_bytes"])  # type: ignore[call-overload]
        if p["state"] == "resolving":
            return
        if self._first is None:
            self._first, self._start = done, time.monotonic()
        elapsed = max(time.monotonic() - self._start, 1e-6)
        rate = (done - self._first) / elapsed
        left = total - done
        eta = f"{left / rate:.0f}s" if rate > 0 and left > 0 else "-"
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        print(f"\r[{bar:<30}] {frac:6.1%} {human_bytes(done)}/{human_bytes(total)} "
              f"{human_bytes(rate)}/s ETA {eta}   ", end="", file=sys.stderr, flush=True)
        self._drawn = True

    def end(self) -> None:
        if self._drawn:
            print(file=sys.stderr)
            self._drawn = False


# -- pins -------------------------------------------------------------------------------


def pin(paths: list[Path], unpin: bool) -> int:
    files = list(regular_files(paths))
    total = 0
    name = _P + ("unpin" if unpin else "pin")
    for p, size in files:
        try:
            total += int(os.getxattr(p, name))
        except OSError as exc:
            if exc.errno == errno.ENOSPC and not unpin:
                st = json.loads(read_attribute(p, _P + "status"))
                raise UserError(
                    f"pinning {p} ({human_bytes(size)}) would exceed the pin limit: "
                    f"{human_bytes(st['pinned_bytes'])} of {human_bytes(st['pinned_limit_bytes'])} "
                    "pinned (--max-pinned-share of the cache); unpin something first"
                ) from None
            total += int(read_attribute(p, name))  # again: the generic messages if it fails again
    st = json.loads(read_attribute(files[0][0], _STATUS)) if files else None
    verb = "unpinned" if unpin else "pinned"
    now = (f"; {human_bytes(st['pinned_bytes'])} of "
           f"{human_bytes(st['pinned_limit_bytes'])} pinned now" if st else "")
    print(f"spokefs: {verb} {len(files)} files, {human_bytes(total)}{now}")
    return 0
