"""The replicated namespace: the hub's tree in a local LMDB.

- ``replica``: ``Namespace``: lookups, listings, generations.
- ``snapshot_load``: a full snapshot loaded in a child process.
- ``refresher``: keeps the replica in step with the hub.
- ``seal``: the digest checked at open.
"""
