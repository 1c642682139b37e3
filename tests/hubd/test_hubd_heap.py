"""hubd's malloc thresholds: freed MiB buffers are reused, not faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# 50 rounds of eight 1 MiB buffers written and freed: 100,000 page faults when each round's
# pages are handed back and taken again, ~2,000 when they stay mapped.
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
    _, untuned = _faults("leave")
    tuned_ok, tuned = _faults("tune")
    assert tuned_ok == "True"
    assert tuned * 10 < untuned, (tuned, untuned)


def test_an_operators_malloc_settings_win() -> None:
    tuned_ok, _ = _faults("tune", MALLOC_TRIM_THRESHOLD_="1048576")
    assert tuned_ok == "False"
