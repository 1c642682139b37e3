"""Component tests of the spoke, without the kernel or a hub process. Trio mode is on here only."""

from __future__ import annotations

from pytest_trio.enable_trio_mode import *  # noqa: F403
