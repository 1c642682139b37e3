"""The command line: ``spokefs`` and ``mount.spokefs``. Loads no FUSE module until a mount runs.

- ``entry``: the console entry points.
- ``main``: argument parsing and ``spokefs mount``.
- ``commands``, ``job_commands``: clients of a running mount's control interface.
- ``mount_helper``: the mount(8) helper for fstab.
- ``sdnotify``: systemd readiness.
"""
