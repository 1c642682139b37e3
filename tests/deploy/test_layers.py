"""The layers of the code base: hubd and the protocol import without pyfuse3, trio or LMDB
(a hub host runs without FUSE); the spoke's modules import nothing of hubd; only the FUSE
layer imports pyfuse3, so the CLI runs without it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Modules a hub host must be able to import with only `spokefs[hub]` installed.
_HUB_SIDE = ("hubd.cli", "hubd.server", "hubd.app", "spokefs.protocol")
# The only modules that may import pyfuse3 (docs/contributing.md, "Layout").
FUSE_LAYER = ("spokefs.fuse_ops", "spokefs.fuse_errors", "spokefs.kernel", "spokefs.mount")
# What runs without pyfuse3: the command line (all but the mount itself), the protocol, hubd.
_NO_FUSE_SIDE = ("spokefs.entry", "spokefs.cli", "spokefs.commands", "spokefs.job_commands",
                 "spokefs.mount_helper", *_HUB_SIDE)
_BLOCK = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed", name=name)
        return None
sys.meta_path.insert(0, Block())
"""


def _run_blocked(blocked: set[str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK.format(blocked=blocked) + code],
                          cwd=REPO, capture_output=True, text=True, check=False)


def test_hubd_and_the_protocol_import_without_the_spoke_dependencies() -> None:
    done = _run_blocked({"pyfuse3", "trio", "lmdb", "httpx"},
                        "".join(f"import {m}\n" for m in _HUB_SIDE))
    assert done.returncode == 0, done.stderr


def test_the_cli_imports_without_pyfuse3() -> None:
    done = _run_blocked({"pyfuse3"}, "".join(f"import {m}\n" for m in _NO_FUSE_SIDE)
                        + "assert not any(m.split('.')[0] == 'pyfuse3' for m in sys.modules)\n")
    assert done.returncode == 0, done.stderr


def test_a_mount_without_pyfuse3_says_what_to_install(tmp_path: Path) -> None:
    """The FUSE layer loads when a mount starts: without pyfuse3, one line, exit 1."""
    args = ["mount", "http://127.0.0.1:9", str(tmp_path), "--cache-dir", str(tmp_path / "c"),
            "--cache-size", "1G"]
    done = _run_blocked({"pyfuse3"}, f"from spokefs.entry import main\nsys.exit(main({args!r}))")
    assert done.returncode == 1, done.stderr
    assert done.stderr == ("spokefs: error: the spoke's dependencies are not installed (no module "
                           "'pyfuse3'); install them with: pip install 'spokefs[spoke]'\n")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_only_the_fuse_layer_imports_pyfuse3() -> None:
    importers = set()
    for pkg in ("spokefs", "hubd"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):  # lazy imports included
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom)
                         and not node.level else [])
                if any(n.split(".")[0] == "pyfuse3" for n in names):
                    importers.add(_module_name(path))
    assert importers <= set(FUSE_LAYER), sorted(importers - set(FUSE_LAYER))
    contributing = (REPO / "docs" / "contributing.md").read_text()
    assert all(f"`{m.removeprefix('spokefs.')}`" in contributing for m in FUSE_LAYER)


def test_the_spoke_imports_nothing_of_hubd() -> None:
    offenders = []
    for path in sorted((REPO / "spokefs").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "hubd" or n.startswith("hubd.") for n in names):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders
