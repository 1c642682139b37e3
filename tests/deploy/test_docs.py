"""The README and docs/ match the code: every flag documented with its real default, every
relative link resolving, no reference to documents outside the repository."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from hubd.cli import build_parser as hubd_parser
from spokefs.cli.main import _parser as spokefs_parser
from spokefs.cli.mount_helper import FLAG_OPTIONS, VALUE_OPTIONS
from tests.helpers import procs

REPO = procs.REPO_ROOT
README = (REPO / "README.md").read_text()
SKIP_DIRS = {".git", ".venv", "__pycache__", "results", "build"}
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".service", ".json", ""}


def _repo_files() -> list[Path]:
    out = []
    for path in REPO.rglob("*"):
        if SKIP_DIRS & set(path.relative_to(REPO).parts) or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES and ".egg-info" not in str(path):
            out.append(path)
    return out


def test_no_reference_outside_the_repository() -> None:
    stale = re.compile(r"DESIGN\.md|STYLE\.md|BENCHMARKS guide|\.\./shared")
    me = Path(__file__).resolve()
    hits = [f"{p.relative_to(REPO)}:{n}" for p in _repo_files() if p.resolve() != me
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if stale.search(line)]
    assert not hits, hits


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md", "docs/contributing.md",
                                 "docs/benchmarks.md", "deploy/systemd/README.md",
                                 "deploy/kubernetes/README.md", "benchmarks/README.md"])
def test_relative_links_resolve(doc: str) -> None:
    path = REPO / doc
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target:
            continue
        assert (path.parent / target).exists(), f"{doc}: link to {target} does not resolve"


def test_readme_sections() -> None:
    for heading in ("## Quick start", "### fstab: mount.spokefs", "## Deploying on two machines",
                    "## Cache sizing", "## Tuning for long links", "## Consistency",
                    "## Several datasets on one node"):
        assert f"\n{heading}\n" in README, heading
    quick = README.split("## Quick start", 1)[1].split("```", 2)[1]
    commands = [line.split("#")[0].strip() for line in quick.strip().splitlines()]
    assert commands == ["bash deploy/quickstart.sh", "bash .ci/run"]


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings
            if opt.startswith("--") and opt != "--help"}


def _shown(default: object) -> str | None:
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return None if default is None else str(default)


def test_spokefs_mount_table_matches_help() -> None:
    flags = _flags(_subparser(spokefs_parser(), "mount"))
    section = README.split("### spokefs", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    documented: dict[str, str] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = re.findall(r"`(--[\w-]+)", cells[0])
        defaults = [d.strip() for d in cells[1].split(",")] if len(names) > 1 else [cells[1]]
        documented.update(zip(names, defaults, strict=True))
    assert set(documented) == set(flags), set(documented) ^ set(flags)
    for name, cell in documented.items():
        action = flags[name]
        if action.required:
            assert cell == "required", name
        elif (shown := _shown(action.default)) is not None:
            assert cell.startswith(shown), f"{name}: README says {cell!r}, --help {shown!r}"
        help_text = action.help or ""
        if "default" in help_text and shown is not None:
            assert shown in help_text, f"{name}: --help does not state {shown}"


def test_hubd_synopsis_lists_every_flag() -> None:
    flags = set(_flags(_subparser(hubd_parser(), "serve")))
    section = README.split("### hubd", 1)[1].split("### spokefs", 1)[0]
    synopsis = section.split("```", 2)[1]
    assert set(re.findall(r"--[\w-]+", synopsis)) == flags


def test_fstab_options_match_the_helper() -> None:
    section = README.split("### fstab: mount.spokefs", 1)[1].split("\n## ", 1)[0]
    listed = section.split("Options are", 1)[1].split("Generic options", 1)[0]
    assert set(re.findall(r"`([a-z]\w+)`", listed)) == VALUE_OPTIONS | FLAG_OPTIONS
