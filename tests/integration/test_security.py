"""TLS and the bearer token end to end: a real hubd, a real mount.

- TLS: a throwaway CA and a server certificate for 127.0.0.1 (made with the ``openssl``
  CLI in a temp dir). ``hubd --tls-cert/--tls-key`` serves HTTPS; a spoke trusting the CA
  (``--ca-file``) mounts and reads, a spoke that cannot verify the certificate (system
  roots, another CA, another host name) fails with one line, exit 1, nothing mounted.
- Token: the right token mounts and reads; a wrong or missing one fails with one line.
  Both daemons run at DEBUG: the token is in no log, no metrics scrape, no
  ``/proc/PID/cmdline``, no error line. A token file open to group/others is warned about.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import procs
from tests.helpers.procs import SpokeMount

pytestmark = pytest.mark.fuse

TOKEN = "k3Y-integration_token.0123456789"
READY_RE = re.compile(r"at (https?://\S+) \(")
FILES = {"a.txt": b"alpha\n", "sub/b.bin": bytes(range(256)) * 300}


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path
    other_ca: Path  # a CA that did not sign ``cert``


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is missing (Debian package openssl)")
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key",
                 "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN=spokefs test {ca}", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
             "server.csr", "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                               "extendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    (d / "server.key").chmod(0o600)
    return Certs(d / "ca.pem", d / "server.pem", d / "server.key", d / "other.pem")


@pytest.fixture(scope="module")
def export_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export")
    for name, data in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@dataclass
class Hubd:
    proc: subprocess.Popen
    url: str
    stderr_path: Path

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


@contextlib.contextmanager
def hubd(root: Path, log_dir: Path, *args: str) -> Iterator[Hubd]:
    """A hubd child (http or https); SIGTERM at the end must exit 0."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out, err = log_dir / "hub.out", log_dir / "hub.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([sys.executable, "-m", "hubd", "serve", str(root), "--listen",
                                 "127.0.0.1:0", *args], stdout=o, stderr=e,
                                stdin=subprocess.DEVNULL, cwd=procs.REPO_ROOT,
                                env=procs.child_env())
    try:
        deadline = time.monotonic() + procs.START_TIMEOUT_S
        while not (m := READY_RE.search(out.read_text(errors="replace"))):
            assert proc.poll() is None, f"hubd exited {proc.returncode}:\n{err.read_text()}"
            assert time.monotonic() < deadline, f"hubd not ready:\n{err.read_text()}"
            time.sleep(0.05)
        yield Hubd(proc, m.group(1), err)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=procs.STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    assert rc == 0, f"hubd exited {rc} on SIGTERM:\n{err.read_text()}"


@contextlib.contextmanager
def mounted(url: str, mnt: Path, tmp: Path, *args: str) -> Iterator[SpokeMount]:
    spoke = SpokeMount(url, mnt, tmp / "cache", tmp / "spoke", args)
    try:
        yield spoke.start()
    finally:
        spoke.unmount()
    spoke.assert_clean_exit()




def check_files(mnt: Path) -> None:
    for name, data in FILES.items():
        assert (mnt / name).read_bytes() == data


def run_hubd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hubd", *args], capture_output=True, text=True,
                          cwd=procs.REPO_ROOT, env=procs.child_env(), timeout=30, check=False)


# -- TLS --------------------------------------------------------------------------------------


def test_tls_mount_verifies_the_hub(certs: Certs, export_root: Path, tmp_path: Path,
                                    make_mountpoint: Callable[[str], Path]) -> None:
    with hubd(export_root, tmp_path / "hub", "--tls-cert", str(certs.cert),
              "--tls-key", str(certs.key)) as hub:
        assert hub.url.startswith("https://127.0.0.1:")
        with mounted(hub.url, make_mountpoint("tls"), tmp_path / "ok",
                     "--ca-file", str(certs.ca)) as spoke:
            check_files(spoke.mnt)
        mnt = make_mountpoint("tls-bad")
        system_roots = procs.mount_fails(hub.url, mnt, tmp_path / "c1")
        other_ca = procs.mount_fails(hub.url, mnt, tmp_path / "c2",
                                     "--ca-file", str(certs.other_ca))
        wrong_name = procs.mount_fails(hub.url.replace("127.0.0.1", "localhost"), mnt,
                                       tmp_path / "c3", "--ca-file", str(certs.ca))
        for line in (system_roots, other_ca, wrong_name):
            assert "certificate verify failed" in line, line
        assert "--ca-file" in system_roots
        assert "localhost" in wrong_name
        plain = procs.mount_fails(hub.url.replace("https:", "http:"), mnt, tmp_path / "c4")
        assert "cannot reach the hub" in plain
        assert hub.proc.poll() is None
    err = hub.stderr()
    assert "Traceback" not in err and " ERROR " not in err, err


