"""The block cache: verified 4 KiB blocks of file versions in an LMDB environment on local disk.

- ``block_cache``: ``BlockCache``, what the rest of the spoke uses (inline reads, write-behind
  staging, the writer task, hit accounting) and the docstring with the whole policy.
- ``store``: ``ChunkStore``, the LMDB transactions (reads, fills, promotions, drops).
- ``eviction``: ``Evictor``, which chunks leave when the cache is over its quota.
- ``policy``: ``AccessClock``, the visit counts and re-use intervals eviction learns from.
- ``layout``: the records (keys, chunk headers, totals) and the on-disk layout version.
"""
