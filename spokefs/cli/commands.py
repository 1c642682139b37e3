"""``spokefs status``, ``refresh`` and ``warm``: clients of a running mount's control
attributes (see ``control``). Plain threads and blocking calls: no trio, no pyfuse3.
``read_attribute``, ``human_bytes`` and ``regular_files`` serve ``job_commands`` too.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from spokefs.errors import UserError

_CACHED = "user.spokefs.cached"
_STATUS = "user.spokefs.status"
_REFRESH = "user.spokefs.refresh"
_WARM = "user.spokefs.warm"


def read_attribute(path: Path, name: str) -> str:
    """A control attribute of ``path`` on a mount, as text.

    Raises:
        UserError: no such path, not on a spokefs mount, or the mount's answer is an error.
    """
    try:
        return os.getxattr(path, name).decode()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file or directory") from None
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            raise UserError(f"{path} is not on a spokefs mount") from None
        # the mount answered, but the operation failed (hub unreachable, version gone)
        raise UserError(f"{name} on {path} failed: {exc.strerror}; see the mount's log") from None


def human_bytes(n: float) -> str:
    """``n`` bytes for a person: ``512 B``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def status(path: Path) -> int:
    info = json.loads(read_attribute(path, _STATUS))
    cached, total = (int(x) for x in read_attribute(path, _CACHED).split())
    ratio = info["hit_ratio"]
    print(f"namespace:  generation {info['generation']}, {info['entries']} entries, "
          f"{human_bytes(info['namespace_bytes'])}")
    print(f"cache:      {human_bytes(info['cache_bytes'])} of "
          f"{human_bytes(info['cache_capacity_bytes'])}")
    if "pinned_limit_bytes" in info:
        print(f"pinned:     {human_bytes(info['pinned_bytes'])} of at most "
              f"{human_bytes(info['pinned_limit_bytes'])}")
        records = info["trace_records"]
        print(f"trace:      {'off' if records is None else f'{records} records'}")
        r = info["replay"]
        if r["state"] != "idle":
            share = f"{r['done_bytes'] / r['total_bytes']:.1%}" if r["total_bytes"] else "-"
            print(f"replay:     {r['name']}: {r['state']}, {human_bytes(r['done_bytes'])} of "
                  f"{human_bytes(r['total_bytes'])} ({share})")
    print(f"hit ratio:  {'-' if ratio is None else f'{ratio:.1%}'} "
          f"({info['block_hits']} block hits, {info['block_misses']} misses since mount)")
    share = f"{cached / total:.1%}" if total else "-"
    print(f"{path}: {human_bytes(cached)} of {human_bytes(total)} cached ({share})")
    return 0


def refresh(path: Path) -> int:
    print(f"spokefs: namespace at generation {read_attribute(path, _REFRESH)}")
    return 0


def regular_files(paths: list[Path]) -> Iterator[tuple[Path, int]]:
    """(path, size) of each regular file named or below a directory named (no symlinks).

    Raises:
        UserError: a path does not exist.
    """
    for root in paths:
        if not root.exists():
            raise UserError(f"{root}: no such file or directory")
        if root.is_file():
            yield root, root.stat().st_size
            continue
        for dirpath, _, names in os.walk(root):
            for name in names:
                p = Path(dirpath, name)
                if p.is_file() and not p.is_symlink():
                    yield p, p.stat().st_size


def warm(paths: list[Path], jobs: int) -> int:
    """Fill the cache with these files or trees; resumable (cached blocks are skipped)."""
    files = list(regular_files(paths))
    total = sum(size for _, size in files)
    todo = []
    done = 0
    for p, size in files:
        cached = int(read_attribute(p, _CACHED).split()[0])
        done += cached
        if cached < size:
            todo.append((p, size))
    progress = _Progress(total, done)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(read_attribute, p, _WARM): size for p, size in todo}
        ticker = threading.Thread(target=progress.run, daemon=True)
        ticker.start()
        for future in as_completed(futures):
            future.result()
            progress.add(futures[future])
        progress.stop()
        ticker.join()
    print(f"spokefs: warmed {len(files)} files, {human_bytes(total)} "
          f"({len(files) - len(todo)} were cached already)")
    return 0


class _Progress:
    """A one-line progress bar on stderr: bytes, rate and ETA."""

    def __init__(self, total: int, done: int) -> None:
        self.total, self.done = total, done
        self._start_done, self._start = done, time.monotonic()
        self._stop = threading.Event()

    def add(self, n: int) -> None:
        self.done += n

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.wait(0.5):
            self.draw()
        self.draw()
        print(file=sys.stderr)

    def draw(self) -> None:
        elapsed = max(time.monotonic() - self._start, 1e-6)
        rate = (self.done - self._start_done) / elapsed
        left = self.total - self.done
        eta = f"{left / rate:.0f}s" if rate > 0 and left > 0 else "-"
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * 30)
        print(f"\r[{bar:<30}] {frac:6.1%} {human_bytes(self.done)}/{human_bytes(self.total)} "
              f"{human_bytes(rate)}/s ETA {eta}   ", end="", file=sys.stderr, flush=True)
