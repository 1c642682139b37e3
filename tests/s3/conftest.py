"""Fixtures of the S3 tests: one real SeaweedFS per session (``seaweed``), a fresh bucket per
test (``bucket``), a private server for tests that stop it (``own_seaweed``), and
``s3_env``: the server's keys in the environment hubd children inherit, and nothing else
of the AWS configuration (no profile, files, endpoint or region from the machine)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedServer

_buckets = itertools.count()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    tmp = tmp_path_factory.mktemp("seaweed")
    server = SeaweedServer(tmp / "data", tmp / "logs")
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


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                 "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
