"""The read path: from a FUSE read to bytes, and the fills ahead of readers.

- ``reader``: one request: hints, trace, deadline, metrics.
- ``block_source``: the one entry to the block cache (look, claim, fetch, stage, answer).
- ``claims``, ``grid``: single flight, and the requests on the hub client's grid.
- ``stream``, ``prefetcher``, ``dir_fill``: read-ahead and directory fills, sized from the
  link (``hub.link_model``).
- ``trace``: the access trace the reads record.
"""
