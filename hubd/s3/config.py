"""Settings of a bucket export (no aiohttp import: ``cli.py`` builds them before aiohttp loads).

``S3Config`` says how to reach the endpoint; ``BucketSpec`` what to export with which keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hubd.s3.sigv4 import Credentials

MIB = 1024 * 1024
AWS_DEFAULT_REGION = "us-east-1"


@dataclass(frozen=True, slots=True)
class S3Config:
    """How to reach one S3 endpoint.

    Attributes:
        endpoint: ``http(s)://host[:port]`` (no path), e.g. ``https://s3.eu-west-1.amazonaws.com``.
        region: the signing region (``us-east-1`` for most S3-compatible servers).
        virtual_hosted: address buckets as ``BUCKET.host`` instead of ``host/BUCKET``
            (path style, the default: every S3-compatible server takes it, and AWS does).
        deadline_s: one request, all its retries included, must end within this long.
            10 s: a spoke request may first wait up to ``read_wait_s`` (20 s) for a read
            slot, and the hub's answer must still come before the spoke's 30 s request
            timeout, so the spoke gets a 503 it retries rather than a timeout.
        connect_timeout_s, read_timeout_s: one attempt's connect, and its longest silence
            while reading; an attempt stuck longer is abandoned and retried.
        retry_base_s, retry_cap_s: the backoff (see the module docstring). 50 ms doubles to
            the 2 s cap in 6 attempts: ~8 attempts fit a 10 s deadline.
        max_connections: the pool's size; every hub read holds at most one connection per
            part, so this bounds parallel GETs (and SlowDown risk) per hub.
        part_bytes: a range longer than this is fetched as parallel parts of this size.
            8 MiB: AWS's guidance for parallel ranged GETs is 8-16 MiB per part. The bucket
            reader asks for at most 5 MiB at a time (``reader._GET_SLICES`` slices), so
            only longer direct ``S3Client.get`` calls are split.
    """

    endpoint: str
    region: str = "us-east-1"
    virtual_hosted: bool = False
    deadline_s: float = 10.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0
    retry_base_s: float = 0.05
    retry_cap_s: float = 2.0
    max_connections: int = 64
    part_bytes: int = 8 * MIB


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """``s3://BUCKET[/PREFIX]`` and how to reach it.

    Attributes:
        bucket, prefix: what to export (prefix "" for the whole bucket).
        client: the endpoint settings.
        creds: the keys (never logged: ``repr=False``; ``creds.source`` says where from).
        list_workers: parallel LIST streams per listing (``listing.DEFAULT_WORKERS``).
    """

    bucket: str
    prefix: str
    client: S3Config
    creds: Credentials = field(repr=False)
    list_workers: int = 8

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def aws_endpoint(region: str) -> str:
    """AWS S3's regional endpoint."""
    return f"https://s3.{region}.amazonaws.com"
