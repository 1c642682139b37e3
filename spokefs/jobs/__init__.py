"""Job-aware prefetch: traces, replays and pins.

- ``trace_file``: the portable trace file.
- ``replay``: a trace's working set fetched ahead.
- ``pins``: files never evicted.
- ``control``: the control attributes behind ``spokefs trace|warm|pin``.
"""
