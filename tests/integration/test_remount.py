"""Remounts on a stored namespace: mounted at once whether the hub is up, slow (900 ms) or
down, then caught up with the hub in the background, and the kernel's caches of the stored
names forgotten when the catch-up changes them. Real hubd, real FUSE mounts."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.helpers.procs import SpokeMount, run_spokefs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from longlink import LongLinkProcess

pytestmark = pytest.mark.fuse

CATCH_UP_WAIT_S = 90.0  # generous: the catch-up takes a few round trips, on a loaded machine


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def names_of(root: Path) -> set[str]:
    return {str(Path(d, n).relative_to(root)) for d, ds, fs in os.walk(root) for n in ds + fs}


def view_of(root: Path) -> dict[str, tuple[int, int]]:
    """rel path -> (mode, size), through lstat (what the kernel's attribute cache holds)."""
    return {rel: (st.st_mode, st.st_size) for rel in names_of(root)
            for st in [os.lstat(root / rel)]}


@pytest.fixture
def src(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    for i in range(5):
        write(root / "data" / f"f{i}.bin", bytes([i]) * (10_000 + i))
    write(root / "keep.txt", b"kept\n")
    write(root / "gone" / "x", b"x" * 100)
    return root


def change(src: Path) -> None:
    """New, removed, grown and renamed entries, for the catch-up to bring in."""
    write(src / "data" / "new.bin", b"n" * 777)
    (src / "gone" / "x").unlink()
    (src / "gone").rmdir()
    with open(src / "data" / "f1.bin", "ab") as f:
        f.write(b"grown" * 100)
    os.rename(src / "data" / "f2.bin", src / "data" / "f2-renamed.bin")


def first_mount(hub_url: str, cache: Path, mount_factory) -> dict[str, tuple[int, int]]:
    """Mount on a fresh cache dir, read a file (cached), unmount; the stored view."""
    spoke = mount_factory(hub_url, cache_dir=cache)
    assert (spoke.mnt / "data" / "f0.bin").read_bytes() == b"\0" * 10_000
    view = view_of(spoke.mnt)
    spoke.unmount()
    spoke.assert_clean_exit()
    return view


def blackhole(link: LongLinkProcess, on: bool) -> None:
    """Switch the link's blackhole and wait until the proxy has (it handles the signal
    asynchronously; its status file, rewritten every 0.2 s, says when)."""
    link.set_blackhole(on)
    deadline = time.monotonic() + 10
    while link.statistics().get("blackhole") is not on:
        assert time.monotonic() < deadline, f"the link's blackhole is not {on} after 10 s"
        time.sleep(0.05)


def wait_for_log(spoke: SpokeMount, text: str, timeout_s: float = CATCH_UP_WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in spoke.stderr():
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{spoke.stderr()}"
        time.sleep(0.1)


def assert_stored_then_current(spoke: SpokeMount, stored: dict[str, tuple[int, int]],
                               src: Path, release: Callable[[], None]) -> None:
    """While the hub is held (the catch-up cannot have finished) the mount serves exactly
    the stored view; once ``release`` lets the hub answer, exactly the source, with no stale
    name or attribute left in the kernel's caches (the first look filled all of them)."""
    assert "mounting the stored namespace" in spoke.stderr()
    assert view_of(spoke.mnt) == stored  # also fills the kernel's entry and attr caches
    assert (spoke.mnt / "data" / "f0.bin").read_bytes() == b"\0" * 10_000  # cached
    assert "caught up with the hub" not in spoke.stderr()
    release()
    wait_for_log(spoke, "caught up with the hub")
    assert view_of(spoke.mnt) == view_of(src)
    assert (spoke.mnt / "data" / "f1.bin").read_bytes() == (src / "data" / "f1.bin").read_bytes()


def test_remount_with_the_hub_up_mounts_stored_then_catches_up(src, tmp_path, hub_factory,
                                                               mount_factory):
    hub = hub_factory(root=src, args=("--rescan-interval", "0"))
    cache = tmp_path / "cache"
    stored = first_mount(hub.url, cache, mount_factory)
    change(src)
    hub.proc.send_signal(signal.SIGHUP)  # hubd rescans: the changes are in its history
    time.sleep(1.0)
    assert hub.proc is not None
    hub.proc.send_signal(signal.SIGSTOP)  # up (connections queue) but not answering yet
    try:
        spoke = mount_factory(hub.url, "--refresh-interval", "0", cache_dir=cache)
        assert_stored_then_current(spoke, stored, src,
                                   lambda: hub.proc.send_signal(signal.SIGCONT))
    finally:
        hub.proc.send_signal(signal.SIGCONT)


def test_remount_over_a_900ms_link_browses_before_the_hub_answers(src, tmp_path, hub_factory,
                                                                  mount_factory):
    hub = hub_factory(root=src, args=("--rescan-interval", "0"))
    cache = tmp_path / "cache"
    stored = first_mount(hub.url, cache, mount_factory)
    change(src)
    hub.proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    parts = urlsplit(hub.url)
    with LongLinkProcess((parts.hostname, parts.port), delay_ms=450, rate_mbit=0) as link:
        # a catch-up costs a connection (1.5 round trips) and a request, 2.25 s at least;
        # the link carries nothing until the first look is done, so that look cannot race it
        blackhole(link, True)
        spoke = mount_factory(f"http://127.0.0.1:{link.port}", "--refresh-interval", "0",
                              cache_dir=cache)
        try:
            assert_stored_then_current(spoke, stored, src, lambda: blackhole(link, False))
        finally:
            link.set_blackhole(False)
            spoke.unmount()  # before the link goes away
        spoke.assert_clean_exit()


def test_remount_with_the_hub_down_serves_stored_then_catches_up_when_back(
        src, tmp_path, hub_factory, mount_factory):
    hub = hub_factory(root=src)
    port = urlsplit(hub.url).port
    cache = tmp_path / "cache"
    stored = first_mount(hub.url, cache, mount_factory)
    hub.stop()
    spoke = mount_factory(hub.url, "--hub-deadline", "2", "--refresh-interval", "0",
                          cache_dir=cache)
    assert view_of(spoke.mnt) == stored  # offline: the stored namespace and cached blocks
    assert (spoke.mnt / "data" / "f0.bin").read_bytes() == b"\0" * 10_000
    wait_for_log(spoke, "catch-up with the hub failed")
    change(src)
    back = hub_factory(root=src, port=port)  # a new hub: the old generation is unknown (410)
    assert back.url == hub.url
    res = run_spokefs("refresh", str(spoke.mnt))  # retries the catch-up now
    assert res.returncode == 0, res.stderr
    wait_for_log(spoke, "caught up with the hub")
    assert view_of(spoke.mnt) == view_of(src)  # the kernel forgot the stored names
    assert (spoke.mnt / "data" / "new.bin").read_bytes() == b"n" * 777
