"""bench_longlink's figures and grades: the per-pass figures (``Results``), the table per RTT,
and the goals of "Prefetch and the long link" (item 5) and of "Large files and the namespace"
copied word for word, each graded on the spokefs median (``KEY/rclone``: its ratio to
rclone's in the same run)."""

from __future__ import annotations

import argparse
from typing import Any

import benchlib as bl

SYSTEMS = ("spokefs", "rclone", "local")


# -- the goals, word for word --------------------------------------------------------------

ISSUE = "Prefetch and the long link"
AHEAD = "Goals, each to be ahead of rclone on the same run"
SEQ = ("cold sequential MB/s on large files, one reader, as a fraction of the cap: at least "
       "0.95 at 60 ms, at least 0.8 at 900 ms")
LINK = "link bytes per byte read: at most 1.02 for sequential; at most 4 for random 4 KiB reads"
SMALL = ("shuffled pass over 10,000 small files (16-128 KiB) with 4 worker processes, cold: at "
         "least 0.8 of the link's bound (cap / mean file size, about 1,600 files/s at 1 Gbit/s)")
RAND = "random 4 KiB reads (fio): cold p99 within 3 RTT; warm p99 under 1 ms"
META = ("seconds from mount to a finished `find | wc -l` on 10,000 and on 1,000,000 entries at "
        "60 ms")
# from "Large files and the namespace"
WARM4 = "Warm 4 KiB random p99 < 1 ms with 4 fio jobs, and no worse than rclone's in the same run."
META1M = ("1M entries: mount to finished `find` <= 10 s at 60 ms; remount browses <= 1 s with "
          "the hub up, at 900 ms, and down; RSS <= 300 MB.")
SENTENCES = (f"{AHEAD} (issue \"{ISSUE}\")", SEQ, LINK, SMALL, RAND, META,
             f"{WARM4} (issue \"Large files and the namespace\")",
             f"{META1M} (issue \"Large files and the namespace\"; bench_foundation.py grades "
             "the remounts and RSS)")
G = bl.Goal
BOTH = (60, 900)  # issue 3: "Figures from `benchmarks/` at 60 ms RTT and at 900 ms RTT"
GOALS = (
    G(SEQ, "seq_link", "seq cold: link MB/s / cap", ">=", 0.95, (60,)),
    G(SEQ, "seq_link", "seq cold: link MB/s / cap", ">=", 0.8, (900,)),
    G(AHEAD, "seq_link/rclone", "seq cold: link MB/s, spokefs / rclone", ">", 1.0, BOTH),
    G(LINK, "seq_bytes", "seq: link bytes / byte read", "<=", 1.02, BOTH),
    G(AHEAD, "seq_bytes/rclone", "seq: link bytes / byte read, spokefs / rclone", "<", 1.0, BOTH),
    G(LINK, "rand_bytes", "rand cold: link bytes / byte read", "<=", 4.0, BOTH),
    G(AHEAD, "rand_bytes/rclone", "rand cold: link bytes / byte read, spokefs / rclone",
      "<", 1.0, BOTH),
    G(SMALL, "small", "small cold: files/s / link bound", ">=", 0.8, BOTH),
    G(AHEAD, "small/rclone", "small cold: files/s, spokefs / rclone", ">", 1.0, BOTH),
    G(RAND, "rand_cold_rtt", "rand cold: p99 / RTT", "<=", 3.0, BOTH),
    G(AHEAD, "rand_cold/rclone", "rand cold: p99, spokefs / rclone", "<", 1.0, BOTH),
    # warm = after a remount (a fresh process on the cold pass's cache, page cache dropped)
    G(RAND, "rand_warm", "rand warm, after a remount: p99 ms", "<", 1.0, BOTH),
    G(WARM4, "rand_warm4", "rand warm, after a remount, 4 fio jobs: p99 ms", "<", 1.0),
    G(WARM4, "rand_warm4/rclone", "rand warm, after a remount, 4 fio jobs: p99, spokefs / "
      "rclone", "<=", 1.0),
    G(META, "meta10k", "mount -> `find` done, 10,000 entries, s", "", 0.0, (60,)),
    G(AHEAD, "meta10k/rclone", "mount -> `find` done, 10,000 entries, spokefs / rclone",
      "<", 1.0, (60,)),
    G(META1M, "meta1M", "mount -> `find` done, 1,000,000 entries, s", "<=", 10.0, (60,)),
)
# goal key -> (workload, figure) of the spokefs (and rclone) medians it is graded on
GOAL_FIGURES = {
    "seq_link": ("seq", "link_frac_cap"), "seq_bytes": ("seq", "link_per_byte"),
    "rand_bytes": ("rand", "cold_link_per_byte"), "small": ("small", "frac_bound"),
    "rand_cold": ("rand", "cold_p99_ms"), "rand_cold_rtt": ("rand", "cold_p99_ms"),
    "rand_warm": ("rand", "warm_remount_p99_ms"), "rand_warm4": ("rand", "warm_remount_p99_ms"),
    "meta10k": ("meta10k", "seconds"), "meta1M": ("meta1M", "seconds"),
}


