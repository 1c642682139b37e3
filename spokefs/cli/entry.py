"""Console entry points: ``spokefs`` and ``mount.spokefs``.

They only import the real command line once the spoke's dependencies are known to be
there, so an install without them (``pip install 'spokefs[hub]'`` on a hub host) answers
with one line naming the install command instead of an ImportError traceback. The FUSE layer
(pyfuse3) loads only when a mount starts, so the same line answers a mount without it.
"""

from __future__ import annotations

import sys

SPOKE_MODULES = ("pyfuse3", "trio", "lmdb", "httpx")
INSTALL_HINT = "pip install 'spokefs[spoke]'"


def _missing(prog: str, exc: ImportError) -> int:
    print(f"{prog}: error: the spoke's dependencies are not installed (no module "
          f"{exc.name!r}); install them with: {INSTALL_HINT}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """``spokefs ...``"""
    try:
        from spokefs.cli.main import main as cli_main

        return cli_main(argv)  # mounting imports the FUSE layer (pyfuse3) only now
    except ImportError as exc:
        if exc.name not in SPOKE_MODULES:
            raise
        return _missing("spokefs", exc)


def mount_helper(argv: list[str] | None = None) -> int:
    """``mount.spokefs SOURCE DIR [-o OPTIONS]``, as mount(8) calls it."""
    try:
        from spokefs.cli.mount_helper import main as helper_main

        return helper_main(argv)  # mounting imports the FUSE layer (pyfuse3) only now
    except ImportError as exc:
        if exc.name not in SPOKE_MODULES:
            raise
        return _missing("mount.spokefs", exc)
