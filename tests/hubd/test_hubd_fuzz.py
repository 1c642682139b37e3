"""Fuzz a real hubd over raw sockets: hostile requests of every kind, a fixed seeded budget.

Each category sends ``CASES`` requests built by a seeded generator (the same bytes on every
run), one connection each, and checks every answer: a status in its allowed set (4xx, or
2xx/206 where the request is valid, with the right bytes), never a 5xx, never a connection
dropped without an answer, never a byte from outside ROOT. After each category hubd must
still be alive, answer ``/healthz``, have logged no traceback and no ERROR, and its RSS
must have grown by less than ``RSS_GROWTH_MAX``. Slow clients (a header sent one byte per
100 ms, a pack body likewise) must be cut off within the idle timeout.

Every category prints its case count and status histogram (``pytest -s`` shows them).
"""

from __future__ import annotations

import collections
import contextlib
import random
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

import pytest
import xxhash

from spokefs import protocol
from tests.helpers import wire
from tests.hubd.hubd_testlib import (
    DATA,
    Hub,
    Tree,
    decode_snapshot,
    framed,
    paths_of,
    start_hub_process,
)

SEED = 20261202
CASES = 200  # per category
IDLE_TIMEOUT_S = 2.0  # hubd's --idle-timeout for this module
SLOW_CLIENTS = 6
SLOW_BYTE_INTERVAL_S = 0.1
RSS_GROWTH_MAX = 50 << 20
TOKEN = "fuzz-T0ken_value"
SECRETS = (b"outside secret", b"root:x:0:0")  # tree.outside/secret.txt, /etc/passwd


# -- raw HTTP ---------------------------------------------------------------------------


@dataclass
class Reply:
    """What came back on one connection: ``status`` None means no answer at all."""

    status: int | None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    raw: bytes = b""


def exchange(port: int, raw: bytes, timeout_s: float = 10.0) -> Reply:
    """Send ``raw`` on a fresh connection and read until hubd closes it."""
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        # hubd may close early on an oversized request: read what it said
        with contextlib.suppress(OSError):
            sock.sendall(raw)
        try:
            while chunk := sock.recv(1 << 16):
                data += chunk
        except OSError:
            pass
    return parse_reply(data)


def parse_reply(data: bytes) -> Reply:
    head, sep, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if not sep or len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return Reply(None, raw=data)
    status = int(parts[1])
    if 100 <= status < 200 and body:  # an interim answer (100 Continue): the real one follows
        return parse_reply(body)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return Reply(status, headers, body, data)


def request(method: str, target: bytes | str, headers: dict[str, str] | None = None,
            body: bytes = b"", version: str = "HTTP/1.1") -> bytes:
    """A well-formed request (closing the connection after the answer)."""
    if isinstance(target, str):
        target = target.encode()
    lines = [method.encode() + b" " + target + b" " + version.encode(), b"Host: hub",
             b"Connection: close"]
    for name, value in (headers or {}).items():
        lines.append(name.encode() + b": " + value.encode("utf-8", "surrogateescape"))
    if body or method == "POST":
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


# -- the hub and its invariants -----------------------------------------------------------


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@dataclass
class Target:
    """A running hub plus what the fuzzers aim at."""

    hub: Hub
    port: int
    entries: dict[bytes, protocol.Entry]
    rss_start: int

    @property
    def data(self) -> protocol.Entry:
        return self.entries[b"sub/deeper/data.bin"]

    def assert_healthy(self) -> None:
        assert self.hub.proc.poll() is None, f"hubd died:\n{self.hub.stderr()}"
        assert exchange(self.port, request("GET", protocol.HEALTH_PATH)).status == 200
        err = self.hub.stderr()
        assert "Traceback" not in err and " ERROR " not in err, err[-4000:]
        grown = rss_bytes(self.hub.proc.pid) - self.rss_start
        assert grown < RSS_GROWTH_MAX, f"hubd RSS grew by {grown >> 20} MiB"


