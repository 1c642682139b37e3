"""Probe: what one benchmark pass over a mount costs, measured around it.

Between ``start()`` and ``stop()``: the link's counters as a time series stamped by the
emulator (``benchlib.LinkSeries``: the pass's link rate is read there, never at the reader),
the CPU of the named processes and of the whole machine (and its busiest processes), the
deltas of spokefs's and hubd's Prometheus counters, and, with ``series``, a 0.5 s series of
the spoke's in-flight limit, hubd's reads in flight, spokefs's CPU and the reader's progress.
``stop()`` notes the end of the pass first, then waits ``settle_s`` for bytes still on their
way, so link bytes per byte read count every byte the pass caused.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import benchlib as bl
from longlink import LongLinkProcess

SPOKE_PREFIXES = ("spokefs_prefetch", "spokefs_hub_requests_total", "spokefs_link_bytes",
                  "spokefs_reads_total", "spokefs_block_", "spokefs_hub_retries",
                  "spokefs_hub_errors", "spokefs_read_bytes", "spokefs_hub_request_seconds_sum",
                  "spokefs_hub_request_seconds_count")
HUB_PREFIXES = ("hubd_requests_total", "hubd_reads_in_flight", "hubd_bytes_served_total",
                "hubd_pack_files_total")


@dataclass
class Target:
    """Where a system's data is visible, and what to watch while a pass runs."""

    system: str
    path: Path
    link: LongLinkProcess | None = None
    pids: dict[str, int] = field(default_factory=dict)
    metrics_url: str | None = None  # spokefs /metrics
    hub_metrics_url: str | None = None  # hubd /metrics
    launched: float = 0.0  # perf_counter() at the mount command
    ready_s: float = 0.0
    mount: bl.Mount | None = None


class Probe:
    """Counters around one pass (see the module docstring)."""

    def __init__(self, t: Target, series: bool = False,
                 progress: Callable[[], float] | None = None) -> None:
        self.t = t
        self.link = bl.LinkSeries(t.link) if t.link is not None else None
        self.extra: bl.Series | None = None
        if series:
            progress = progress or (lambda: -1.0)
            self.extra = bl.Series({
                "prefetch_limit": lambda: bl.scrape(t.metrics_url, ("spokefs_prefetch_inflight",)
                                                    ).get("spokefs_prefetch_inflight_requests_limit",
                                                          -1),
                "hub_reads_in_flight": lambda: bl.scrape(t.hub_metrics_url,
                                                         ("hubd_reads_in_flight",)
                                                         ).get("hubd_reads_in_flight", -1),
                "spokefs_cpu_ticks": lambda: bl.proc_cpu_ticks(t.pids.get("spokefs", 0)),
                "bytes_read": progress,
            })

    def start(self) -> Probe:
        if self.link is not None:
            self.link.start()
        self.k0 = bl.scrape(self.t.metrics_url, SPOKE_PREFIXES)
        self.h0 = bl.scrape(self.t.hub_metrics_url, HUB_PREFIXES)
        self.all0 = bl.all_ticks()
        self.cpu = bl.CpuMeter(self.t.pids)
        if self.extra is not None:
            self.extra.start()
        self.t0 = time.time()
        return self

    def stop(self, settle_s: float = 1.0) -> dict[str, Any]:
        """The pass's figures; call it as soon as the pass's reader is done."""
        t1 = self.t1 = time.time()
        cpu = self.cpu.stop()
        wall = cpu["wall_s"]
        top = bl.top_processes(self.all0, bl.all_ticks(), wall)
        series = self.extra.stop() if self.extra is not None else None
        out: dict[str, Any] = {
            "wall_s": wall,
            "cpu_pct": {k: round(v / wall * 100, 1) for k, v in cpu["cpu_s"].items()},
            "machine_busy_pct": cpu["machine_busy_pct"],
            "machine_busy_cores": cpu["machine_busy_cores"],
            "loadavg": os.getloadavg()[0], "top_processes_cpu_pct": top,
        }
        if self.link is not None:
            self.link.stop(settle_s)
        if self.link is not None and self.link.rows:  # none if the emulator wrote no status
            first, last = self.link.rows[0], self.link.rows[-1]
            out |= {"link_bytes_down": last[1] - first[1], "link_bytes_up": last[2] - first[2],
                    "link_connections_accepted": last[3] - first[3],
                    "link_bytes_down_in_pass": round(self.link.delivered(self.t0, t1)),
                    "link_rate_bps": self.link.rate(self.t0, t1),
                    "link_series": self.link.as_json(self.t0)}
        out |= self._counter_deltas()
        if series is not None:
            out["series"] = series
        return out

    def _counter_deltas(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        k1 = bl.scrape(self.t.metrics_url, SPOKE_PREFIXES)
        h1 = bl.scrape(self.t.hub_metrics_url, HUB_PREFIXES)
        if k1:
            spoke = {k: v - self.k0.get(k, 0) for k, v in k1.items()
                     if "limit" not in k and v != self.k0.get(k, 0)}
            for kind in ("blob", "pack"):
                key = f'{{kind="{kind}"}}'
                if n := spoke.get(f"spokefs_hub_request_seconds_count{key}", 0):
                    spoke[f"mean_hub_{kind}_latency_s"] = round(
                        spoke[f"spokefs_hub_request_seconds_sum{key}"] / n, 4)
            spoke["prefetch_inflight_requests_limit_end"] = k1.get(
                "spokefs_prefetch_inflight_requests_limit", -1)
            out["spoke"] = spoke
        if h1:
            out["hub"] = {k: v - self.h0.get(k, 0) for k, v in h1.items()
                          if v != self.h0.get(k, 0)}
        return out
