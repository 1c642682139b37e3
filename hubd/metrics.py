"""Every hubd_* Prometheus metric, declared once, and the ``/metrics`` route.

Each ``HubMetrics`` owns its registry, so several apps (tests) never clash. Labels stay
low-cardinality: the route template (never a file id or path) and the status code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from hubd.export_root import Rescan
from hubd.snapshot import Snapshot

if TYPE_CHECKING:
    from hubd.s3.bucket import BucketExport

# Request latency buckets, seconds: from a cached small range on loopback (~1 ms) to a
# 16 MiB range to a slow far-away client (tens of seconds).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)


class HubMetrics:
    """The hubd metrics and their registry.

    Attributes:
        requests: hubd_requests_total{route,status}.
        request_seconds: hubd_request_seconds{route}, time to the last byte written.
        bytes_served: hubd_bytes_served_total{route}, body bytes (blobs and snapshots).
        reads_in_flight: hubd_reads_in_flight, requests holding a read slot.
        pack_files: hubd_pack_files_total{result}, files asked for in packs, by result
            (``served`` with bytes, ``gone``: unknown id or version not current).
        pack_file_bytes: hubd_pack_file_bytes_total, file bytes served in packs.
        snapshot_*: the current snapshot's generation, entries and encoded size.
        scan_seconds: hubd_scan_seconds, duration of the last scan (walk, diff, encoding).
        rescans: hubd_rescans_total{result}: ``changed`` (a new generation), ``unchanged``,
            ``failed``.
        connections_open: hubd_connections_open, connections counted by the
            ``conn_limit.ConnectionLimit`` (set by it).
        connections_refused: hubd_connections_refused_total, connections closed unanswered
            because the limit was reached.
        accept_failures: hubd_accept_failures_total{reason}, accept() calls that failed for
            want of descriptors (``emfile``, ``enfile``) or memory (``enobufs``, ``enomem``).
        s3_*: only for a bucket export (``watch_bucket``): hubd_s3_skipped_keys{reason},
            keys of the latest listing that are no POSIX path; hubd_s3_requests,
            hubd_s3_retries, hubd_s3_list_pages, hubd_s3_get_bytes: the S3 client's
            counters since start.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("hubd_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=reg)
        self.request_seconds = Histogram("hubd_request_seconds",
                                         "Time from request to last byte written, by route",
                                         ["route"], buckets=_LATENCY_BUCKETS, registry=reg)
        self.bytes_served = Counter("hubd_bytes_served", "Response body bytes sent, by route",
                                    ["route"], registry=reg)
        self.reads_in_flight = Gauge("hubd_reads_in_flight",
                                     "Range reads holding a read slot", registry=reg)
        self.pack_files = Counter("hubd_pack_files",
                                  "Files asked for in pack requests, by result (served, gone)",
                                  ["result"], registry=reg)
        self.pack_file_bytes = Counter("hubd_pack_file_bytes",
                                       "File bytes served in pack answers", registry=reg)
        self.snapshot_generation = Gauge("hubd_snapshot_generation",
                                         "Generation of the current snapshot", registry=reg)
        self.snapshot_entries = Gauge("hubd_snapshot_entries",
                                      "Entries in the current snapshot", registry=reg)
        self.snapshot_bytes = Gauge("hubd_snapshot_bytes",
                                    "Compressed size of the current snapshot", registry=reg)
        self.scan_seconds = Gauge("hubd_scan_seconds",
                                  "Duration of the last scan: walk, diff and encoding",
                                  registry=reg)
        self.rescans = Counter("hubd_rescans", "Rescans, by result (changed, unchanged, failed)",
                               ["result"], registry=reg)
        self.connections_open = Gauge("hubd_connections_open", "Client connections open",
                                      registry=reg)
        self.connections_refused = Counter(
            "hubd_connections_refused",
            "Connections closed unanswered: as many open as file descriptors allow",
            registry=reg)
        self.accept_failures = Counter(
            "hubd_accept_failures",
            "accept() calls that failed, by errno (emfile, enfile: out of file descriptors)",
            ["reason"], registry=reg)
        for reason in ("emfile", "enfile", "enobufs", "enomem"):  # shown at 0 from the start
            self.accept_failures.labels(reason=reason)

    def watch_bucket(self, export: BucketExport) -> None:
        """Export a bucket's listing and S3 client figures (read when scraped)."""
        from hubd.s3.tree import SKIP_REASONS

        skipped = Gauge("hubd_s3_skipped_keys", "Keys of the latest listing left out (not "
                        "a POSIX path), by reason", ["reason"], registry=self.registry)
        for reason in SKIP_REASONS:
            def skipped_now(reason: str = reason) -> int:
                return export.skipped[reason]  # the latest listing's (export.skipped is replaced)

            skipped.labels(reason=reason).set_function(skipped_now)
        stats = export.client.stats
        for name, doc in (("requests", "S3 requests sent (retries included)"),
                          ("retries", "S3 requests retried (5xx, throttling, no connection)"),
                          ("list_pages", "ListObjectsV2 pages received"),
                          ("get_bytes", "Object bytes received by ranged GETs")):
            def stat_now(name: str = name) -> int:
                return getattr(stats, name)

            Gauge(f"hubd_s3_{name}", doc, registry=self.registry).set_function(stat_now)

    def observe_snapshot(self, snap: Snapshot) -> None:
        self.snapshot_generation.set(snap.generation)
        self.snapshot_entries.set(snap.count)
        self.snapshot_bytes.set(len(snap.encoded))

    def observe_rescan(self, rescan: Rescan | None) -> None:
        """After a scan (None: it failed)."""
        if rescan is None:
            self.rescans.labels(result="failed").inc()
            return
        self.rescans.labels(result="changed" if rescan.changed else "unchanged").inc()
        self.scan_seconds.set(rescan.seconds)

    def observe_request(self, route: str, status: int | str, seconds: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.request_seconds.labels(route=route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


METRICS = web.AppKey("metrics", HubMetrics)


async def metrics_handler(request: web.Request) -> web.Response:
    """GET /metrics: the Prometheus text format (cheap: rendered inline)."""
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