def _start(tree: Tree, tmp: Path, name: str, *args: str) -> Iterator[Target]:
    hub = start_hub_process(tree.root, tmp / f"{name}.err", "--idle-timeout",
                            str(IDLE_TIMEOUT_S), *args)
    try:
        port = int(hub.url.rsplit(":", 1)[1])
        auth = {"Authorization": f"Bearer {TOKEN}"} if args else {}
        entries = paths_of(decode_snapshot(hub.request(protocol.SNAPSHOT_PATH, auth).body)[1])
        for _ in range(20):  # warm up: first requests import and allocate for good
            exchange(port, request("GET", protocol.blob_path(2, 2), auth))
        hub.close_conn()
        yield Target(hub, port, entries, rss_bytes(hub.proc.pid))
    finally:
        assert hub.stop() == 0, hub.stderr()


@pytest.fixture(scope="module")
def target(module_tree: Tree, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    yield from _start(module_tree, tmp_path_factory.mktemp("fuzz"), "hubd")


@pytest.fixture(scope="module")
def guarded(module_tree: Tree, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    tmp = tmp_path_factory.mktemp("fuzz-token")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    yield from _start(module_tree, tmp, "hubd-token", "--token-file", str(token_file))


def run_category(name: str, target: Target, make: Callable[[random.Random], tuple[bytes, Check]],
                 cases: int = CASES) -> collections.Counter[int | None]:
    """Send ``cases`` generated requests, check each answer, print the histogram."""
    rng = random.Random(f"{SEED}-{name}")
    seen: collections.Counter[int | None] = collections.Counter()
    for i in range(cases):
        raw, check = make(rng)
        reply = exchange(target.port, raw)
        seen[reply.status] += 1
        where = f"{name} case {i}: {raw[:300]!r}\n-> {reply.raw[:300]!r}"
        assert reply.status is not None, f"no answer: {where}"
        assert reply.status < 500, where
        assert not any(s in reply.body for s in SECRETS), where
        check(reply, where)
    target.assert_healthy()
    histogram = ", ".join(f"{k}: {v}" for k, v in sorted(seen.items(), key=str))
    print(f"\nfuzz {name}: {cases} cases, statuses {{{histogram}}}")
    return seen


Check = Callable[[Reply, str], None]


def status_in(*allowed: int) -> Check:
    def check(reply: Reply, where: str) -> None:
        assert reply.status in allowed, where
    return check


# -- generators -----------------------------------------------------------------------------

HUGE = ["0", "1", "-1", "99999999999999999999999", str(2**63), str(2**63 - 1), str(2**64),
        str(2**64 - 1), "-" + str(2**63), "00000000000000000000000001", "1e3", "0x10", "+1",
        "\u0661", "1.5", " 1", "1 ", ""]


def hostile_range(rng: random.Random, size: int) -> str:
    kind = rng.randrange(10)
    if kind == 0:  # printable garbage
        return "".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(0, 80)))
    if kind == 1:
        return rng.choice(["bytes=", "bytes=-", "bytes=--1", "bytes=1--2", "bytes=,", "bytes=-,-",
                           "bytes=0-1,", "bytes=,0-1", "bytes", "=0-1", "bytes==0-1"])
    if kind == 2:  # huge, negative, overflowing numbers
        return f"bytes={rng.choice(HUGE)}-{rng.choice(HUGE)}"
    if kind == 3:  # many ranges (the longest go past aiohttp's 8190-byte field limit)
        n = rng.choice([2, 3, 10, 100, 1000, 2000])
        return "bytes=" + ",".join(f"{i}-{i}" for i in range(n))
    if kind == 4:  # whitespace and case tricks
        return rng.choice([" bytes=0-1", "bytes =0-1", "bytes=\t0-1", "bytes=0 - 1", "bytes=0-1 ",
                           "BYTES=0-1", "Bytes=0-1", "bytes= 0-1", "bytes=0-\t1", "bytes=0-1\t"])
    if kind == 5:
        return rng.choice(["items=0-1", "bytes:0-1", "bytes=0-1;q=1", "bytes=a-b", "bytes=0x0-0x10",
                           "bytes=\u0661-\u0662", "bytes=½-1", "bytes=0-1\x0b"])
    if kind == 6:  # edges of the file
        a = rng.choice([0, size - 1, size, size + 1, 2**62])
        b = rng.choice([a, a + 1, size - 1, size, size + 10**6, a - 1])
        return f"bytes={a}-{b}"
    if kind == 7:
        return f"bytes=-{rng.choice([0, 1, size, size + 1, 10**30])}"
    a = rng.randrange(size)  # valid ranges: the bytes must be right
    b = rng.randrange(a, min(size, a + 20000))
    return f"bytes={a}-{b}" if kind == 8 else f"bytes={a}-"