class Results:
    """results[rtt][workload][system][figure] -> Figure, plus per-pass diagnostics."""

    def __init__(self) -> None:
        self.figs: dict[int, dict[str, dict[str, dict[str, bl.Figure]]]] = {}
        self.passes: list[dict[str, Any]] = []

    def add(self, rtt: int, workload: str, system: str, **values: float | None) -> None:
        d = self.figs.setdefault(rtt, {}).setdefault(workload, {}).setdefault(system, {})
        for k, v in values.items():
            d.setdefault(k, bl.Figure()).add(v)

    def get(self, rtt: int, workload: str, system: str, fig: str) -> bl.Figure:
        return self.figs.get(rtt, {}).get(workload, {}).get(system, {}).get(fig, bl.Figure())

    def capped(self, rtt: int, workload: str, system: str) -> bool:
        return bool(self.get(rtt, workload, system, "capped").median())

    def record(self, rtt: int, workload: str, system: str, run: int, **info: Any) -> None:
        self.passes.append({"rtt_ms": rtt, "workload": workload, "system": system, "run": run,
                            **info})


def table_rows(res: Results, rtt: int) -> list[list[str]]:
    """[workload, spokefs, rclone, local] rows for one RTT: median (min-max) over runs; a
    cell marked * comes from a pass cut at its budget."""
    rows: list[list[str]] = []

    def row(label: str, workload: str, fig: str, fmt: str, ratio: str | None = None) -> None:
        cells = []
        for s in SYSTEMS:
            text = res.get(rtt, workload, s, fig).text(fmt)
            if text != "-" and ratio:
                text += f" [{res.get(rtt, workload, s, ratio).median():.2f}x]"
            if text != "-" and res.capped(rtt, workload, s):
                text = f"> {text} *" if workload.startswith("meta") else f"{text} *"
            cells.append(text)
        if any(c != "-" for c in cells):
            rows.append([label, *cells])

    row("seq cold link MB/s [x cap]", "seq", "link_mbps", "{:.1f}", ratio="link_frac_cap")
    row("seq cold link MB/s, 2nd half of the bytes", "seq", "link_mbps_2nd_half", "{:.1f}")
    row("seq cold reader MB/s", "seq", "reader_mbps", "{:.1f}")
    row("seq link bytes / byte read", "seq", "link_per_byte", "{:.3f}")
    row("rand 4K cold p50 ms", "rand", "cold_p50_ms", "{:.1f}")
    row("rand 4K cold p99 ms", "rand", "cold_p99_ms", "{:.1f}")
    row("rand 4K cold link bytes / byte read", "rand", "cold_link_per_byte", "{:.2f}")
    row("rand 4K warm (after a remount) p50 ms", "rand", "warm_remount_p50_ms", "{:.3f}")
    row("rand 4K warm (after a remount) p99 ms", "rand", "warm_remount_p99_ms", "{:.3f}")
    row("small files/s cold [x bound]", "small", "files_per_s", "{:.0f}", ratio="frac_bound")
    row("small link bytes / byte read", "small", "link_per_byte", "{:.3f}")
    for name in sorted(k for k in res.figs.get(rtt, {}) if k.startswith("meta")):
        row(f"mount -> `find \\| wc -l` done, {name[4:]} entries, s", name, "seconds", "{:.2f}")
    return rows


def print_table(rows: list[list[str]], rtt: int, args: argparse.Namespace) -> str:
    text = (f"RTT {rtt} ms (one-way {rtt / 2:g} ms), {args.rate_mbit:g} Mbit/s cap, "
            f"{args.window_bytes // bl.MIB} MiB window per connection\n\n"
            + bl.markdown_table(["workload", *SYSTEMS], rows))
    if any("*" in c for r in rows for c in r[1:]):
        text += (f"\n\n\\* cut at the pass budget (rand/small {args.budget_s:g} s, seq "
                 f"{args.seq_budget_s:g} s, find {args.meta_timeout_s:g} s): one run, rate "
                 "over what it did (for find: did not finish).")
    print("\n" + text, flush=True)
    return text


def goal_value(res: Results, args: argparse.Namespace, goal: bl.Goal,
               rtt: int) -> tuple[float | None, str]:
    """The spokefs median a goal is graded on (``KEY/rclone``: its ratio to rclone's)."""
    key, _, versus = goal.key.partition("/")
    workload, fig = GOAL_FIGURES[key]
    if key.startswith("rand_warm4") and args.fio_jobs != 4:
        return None, f"run with --fio-jobs {args.fio_jobs}, not 4"
    if workload.startswith("meta") and workload not in res.figs.get(rtt, {}):
        return None, ""
    spoke = res.get(rtt, workload, "spokefs", fig).median()
    notes = ["spokefs cut at its budget"] if res.capped(rtt, workload, "spokefs") else []
    if not versus:
        if spoke is not None and key == "rand_cold_rtt":
            return spoke / rtt, f"p99 {spoke:.1f} ms"
        return spoke, "; ".join(notes)
    other = res.get(rtt, workload, versus, fig).median()
    if spoke is None or not other:
        return None, f"{versus} not measured" if spoke is not None else ""
    if res.capped(rtt, workload, versus):
        notes.append(f"{versus} cut at its budget")
    return spoke / other, "; ".join([f"spokefs {spoke:.3g}, {versus} {other:.3g}", *notes])
