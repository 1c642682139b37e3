"""The hub client: HTTP to hubd (or a regional tier) and replica failover.

- ``client``: ``HubClient``: snapshot, changes, framed ranges, packs.
- ``bodies``: reading and checking answer bodies.
- ``origins``: which replica, failover and failback.
- ``link_model``: what the far link has shown (round trip, delivery rate) and how many
  requests keep it full.
"""
