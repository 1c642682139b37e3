"""The layers of the code base: hubd and the protocol import without pyfuse3, trio or LMDB
(a hub host runs without FUSE); the spoke's modules import nothing of hubd; only the FUSE
layer imports pyfuse3, so the CLI runs without it; the spoke's packages import only the
packages beneath them; no import cycles (TYPE_CHECKING ones included); no private name
imported from another module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Modules a hub host must be able to import with only `spokefs[hub]` installed.
_HUB_SIDE = ("hubd.cli", "hubd.server", "hubd.app", "spokefs.protocol")
# The only modules that may import pyfuse3 (docs/contributing.md, "Layout").
FUSE_LAYER = ("spokefs.fuse.ops", "spokefs.fuse.errors", "spokefs.fuse.kernel",
              "spokefs.fuse.mount", "spokefs.fuse.session", "spokefs.fuse.workers")
# What runs without pyfuse3: the command line (all but the mount itself), the protocol, hubd.
_NO_FUSE_SIDE = ("spokefs.cli.entry", "spokefs.cli.main", "spokefs.cli.commands",
                 "spokefs.cli.job_commands", "spokefs.cli.mount_helper", *_HUB_SIDE)
# The spoke's packages, each ranked above what it may import (docs/contributing.md, "Layout").
# "top" is the shared modules at spokefs/'s top (config, errors, types, metrics, ...).
SPOKE_RANKS = {"protocol": 0, "top": 1, "cache": 2, "hub": 2, "namespace": 3, "read": 4,
               "jobs": 5, "fuse": 6, "cli": 7}
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
    done = _run_blocked({"pyfuse3"},
                        f"from spokefs.cli.entry import main\nsys.exit(main({args!r}))")
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


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in ("spokefs", "hubd")
            for p in sorted((REPO / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when loaded, and those under ``if TYPE_CHECKING:`` (a cycle
    there is a cycle of the design, whether or not Python meets it); not those in functions."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            found += _module_imports(node.body if _is_type_checking(node.test)
                                     else node.body + node.orelse)
        elif isinstance(node, ast.Try):
            found += _module_imports(node.body + node.orelse + node.finalbody
                                     + [s for h in node.handlers for s in h.body])
    return found


def _import_graph() -> dict[str, set[str]]:
    """Module -> the spokefs and hubd modules it imports (``from X import Y``: X, and X.Y when
    Y is a module)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str] = []
        for node in _module_imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
                continue
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets += [base] + [f"{base}.{a.name}" for a in node.names]
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:  # the shortest way back to its first module, breadth first
        start = min(component)
        came_from: dict[str, str] = {}
        frontier = [start]
        while start not in came_from:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w not in came_from:
                        came_from[w] = v
                        nxt.append(w)
            frontier = nxt
        cycle = [start]
        while cycle[-1] != start or len(cycle) == 1:
            cycle.append(came_from[cycle[-1]])
        cycles.append(cycle[::-1])
    return cycles


def test_the_graph_sees_type_checking_and_relative_imports() -> None:
    graph = _import_graph()
    assert "spokefs.read.prefetcher" in graph["spokefs.read.reader"]  # under TYPE_CHECKING
    assert "spokefs.protocol.base" in graph["spokefs.protocol"]  # relative, from . import
    assert "spokefs.metrics" in graph["spokefs.fuse.errors"]  # from spokefs import metrics
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def _spoke_package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "spokefs" or module == "spokefs.__main__":  # the entry point: above all
        return None
    return parts[1] if len(parts) > 1 and parts[1] in SPOKE_RANKS else "top"


def test_the_spoke_packages_import_only_downwards() -> None:
    graph = _import_graph()
    assert "spokefs.read.block_source" in graph["spokefs.read.reader"]
    offenders = []
    for module, imported in sorted(graph.items()):
        pkg = _spoke_package(module)
        if pkg is None:
            continue
        for target in sorted(imported):
            to = _spoke_package(target)
            if to is not None and to != pkg and SPOKE_RANKS[to] >= SPOKE_RANKS[pkg]:
                offenders.append(f"{module} ({pkg}) imports {target} ({to})")
    assert not offenders, "\n".join(offenders)
    assert _spoke_package("spokefs.config") == "top"


def test_no_import_cycles() -> None:
    cycles = _cycles(_import_graph())
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)



def test_no_private_name_is_imported_from_another_module() -> None:
    offenders = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names
                           if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: "
                                     f"from {'.' * node.level}{node.module or ''} import "
                                     f"{', '.join(private)}")
    assert not offenders, "\n".join(offenders)


def test_every_module_over_500_lines_says_why_in_contributing() -> None:
    contributing = (REPO / "docs" / "contributing.md").read_text()
    long = [path.relative_to(REPO) for path in _modules().values()
            if len(path.read_text().splitlines()) > 500]
    unexplained = [str(p) for p in long
                   if f"`{p.relative_to(p.parts[0])}` (" not in contributing]
    assert not unexplained, unexplained
