"""benchlib: what the spokefs benchmarks share: processes, the emulated link, meters, results
and goal grading. Scripts do ``import benchlib as bl`` (every name below is re-exported here).

- **processes** (``procs``): ``Proc``, a child whose stdout lines are collected by a thread
  (to wait for a readiness line) and whose stderr goes to a log file; ``stop()`` is SIGTERM
  then SIGKILL and safe to call twice. ``run_hub`` starts ``python -m hubd serve ROOT --listen
  127.0.0.1:0``; ``spoke_mount`` a foreground ``python -m spokefs mount``, ``rclone_mount`` a
  foreground ``rclone mount :http:``, ``ceiling_mount`` benchmarks/ceiling_fs.py and
  ``fuse_process`` any FUSE daemon with a readiness line; ``rclone_serve`` an ``rclone serve
  http``. Each is a context manager whose exit stops or unmounts (``fusermount3 -u``, lazily
  if busy, the daemon killed if it does not exit, or at once if a reader is stuck inside:
  ``Mount.stuck``) whatever happened, and records the daemon's exit code (``Mount.result``).
- **the link** (``link``): ``LinkSpec``, ``open_link`` (benchmarks/longlink.py as a subprocess
  in front of a server), ``link_counters`` and ``LinkSeries``: the emulator's byte counters
  from the status file it rewrites every 0.2 s, stamped with the time it wrote them, so
  throughput is counted at the link, never at the reader (where read-ahead flatters it).
- **meters** (``meters``): CPU of pids and of the machine between two points (``CpuMeter``,
  ``all_ticks``/``top_processes``; ``tree_pids``: a process and its children, e.g. a spoke's
  workers), a sampler thread for any columns (``Series``), and
  ``scrape`` for Prometheus text endpoints.
- **results** (``results``): ``run_info``, the JSON line's common head (time, git commit,
  whether the tree was dirty, kernel, Python, CPUs, argv), taken at the start of a run before
  it writes anything into the tree; ``append_jsonl`` and ``save_record``; ``Figure``
  (median (min-max) of runs); ``markdown_table``.
- **goals** (``goals``): ``Goal`` rows copied word for word from an issue, graded by ``grade``
  into PASS / MISS against the issue's own number, REPORTED where the issue states no number,
  NOT MEASURED where the run has no figure (never a pass); ``format_grades``,
  ``print_goals``, ``grades_json``.
- the run's time budget (``Deadline``, ``BudgetExhausted``) and ``BenchError`` (``common``).

Everything binds and connects to 127.0.0.1 only. Nothing here runs a benchmark by itself.
"""

from __future__ import annotations

from .common import HERE, KIB, MIB, REPO, BenchError, BudgetExhausted, Deadline
from .goals import OPS, Goal, Grade, format_grades, grade, grades_json, print_goals
from .link import (
    SERIES_STATUS_MS,
    STATUS_PERIOD_S,
    LinkCounters,
    LinkSeries,
    LinkSpec,
    link_counters,
    open_link,
)
from .meters import (
    CLK_TCK,
    CpuMeter,
    Series,
    all_ticks,
    machine_ticks,
    proc_cpu_ticks,
    reads_settled,
    scrape,
    scrape_counted,
    summed_over_labels,
    top_processes,
    tree_cpu_ticks,
    tree_minor_faults,
    tree_pids,
    wait_workers,
)
from .procs import (
    CEILING_READY_RE,
    HUB_READY_RE,
    NATIVE_READY_RE,
    SPOKE_READY_RE,
    STOP_TIMEOUT_S,
    Hub,
    Mount,
    Proc,
    Unmounted,
    build_native,
    ceiling_mount,
    child_env,
    drop_caches,
    fill_cache,
    free_port,
    fuse_process,
    fusermount,
    is_mounted,
    kill_mount,
    native_mount,
    rclone_mount,
    rclone_serve,
    run_hub,
    spoke_mount,
    unmount,
    wait_mounted,
    wait_port,
    warm_spoke,
    which,
)
from .results import (
    Figure,
    append_jsonl,
    git_info,
    jsonable,
    markdown_table,
    run_info,
    save_record,
)

__all__ = [
    "CEILING_READY_RE", "CLK_TCK", "HERE", "HUB_READY_RE", "KIB", "MIB", "NATIVE_READY_RE",
    "OPS", "REPO", "SERIES_STATUS_MS", "SPOKE_READY_RE", "STATUS_PERIOD_S", "STOP_TIMEOUT_S",
    "BenchError", "BudgetExhausted", "CpuMeter", "Deadline", "Figure", "Goal", "Grade", "Hub",
    "LinkCounters", "LinkSeries", "LinkSpec", "Mount", "Proc", "Series", "Unmounted",
    "all_ticks", "append_jsonl", "build_native", "ceiling_mount", "child_env", "drop_caches",
    "fill_cache", "format_grades", "free_port", "fuse_process", "fusermount", "git_info",
    "grade", "grades_json", "is_mounted", "jsonable", "kill_mount", "link_counters",
    "machine_ticks", "markdown_table", "native_mount", "open_link", "print_goals",
    "proc_cpu_ticks", "rclone_mount", "rclone_serve", "reads_settled", "run_hub", "run_info",
    "save_record", "scrape", "scrape_counted", "spoke_mount", "summed_over_labels",
    "top_processes", "tree_cpu_ticks", "tree_minor_faults",
    "tree_pids", "unmount", "wait_mounted", "wait_port", "wait_workers", "warm_spoke", "which",
]
