"""Rescans of a real hubd child (SIGHUP, timer) and GET /v1/changes; the Rescanner alone."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hubd.export_root import Rescan, ScanCancelled
from hubd.metrics import HubMetrics
from hubd.rescanner import Rescanner
from spokefs import protocol
from tests.hubd.hubd_testlib import (
    Answer,
    Hub,
    Tree,
    decode_snapshot,
    paths_of,
    unframed,
)
from tests.hubd.test_hubd_changes import apply, decode_changes, keyed, mutate

StartHub = Callable[..., Hub]
WAIT_S = 15.0


def snapshot(hub: Hub, headers: dict[str, str] | None = None
             ) -> tuple[protocol.SnapshotHeader, list[protocol.Entry]]:
    answer = hub.request(protocol.SNAPSHOT_PATH, headers)
    assert answer.status == 200, answer
    header, entries = decode_snapshot(answer.body)
    assert answer.header(protocol.HEADER_GENERATION) == str(header.generation)
    return header, entries


def wait_for_generation_after(hub: Hub, generation: int) -> tuple[protocol.SnapshotHeader,
                                                                 list[protocol.Entry]]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        header, entries = snapshot(hub)
        if header.generation != generation:
            return header, entries
        time.sleep(0.05)
    raise AssertionError(f"no new generation after {generation}:\n{hub.stderr()}")


def wait_for_log(hub: Hub, needle: str, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while hub.stderr().count(needle) < count:
        assert time.monotonic() < deadline, hub.stderr()
        time.sleep(0.05)


def changes(hub: Hub, since: object, headers: dict[str, str] | None = None) -> Answer:
    return hub.request(f"{protocol.CHANGES_PATH}?since={since}", headers)


def assert_error(answer: Answer, status: int, reason: str) -> None:
    assert answer.status == status, answer
    assert answer.header(protocol.HEADER_ERROR) == reason
    assert json.loads(answer.body)["error"] == reason


def test_sighup_rescans_and_changes_replay(tree: Tree, start_hub: StartHub) -> None:
    hub = start_hub(tree.root, "--rescan-interval", "0")
    first, old_entries = snapshot(hub)
    mutate(tree.root)
    hub.proc.send_signal(signal.SIGHUP)
    second, new_entries = wait_for_generation_after(hub, first.generation)
    assert second.generation > first.generation
    answer = changes(hub, first.generation)
    assert answer.status == 200
    assert answer.header("Content-Type") == protocol.CHANGES_MEDIA_TYPE
    assert answer.header(protocol.HEADER_GENERATION) == str(second.generation)
    assert answer.header("Cache-Control") == "no-cache"
    header, records = decode_changes(answer.body)
    assert (header.from_generation, header.to_generation) == (first.generation,
                                                              second.generation)
    assert apply(keyed(old_entries), first.root_id, records) == keyed(new_entries)
    new = paths_of(new_entries)[b"new.txt"]  # the new generation's files are served
    assert unframed(hub.request(protocol.blob_path(new.file_id, new.version)).body) == b"new"
    hub.proc.send_signal(signal.SIGHUP)  # nothing changed: the generation stays
    wait_for_log(hub, "unchanged", 1)
    assert snapshot(hub)[0].generation == second.generation
    assert hub.proc.poll() is None  # SIGHUP never stops hubd
    text = hub.request(protocol.METRICS_PATH).body.decode()
    assert 'hubd_rescans_total{result="changed"} 2.0' in text  # the first scan counts
    assert 'hubd_rescans_total{result="unchanged"} 1.0' in text
    [gauge] = [line for line in text.splitlines() if line.startswith("hubd_snapshot_generation ")]
    # a float64 gauge: exact to 2**8 at generations near 2**61 (export_root.generation_of)
    assert float(gauge.split()[1]) == float(second.generation)
    assert "Traceback" not in hub.stderr()


def test_timer_rescans(tree: Tree, start_hub: StartHub) -> None:
    hub = start_hub(tree.root, "--rescan-interval", "0.2")
    first, _ = snapshot(hub)
    (tree.root / "late.txt").write_bytes(b"late")
    _, entries = wait_for_generation_after(hub, first.generation)
    assert b"late.txt" in paths_of(entries)
    wait_for_log(hub, "unchanged", 2)  # the timer goes on


def test_changes_answers(tree: Tree, start_hub: StartHub, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("tok")
    good = {"Authorization": "Bearer tok"}
    hub = start_hub(tree.root, "--rescan-interval", "0", "--token-file", str(token))
    assert_error(changes(hub, 1), 401, "unauthorized")
    current = snapshot(hub, good)[0].generation
    answer = changes(hub, current, good)
    assert answer.status == 200 and answer.header(protocol.HEADER_GENERATION) == str(current)
    assert decode_changes(answer.body)[1] == []
    assert_error(changes(hub, current - 1, good), 410, "generation-gone")
    assert_error(changes(hub, 0, good), 410, "generation-gone")
    assert_error(changes(hub, current + 1, good), 400, "bad-generation")
    for bad in ("", "abc", "-1", "1e3", "+1", "%201", "0x10", "1.0", str(2**64), "9" * 30,
                "%D9%A1%D9%A2"):  # the last: Arabic-Indic digits, which str.isdigit accepts
        assert_error(changes(hub, bad, good), 400, "bad-generation")
    assert_error(hub.request(protocol.CHANGES_PATH, good), 400, "bad-generation")
    assert_error(hub.request(f"{protocol.CHANGES_PATH}?since=1&since=1", good), 400,
                 "bad-generation")


# -- the Rescanner alone -----------------------------------------------------------------


class FakeExport:
    """Records rescans; each blocks until released (or cancelled)."""

    root = "fake"

    def __init__(self) -> None:
        self.calls = 0
        self.running = 0
        self.max_running = 0
        self.started = threading.Semaphore(0)
        self.release = threading.Event()
        self.last_rescan: Rescan | None = None

    def rescan(self, cancel: threading.Event) -> object:
        self.calls += 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self.started.release()
        try:
            while not self.release.wait(0.01):
                if cancel.is_set():
                    raise ScanCancelled
            self.release.clear()
            self.last_rescan = Rescan(self.calls, 1, True, 1, 0, 0, 0.0)
            return _Snap(self.calls)
        finally:
            self.running -= 1


class _Snap:
    def __init__(self, generation: int) -> None:
        self.generation, self.count, self.encoded = generation, 1, b""


async def _started(export: FakeExport) -> None:
    assert await asyncio.to_thread(export.started.acquire, True, WAIT_S)


def test_requests_during_a_scan_coalesce_into_one_more() -> None:
    export = FakeExport()

    async def main() -> None:
        rescanner = Rescanner(export, HubMetrics(), 0)  # type: ignore[arg-type]
        task = asyncio.create_task(rescanner.run())
        rescanner.request()
        await _started(export)
        for _ in range(5):
            rescanner.request()
        export.release.set()
        await _started(export)  # exactly one more scan
        export.release.set()
        await asyncio.sleep(0.2)
        assert (export.calls, export.max_running) == (2, 1)
        rescanner.request()
        await _started(export)
        task.cancel()  # mid-scan: the scan is cancelled and its thread joined
        with pytest.raises(asyncio.CancelledError):
            await task
        assert export.running == 0 and export.calls == 3

    asyncio.run(main())


def test_a_failed_rescan_is_logged_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    export = FakeExport()
    failures = [OSError(5, "Input/output error"), RuntimeError("bug")]
    real = export.rescan

    def flaky(cancel: threading.Event) -> object:
        if failures:
            raise failures.pop(0)
        return real(cancel)

    export.rescan = flaky  # type: ignore[method-assign]
    metrics = HubMetrics()

    async def main() -> None:
        task = asyncio.create_task(Rescanner(export, metrics, 0.01).run())  # type: ignore[arg-type]
        await _started(export)
        export.release.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    text = metrics.render().decode()
    assert 'hubd_rescans_total{result="failed"} 2.0' in text
    messages = [r.getMessage() for r in caplog.records]
    assert any("Input/output error" in m for m in messages)
    assert any(r.exc_info for r in caplog.records)
