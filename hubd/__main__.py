"""``python -m hubd``: the same as the ``hubd`` console script."""

from __future__ import annotations

from hubd.cli import main

raise SystemExit(main())
