"""The cache directory's safety rules: private modes, and one mount per directory.

- **Modes.** Cached blocks are copies of the export's bytes, whatever the export's own
  modes, so the cache must be readable by root only: the directory is 0700 and every file
  in it 0600. ``prepare`` sets the process umask to 0077 (so LMDB, which creates its files
  with mode 0755 & ~umask, the log file and anything else a mount creates start private),
  creates or tightens the directory, and ``harden`` chmods what is already there (a cache
  dir made by an older version, or files that LMDB created with the execute bits).
- **One mount per cache dir.** Two mounts sharing one directory would overwrite each
  other's namespace. ``CacheLock`` takes an exclusive ``flock`` on ``<cache_dir>/spokefs.lock``
  for the life of the mount (the kernel drops it when the process dies, so a ``kill -9``
  leaves no stale lock) and writes the holder's pid and mountpoint into it for the refusal
  message.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from pathlib import Path

from spokefs.errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = "spokefs.lock"
LOG_NAME = "spokefs.log"
DIR_MODE = 0o700
FILE_MODE = 0o600
UMASK = 0o077


def prepare(cache_dir: Path) -> None:
    """Set the umask to 0077, create ``cache_dir`` 0700 (or tighten it) and its contents.

    Raises:
        UserError: the directory cannot be created or is not a directory.
    """
    os.umask(UMASK)
    try:
        cache_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"--cache-dir {cache_dir} is not a directory") from None
    except OSError as exc:
        raise UserError(f"cannot create --cache-dir {cache_dir}: {exc.strerror}") from None
    if not cache_dir.is_dir():
        raise UserError(f"--cache-dir {cache_dir} is not a directory")
    harden(cache_dir)


def harden(cache_dir: Path) -> None:
    """chmod ``cache_dir`` and its subdirectories 0700 and every regular file 0600.

    The tree is small (two LMDB environments, the lock and the log), so this is cheap. A
    file that vanishes meanwhile is skipped; symlinks are neither followed nor changed.
    """
    _chmod(cache_dir, DIR_MODE)
    for dirpath, dirnames, filenames in os.walk(cache_dir):
        for name in dirnames:
            _chmod(Path(dirpath, name), DIR_MODE)
        for name in filenames:
            _chmod(Path(dirpath, name), FILE_MODE)


def _chmod(path: Path, mode: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode) or stat.S_IMODE(st.st_mode) == mode:
            return
        if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
            path.chmod(mode)


class CacheLock:
    """An exclusive ``flock`` on ``<cache_dir>/spokefs.lock``, held until ``release``.

    Attributes:
        path: the lock file.
    """

    def __init__(self, cache_dir: Path) -> None:
        self.path = cache_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, mountpoint: Path) -> None:
        """Take the lock or refuse with one line naming the holder.

        Raises:
            UserError: another live mount holds the lock, or the file cannot be opened.
        """
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        except OSError as exc:
            raise UserError(f"cannot open the lock file {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UserError(
                f"--cache-dir {self.path.parent} is in use by another mount{holder}: "
                "give each mount its own --cache-dir") from None
        self._fd = fd
        try:  # who holds it, for a refusal's message only: a full disk must not stop a mount
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {mountpoint}\n".encode(errors="surrogateescape"), 0)
        except OSError as exc:
            log.warning("could not note the holder in %s: %s", self.path, exc.strerror)

    def release(self) -> None:
        """Drop the lock (closing the file drops the flock); safe to call twice."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _holder(fd: int) -> str:
    """`` (pid N, at MOUNTPOINT)`` from the lock file, or nothing if it is unreadable."""
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    pid, _, mnt = text.partition(" ")
    return f" (pid {pid}, mounted at {mnt})" if pid.isdigit() and mnt else ""
