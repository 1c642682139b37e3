"""Fixtures of the S3 tests: one real SeaweedFS per session (``seaweed``), a fresh bucket per
test (``bucket``), and a private server for tests that stop it (``own_seaweed``)."""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.seaweed import SeaweedServer

_buckets = itertools.count()


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedServer]:
    with tempfile.TemporaryDirectory(prefix="spokefs-seaweed-") as tmp:
        server = SeaweedServer(Path(tmp) / "data", Path(tmp) / "logs")
        try:
            yield server.start()
        finally:
            server.stop()


@pytest.fixture
def own_seaweed(tmp_path: Path) -> Iterator[SeaweedServer]:
    server = SeaweedServer(tmp_path / "weed-data", tmp_path / "weed-logs")
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def bucket(seaweed: SeaweedServer) -> str:
    name = f"test-{next(_buckets)}-{id(seaweed) % 10000}"
    seaweed.writer().create_bucket(Bucket=name)
    return name
