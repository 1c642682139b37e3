"""File descriptors: hubd raises its soft limit, caps its connections below it, and runs out
of descriptors quietly (one warning a minute, not a traceback per failed accept()).

A real hubd child over real sockets. ``FLOOD_CLIENTS`` clients connect at once to a hubd
whose limit is ``LOW_LIMIT`` soft and hard (so it cannot raise it), each sends one request
and keeps its connection, while ``READERS`` clients connected before keep reading ranges.
The readers must be answered throughout (206, or 503 ``read-failed`` when an open found no
descriptor for a moment); afterwards hubd must answer ``/healthz`` and a range read, its
log must hold at most ``MAX_CONDITION_LINES`` warnings and no traceback, and ``/metrics``
must count the refusals. ``pytest -s`` prints the figures.
"""

from __future__ import annotations

import collections
import errno
import logging
import re
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable

import pytest

from hubd.accept_errors import ACCEPT_OUT_OF_RESOURCE, AcceptErrorHandler
from hubd.fd_limit import FD_RESERVE, MIN_CONNECTIONS, connection_cap
from hubd.log_rate import LogEvery
from hubd.metrics import HubMetrics
from spokefs import protocol
from tests.hubd.hubd_testlib import DATA, Hub, Tree, decode_snapshot, framed, paths_of

StartHub = Callable[..., Hub]

LOW_LIMIT = 256  # the limit of the original report (ulimit -n 256)
FLOOD_CLIENTS = 2000  # ... and its 2,000 concurrent clients
FLOOD_BUDGET_S = 30.0  # every client connects and gets an answer or a close well within this
# The goal: at most 10 log lines a minute for any repeated condition (the test runs under
# a minute, so this allows several conditions at once).
MAX_CONDITION_LINES = 10
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: hub\r\n\r\n"
READERS = 4  # spokes already connected, reading on


def _limit_nofile(soft: int, hard: int) -> Callable[[], None]:
    def limit() -> None:  # runs in the child, before hubd
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return limit


