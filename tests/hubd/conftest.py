"""Fixtures for the hubd tests (helpers are in ``hubd_testlib.py``).

- ``tree`` / ``module_tree``: the awkward test tree (odd names, links, a fifo, an empty file,
  a sparse file just over ``MAX_RANGE_BYTES``) plus a directory outside ROOT.
- ``start_hub(root, *args, preexec_fn=None) -> Hub``: a real ``python -m hubd serve`` child
  on 127.0.0.1:0, ready when it returns (``preexec_fn`` runs in the child first, e.g. to
  lower its limits); every hub gets SIGTERM at teardown and must then exit 0.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.hubd.hubd_testlib import Hub, Tree, build_tree, start_hub_process  # noqa: E402


@pytest.fixture
def start_hub(tmp_path: Path) -> Iterator[Callable[..., Hub]]:
    """``start_hub(root, *extra_args, preexec_fn=None) -> Hub``; all hubs stop at teardown
    and must exit 0."""
    hubs: list[Hub] = []

    def start(root: Path | bytes, *args: str,
              preexec_fn: Callable[[], None] | None = None) -> Hub:
        hub = start_hub_process(root, tmp_path / f"hubd-{len(hubs)}.err", *args,
                                preexec_fn=preexec_fn)
        hubs.append(hub)
        return hub

    yield start
    codes = [(hub.stop(), hub) for hub in hubs]
    for code, hub in codes:
        assert code == 0, f"hubd exited {code} on SIGTERM:\n{hub.stderr()}"


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    return build_tree(tmp_path)


@pytest.fixture(scope="module")
def module_tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    return build_tree(tmp_path_factory.mktemp("tree"))
