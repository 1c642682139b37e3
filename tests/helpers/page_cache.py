"""Dropping a file's pages from the kernel's page cache: ``benchlib.page_cache``, which the
benchmarks that count the mount's reads use too."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from benchlib.page_cache import drop_pages, resident_pages

__all__ = ["drop_pages", "resident_pages"]