def _nofile_of(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


def _metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) in a /metrics text."""
    values = [float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)]
    assert values, f"no {name} in /metrics"
    return sum(values)


def flood(port: int, clients: int, budget_s: float) -> tuple[collections.Counter[str],
                                                             list[socket.socket]]:
    """``clients`` connections at once, each sending one GET /healthz.

    Returns the outcomes (``answered``: a 200 came back, and the connection is kept open;
    ``refused``: closed or reset without an answer; ``unfinished``: no outcome within
    ``budget_s``) and the open sockets, which the caller closes.
    """
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    outcome: collections.Counter[str] = collections.Counter()
    try:
        for _ in range(clients):
            sock = socket.socket()
            socks.append(sock)
            sock.setblocking(False)
            err = sock.connect_ex(("127.0.0.1", port))
            assert err in (0, errno.EINPROGRESS), errno.errorcode.get(err, err)
            sel.register(sock, selectors.EVENT_WRITE, "connecting")
        deadline = time.monotonic() + budget_s
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                result = _step(sel, sock, key.data)
                if result is not None:
                    outcome[result] += 1
                    sel.unregister(sock)
        outcome["unfinished"] += len(sel.get_map())
    finally:
        sel.close()
    return outcome, socks


def _step(sel: selectors.BaseSelector, sock: socket.socket, state: str) -> str | None:
    """One readiness event of a flood client; its outcome once it has one."""
    try:
        if state == "connecting":
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                return "refused"
            sock.send(HEALTHZ)
            sel.modify(sock, selectors.EVENT_READ, "reading")
            return None
        data = sock.recv(4096)
    except OSError:  # reset by hubd (refused while the request was on its way)
        return "refused"
    if not data:
        return "refused"
    assert data.startswith(b"HTTP/1.1 200 "), data[:100]
    return "answered"


def test_soft_limit_is_raised_to_the_hard_limit(tree: Tree, start_hub: StartHub) -> None:
    hub = start_hub(tree.root, preexec_fn=_limit_nofile(512, 4096))
    assert _nofile_of(hub.proc.pid) == (4096, 4096)
    lines = [line for line in hub.stderr().splitlines() if "file descriptor limit raised" in line]
    assert len(lines) == 1 and " INFO " in lines[0], lines
    assert "512" in lines[0] and "4096" in lines[0]


def test_no_raise_no_line_when_soft_is_hard(tree: Tree, start_hub: StartHub) -> None:
    hub = start_hub(tree.root, preexec_fn=_limit_nofile(LOW_LIMIT, LOW_LIMIT))
    assert _nofile_of(hub.proc.pid) == (LOW_LIMIT, LOW_LIMIT)
    assert "file descriptor limit raised" not in hub.stderr()
    assert hub.request(protocol.HEALTH_PATH).status == 200


def test_descriptor_exhaustion_refuses_quietly_and_hubd_keeps_serving(
        tree: Tree, start_hub: StartHub) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FLOOD_CLIENTS + 100:
        pytest.skip(f"the test itself needs {FLOOD_CLIENTS + 100} descriptors, hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FLOOD_CLIENTS + 100), hard))
    try:
        hub = start_hub(tree.root, preexec_fn=_limit_nofile(LOW_LIMIT, LOW_LIMIT))
        paths = paths_of(decode_snapshot(hub.request(protocol.SNAPSHOT_PATH).body)[1])
        data = paths[b"sub/deeper/data.bin"]
        want = framed(DATA, data.file_id, data.version)[100:4300]
        port = int(hub.url.rsplit(":", 1)[1])
        with ReadersDuringFlood(hub, data, want) as readers:
            started = time.monotonic()
            outcome, socks = flood(port, FLOOD_CLIENTS, FLOOD_BUDGET_S)
            seconds = time.monotonic() - started
        for sock in socks:
            sock.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    health = _healthz_within(hub, 5.0)
    ranged = hub.request(protocol.blob_path(data.file_id, data.version),
                         {"Range": "bytes=100-4299"})
    metrics = hub.request(protocol.METRICS_PATH).body.decode()
    refused = _metric(metrics, "hubd_connections_refused_total")
    accept_failures = _metric(metrics, "hubd_accept_failures_total")
    assert hub.proc.poll() is None
    hub.stop()
    log = hub.stderr().splitlines()
    warnings = [line for line in log if " WARNING " in line or " ERROR " in line]
    print(f"\n{FLOOD_CLIENTS} clients, limit {LOW_LIMIT}: {dict(outcome)} in {seconds:.1f} s; "
          f"{READERS} readers meanwhile: {dict(readers.statuses)}; "
          f"hubd_connections_refused_total {refused:g}, hubd_accept_failures_total "
          f"{accept_failures:g}; log: {len(log)} lines, {len(warnings)} warnings:")
    print("\n".join(warnings))

    assert health == 200
    assert ranged.status == 206 and ranged.body == want
    assert outcome["answered"] > 0 and outcome["refused"] > 0
    assert outcome["unfinished"] == 0, outcome
    assert readers.statuses[206] >= READERS and set(readers.statuses) <= {206, 503}, readers
    assert refused > 0
    assert "Traceback" not in hub.stderr() and not [line for line in log if " ERROR " in line]
    assert len(warnings) <= MAX_CONDITION_LINES, warnings


class ReadersDuringFlood:
    """``READERS`` threads, each on a connection made before the flood, reading one range
    over and over until the ``with`` block ends; ``statuses`` counts their answers (a
    wrong body or a failed request counts as its error's name)."""

    def __init__(self, hub: Hub, entry: protocol.Entry, want: bytes) -> None:
        self._path = protocol.blob_path(entry.file_id, entry.version)
        self._want = want
        self._hubs = [Hub(hub.proc, hub.url, hub.ready_line, hub.stderr_path)
                      for _ in range(READERS)]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._read, args=(one,)) for one in self._hubs]
        self.statuses: collections.Counter[int | str] = collections.Counter()

    def __enter__(self) -> ReadersDuringFlood:
        for one in self._hubs:  # connected (and counted by hubd) before the flood
            assert one.request(protocol.HEALTH_PATH).status == 200
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        for one in self._hubs:
            one.close_conn()

    def _read(self, one: Hub) -> None:
        while not self._stop.is_set():
            try:
                answer = one.request(self._path, {"Range": "bytes=100-4299"})
                status: int | str = answer.status
                if status == 206 and answer.body != self._want:
                    status = "wrong bytes"
            except OSError as exc:
                status = type(exc).__name__
            with self._lock:
                self.statuses[status] += 1


