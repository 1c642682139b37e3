"""Every spokefs_* Prometheus metric, declared once (and ``observe_many``, a batch's observations).

Labels are low-cardinality (source, op, errno, status); never a path or an inode.
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import Counter, Gauge, Histogram

# Fine at the bottom to show sub-millisecond cache hits, wide at the top for 60-900 ms trips.
_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)

READS = Counter("spokefs_reads_total", "FUSE reads, by where all their bytes came from", ["source"])
READ_BYTES = Counter("spokefs_read_bytes_total", "Bytes returned to readers, by source", ["source"])
# A labelled counter whose label values are known exports 0 for each from the start: a series
# that appears at its first increment loses that increment to rate() and increase(), which the
# dashboard's hit-ratio and throughput panels and the alert rules rely on.
for _source in ("cache", "hub"):
    READS.labels(source=_source)
    READ_BYTES.labels(source=_source)
READ_SECONDS = Histogram("spokefs_read_seconds", "Latency of FUSE reads", buckets=_LATENCY_BUCKETS)
# Reads that waited for the hub (a demand fetch, or someone else's fetch of their blocks):
# finer between 50 ms and 1 s, where demand reads over a 60-900 ms link fall, so that the
# p99 with and without background traffic (a replay) can be told apart.
READ_MISS_SECONDS = Histogram(
    "spokefs_read_miss_seconds", "Latency of FUSE reads that waited for the hub",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.125, 0.15, 0.2, 0.25,
             0.3, 0.4, 0.5, 0.65, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0),
)
BLOCK_HITS = Counter(
    "spokefs_block_hits_total", "4 KiB blocks served from the cache, by how they got there",
    ["origin"],
)
for _origin in ("demand", "prefetch", "warm", "replay"):  # block_cache.ORIGINS
    BLOCK_HITS.labels(origin=_origin)
BLOCK_MISSES = Counter("spokefs_block_misses_total", "4 KiB blocks fetched from the hub")

CACHE_BYTES = Gauge("spokefs_cache_bytes", "Bytes of cached blocks on disk")
CACHE_CAPACITY = Gauge("spokefs_cache_capacity_bytes", "Configured cache size")
CACHE_EVICTIONS = Counter("spokefs_cache_evicted_bytes_total", "Bytes evicted from the cache")
CHECKSUM_FAILURES = Counter(
    "spokefs_cache_checksum_failures_total", "Cached blocks that failed their checksum (dropped)"
)
CACHE_WRITE_ERRORS = Counter(
    "spokefs_cache_write_errors_total", "Fills that could not be stored (read still served)"
)
CACHE_PROTECTED_BYTES = Gauge(
    "spokefs_cache_protected_bytes", "Cached bytes in the protected (re-used) segment"
)
CACHE_PINNED_BYTES = Gauge(
    "spokefs_cache_pinned_bytes", "Cached bytes pinned (never evicted; spokefs pin)"
)
CACHE_PINNED_LIMIT = Gauge(
    "spokefs_cache_pinned_limit_bytes", "Bytes that may be pinned (--max-pinned-share)"
)
CACHE_CORRUPTIONS = Counter(
    "spokefs_cache_corruptions_total", "Times the cache's LMDB was found corrupt and set aside"
)

HUB_REQUESTS = Counter("spokefs_hub_requests_total", "HTTP requests to the hub", ["kind", "status"])
HUB_SECONDS = Histogram(
    "spokefs_hub_request_seconds", "Latency of hub requests", ["kind"], buckets=_LATENCY_BUCKETS
)
HUB_RETRIES = Counter("spokefs_hub_retries_total", "Hub requests retried after a failure")
HUB_ERRORS = Counter("spokefs_hub_errors_total", "Failed hub requests", ["reason"])
HUB_ORIGIN = Gauge(
    "spokefs_hub_origin", "1 for the hub URL in use, 0 for the mount's other hub replicas", ["url"]
)
HUB_FAILOVERS = Counter(
    "spokefs_hub_failovers_total",
    "Switches of the hub in use: away from a failing one (failed), back to the preferred one "
    "(preferred)", ["reason"],
)
for _reason in ("failed", "preferred"):
    HUB_FAILOVERS.labels(reason=_reason)
LINK_BYTES = Counter(
    "spokefs_link_bytes_total",
    "Body bytes received from the hub, or from the tier when there is one (what crossed "
    "the far link: spokefs_fetched_bytes_total{origin=~\"hub|tier_miss\"})",
)
FETCHED_BYTES = Counter(
    "spokefs_fetched_bytes_total",
    "Data bytes received, by origin: hub (over the far link), tier_hit (from the regional "
    "tier's cache), tier_miss (the tier fetched them over the far link), tier (no status)",
    ["origin"],
)
TIER_FALLBACKS = Counter(
    "spokefs_tier_fallbacks_total",
    "Data requests that failed at the tier and went to the hub, by request kind and reason "
    "(timeout, transport, status, protocol: a short or malformed answer, checksum)",
    ["kind", "reason"],
)
for _kind in ("blob", "pack"):
    for _reason in ("timeout", "transport", "status", "protocol", "checksum"):
        TIER_FALLBACKS.labels(kind=_kind, reason=_reason)

NAMESPACE_ENTRIES = Gauge("spokefs_namespace_entries", "Entries in the replicated namespace")
NAMESPACE_GENERATION = Gauge("spokefs_namespace_generation", "Generation of the namespace")
NAMESPACE_BYTES = Gauge("spokefs_namespace_bytes", "Bytes of all files in the namespace")
REFRESH_ERRORS = Counter("spokefs_namespace_refresh_errors_total", "Failed namespace refreshes")
NAMESPACE_CORRUPTIONS = Counter(
    "spokefs_namespace_corruptions_total",
    "Times the stored namespace no longer matched its digest at a mount (set aside, reloaded)",
)
STORE_ERRORS = Counter(
    "spokefs_store_errors_total",
    "Writes to a local store that failed (a full or failing disk): the mount goes on without",
    ["store"],
)
for _store in ("namespace", "trace"):
    STORE_ERRORS.labels(store=_store)

FUSE_ERRORS = Counter("spokefs_fuse_errors_total", "Errors returned to FUSE", ["op", "errno"])
WORKERS = Gauge("spokefs_workers", "Worker processes serving the mount beside its own (--workers)")
WORKER_RESTARTS = Counter(
    "spokefs_worker_restarts_total", "Worker processes that ended unasked and were started again"
)
INTERNAL_ERRORS = Counter(
    "spokefs_internal_errors_total", "Bugs caught at the FUSE boundary", ["op"]
)

PREFETCH_ISSUED_BYTES = Counter(
    "spokefs_prefetch_issued_bytes_total", "Bytes fetched ahead of readers"
)
PREFETCH_USED_BYTES = Counter(
    "spokefs_prefetch_used_bytes_total", "Prefetched bytes that a read later used"
)
PREFETCH_HOLDS = Counter(
    "spokefs_prefetch_holds_total",
    "Times directory packs and fills were held because what they fetched left the cache "
    "unread (a cache smaller than what the readers go through)"
)
PREFETCH_RESETS = Counter(
    "spokefs_prefetch_window_resets_total", "Read-ahead windows closed by a non-sequential read"
)
PREFETCH_DROPPED_HINTS = Counter(
    "spokefs_prefetch_dropped_hints_total", "Prefetch jobs dropped because the queue was full"
)
PREFETCH_ERRORS = Counter("spokefs_prefetch_errors_total", "Background fetches that failed")
PREFETCH_INFLIGHT_LIMIT = Gauge(
    "spokefs_prefetch_inflight_requests_limit", "Background requests allowed in flight now"
)
LINK_BDP = Gauge(
    "spokefs_link_bdp_bytes",
    "The far link's bandwidth-delay product as measured (peak delivery rate x round trip)",
)
PREFETCH_SPILL_LIMIT = Gauge(
    "spokefs_prefetch_spill_limit_bytes",
    "Most bytes read ahead past the end of the file a sequential reader is in (next shards)",
)

TRACE_RECORDS = Gauge("spokefs_trace_records", "Records in this cache dir's access trace")
TRACE_DROPPED = Counter(
    "spokefs_trace_dropped_total", "First accesses not recorded because the trace was full"
)
REPLAY_TOTAL_BYTES = Gauge(
    "spokefs_replay_total_bytes", "Bytes of the running (or last) trace replay's working set"
)
REPLAY_DONE_BYTES = Gauge(
    "spokefs_replay_done_bytes", "Bytes of the replay's working set cached so far"
)
REPLAY_FETCHED_BYTES = Counter(
    "spokefs_replay_fetched_bytes_total", "Bytes fetched from the hub by trace replays"
)


def observe_many(histogram: Histogram, amounts: list[float]) -> None:
    """``histogram.observe`` of each amount, with one increment per bucket touched and one of
    the sum: a serving worker's hits come in batches, and ``observe`` costs ~2.4 us each.
    Reaches into prometheus_client's unlabelled histogram (its ``_sum``, ``_buckets`` and
    ``_upper_bounds``, there since 0.4); anything else takes the loop."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(amounts) < 4:
        for amount in amounts:
            histogram.observe(amount)
        return
    counts: dict[int, int] = {}
    for amount in amounts:
        i = bisect_left(bounds, amount)  # the first bound >= amount, as observe's loop finds
        counts[i] = counts.get(i, 0) + 1
    for i, n in counts.items():
        buckets[i].inc(n)
    total.inc(sum(amounts))
