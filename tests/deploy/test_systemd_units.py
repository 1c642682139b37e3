"""deploy/systemd/: ``systemd-analyze verify`` offline, and every ExecStart a real command line.

systemd-analyze needs no systemd as PID 1: with ``--root`` it reads the units from a
temporary root that holds a copy of the distribution's units (for the targets ours name)
and the binaries named in Exec lines: the console scripts of this venv at
``/opt/spokefs/bin``, the host's ``kill``, ``mkdir`` and ``fusermount3``. Any output at all,
a warning about an unknown key included, fails the test.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hubd.cli import build_parser as hubd_parser
from spokefs.cli.main import _parser as spokefs_parser
from tests.helpers import procs

UNITS_DIR = procs.REPO_ROOT / "deploy" / "systemd"
UNITS = sorted(p.name for p in UNITS_DIR.glob("*.service"))
SYSTEM_UNITS = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
                     if p.is_dir()), None)
ANALYZE = shutil.which("systemd-analyze")
# Options that give a service its own mount namespace: a FUSE mount made there is invisible.
NAMESPACE_OPTIONS = (
    "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts",
    "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
    "ProtectControlGroups", "ProtectHostname", "ProtectClock", "ProtectProc", "ProcSubset",
    "ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths", "TemporaryFileSystem",
    "BindPaths", "BindReadOnlyPaths", "MountFlags", "RootDirectory", "RootImage",
    "PrivateNetwork", "NetworkNamespacePath",
)


def _entries(unit: str) -> list[tuple[str, str]]:
    """(key, value) of every assignment in ``unit``, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (UNITS_DIR / unit).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.append((key.strip(), value.strip()))
    return out


def _values(unit: str, key: str) -> list[str]:
    return [value for k, value in _entries(unit) if k == key]


def _exec_paths(unit: str) -> set[str]:
    paths = set()
    for key, value in _entries(unit):
        if key.startswith("Exec"):
            paths.add(value.lstrip("-@:+!").split()[0])
    return paths


def _stage_root(root: Path) -> None:
    assert SYSTEM_UNITS is not None
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for unit in UNITS:
        shutil.copy(UNITS_DIR / unit, root / "etc/systemd/system" / unit)
    venv_bin = Path(sys.executable).parent
    for unit in UNITS:
        for path in _exec_paths(unit):
            dest = root / path.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            if path.startswith("/opt/spokefs/bin/"):
                shutil.copy(venv_bin / Path(path).name, dest)  # the installed console script
            elif Path(path).exists():
                shutil.copy(path, dest)
            else:  # the example training job's interpreter: only its existence is checked
                dest.write_text("#!/bin/sh\n")
                dest.chmod(0o755)


@pytest.mark.skipif(ANALYZE is None or SYSTEM_UNITS is None,
                    reason="systemd-analyze is missing (Debian package systemd)")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    assert {"hubd.service", "spokefs-dataset.service", "training.service"} <= set(UNITS)
    root = tmp_path / "root"
    _stage_root(root)
    for unit in UNITS:
        res = subprocess.run(
            [str(ANALYZE), f"--root={root}", "verify", "--man=no",
             f"/etc/systemd/system/{unit}"],
            capture_output=True, text=True, timeout=60, check=False)
        assert res.returncode == 0 and not (res.stdout + res.stderr).strip(), (
            f"{unit}: exit {res.returncode}\n{res.stdout}{res.stderr}")


def _command(unit: str, credentials: str) -> list[str]:
    """The unit's ExecStart as argv: its Environment= defaults and %d substituted."""
    env: dict[str, str] = {}
    for value in _values(unit, "Environment"):
        for item in shlex.split(value):
            key, _, val = item.partition("=")
            env[key] = val
    (start,) = _values(unit, "ExecStart")
    start = start.replace("%d", credentials)
    start = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env[m.group(1) or m.group(2)], start)
    return shlex.split(start)


def test_exec_start_lines_parse() -> None:
    argv = _command("hubd.service", "/run/credentials/hubd.service")
    args = hubd_parser().parse_args(argv[1:])
    assert args.token_file == "/run/credentials/hubd.service/token"
    assert args.tls_cert and args.tls_key and args.listen == ("10.0.0.5", 8443)

    argv = _command("spokefs-dataset.service", "/run/credentials/spokefs-dataset.service")
    args = spokefs_parser().parse_args(argv[1:])
    assert args.command == "mount" and str(args.mountpoint) == "/mnt/dataset"
    assert not args.daemon, "Type=notify wants the mount in the foreground"
    assert args.metrics_addr == "127.0.0.1"


def test_ordering_credentials_and_hardening() -> None:
    spoke = "spokefs-dataset.service"
    assert _values(spoke, "Type") == ["notify"]
    assert "network-online.target" in _values(spoke, "After")[0]
    assert "network-online.target" in _values(spoke, "Wants")[0]
    assert _values(spoke, "Before") == ["training.service"]
    assert "spokefs-dataset.service" in _values("training.service", "After")[0]
    assert "spokefs-dataset.service" in _values("training.service", "Requires")[0]
    for unit in ("hubd.service", spoke):
        assert _values(unit, "NoNewPrivileges") == ["yes"]
        assert _values(unit, "Restart") == ["on-failure"]
        assert any(v.startswith("token:") for v in _values(unit, "LoadCredential"))
    assert _values("hubd.service", "ProtectSystem") == ["strict"]
    assert _values("hubd.service", "CapabilityBoundingSet") == [""]
    present = [key for key, _ in _entries(spoke) if key in NAMESPACE_OPTIONS]
    assert not present, f"{present} would hide the FUSE mount in a private mount namespace"
    assert _values(spoke, "DeviceAllow") == ["/dev/fuse rw"]
