"""Which requests fetch a set of blocks: runs widened to the hub client's grid.

Ranges are asked for on the hub client's grid (``HubClient.align_bytes``: a tier's 1 MiB
cache slice, or one 4 KiB frame, i.e. one block, straight to the hub): so the spokes behind
one tier ask it for the same slices, and a random 4 KiB read straight to the hub still moves
4 KiB. Pure arithmetic, no I/O.
"""

from __future__ import annotations

from spokefs import protocol
from spokefs.config import BLOCK_SIZE, CHUNK_BLOCKS

RUN_BLOCKS = protocol.MAX_RANGE_BYTES // BLOCK_SIZE  # the most one request may carry


def chunk_blocks(ci: int, nblocks: int) -> range:
    """The block indexes of chunk ``ci`` of a file of ``nblocks`` blocks."""
    return range(ci * CHUNK_BLOCKS, min((ci + 1) * CHUNK_BLOCKS, nblocks))


def grid_runs(blocks: list[int], grid: int, nblocks: int) -> list[range]:
    """Block indexes as contiguous runs widened to a grid of ``grid`` blocks and clipped
    to the file, none longer than ``RUN_BLOCKS`` (one request each).

    A grid wider than a chunk is a tier's: every run is one slice. nginx's slice module
    fetches the slices of one request one after the other, so a 4 MiB request that misses
    would wait four far round trips; four one-slice requests wait one, side by side (and
    the tier is near: the extra requests cost little)."""
    grid = max(1, grid)
    if grid > CHUNK_BLOCKS:
        cells = sorted({b // grid for b in blocks})
        return [range(c * grid, min((c + 1) * grid, nblocks)) for c in cells]
    runs: list[range] = []
    for run in contiguous_runs(blocks, RUN_BLOCKS):
        lo = run.start - run.start % grid
        hi = min(-(-run.stop // grid) * grid, nblocks)
        if runs and runs[-1].stop >= lo and hi - runs[-1].start <= RUN_BLOCKS:
            runs[-1] = range(runs[-1].start, max(hi, runs[-1].stop))
        elif runs and runs[-1].stop > lo:  # overlaps a full run: the rest only
            runs.append(range(runs[-1].stop, hi))
        else:
            runs.append(range(lo, hi))
    return [r for r in runs if len(r)]


def contiguous_runs(indexes: list[int], max_len: int) -> list[range]:
    """Block indexes, sorted, as contiguous runs none longer than ``max_len``."""
    ordered = sorted(set(indexes))
    if ordered and ordered[-1] - ordered[0] + 1 == len(ordered):  # one run (the usual case)
        end = ordered[-1] + 1
        return [range(a, min(a + max_len, end)) for a in range(ordered[0], end, max_len)]
    runs: list[range] = []
    for idx in ordered:
        if runs and runs[-1].stop == idx and len(runs[-1]) < max_len:
            runs[-1] = range(runs[-1].start, idx + 1)
        else:
            runs.append(range(idx, idx + 1))
    return runs
