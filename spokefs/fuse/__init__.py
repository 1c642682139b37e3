"""The FUSE layer: the only part of the spoke that imports pyfuse3.

- ``ops``: ``SpokeOps``, thin handlers over the namespace and the read path.
- ``errors``: the errno boundary (domain exceptions to ``FUSEError``).
- ``kernel``: what the spoke asks of the kernel outside requests (read-ahead, invalidations).
- ``inode_streams``, ``page_cache``: per-inode streams and the page-cache rule.
- ``control``: the control interface (extended attributes of the mount root).
- ``mount``: the mount's lifecycle; it wires every component and runs the loop.
"""