def make_range(target: Target) -> Callable[[random.Random], tuple[bytes, Check]]:
    entry = target.data
    path = protocol.blob_path(entry.file_id, entry.version)
    want = framed(DATA, entry.file_id, entry.version)

    def check(reply: Reply, where: str) -> None:
        assert reply.status in (200, 206, 400, 416), where
        if reply.status == 206:
            first, last = (int(x) for x in reply.headers["content-range"]
                           .removeprefix("bytes ").split("/")[0].split("-"))
            assert reply.body == want[first : last + 1], where
        elif reply.status == 200:
            assert reply.body == want, where

    def make(rng: random.Random) -> tuple[bytes, Check]:
        value = hostile_range(rng, len(want))
        raw = request("GET", path, {"Range": value})
        if rng.random() < 0.1:  # the header twice
            raw = raw.replace(b"\r\n\r\n", b"\r\nRange: bytes=0-1\r\n\r\n")
        return raw, check

    return make


def hostile_id(rng: random.Random, good: int) -> str:
    kind = rng.randrange(8)
    if kind == 0:
        return protocol.format_id(rng.getrandbits(64))  # well formed, unknown
    if kind == 1:
        return protocol.format_id(good)
    if kind == 2:
        return protocol.format_id(good).upper()
    if kind == 3:
        return protocol.format_id(good)[: rng.choice([0, 1, 15])] + rng.choice(["", "0", "00"])
    if kind == 4:
        return "".join(rng.choice("0123456789abcdefgxyzGHXZ-+_. ~") for _ in range(16))
    if kind == 5:
        return rng.choice(["0x" + protocol.format_id(good)[2:], "-000000000000001", "%00" * 16,
                           "%30" * 16, "%2e%2e", "%ff%fe", "%c3%a9" * 8, "%2f" * 16,
                           "0" * 10000, "ffffffffffffffff", "0000000000000000", "1" * 17])
    if kind == 6:
        return protocol.format_id(good) + rng.choice(["%00", "/", "%2f", "?x=1", "#", ";x", "/.."])
    return protocol.format_id(rng.choice([0, 1, 2**64 - 1, good + 1]))


def make_ids(target: Target) -> Callable[[random.Random], tuple[bytes, Check]]:
    entry = target.data
    files = [e for e in target.entries.values() if not e.is_dir]

    def check(reply: Reply, where: str) -> None:
        assert reply.status in (200, 206, 400, 404, 405, 412, 416), where
        if reply.status in (200, 206):
            assert len(reply.body) == int(reply.headers["content-length"]), where

    def make(rng: random.Random) -> tuple[bytes, Check]:
        good = rng.choice(files)
        fid = hostile_id(rng, good.file_id)
        ver = hostile_id(rng, good.version if rng.random() < 0.5 else entry.version)
        headers = {"Range": "bytes=0-99"} if rng.random() < 0.5 else {}
        return request("GET", f"/v2/blob/{fid}/{ver}", headers), check

    return make


SEGMENTS = ["..", "%2e%2e", "%2E%2E", ".%2e", ".", "%2e", "", "etc", "passwd", "%00", "%2f", "v2",
            "blob", "snapshot", "changes", "pack", "%ff", "~", "outside", "secret.txt", "..;",
            "%252e%252e", "\\..", "..%5c", "%c0%ae%c0%ae", "healthz", "metrics"]


