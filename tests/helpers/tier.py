"""Regional tiers for tests: Debian's nginx with ``deploy/regional/nginx.conf.template``,
and a lying tier (``bad_tier.py``) that corrupts or cuts what it passes on.

Both run as child processes with their own temp config, port and cache, logs in files, and
are stopped (SIGTERM, then SIGKILL) by ``stop``, which is safe to call twice.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.procs import REPO_ROOT, child_env, free_port

TEMPLATE = REPO_ROOT / "deploy" / "regional" / "nginx.conf.template"
START_TIMEOUT_S = 15.0


def nginx_skip_reason() -> str | None:
    """Why nginx-tier tests cannot run here (None: they can)."""
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx")
                                      else None)
    if nginx is None:
        return "nginx is not installed (deploy/setup.sh installs Debian's nginx)"
    out = subprocess.run([nginx, "-V"], capture_output=True, text=True, check=False).stderr
    if "with-http_slice_module" not in out:
        return "this nginx has no ngx_http_slice_module"
    return None


def _wait_port(port: int, proc: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{log.read_text()}",
                        pytrace=False)
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not listening after {START_TIMEOUT_S}s:\n{log.read_text()}",
                        pytrace=False)
        time.sleep(0.05)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


class NginxTier:
    """nginx from the shipped template, in front of ``upstream`` (HOST:PORT).

    Attributes:
        url: where spokes reach it.
        cache_dir: its proxy_cache directory.
    """

    def __init__(self, upstream: str, workdir: Path) -> None:
        self.workdir = workdir
        self.cache_dir = workdir / "cache"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "nginx.err"
        self.upstream = upstream
        self.proc: subprocess.Popen | None = None

    def start(self) -> NginxTier:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(exist_ok=True)
        conf = string.Template(TEMPLATE.read_text()).safe_substitute(
            HUB=self.upstream, LISTEN=f"127.0.0.1:{self.port}", CACHE_DIR=str(self.cache_dir),
            CACHE_MAX_SIZE="4g", KEYS_ZONE_SIZE="16m")
        path = self.workdir / "nginx.conf"
        path.write_text(conf)
        # As root the workers would run as nobody, who cannot enter pytest's 0700 temp dirs
        user = "user root;" if os.geteuid() == 0 else ""
        cmd = [shutil.which("nginx") or "/usr/sbin/nginx", "-e", "stderr", "-p",
               str(self.workdir), "-c", str(path), "-g",
               f"daemon off; pid {self.workdir / 'nginx.pid'}; {user}"]
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=err, stderr=err, stdin=subprocess.DEVNULL)
        _wait_port(self.port, self.proc, "nginx", self.log)
        return self

    def stop(self) -> None:
        _stop(self.proc)

    def cached_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.cache_dir.rglob("*") if p.is_file())


class BadTier:
    """``bad_tier.py`` in front of ``upstream``: ``mode`` is ``flip`` (one byte of every
    blob and pack answer changed), ``truncate`` (every blob answer cut short, connection
    closed) or ``other-slice`` (blob answers carry the bytes of another offset)."""

    def __init__(self, upstream: str, mode: str, workdir: Path) -> None:
        self.upstream = upstream
        self.mode = mode
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"bad-tier-{mode}.err"
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    def start(self) -> BadTier:
        cmd = [sys.executable, "-m", "tests.helpers.bad_tier", "--listen",
               f"127.0.0.1:{self.port}", "--upstream", self.upstream, "--mode", self.mode]
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=err, stderr=err, stdin=subprocess.DEVNULL,
                                         cwd=REPO_ROOT, env=child_env())
        _wait_port(self.port, self.proc, "bad_tier", self.log)
        return self

    def stop(self) -> None:
        _stop(self.proc)
