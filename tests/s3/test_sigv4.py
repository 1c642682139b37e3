"""``hubd.s3.sigv4.sign`` against botocore's ``S3SigV4Auth``, the reference signer.

botocore is a test-only dependency: hubd signs its own requests (see ``hubd/s3/__init__``),
and the tests compare every header that signer produces with botocore's for the same
request, time and keys: fixed cases for the awkward parts (odd keys, query strings, ports,
session tokens) and generated ones.
"""

from __future__ import annotations

import datetime
import hashlib

import pytest
from botocore import auth as botocore_auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials as BotoCredentials
from hypothesis import given
from hypothesis import strategies as st

from hubd.s3.sigv4 import EMPTY_SHA256, Credentials, host_header, sign, uri_encode

NOW = datetime.datetime(2026, 12, 3, 8, 15, 42, tzinfo=datetime.UTC)
KEYS = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
TEMP = Credentials("ASIAEXAMPLE", "secret/with+odd=chars", "FwoGZXIvYXdzE//token+with/slashes=")


def botocore_headers(method: str, url: str, headers: dict[str, str], body: bytes,
                     creds: Credentials, region: str, now: datetime.datetime,
                     monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setattr(botocore_auth, "get_current_datetime", lambda: now)
    request = AWSRequest(method=method, url=url, headers=dict(headers), data=body)
    boto_creds = BotoCredentials(creds.access_key_id, creds.secret_access_key,
                                 creds.session_token)
    botocore_auth.S3SigV4Auth(boto_creds, "s3", region).add_auth(request)
    return {k: v for k, v in request.headers.items() if k not in headers}


def check(method: str, url: str, headers: dict[str, str], body: bytes, creds: Credentials,
          region: str, monkeypatch: pytest.MonkeyPatch, now: datetime.datetime = NOW) -> None:
    ours = sign(method, url, headers, hashlib.sha256(body).hexdigest(), creds, region, now)
    theirs = botocore_headers(method, url, headers, body, creds, region, now, monkeypatch)
    assert ours == theirs


def object_url(endpoint: str, bucket: str, key: str) -> str:
    return f"{endpoint}/{bucket}/{uri_encode(key, keep_slash=True)}"


ODD_KEYS = [
    "plain.txt", "dir/sub/file.bin", "with space", "plus+and%percent", "uni/ça/日本語.jpg",
    "a//double", "a/./dot", "a/../up", "trailing/", "~tilde-_.", "q?mark#hash&amp=eq",
    "emoji/🙂", "semi;colon,comma", "'quote\"", "tab\there", "back\\slash", "*star(paren)",
    "@at!bang$dollar", "x" * 1024,
]


@pytest.mark.parametrize("key", ODD_KEYS)
def test_object_get_with_odd_keys(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    url = object_url("http://127.0.0.1:8333", "bucket", key)
    check("GET", url, {"Range": "bytes=0-99", "If-Match": '"0123abcd"'}, b"", KEYS,
          "us-east-1", monkeypatch)


@pytest.mark.parametrize("query", [
    "list-type=2",
    "list-type=2&prefix=a%2Fb%20c&delimiter=%2F&max-keys=1000&encoding-type=url",
    "list-type=2&continuation-token=1%2F%2Babc%3D%3D&start-after=zzz",
    "b=2&a=1&a=0&c=",
    "uploads",
    "prefix=%E6%97%A5%E6%9C%AC&list-type=2",
])
def test_query_strings(query: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check("GET", f"https://s3.eu-west-1.amazonaws.com/bucket?{query}", {}, b"", KEYS,
          "eu-west-1", monkeypatch)


@pytest.mark.parametrize("endpoint", [
    "http://localhost", "http://localhost:80", "https://s3.example.com:443",
    "https://S3.Example.COM:8443", "http://[::1]:9000", "http://10.0.0.1:9000",
])
def test_hosts_and_ports(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check("GET", f"{endpoint}/bucket/key", {}, b"", KEYS, "us-east-1", monkeypatch)


def test_session_token_is_sent_and_signed(monkeypatch: pytest.MonkeyPatch) -> None:
    added = sign("GET", "http://h:1/b/k", {}, EMPTY_SHA256, TEMP, "us-west-2", NOW)
    assert added["X-Amz-Security-Token"] == TEMP.session_token
    assert "x-amz-security-token" in added["Authorization"]
    check("GET", "http://h:1/b/k", {"Range": "bytes=5-"}, b"", TEMP, "us-west-2", monkeypatch)


def test_body_hash_and_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    for method in ("PUT", "post", "HEAD", "DELETE"):
        check(method, "https://s3.amazonaws.com/b/k", {"Content-Type": "text/plain"},
              b"some body bytes", KEYS, "us-east-1", monkeypatch)


def test_header_values_are_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    check("GET", "http://h/b/k", {"X-Amz-Meta-Note": "  two   spaces  here "}, b"", KEYS,
          "us-east-1", monkeypatch)


def test_time_zone_is_utc(monkeypatch: pytest.MonkeyPatch) -> None:
    local = NOW.astimezone(datetime.timezone(datetime.timedelta(hours=-11)))
    assert sign("GET", "http://h/b/k", {}, EMPTY_SHA256, KEYS, "r", local) == \
        sign("GET", "http://h/b/k", {}, EMPTY_SHA256, KEYS, "r", NOW)
    # and just before midnight UTC in a zone where it is already tomorrow
    late = datetime.datetime(2026, 12, 31, 23, 59, 59, tzinfo=datetime.UTC)
    check("GET", "http://h/b/k", {}, b"", KEYS, "ap-southeast-2", monkeypatch, late)


def test_credentials_never_in_repr() -> None:
    text = repr(TEMP)
    assert TEMP.secret_access_key not in text
    assert TEMP.session_token is not None and TEMP.session_token not in text


def test_host_header() -> None:
    assert host_header("https://Example.com:443/x") == "example.com"
    assert host_header("http://example.com:8080/x") == "example.com:8080"
    assert host_header("http://[::1]:80/") == "[::1]"


_key_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=60)


@given(key=_key_text, prefix=_key_text, token=st.none() | _key_text,
       region=st.sampled_from(["us-east-1", "eu-central-1", "auto", "garage"]),
       seconds=st.integers(0, 2**31), start=st.integers(0, 2**40),
       length=st.integers(1, 2**24))
def test_generated_requests(key: str, prefix: str, token: str | None, region: str,
                            seconds: int, start: int, length: int) -> None:
    creds = Credentials("AKID", "secret", token)
    now = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    with pytest.MonkeyPatch.context() as mp:
        check("GET", object_url("http://127.0.0.1:9000", "data-bucket", key),
              {"Range": f"bytes={start}-{start + length - 1}", "If-Match": '"etag-1"'},
              b"", creds, region, mp, now)
        query = (f"list-type=2&prefix={uri_encode(prefix, keep_slash=False)}"
                 f"&delimiter=%2F&encoding-type=url")
        check("GET", f"http://127.0.0.1:9000/data-bucket?{query}", {}, b"", creds, region,
              mp, now)
