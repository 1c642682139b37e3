"""Shared test setup: import path, faulthandler, the ``fuse`` marker, process fixtures.

Skips: a test that needs what the machine lacks skips with the reason, except under
``CI=true``, where every skip is a failure (``tests/helpers/ci_strict.py``): CI must not go
green with the real-FUSE, Prometheus or DataLoader tests unrun.

Fixtures for the end-to-end tests (all in ``tests/integration``):

- ``free_port``: a port nothing listens on.
- ``source_tree`` (session): the awkward tree of ``tests.helpers.treegen`` (built once).
- ``hub_factory`` / ``hub``: a real ``python -m hubd serve`` child; always stopped.
- ``mount_factory`` / ``mounted``: a real foreground ``python -m spokefs mount`` child;
  always unmounted, and a clean unmount must end with exit code 0.
- ``make_mountpoint``: an empty directory any user can reach (for the other-user test:
  pytest's own tmp dirs are 0700).

Daemons run as subprocesses so a crash cannot take pytest down; see tests/helpers/procs.py.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
try:
    import spokefs  # noqa: F401
except ImportError:
    sys.path.insert(0, _REPO_ROOT)
if _REPO_ROOT not in sys.path:  # for ``tests.helpers``; appended so it shadows nothing
    sys.path.append(_REPO_ROOT)

from tests.helpers import procs, treegen  # noqa: E402
from tests.helpers.ci_strict import (  # noqa: E402, F401 - hooks, found by name
    pytest_make_collect_report,
    pytest_runtest_makereport,
)
from tests.helpers.procs import HubProcess, SpokeMount  # noqa: E402

faulthandler.enable()

# A test stuck on a hung FUSE request would hang the run silently; dump every thread's stack
# after this long so the log shows where (the test is not killed: that is pytest's job).
HANG_DUMP_S = 240

with contextlib.suppress(ImportError):
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", max_examples=200, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("dev", max_examples=30, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# -- the fuse marker --------------------------------------------------------------------------


def fuse_skip_reason() -> str | None:
    """Why real-FUSE tests cannot run here, or None when they can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (Debian package fuse3)"
    if os.geteuid() != 0:
        return "real-FUSE tests need root (allow_other, setpriv, other users)"
    try:
        import pyfuse3  # noqa: F401
    except ImportError as exc:
        return f"pyfuse3 is not importable: {exc}"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fuse: needs /dev/fuse, fusermount3 and root")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = fuse_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "fuse" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _hang_watchdog() -> Iterator[None]:
    faulthandler.dump_traceback_later(HANG_DUMP_S, exit=False)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _no_sigchld_handler_outlives_its_test() -> Iterator[None]:
    """A DataLoader with workers installs a Python SIGCHLD handler in pytest's process (torch's
    ``_set_SIGCHLD_handler``), and it stays for every later test. With a Python handler,
    every child's exit makes CPython's C handler write to the signal wakeup fd; when that
    happens while trio closes its wakeup socketpair at the end of an async test (it closes
    the reading end first), the write fails with EPIPE and pytest fails that test with an
    unraisable "Exception ignored when trying to write to the signal wakeup fd".
    So the handler goes with the test that made it; torch installs it again when needed."""
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGCHLD) not in (signal.SIG_DFL, None):
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            torch_signals = sys.modules.get("torch.utils.data._utils.signal_handling")
            if torch_signals is not None:
                torch_signals._SIGCHLD_handler_set = False  # type: ignore[attr-defined]


# -- plain fixtures ---------------------------------------------------------------------------


@pytest.fixture
def free_port() -> int:
    return procs.free_port()


@pytest.fixture(scope="session")
def source_tree(tmp_path_factory: pytest.TempPathFactory) -> treegen.Tree:
    """The awkward tree (10,000-entry dir, sparse 4 GiB file, odd names, links), built once."""
    return treegen.build_tree(tmp_path_factory.mktemp("tree"))