def make_paths(target: Target) -> Callable[[random.Random], tuple[bytes, Check]]:
    entry = target.data
    blob = protocol.blob_path(entry.file_id, entry.version)
    prefixes = ["", "/", "/v1", "/v2", "/v2/blob", "/v2/pack", blob, "/v2/snapshot",
                "/v2/changes", "/v1/blob", "//", "/./"]

    def make(rng: random.Random) -> tuple[bytes, Check]:
        kind = rng.randrange(6)
        if kind < 3:
            segs = [rng.choice(SEGMENTS) for _ in range(rng.randrange(1, 12))]
            target_ = rng.choice(prefixes) + "/" + "/".join(segs)
        elif kind == 3:  # very long paths (past 8190 bytes: aiohttp's 400)
            target_ = "/v2/blob/" + "a/" * rng.choice([100, 1000, 4000, 5000])
        elif kind == 4:  # query strings on every route
            since = rng.choice(["", "0", "-1", "x", "1" * 30, str(2**64), "%00", "1&since=2"])
            target_ = rng.choice(["/v2/changes", "/v2/snapshot", blob]) + f"?since={since}"
        else:
            target_ = rng.choice(["http://evil/v2/snapshot", "*", "/v2/blob/../../etc/passwd",
                                  "/v2/blob/%2e%2e/%2e%2e/etc/passwd", "//v2//snapshot",
                                  "/v2/blob/..%2f..%2f..%2fetc%2fpasswd", "/%2e%2e/%2e%2e/etc",
                                  "/v2/snapshot/", "/V2/SNAPSHOT", "/v2/snapshot%00",
                                  "/healthz/../v2/snapshot", "/metrics/../v2/snapshot",
                                  "/v2/pack/../../etc/passwd", "/v1/snapshot"])
        method = rng.choice(["GET", "GET", "HEAD", "POST"])
        return request(method, target_), status_in(200, 400, 404, 405, 410, 411, 412, 413,
                                                   416)

    return make


def make_oversized(target: Target) -> Callable[[random.Random], tuple[bytes, Check]]:
    def make(rng: random.Random) -> tuple[bytes, Check]:
        n = rng.randrange(8191, 65536)
        kind = rng.randrange(5)
        if kind == 0:  # a long request target
            raw = request("GET", "/v1/" + "x" * n)
        elif kind == 1:  # a long header value
            raw = request("GET", protocol.SNAPSHOT_PATH, {"X-Big": "v" * n})
        elif kind == 2:  # a long header name
            raw = request("GET", protocol.SNAPSHOT_PATH, {"X" * n: "v"})
        elif kind == 3:  # too many headers (aiohttp allows 128)
            raw = request("GET", protocol.SNAPSHOT_PATH,
                          {f"X-H{i}": "v" for i in range(rng.randrange(129, 2000))})
        else:  # a long Range header
            raw = request("GET", protocol.blob_path(2, 2), {"Range": "bytes=" + "0" * n + "-1"})
        return raw, status_in(400, 413, 414, 431)

    return make


METHODS = ["G@T", "get", "FOO", "GET\x00", "M" * 300, "", "CONNECT", "TRACE", "DELETE", "PUT",
           "OPTIONS", "HEAD", "PRI", "GET GET", "\x16\x03\x01"]
VERSIONS = ["HTTP/1.1", "HTTP/1.0", "HTTP/9.9", "HTTP/1.x", "HTTPS/1.1", "", "HTTP/0.9",
            "http/1.1", "HTTP/1.1 extra", "HTTP/01.1", "HTTP/2.0", "HTTP/1.1\x00"]
HEADER_TRICKS = [b"NoColon", b"Host : x", b"X: a\r\n folded", b"X\x00: y", b"Content-Length: -1",
                 b"Content-Length: 1\r\nContent-Length: 2", b"Content-Length: 99999999999999999999",
                 b"Transfer-Encoding: chunked\r\nContent-Length: 5", b"Transfer-Encoding: gzip",
                 b"Expect: 100-continue", b": empty-name", b"X: \x7f\x01", b"Content-Length: 0x10",
                 b"Connection: keep-alive, Upgrade\r\nUpgrade: h2c", b"Host: a\r\nHost: b"]


