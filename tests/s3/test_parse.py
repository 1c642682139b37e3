"""The S3 client's parsers on answers a server could send, and its URLs (no server needed)."""

from __future__ import annotations

import pytest

from hubd.s3.client import error_of, parse_list_page, parse_timestamp_ns
from hubd.s3.errors import (
    AccessDenied,
    BadS3Answer,
    BucketMissing,
    ObjectChanged,
    ObjectMissing,
    S3Unavailable,
)

NS = ' xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


def page(contents: str, *, ns: str = NS, extra: str = "", encoding: str = "url",
         truncated: str = "false") -> bytes:
    enc = f"<EncodingType>{encoding}</EncodingType>" if encoding else ""
    return (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult{ns}><Name>b</Name>'
            f"{enc}<IsTruncated>{truncated}</IsTruncated>{contents}{extra}"
            "</ListBucketResult>").encode()


def obj(key: str, size: str = "5", etag: str = "&quot;e&quot;",
        stamp: str = "2026-12-03T08:00:31.123Z") -> str:
    return (f"<Contents><Key>{key}</Key><LastModified>{stamp}</LastModified>"
            f"<ETag>{etag}</ETag><Size>{size}</Size></Contents>")


def test_keys_prefixes_and_token() -> None:
    body = page(obj("a%2Fb+c%2B%25") + obj("plain"),
                extra="<CommonPrefixes><Prefix>d%20x%2F</Prefix></CommonPrefixes>"
                      "<NextContinuationToken>tok/en==</NextContinuationToken>",
                truncated="true")
    result = parse_list_page(body)
    assert [(o.key, o.size, o.etag) for o in result.objects] == [
        ("a/b c+%", 5, '"e"'), ("plain", 5, '"e"')]
    assert result.prefixes == ["d x/"]
    assert result.next_token == "tok/en=="
    assert result.objects[0].mtime_ns == 1_796_284_831_123_000_000


def test_without_namespace_or_url_encoding() -> None:
    result = parse_list_page(page(obj("a+b%20c &amp; d"), ns="", encoding=""))
    assert [o.key for o in result.objects] == ["a+b%20c & d"]
    assert result.next_token is None


@pytest.mark.parametrize(("body", "match"), [
    (b"not xml", "not XML"),
    (b"<Error><Code>X</Code></Error>", "is a Error"),
    (page(obj("k", size="big")), "malformed object"),
    (page("<Contents><Key>k</Key></Contents>"), "malformed object"),
    (page("", truncated="true"), "no NextContinuationToken"),
])
def test_malformed_pages(body: bytes, match: str) -> None:
    with pytest.raises(BadS3Answer, match=match):
        parse_list_page(body)


def test_timestamps() -> None:
    assert parse_timestamp_ns("1970-01-01T00:00:01Z") == 10**9
    assert parse_timestamp_ns("1970-01-01T00:00:00.000001+00:00") == 1000
    assert parse_timestamp_ns("1969-12-31T23:59:59Z") == -(10**9)


def error_body(code: str) -> bytes:
    return f"<Error><Code>{code}</Code><Message>m</Message></Error>".encode()


@pytest.mark.parametrize(("status", "code", "kind"), [
    (412, "PreconditionFailed", ObjectChanged), (404, "NoSuchKey", ObjectMissing),
    (404, "NoSuchBucket", BucketMissing), (403, "AccessDenied", AccessDenied),
    (403, "SignatureDoesNotMatch", AccessDenied), (400, "ExpiredToken", AccessDenied),
    (503, "SlowDown", S3Unavailable), (500, "InternalError", S3Unavailable),
    (429, "", S3Unavailable), (400, "InvalidArgument", BadS3Answer), (416, "", BadS3Answer),
])
def test_error_table(status: int, code: str, kind: type) -> None:
    exc = error_of(status, error_body(code) if code else b"", "GET s3://b/k")
    assert type(exc) is kind
    assert str(exc).startswith(f"GET s3://b/k: HTTP {status}")
    assert (exc.status, exc.code) == (status, code)


def test_urls_path_and_virtual_hosted_style() -> None:
    from hubd.s3.client import S3Client, S3Config
    from hubd.s3.sigv4 import Credentials

    creds = Credentials("k", "s")
    path = S3Client(S3Config("http://127.0.0.1:9000"), creds)
    assert path.url("bkt", "a b/ç+%.txt") == "http://127.0.0.1:9000/bkt/a%20b/%C3%A7%2B%25.txt"
    assert path.url("bkt", query="list-type=2") == "http://127.0.0.1:9000/bkt?list-type=2"
    virtual = S3Client(S3Config("https://s3.eu-west-1.amazonaws.com", virtual_hosted=True),
                       creds)
    assert virtual.url("bkt", "k/1") == "https://bkt.s3.eu-west-1.amazonaws.com/k/1"
    assert virtual.url("bkt", query="x=1") == "https://bkt.s3.eu-west-1.amazonaws.com/?x=1"
    for bad in ("ftp://h", "http://", "http://h/path", "http://h?q=1"):
        with pytest.raises(ValueError, match="bad S3 endpoint"):
            S3Client(S3Config(bad), creds)
