"""A hub-only install: ``pip install 'spokefs[hub]'`` brings hubd without pyfuse3 or a compiler.

The project is built into a wheel, then installed with the ``hub`` extra into a fresh
virtualenv with ``--only-binary :all:`` (so nothing may be compiled); hubd then serves a
directory on 127.0.0.1, and ``spokefs`` answers with one line naming the missing extra.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest

from tests.helpers import procs

pytestmark = pytest.mark.slow


def test_extras_split_the_roles() -> None:
    requires = metadata.requires("spokefs") or []
    by_extra: dict[str, set[str]] = {}
    for req in requires:
        name = re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0].lower()
        m = re.search(r'extra == "(\w+)"', req)
        by_extra.setdefault(m.group(1) if m else "", set()).add(name)
    assert by_extra[""] == {"xxhash", "prometheus-client"}
    assert {"pyfuse3", "trio", "lmdb", "httpx"} <= by_extra["spoke"]
    assert by_extra["hub"] == {"aiohttp"}
    scripts = {ep.name for ep in metadata.entry_points(group="console_scripts")
               if ep.value.startswith(("spokefs.", "hubd."))}
    assert {"hubd", "spokefs", "mount.spokefs"} <= scripts


def _run(*cmd: str | Path, timeout: float = 600) -> str:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                         timeout=timeout, check=False, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"{cmd}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout


def test_hub_only_install_serves_without_fuse(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels,
         procs.REPO_ROOT)
    (wheel,) = wheels.glob("spokefs-*.whl")
    venv = tmp_path / "hubvenv"
    _run(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    _run(py, "-m", "pip", "install", "-q", "--only-binary", ":all:", f"{wheel}[hub]")
    installed = _run(py, "-m", "pip", "list", "--format=freeze").lower()
    assert "aiohttp==" in installed
    for absent in ("pyfuse3", "trio==", "lmdb", "httpx"):
        assert absent not in installed, f"{absent} came with the hub extra:\n{installed}"

    export = tmp_path / "export"
    export.mkdir()
    (export / "f").write_text("x")
    err = tmp_path / "hubd.err"
    with open(tmp_path / "hubd.out", "wb") as out, open(err, "wb") as errf:
        hub = subprocess.Popen([venv / "bin" / "hubd", "serve", export, "--listen",
                                "127.0.0.1:0"], stdout=out, stderr=errf,
                               stdin=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not (m := procs.HUB_READY_RE.search((tmp_path / "hubd.out").read_text())):
            assert hub.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        with urllib.request.urlopen(f"{m.group(1)}/healthz", timeout=10) as resp:
            assert resp.read() == b"ok"
    finally:
        hub.terminate()
        assert hub.wait(timeout=15) == 0, err.read_text()

    res = subprocess.run([venv / "bin" / "spokefs", "mount", "--help"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert re.fullmatch(r"spokefs: error: the spoke's dependencies are not installed \(no "
                        r"module '(pyfuse3|trio|lmdb|httpx)'\); install them with: "
                        r"pip install 'spokefs\[spoke\]'\n", res.stderr), res.stderr
