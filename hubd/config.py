"""hubd's configuration: one frozen dataclass, built by ``cli.py`` from argv.

Every knob carries its unit in its name, a default, and the reason for that default.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from hubd.s3.config import BucketSpec

KIB = 1024

DEFAULT_CONCURRENT_READS = 256
"""Read slots. One spoke keeps up to ~136 requests in flight (128 background + demand
reads), and over a long link each slot is held for about one round trip plus the body's
send time (a 3.75 MiB body at 4.7 MB/s per connection through a 4 MiB window at 900 ms:
~1.7 s). 256 slots then carry ~590 MB/s (4.7 Gbit/s) for a fleet of tens of spokes at
900 ms, far more on shorter links; more requests queue (FIFO) for ``read_wait_s``. Memory: a slot
holds one pack (``protocol.PACK_MAX_BYTES``, 3.75 MiB) or up to three slices of a streamed blob
(3 MiB of data, ``hubd.framed``), so 960 MiB at worst. Lower it on a small hub."""

DEFAULT_READ_WAIT_S = 20.0
"""How long a request waits for a read slot before a 503 ``overloaded`` (with
``Retry-After: 1``). Below the spoke's 30 s per-request timeout, so a queued spoke request
gets an answer it retries (backoff, until ``--hub-deadline``) instead of timing out while
the hub still holds its place; long enough that a burst of a whole fleet's requests
drains through 256 slots (at ~1.7 s each: ~3,000 requests in 20 s) without failing."""


@dataclass(frozen=True, slots=True)
class HubConfig:
    """Effective settings of one hubd process.

    Attributes:
        root: the exported directory, or ``s3://BUCKET[/PREFIX]``, as given on the
            command line.
        s3: the bucket export's settings when ROOT is ``s3://...``, else None.
        host, port: where to listen; port 0 picks a free port.
        token: the bearer token (never logged: ``repr=False``), or None for no auth.
        tls: the server TLS context (TLS >= 1.2) built from ``--tls-cert``/``--tls-key``,
            or None for plain HTTP; ``tls_cert_file`` names the certificate for the log.
        idle_timeout_s: a connection must send a whole request header within this long of
            opening or of its last answer, else it is closed. Bounds what slow-header
            ("slowloris") and idle clients hold; spokes touch their idle connections every
            10 s, close them after 12 s (``spokefs.hub.wire``) and send a header in one
            round trip (< 1 s).
        log_level: a ``logging`` level name.
        max_concurrent_reads: range reads in flight at once (``DEFAULT_CONCURRENT_READS``);
            hubd's read memory stays under ``max_concurrent_reads * protocol.PACK_MAX_BYTES``.
        read_wait_s: how long a request may wait for a read slot before a 503 ``overloaded``
            (``DEFAULT_READ_WAIT_S``).
        snapshot_chunk_bytes: size of each write when streaming the snapshot (256 KiB keeps
            the per-write overhead negligible without large transport buffers).
        rescan_interval_s: seconds between the end of one rescan and the start of the next
            (0: only on SIGHUP). A 1M-entry scan takes ~8 s of one core, so 60 s keeps the
            hub mostly idle while spokes still see changes within about a minute.
        changes_max_steps: generation steps kept for ``GET /v2/changes`` (older ``since``
            values get 410): 16 rescans that changed something.
        changes_max_bytes: bound of the kept change records, and separately of the cached
            compressed answers (a step bigger than this is not kept: a snapshot is cheaper).
        snapshot_zlib_level: zlib level of the snapshot. Measured on a 1M-entry tree: level 6
            takes 2.9 s and 28.2 MB, level 1 1.5 s and 30.1 MB. Encoding happens once per
            generation while every spoke downloads the bytes over the far link, so 6.
    """

    root: str
    host: str
    port: int
    token: bytes | None = field(default=None, repr=False)
    tls: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    tls_cert_file: str | None = None
    idle_timeout_s: float = 15.0
    log_level: str = "INFO"
    max_concurrent_reads: int = DEFAULT_CONCURRENT_READS
    read_wait_s: float = DEFAULT_READ_WAIT_S
    snapshot_chunk_bytes: int = 256 * KIB
    snapshot_zlib_level: int = 6
    rescan_interval_s: float = 60.0
    changes_max_steps: int = 16
    changes_max_bytes: int = 64 * 1024 * KIB
    s3: BucketSpec | None = None