@pytest.fixture(scope="session")
def _mount_base() -> Iterator[Path]:
    """A 0755 directory under /tmp for mountpoints (pytest's tmp dirs are 0700, which would
    hide the mount from other users). Only empty directories are removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="spokefs-it-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        for child in base.iterdir():
            if procs.is_mounted(child):  # a fixture should have unmounted it; be safe anyway
                procs.fusermount_unmount(child)
            with contextlib.suppress(OSError):
                child.rmdir()
        with contextlib.suppress(OSError):
            base.rmdir()


@pytest.fixture(scope="session")
def make_mountpoint(_mount_base: Path) -> Callable[[str], Path]:
    counter = itertools.count()

    def make(name: str = "mnt") -> Path:
        mnt = _mount_base / f"{name}-{next(counter)}"
        mnt.mkdir(mode=0o755)
        return mnt

    return make


# -- hubd -------------------------------------------------------------------------------------


@contextlib.contextmanager
def running_hub(root: Path | str | bytes, log_dir: Path, port: int = 0,
                args: tuple[str, ...] = ()) -> Iterator[HubProcess]:
    """A started hub that is always stopped; a stop must exit 0 (SIGTERM is a clean exit)."""
    hub = HubProcess(os.fsdecode(root), log_dir, port=port, args=args)
    try:
        yield hub.start()
    finally:
        hub.stop()
    bad = [rc for rc in hub.returncodes if rc != 0]
    assert not bad, f"hubd exited with {bad} on SIGTERM (want 0)\nstderr:\n{hub.stderr()}"


class HubFactory:
    """``hub_factory(root=None, port=0, args=())`` starts one more hub; all stop at teardown."""

    def __init__(self, stack: contextlib.ExitStack, tmp: Path, default_root: bytes):
        self._stack = stack
        self._tmp = tmp
        self._root = default_root
        self._n = itertools.count()

    def __call__(self, root: Path | str | bytes | None = None, port: int = 0,
                 args: tuple[str, ...] = ()) -> HubProcess:
        log_dir = self._tmp / f"hub{next(self._n)}"
        return self._stack.enter_context(
            running_hub(self._root if root is None else root, log_dir, port, args))


@pytest.fixture
def hub_factory(tmp_path: Path, source_tree: treegen.Tree) -> Iterator[HubFactory]:
    with contextlib.ExitStack() as stack:
        yield HubFactory(stack, tmp_path, source_tree.root)


@pytest.fixture
def hub(hub_factory: HubFactory) -> HubProcess:
    """A hub exporting ``source_tree``."""
    return hub_factory()


# -- spokefs ----------------------------------------------------------------------------------


@contextlib.contextmanager
def mounted_spoke(url: str, mnt: Path, cache_dir: Path, log_dir: Path,
                  args: tuple[str, ...] = ()) -> Iterator[SpokeMount]:
    """A mounted spoke that is always unmounted; then it must have exited 0 cleanly."""
    spoke = SpokeMount(url, mnt, cache_dir, log_dir, args)
    try:
        yield spoke.start()
    finally:
        spoke.unmount()
    spoke.assert_clean_exit()


class MountFactory:
    """``mount_factory(url, *args, cache_dir=None)`` mounts once more; all unmount at teardown."""

    def __init__(self, stack: contextlib.ExitStack, tmp: Path,
                 make_mountpoint: Callable[[str], Path]):
        self._stack = stack
        self._tmp = tmp
        self._make_mountpoint = make_mountpoint
        self._n = itertools.count()

    def __call__(self, url: str, *args: str, cache_dir: Path | None = None) -> SpokeMount:
        n = next(self._n)
        mnt = self._make_mountpoint("mnt")
        cache = cache_dir if cache_dir is not None else self._tmp / f"cache{n}"
        return self._stack.enter_context(
            mounted_spoke(url, mnt, cache, self._tmp / f"spoke{n}", args))


@pytest.fixture
def mount_factory(tmp_path: Path, make_mountpoint: Callable[[str], Path]) -> Iterator[MountFactory]:
    with contextlib.ExitStack() as stack:
        yield MountFactory(stack, tmp_path, make_mountpoint)


@pytest.fixture
def mounted(mount_factory: MountFactory, hub: HubProcess) -> Path:
    """``source_tree`` served by ``hub`` and mounted; yields the mountpoint."""
    return mount_factory(hub.url).mnt


@pytest.fixture(scope="module")
def shared_mount(tmp_path_factory: pytest.TempPathFactory, source_tree: treegen.Tree,
                 make_mountpoint: Callable[[str], Path]) -> Iterator[SpokeMount]:
    """One hub + mount of ``source_tree`` for a whole module of read-only checks."""
    if (reason := fuse_skip_reason()) is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("shared")
    with running_hub(source_tree.root, tmp / "hub") as hub_proc, \
            mounted_spoke(hub_proc.url, make_mountpoint("shared"), tmp / "cache",
                          tmp / "spoke") as spoke:
        yield spoke
