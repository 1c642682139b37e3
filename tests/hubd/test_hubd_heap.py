"""hubd's malloc thresholds: freed MiB buffers are reused, not faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# 50 rounds of eight 1 MiB buffers written and freed (102,400 pages): ~100,000 page faults
# when each round's pages are handed back and taken again, ~2,000 when they stay mapped.
_ROUNDS = textwrap.dedent("""
    import resource, sys
    from hubd.heap import keep_freed_buffers
    tuned = keep_freed_buffers() if sys.argv[1] == "tune" else None
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        buffers = [b"x" * (1 << 20) for _ in range(8)]
        del buffers
    print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(how: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    out = subprocess.run([sys.executable, "-c", _ROUNDS, how], cwd=ROOT, check=True,
                         capture_output=True, text=True, env=clean | env).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(sys.platform != "linux" or not os.confstr("CS_GNU_LIBC_VERSION"),
                    reason="glibc's malloc only")
def test_freed_buffers_stay_mapped_for_the_next_ones() -> None:
    """Tuned, only the first round faults its pages in. glibc's own choice depends on what
    the process freed before, so the measure is held against a heap forced to map every
    buffer afresh instead (a 64 KiB mmap threshold): the faults it counts are real."""
    _, afresh = _faults("leave", MALLOC_MMAP_THRESHOLD_="65536")
    tuned_ok, tuned = _faults("tune")
    assert tuned_ok == "True"
    assert afresh > 90_000, afresh
    assert tuned * 10 < afresh, (tuned, afresh)


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "1048576"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"}])
def test_an_operators_malloc_settings_win(env: dict[str, str]) -> None:
    tuned_ok, _ = _faults("tune", **env)
    assert tuned_ok == "False"


def test_other_glibc_tunables_leave_the_thresholds_to_hubd() -> None:
    tuned_ok, _ = _faults("tune", GLIBC_TUNABLES="glibc.pthread.rseq=1")
    assert tuned_ok == "True"
