"""No production function or method that only tests or benchmarks call.

A definition in spokefs/ or hubd/ counts as used if its name appears in production code
outside its own body: as a loaded name, an attribute, or a string constant (``getattr``,
``_call("name")``), outside ``__all__`` and imports; the entry points in pyproject.toml
count too. Names are matched, not types, so a name shared with another used definition
hides it (a false negative, never a false positive). Overrides of external base classes
(pyfuse3's Operations, asyncio's Protocol, logging's Filter, ...) are called by their
framework: they are allowed. Private names (``_x``) are left to ruff and review. What users
import into their own code (``USER_API``: ``spokefs.torch.clairvoyant``) is used by definition.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
USER_API = {("spokefs/torch.py", "clairvoyant")}  # (module, name): a job's one-line opt-in


class Refs(ast.NodeVisitor):
    def __init__(self) -> None:
        self.names: dict[str, list[tuple[int, int]]] = defaultdict(list)  # name -> spans

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        self.names[node.id].append((node.lineno, node.lineno))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.names[node.attr].append((node.lineno, node.lineno))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and re.fullmatch(r"[A-Za-z_]\w*", node.value):
            self.names[node.value].append((node.lineno, node.lineno))


def refs_of(paths: list[Path]) -> dict[str, list[tuple[Path, int]]]:
    out: dict[str, list[tuple[Path, int]]] = defaultdict(list)
    for p in paths:
        v = Refs()
        v.visit(ast.parse(p.read_text(), str(p)))
        for name, spans in v.names.items():
            out[name].extend((p, line) for line, _ in spans)
    return out


def _test_only(repo: Path) -> list[tuple[Path, str, str, int, bool]]:
    """(path, qualified name, name, first line, external override) of each unused one."""
    prod = sorted(p for d in ("spokefs", "hubd") for p in (repo / d).rglob("*.py"))
    prod_refs = refs_of(prod)
    scripts = (repo / "pyproject.toml").read_text()

    defs = []  # (path, qualname, name, first line, last line, external bases)
    for p in prod:
        tree = ast.parse(p.read_text(), str(p))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.append((p, node.name, node.name, node.lineno, node.end_lineno, False))
            elif isinstance(node, ast.ClassDef):
                external = any(not (isinstance(b, ast.Name) and b.id in {
                    c.name for c in tree.body if isinstance(c, ast.ClassDef)})
                    and not (isinstance(b, ast.Name) and b.id in ("Exception", "object"))
                    for b in node.bases)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        defs.append((p, f"{node.name}.{item.name}", item.name, item.lineno,
                                     item.end_lineno, external))

    dead: list[tuple[Path, int, int]] = []  # bodies found unused: their references do not count
    found: list[tuple[Path, str, str, int, bool]] = []
    while True:
        more = False
        for p, qual, name, first, last, external in defs:
            if name.startswith("_") or any(f[0] == p and f[3] == first for f in found):
                continue
            if (p.relative_to(repo).as_posix(), qual) in USER_API:
                continue
            used = [(q, line) for q, line in prod_refs.get(name, [])
                    if not (q == p and first <= line <= last)
                    and not any(q == dp and df <= line <= dl for dp, df, dl in dead)]
            if used or f":{name}" in scripts or (
                    name == "main" and (p.parent / "__main__.py").exists()):
                continue
            if not external:  # an override the framework calls is alive: so is what it calls
                dead.append((p, first, last))
            found.append((p, qual, name, first, external))
            more = True
        if not more:
            break
    return found


def test_no_production_method_is_called_only_by_tests_or_benchmarks() -> None:
    found = _test_only(REPO)
    unused = [f"{p.relative_to(REPO)}:{first} {qual}"
              for p, qual, _, first, external in found if not external]
    assert not unused, "\n".join(unused)
    # the framework's overrides are seen as such, not silently skipped
    assert any(qual == "SpokeOps.statfs" for _, qual, _, _, ext in found if ext)
