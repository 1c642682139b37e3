"""Every knob of the spoke, with its unit and why its default is what it is."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

BLOCK_SIZE = 4096
"""The unit of caching and hit accounting (one page: what the kernel asks for)."""

CHUNK_BLOCKS = 16
"""Blocks per LMDB value. LMDB stores any value over ~2 KiB in overflow pages, so one 4 KiB
block per value costs two pages (2.01x space, ~270 MiB/s reads); a 64 KiB run costs 1.06x
and reads at ~2.7 GiB/s (docs/design.md, "Block cache"). A per-block presence map keeps a random
4 KiB read from fetching the other 60 KiB."""

CHUNK_SIZE = BLOCK_SIZE * CHUNK_BLOCKS


@dataclass(frozen=True, slots=True)
class PrefetchConfig:
    """Read-ahead knobs (see ``prefetcher``).

    Attributes:
        window_initial_bytes: first read-ahead window of a sequential stream; small, so a
            reader that reads a little and stops wastes little.
        window_max_bytes: a stream's largest window: at 900 ms and 1 Gbit/s one reader
            needs ~112 MB ahead to keep the link full.
        request_bytes: one background range or pack request. Large enough that the
            request's own round trip is a small part of its time, small enough that a
            reader catching up waits for little; a little under 4 MiB, because a 4 MiB body
            plus headers overflows a 4 MiB TCP window by a few hundred bytes and then takes
            a second round trip (measured through the long-link emulator: 1.81 s for 4 MiB
            at 900 ms RTT, 0.94 s for 4 MiB - 64 KiB).
        max_inflight_bytes: the bound on background bytes in flight (their RAM).
        small_file_bytes: files up to this size are fetched whole on first read (one
            round trip instead of one per kernel read) and are what directory fills fetch.
        assumed_link_bytes_per_s: the link rate that directory fills and new sequential
            streams assume until it is measured (1 Gbit/s, the links this is built for; see
            ``link_model.LinkReach``).
        warm_interval_s: how long the hub client lets an idle connection it keeps open go
            untouched, at most (it touches those unused for half of this; under hubd's 15 s
            keep-alive timeout).
        warm_connections: connections opened while the namespace downloads at mount: as
            many as the prefetcher keeps open at most (``prefetcher._MAX_WARM``), so that
            none is still being opened when a job starts at once (64 x a 4 MiB TCP window
            per 900 ms round trip carry ~300 MB/s: the first requests of an order, which
            puts about three times the bandwidth-delay product in flight).
    """

    window_initial_bytes: int = 512 << 10
    window_max_bytes: int = 256 << 20
    request_bytes: int = (4 << 20) - (256 << 10)
    max_inflight_bytes: int = 512 << 20
    small_file_bytes: int = 1 << 20
    assumed_link_bytes_per_s: float = 125e6
    warm_interval_s: float = 10.0
    warm_connections: int = 64
    enabled: bool = True


@dataclass(frozen=True, slots=True)
class SpokeConfig:
    """Effective configuration of one mount; built only by ``cli.main``.

    Attributes:
        hub_url: base URL of hubd, ``http(s)://host:port``: the preferred hub.
        hub_fallback_urls: hub replicas over the same export, in the order they are tried
            when the one in use fails (``hub.origins``); the mount moves back to
            ``hub_url`` once it answers again.
        mountpoint: an existing, empty-or-not directory that is not already a mount.
        cache_dir: holds the ``namespace`` and ``blocks`` LMDB environments.
        cache_max_bytes: bound on cached block bytes (LMDB value sizes).
        uid, gid: owner shown for every entry (the export's modes are kept).
        metrics_port: Prometheus endpoint port; 0 disables it. A port in use fails the
            mount (a second mount on a node must pick its own port, not lose its metrics).
        metrics_addr: address of the endpoint: loopback by default (it has no
            authentication); a node agent or a pod network needs it set explicitly.
        token: bearer token for the hub, or None (never logged: ``repr=False``).
        tls: the client TLS context for an ``https://`` hub (system roots, or only the CA
            of ``--ca-file``; TLS >= 1.2, certificate and host name verified), else None.
        hub_deadline_s: how long an uncached read keeps retrying before EIO.
        hub_failover_after_s: with replicas, how long one request waits for a hub that
            does not answer (a hung one; a refused connection fails over at once) before
            it tries the next: 10 s is several times a 4 MiB request at 900 ms RTT.
        hub_request_timeout_s: one HTTP request, connect to last byte.
        mount_deadline_s: how long a first ``mount`` tries to get the snapshot before it
            gives up (a stored namespace is mounted without the hub).
        refresh_interval_s: how often the namespace polls the hub for changes (0: never,
            only on ``spokefs refresh``).
        hub_max_connections: HTTP connections kept to the hub.
        fuse_max_tasks: concurrent FUSE requests pyfuse3 may run (in each process).
        workers: threads of the native read loop that serve the mount's FUSE requests, in a
            worker process beside the mount's own (``fuse.workers``); 0: the mount's own
            process serves them all; more than 0 needs ``open_mode='kernel'``.
        kernel_readahead_kib: the mount's kernel read-ahead (see mount.set_kernel_readahead).
        attr_timeout_s: how long the kernel may cache entries and attributes; the export is
            read-only and changes arrive as new generations, so it can be long.
        tier_url: base URL of a regional HTTP cache in front of the hub (``deploy/regional``),
            or None: blob and pack requests go there first and to the hub when it fails.
        open_mode: ``kernel`` (the kernel opens files without a request: lookup + reads per
            file; needs our patched pyfuse3) or ``handle`` (an open and a release per file,
            one version per open file); see ``fuse_ops.SpokeOps``.
        trace: record the access trace in the cache dir (``trace``); costs a comparison per
            read and 28 bytes per file first read.
        replay_path: a trace file to replay from the mount on (``replay``), or None.
        max_pinned_share: the share of ``cache_max_bytes`` that pins may hold (the rest
            keeps the cache working for everything else).
    """

    hub_url: str
    mountpoint: Path
    cache_dir: Path
    cache_max_bytes: int
    uid: int = 0
    gid: int = 0
    metrics_port: int = 9108
    metrics_addr: str = "127.0.0.1"
    token: str | None = field(default=None, repr=False)
    tls: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    hub_deadline_s: float = 60.0
    hub_failover_after_s: float = 10.0
    hub_fallback_urls: tuple[str, ...] = ()
    hub_request_timeout_s: float = 30.0
    mount_deadline_s: float = 5.0
    refresh_interval_s: float = 60.0
    hub_max_connections: int = 160  # background requests (up to 128) + demand reads
    fuse_max_tasks: int = 64
    workers: int = 0
    attr_timeout_s: float = 3600.0
    kernel_readahead_kib: int = 1024
    open_mode: str = "handle"
    tier_url: str | None = None
    prefetch: PrefetchConfig = PrefetchConfig()
    trace: bool = True
    replay_path: Path | None = None
    max_pinned_share: float = 0.5
    daemon: bool = False
    log_level: str = "INFO"

    @property
    def hub_urls(self) -> tuple[str, ...]:
        """Every hub URL, the preferred one first."""
        return (self.hub_url, *self.hub_fallback_urls)

    @property
    def hub_source(self) -> str:
        """The hub URLs as one ``URL1,URL2`` string, as on the command line."""
        return ",".join(self.hub_urls)
