"""``CI=true`` turns skips into failures (tests/helpers/ci_strict.py), run in a child pytest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import procs

SAMPLE = '''
import pytest

def test_runs():
    pass

@pytest.mark.skip(reason="needs /dev/fuse")
def test_marked():
    pass

def test_skips_inside():
    pytest.skip("prometheus is not installed")

@pytest.mark.xfail(reason="known", strict=True)
def test_xfail():
    raise AssertionError
'''

IMPORT_SKIP = '''
import pytest
pytest.importorskip("no_such_module_for_ci_strict")

def test_never():
    pass
'''


def _pytest(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    env = procs.child_env()
    env.pop("CI", None)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
         "-p", "tests.helpers.ci_strict", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=procs.REPO_ROOT, timeout=120, check=False)


def test_skips_pass_outside_ci(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    res = _pytest(tmp_path, None)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed, 2 skipped, 1 xfailed" in res.stdout


def test_skips_fail_under_ci(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    res = _pytest(tmp_path, "true")
    assert res.returncode == 1, res.stdout + res.stderr
    # a marker skips in setup, so that one counts as an error; both make the run fail
    assert "1 failed, 1 passed, 1 xfailed, 1 error" in res.stdout, res.stdout
    assert "CI=true: test_sample.py::test_marked was skipped: needs /dev/fuse" in res.stdout
    assert "was skipped: prometheus is not installed" in res.stdout
    assert "bash deploy/setup.sh --test" in res.stdout


def test_module_skip_fails_under_ci(tmp_path: Path) -> None:
    (tmp_path / "test_imports.py").write_text(IMPORT_SKIP)
    res = _pytest(tmp_path, "true")
    assert res.returncode != 0, res.stdout + res.stderr
    assert "CI=true: collecting test_imports.py was skipped" in res.stdout, res.stdout
