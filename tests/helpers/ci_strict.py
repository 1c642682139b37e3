"""Under ``CI=true`` a skipped test is a failed test.

Locally a test that needs what this machine lacks (``/dev/fuse``, root, fusermount3,
Debian's prometheus, openssl, torch, ...) skips with its reason. In CI that would turn the
run green while the real-FUSE, Prometheus or DataLoader tests never ran, so here every skip
(a ``skip`` marker, ``pytest.skip()`` in a test or fixture, ``importorskip`` at module level)
becomes a failure that quotes the reason and says how to get what is missing. ``xfail`` is
untouched.

``tests/conftest.py`` imports the two hooks; ``python -m pytest -p tests.helpers.ci_strict``
loads them elsewhere (the tests of this module do).
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

HINT = ("CI must run every test: install what it needs (bash deploy/setup.sh --test) or "
        "run CI on a machine with /dev/fuse and root")


def ci_strict() -> bool:
    """True when ``CI`` is set to a true value (``true``, ``1``, ``yes``)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _reason(longrepr: Any) -> str:
    """The skip reason from a report's ``longrepr`` (a (path, line, reason) tuple)."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail(report: pytest.TestReport | pytest.CollectReport, what: str) -> None:
    report.outcome = "failed"
    report.longrepr = f"CI=true: {what} was skipped: {_reason(report.longrepr)}\n{HINT}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.skipped and ci_strict() and not hasattr(report, "wasxfail"):
        _fail(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if report.skipped and ci_strict():
        _fail(report, f"collecting {collector.nodeid}")