def _healthz_within(hub: Hub, seconds: float) -> int:
    """The status of GET /healthz; retried for ``seconds`` while hubd frees the flood's
    connections (it sees their closes asynchronously)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return hub.request(protocol.HEALTH_PATH).status
        except OSError:
            hub.close_conn()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_connection_cap_leaves_room_for_reads_and_the_reserve() -> None:
    """C connections take C + min(C, reads) descriptors beside FD_RESERVE."""
    for soft in (64, 256, 1024, 4096, 65536, 1 << 20):
        for reads in (1, 16, 256, 4096):
            cap = connection_cap(soft, reads)
            assert cap >= MIN_CONNECTIONS
            if cap > MIN_CONNECTIONS:
                assert cap + min(cap, reads) + FD_RESERVE <= soft, (soft, reads, cap)
                more = cap + 1
                assert more + min(more, reads) + FD_RESERVE > soft, (soft, reads, cap)
    assert connection_cap(LOW_LIMIT, 256) == (LOW_LIMIT - FD_RESERVE) // 2
    assert connection_cap(65536, 256) == 65536 - FD_RESERVE - 256


def test_accept_errors_are_one_warning_a_minute_and_the_rest_passes_through(
        caplog: pytest.LogCaptureFixture) -> None:
    metrics = HubMetrics()
    handler = AcceptErrorHandler(metrics)
    passed: list[dict[str, object]] = []
    emfile = OSError(errno.EMFILE, "Too many open files")
    other = {"message": "Task exception was never retrieved", "exception": RuntimeError("x")}
    retry = {"message": "Exception in callback BaseSelectorEventLoop._start_serving(...)",
             "exception": ValueError("Invalid file descriptor: -1"),
             "handle": "<TimerHandle BaseSelectorEventLoop._start_serving(<class 'x'>, ...)>"}

    class Loop:
        def default_exception_handler(self, context: dict[str, object]) -> None:
            passed.append(context)

    loop = Loop()
    with caplog.at_level(logging.DEBUG, logger="hubd.accept_errors"):
        for _ in range(10_000):
            handler(loop, {"message": ACCEPT_OUT_OF_RESOURCE, "exception": emfile})  # type: ignore[arg-type]
        handler(loop, other)  # type: ignore[arg-type]
        handler(loop, retry)  # type: ignore[arg-type]
        handler.listener_closed()
        handler(loop, retry)  # type: ignore[arg-type]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "out of file descriptors" in warnings[0].getMessage()
    assert passed == [other, retry]  # the retry is only dropped once the listener is closed
    text = metrics.render().decode()
    assert 'hubd_accept_failures_total{reason="emfile"} 10000.0' in text


def test_log_every_counts_what_it_kept_quiet() -> None:
    now = [0.0]
    every = LogEvery(60.0, clock=lambda: now[0])
    assert every.occurred() == 1  # the first at once
    assert [every.occurred() for _ in range(99)] == [0] * 99
    now[0] = 59.9
    assert every.occurred() == 0
    now[0] = 60.0
    assert every.occurred() == 101  # the line stands for all since the last one
