"""hubd over object storage: ``hubd serve s3://BUCKET[/PREFIX]``.

A bucket (or a prefix of one) is exported like a directory: the routes and the wire protocol
do not change, and spokes cannot tell the difference (``hubd/source.py`` names what both
backends provide).

Data path::

    rescan thread:  BucketExport.rescan -> listing.list_objects (on the loop) -> tree.build_tree
                    -> Table -> Snapshot + changes.diff -> ExportState (one assignment)
    request:        routes -> BucketReader.open_framed / read_piece / read_pack
                    -> BucketExport.read -> S3Client.get (ranged GET, If-Match: the
                    listed ETag) -> 4 KiB frames, each with its seeded xxh3 -> answer

Modules:

- ``sigv4``: AWS Signature Version 4 as one pure function (checked against botocore).
- ``credentials``: the keys, from where every S3 tool looks; one-line errors.
- ``config``: ``S3Config`` (endpoint, region, deadline, retries, part size) and
  ``BucketSpec``; no aiohttp import, so the CLI can build them before aiohttp loads.
- ``client``: ``S3Client`` on aiohttp: ListObjectsV2 pages, ranged GETs, retries with
  backoff and jitter within a deadline, S3's answers mapped to ``errors``.
- ``listing``: every key under a prefix, several directories listed at once.
- ``tree``: keys -> the namespace table (POSIX-name rules, directory wins, stable ids).
- ``bucket``: ``BucketExport``, the S3 counterpart of ``ExportRoot``.
- ``reader``: ``BucketReader``, the S3 counterpart of ``RangeReader``.

Why a thin client of our own and not a library: hubd is an aiohttp server on asyncio, so
the client must be asyncio-native and share the loop; aiobotocore is, but it runs
botocore's generic request building and response parsing for every call. Measured with
``benchmarks/bench_s3_hub.py`` against SeaweedFS, one request at a time: botocore spends
0.82 ms of CPU per GET and 57 ms per 1,000-key LIST page, this client 0.23 ms and 8.9 ms.
The client and its signer are ~470 lines, the signer tested against botocore's case by case,
and they need no dependency beyond aiohttp, which hubd already has.

Consistency: the snapshot records each object's ETag; every GET carries ``If-Match`` with
it, so S3 refuses (412) an object replaced since the listing and the hub answers
``stale-version`` (or ends an answer already under way short, which the spoke refuses): a
spoke never receives bytes of two versions under one version.
"""
