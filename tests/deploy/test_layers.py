"""The layers that let a hub host run without FUSE: hubd and the protocol import without
pyfuse3, trio or LMDB, and the spoke's modules import nothing of hubd."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Modules a hub host must be able to import with only `spokefs[hub]` installed.
_HUB_SIDE = ("hubd.cli", "hubd.server", "hubd.app", "spokefs.protocol")
_BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"pyfuse3", "trio", "lmdb", "httpx"}:
            raise ImportError(f"{name} is not installed on a hub host")
        return None
sys.meta_path.insert(0, Block())
"""


def test_hubd_and_the_protocol_import_without_the_spoke_dependencies() -> None:
    code = _BLOCK + "".join(f"import {m}\n" for m in _HUB_SIDE)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr


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
