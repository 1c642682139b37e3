"""Block indexes into runs (``read.grid.contiguous_runs``): the one-run fast path and the
general walk give what a plain walk gives."""

from __future__ import annotations

import random

import pytest

from spokefs.read.grid import contiguous_runs


def _walk(indexes: list[int], max_len: int) -> list[range]:
    runs: list[range] = []
    for idx in sorted(set(indexes)):
        if runs and runs[-1].stop == idx and len(runs[-1]) < max_len:
            runs[-1] = range(runs[-1].start, idx + 1)
        else:
            runs.append(range(idx, idx + 1))
    return runs


@pytest.mark.parametrize("seed", range(20))
def test_runs_as_a_plain_walk_gives(seed: int) -> None:
    rng = random.Random(seed)
    start = rng.randrange(1000)
    n = rng.randrange(1, 600)
    if seed % 2:  # one contiguous stretch, shuffled, with repeats
        indexes = list(range(start, start + n)) * rng.choice([1, 2])
        rng.shuffle(indexes)
    else:
        indexes = rng.sample(range(start, start + 2 * n), n)
    for max_len in (1, 3, 64, 4096):
        assert contiguous_runs(indexes, max_len) == _walk(indexes, max_len)
    assert contiguous_runs([], 8) == []
