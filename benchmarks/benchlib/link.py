"""The emulated link: benchmarks/longlink.py as a subprocess in front of a server
(``open_link``), and its byte counters as the emulator counted them: once
(``link_counters``) or as a time series stamped by the emulator (``LinkSeries``), so link
throughput is read at the link, never at the reader."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from longlink import LongLinkProcess

from .common import MIB


@dataclass(frozen=True)
class LinkSpec:
    """A long link: RTT (one-way delay = RTT / 2), a cap shared by all connections, and a
    window per connection (see benchmarks/longlink.py)."""

    rtt_ms: float
    rate_mbit: float = 1000.0
    window_bytes: int = 4 * MIB

    @property
    def delay_ms(self) -> float:
        return self.rtt_ms / 2

    @property
    def cap_bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    def describe(self) -> str:
        return (f"RTT {self.rtt_ms:g} ms (one-way {self.delay_ms:g} ms), {self.rate_mbit:g} "
                f"Mbit/s cap, {self.window_bytes / MIB:g} MiB window per connection")


@contextlib.contextmanager
def open_link(upstream_port: int, spec: LinkSpec) -> Iterator[LongLinkProcess]:
    """longlink.py in front of 127.0.0.1:upstream_port; ``link.port`` is where to connect. Its
    status file is rewritten every SERIES_STATUS_MS, so LinkSeries reads rates finely."""
    with LongLinkProcess(("127.0.0.1", upstream_port), spec.delay_ms, spec.rate_mbit,
                         spec.window_bytes, ("--status-ms", str(SERIES_STATUS_MS))) as link:
        yield link


@dataclass(frozen=True)
class LinkCounters:
    """The emulator's counters (bytes delivered per direction, connections accepted)."""

    bytes_down: int = 0
    bytes_up: int = 0
    connections: int = 0
    at: float = 0.0  # time.time() when the emulator wrote them (its status file's mtime)

    def minus(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(self.bytes_down - other.bytes_down, self.bytes_up - other.bytes_up,
                            self.connections - other.connections)


STATUS_PERIOD_S = 0.2  # longlink.py rewrites its status file at least this often
# open_link's emulators rewrite it every 50 ms: a rate over a pass is then exact to 50 ms
# (about 0.5 % of a 10 s pass); a to_thread hop and a 150-byte write 20 times a second.
SERIES_STATUS_MS = 50


def link_counters(link: LongLinkProcess | None, fresh: bool = True) -> LinkCounters:
    """The link's counters from its status file; with ``fresh``, after one more rewrite
    (so bytes delivered just before the call are in)."""
    if link is None:
        return LinkCounters()
    if fresh:
        time.sleep(STATUS_PERIOD_S * 1.5)
    for _ in range(3):  # the file is replaced under us: keep a reading whose stamp is its own
        before = _stamp(link)
        s = link.statistics()
        if (at := _stamp(link)) == before:
            break
    else:
        at = (0, 0.0)
    return LinkCounters(int(s.get("bytes_down", 0)), int(s.get("bytes_up", 0)),
                        int(s.get("connections_accepted", 0)), at[1])


def _stamp(link: LongLinkProcess) -> tuple[int, float]:
    """(inode, mtime) of the status file; (0, 0.0) if it is missing."""
    try:
        st = link.status_file.stat()
    except OSError:
        return 0, 0.0
    return st.st_ino, st.st_mtime


class LinkSeries:
    """The emulator's counters over time, sampled in a thread from ``start()`` to ``stop()``:
    one row per rewrite of its status file, stamped with the file's mtime (when the emulator
    counted them), so a rate over any interval is read at the link, not at the reader.

    Rows: (at: time.time() seconds, bytes_down, bytes_up, connections). ``bytes_at(t)``
    interpolates linearly between the rows around t; ``rate(t0, t1)`` is bytes_down
    delivered in [t0, t1] over t1 - t0 (B/s).
    """

    COLS = ("t", "bytes_down", "bytes_up", "connections")

    def __init__(self, link: LongLinkProcess, period_s: float = SERIES_STATUS_MS / 2000) -> None:
        self.link = link
        self.period_s = period_s
        self.rows: list[tuple[float, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="link-series")

    def _sample(self) -> None:
        c = link_counters(self.link, fresh=False)
        if c.at and (not self.rows or c.at > self.rows[-1][0]):
            self.rows.append((c.at, c.bytes_down, c.bytes_up, c.connections))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def start(self) -> LinkSeries:
        """Wait for one fresh rewrite (so the series starts at the present), then sample."""
        time.sleep(STATUS_PERIOD_S * 1.5)
        self._sample()
        self._thread.start()
        return self

    def stop(self, settle_s: float = STATUS_PERIOD_S * 2) -> LinkSeries:
        """Keep sampling settle_s more (rows after the interval of interest), then stop."""
        time.sleep(settle_s)
        self._stop.set()
        self._thread.join()
        self._sample()
        return self

    def bytes_at(self, t: float) -> float:
        """bytes_down at time t (time.time()), interpolated between the rows around it."""
        rows = self.rows
        if not rows:
            return 0.0
        if t <= rows[0][0]:
            return float(rows[0][1])
        for (ta, a, *_), (tb, b, *_) in itertools.pairwise(rows):
            if ta <= t <= tb:
                return a + (b - a) * (t - ta) / (tb - ta)
        return float(rows[-1][1])

    def delivered(self, t0: float, t1: float) -> float:
        return self.bytes_at(t1) - self.bytes_at(t0)

    def rate(self, t0: float, t1: float) -> float:
        """Bytes/s the link delivered towards the reader between t0 and t1."""
        return self.delivered(t0, t1) / (t1 - t0) if t1 > t0 else 0.0

    def as_json(self, t0: float, step_s: float = 0.5) -> dict[str, Any]:
        """{"cols", "rows"} with t as seconds since t0; rows at least step_s apart (and the
        last one), so a JSON line stays small."""
        kept: list[tuple[float, int, int, int]] = []
        for r in self.rows:
            if not kept or r[0] - kept[-1][0] >= step_s or r is self.rows[-1]:
                kept.append(r)
        return {"cols": list(self.COLS), "rows": [[round(r[0] - t0, 3), *r[1:]] for r in kept]}