def make_http(target: Target) -> Callable[[random.Random], tuple[bytes, Check]]:
    def make(rng: random.Random) -> tuple[bytes, Check]:
        kind = rng.randrange(4)
        if kind == 0:  # bad request lines
            path = rng.choice(["/healthz", protocol.SNAPSHOT_PATH, "/"])
            line = (f"{rng.choice(METHODS)} {path} "
                    f"{rng.choice(VERSIONS)}").encode("latin-1")
            raw = line + b"\r\nHost: hub\r\nConnection: close\r\n\r\n"
        elif kind == 1:  # bad header lines
            raw = (b"GET /healthz HTTP/1.1\r\nHost: hub\r\n" + rng.choice(HEADER_TRICKS)
                   + b"\r\nConnection: close\r\n\r\n")
        elif kind == 2:  # random bytes, ended like a request
            raw = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 400))) + b"\r\n\r\n"
        else:  # bad line endings and chunked bodies
            raw = rng.choice([
                b"GET /healthz HTTP/1.1\nHost: hub\nConnection: close\n\n",
                b"GET /healthz HTTP/1.1\r\nHost: hub\nConnection: close\r\n\r\n",
                b"POST /v1/pack HTTP/1.1\r\nHost: hub\r\nTransfer-Encoding: chunked\r\n"
                b"Connection: close\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
                b"POST /v1/pack HTTP/1.1\r\nHost: hub\r\nTransfer-Encoding: chunked\r\n"
                b"Connection: close\r\n\r\n10\r\n" + bytes(16) + b"\r\n0\r\n\r\n",
                b"POST /v1/pack HTTP/1.1\r\nHost: hub\r\nTransfer-Encoding: chunked\r\n"
                b"Connection: close\r\n\r\nffffffffffffffffffff\r\nx\r\n0\r\n\r\n",
                b"\r\n\r\nGET /healthz HTTP/1.1\r\nHost: hub\r\nConnection: close\r\n\r\n",
            ])
        return raw, status_in(200, 400, 404, 405, 413, 501)

    return make


def make_pack(target: Target) -> Callable[[random.Random], tuple[bytes, Check]]:
    entries = list(target.entries.values())
    dirs = [e for e in entries if e.is_dir]
    plans = {p.path: p for d in dirs for p in protocol.plan_packs(
        d.file_id, [(e.name, e.file_id, e.version, e.size) for e in entries
                    if e.parent_id == d.file_id and not e.is_dir and not e.is_symlink])}
    by_key = {(e.file_id, e.version): e for e in entries}

    def make(rng: random.Random) -> tuple[bytes, Check]:
        plan = rng.choice(list(plans.values()))
        kind = rng.randrange(4)
        index = rng.choice(["0", "1", "00", "-0", "+1", "4294967296", "9" * 12, "x", "", "%30"])
        digest = rng.choice([plan.digest, plan.digest.upper(), plan.digest[:-1], "0" * 16,
                             plan.digest + "0", "%00" * 8, ""])
        if kind == 0:
            path = plan.path
        elif kind == 1:  # hostile dir ids
            path = f"/v2/pack/{hostile_id(rng, plan.dir_id)}/{plan.index}/{plan.digest}"
        else:
            path = f"/v2/pack/{protocol.format_id(plan.dir_id)}/{index}/{digest}"

        def check(reply: Reply, where: str) -> None:
            assert reply.status in (200, 400, 404, 412), where
            if reply.status == 200:
                good = plans[unquote(path)]  # %30 is "0" to the hub
                answer = wire.decode_pack(reply.body, good.items)
                for key, rec in answer.items():
                    assert rec is not None, where
                    assert rec[1] == xxhash.xxh3_64_intdigest(rec[0]), where
                    assert len(rec[0]) == by_key[key].size, where

        return request("GET", path), check

    return make