def test_tls_protocol_floor(certs: Certs, export_root: Path, tmp_path: Path) -> None:
    """TLS 1.2 and 1.3 handshakes work; hubd's context refuses anything older."""
    from hubd.cli import load_tls

    assert load_tls(str(certs.cert), str(certs.key)).minimum_version == ssl.TLSVersion.TLSv1_2
    with hubd(export_root, tmp_path / "hub", "--tls-cert", str(certs.cert),
              "--tls-key", str(certs.key)) as hub:
        port = int(hub.url.rsplit(":", 1)[1])
        for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
            ctx = ssl.create_default_context(cafile=str(certs.ca))
            ctx.minimum_version = ctx.maximum_version = version
            with urllib.request.urlopen(f"{hub.url}/healthz", context=ctx, timeout=10) as resp:
                assert resp.read() == b"ok"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # plain HTTP
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"ok" not in sock.recv(4096)
        ctx = ssl.create_default_context(cafile=str(certs.ca))
        with urllib.request.urlopen(f"{hub.url}/healthz", context=ctx, timeout=10) as resp:
            assert resp.read() == b"ok"  # still serving after the garbage
    assert "Traceback" not in hub.stderr()


@pytest.mark.parametrize("case", ["one-flag", "missing", "not-a-cert", "wrong-key", "encrypted"])
def test_tls_start_up_errors(case: str, certs: Certs, export_root: Path, tmp_path: Path) -> None:
    args = {
        "one-flag": ["--tls-cert", str(certs.cert)],
        "missing": ["--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(certs.key)],
        "not-a-cert": ["--tls-cert", str(certs.key), "--tls-key", str(certs.key)],
        "wrong-key": ["--tls-cert", str(certs.cert), "--tls-key",
                      str(certs.other_ca.with_suffix(".key"))],
        "encrypted": ["--tls-cert", str(certs.cert), "--tls-key", str(tmp_path / "enc.key")],
    }[case]
    if case == "encrypted":
        _openssl("pkey", "-in", str(certs.key), "-aes256", "-passout", "pass:pw", "-out",
                 str(tmp_path / "enc.key"), cwd=tmp_path)
    res = run_hubd("serve", str(export_root), "--listen", "127.0.0.1:0", *args)
    assert res.returncode == (2 if case == "one-flag" else 1), res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hubd: error: "), res.stderr
    assert res.stdout == ""


# -- token ------------------------------------------------------------------------------------


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _scrape(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read()


def test_token_through_a_real_mount(export_root: Path, tmp_path: Path,
                                    make_mountpoint: Callable[[str], Path]) -> None:
    token_file = tmp_path / "hub-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    spoke_token = tmp_path / "spoke-token"
    spoke_token.write_text(TOKEN)
    spoke_token.chmod(0o644)  # readable by others: warned about, still used
    wrong = tmp_path / "wrong-token"
    wrong.write_text(TOKEN[:-1] + "X")
    wrong.chmod(0o600)
    metrics_port = procs.free_port()
    with hubd(export_root, tmp_path / "hub", "--token-file", str(token_file),
              "--log-level", "DEBUG") as hub:
        with mounted(hub.url, make_mountpoint("token"), tmp_path / "ok", "--token-file",
                     str(spoke_token), "--log-level", "DEBUG",
                     "--metrics-port", str(metrics_port)) as spoke:
            check_files(spoke.mnt)
            scrapes = _scrape(f"http://127.0.0.1:{metrics_port}/metrics") + _scrape(
                f"{hub.url}/metrics")
            hub_cmd, spoke_cmd = _cmdline(hub.proc.pid), _cmdline(spoke.proc.pid)
        mnt = make_mountpoint("token-bad")
        lines = [procs.mount_fails(hub.url, mnt, tmp_path / "c1", "--token-file", str(wrong)),
                 procs.mount_fails(hub.url, mnt, tmp_path / "c2")]
        for line in lines:
            assert "401" in line and "token" in line, line
    secret = TOKEN.encode()
    assert os.fsencode(token_file) in hub_cmd and os.fsencode(spoke_token) in spoke_cmd
    hub_log, spoke_log = hub.stderr(), spoke.stderr()
    for where, text in (("hub log", hub_log.encode()), ("spoke log", spoke_log.encode()),
                        ("metrics", scrapes), ("hubd cmdline", hub_cmd),
                        ("spokefs cmdline", spoke_cmd), ("error lines", "\n".join(lines).encode())):
        assert secret not in text and secret[:10] not in text, f"token in the {where}"
    assert "Traceback" not in hub_log and "Traceback" not in spoke_log
    warnings = [line for line in spoke_log.splitlines() if "group or others" in line]
    assert len(warnings) == 1 and "0644" in warnings[0], spoke_log
    assert not [line for line in hub_log.splitlines() if "group or others" in line]


def test_hub_warns_about_an_exposed_token_file(export_root: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o604)
    with hubd(export_root, tmp_path / "hub", "--token-file", str(token_file)) as hub:
        pass
    warnings = [line for line in hub.stderr().splitlines() if "group or others" in line]
    assert len(warnings) == 1 and "0604" in warnings[0] and TOKEN not in warnings[0]