def make_auth(target: Target) -> Callable[[random.Random], tuple[bytes, Check]]:
    entry = target.data
    pack = f"/v2/pack/{protocol.format_id(entry.parent_id)}/0/{'0' * 16}"
    paths = [protocol.SNAPSHOT_PATH, protocol.blob_path(entry.file_id, entry.version), pack,
             f"{protocol.CHANGES_PATH}?since=0", "/no/such/route", "/v2/blob/x/y", "/v1/blob/x/y"]

    def make(rng: random.Random) -> tuple[bytes, Check]:
        kind = rng.randrange(8)
        values = {
            0: None, 1: f"Bearer {TOKEN}", 2: f"bearer {TOKEN}", 3: f"Bearer {TOKEN[:-1]}",
            4: f"Bearer {TOKEN}x", 5: f"Bearer  {TOKEN}", 6: TOKEN,
            7: "Bearer " + "".join(chr(rng.randrange(33, 0x3000)) for _ in range(len(TOKEN))),
        }
        value = values[kind]
        headers = {} if value is None else {"Authorization": value}
        path = rng.choice(paths)

        def check(reply: Reply, where: str) -> None:
            if kind == 1:
                assert reply.status != 401, where
                return
            assert TOKEN.encode() not in reply.raw, where
            if reply.status == 400 and kind == 7:  # a byte aiohttp's parser refuses
                assert protocol.HEADER_ERROR.lower() not in reply.headers, where
                return
            assert reply.status == 401, where

        return request("GET", path, headers), check

    return make


# -- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, factory", [
    ("range", make_range), ("ids", make_ids), ("paths", make_paths),
    ("oversized", make_oversized), ("http", make_http), ("pack", make_pack),
])
def test_fuzz(name: str, factory: Callable[[Target], Callable[..., tuple[bytes, Check]]],
              target: Target) -> None:
    run_category(name, target, factory(target))


def test_fuzz_token(guarded: Target) -> None:
    run_category("auth", guarded, make_auth(guarded))


def _dribble(port: int, prefix: bytes, slow: bytes, closed: list[float],
             errors: list[str]) -> None:
    """Send ``prefix`` at once, then ``slow`` one byte per SLOW_BYTE_INTERVAL_S, until hubd
    closes the connection (or answers); record how long that took."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(prefix)
            for byte in slow:
                if select.select([sock], [], [], 0)[0]:
                    break  # hubd closed the connection (or answered): cut off
                sock.sendall(bytes((byte,)))
                time.sleep(SLOW_BYTE_INTERVAL_S)
            else:
                errors.append(f"sent all of {prefix + slow!r} without being cut off")
                return
        except OSError:
            pass  # a reset is a close too
    closed.append(time.monotonic() - start)


def test_slow_clients_are_cut_off(target: Target) -> None:
    """Headers (and a pack body) sent one byte per 100 ms: hubd closes each connection
    within the idle timeout (plus slack), and keeps answering everyone else meanwhile."""
    header = request("GET", protocol.SNAPSHOT_PATH, {"X-Pad": "p" * 200})
    pack = request("POST", protocol.PACK_PATH, {"Content-Type": "application/octet-stream"},
                   bytes(16 * 64))
    head_len = pack.index(b"\r\n\r\n") + 4
    closed: list[float] = []
    errors: list[str] = []
    jobs = [(b"", header)] * SLOW_CLIENTS + [(pack[:head_len], pack[head_len:])] * 2
    threads = [threading.Thread(target=_dribble, args=(target.port, prefix, slow, closed, errors),
                                daemon=True)
               for prefix, slow in jobs]
    for t in threads:
        t.start()
    time.sleep(0.5)
    for _ in range(5):  # the hub serves others while the slow clients hang on
        health = request("GET", protocol.HEALTH_PATH)
        assert exchange(target.port, health, timeout_s=2).status == 200
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert len(closed) == SLOW_CLIENTS + 2
    bound = IDLE_TIMEOUT_S + 2.0  # aiohttp's timer plus scheduling slack on a busy machine
    assert max(closed) < bound, closed
    target.assert_healthy()
    print(f"\nfuzz slow: {SLOW_CLIENTS} slow-header and 2 slow-body clients, closed after "
          f"{min(closed):.1f}-{max(closed):.1f} s (idle timeout {IDLE_TIMEOUT_S} s)")
