"""Goals: a table of goals copied word for word from an issue, graded against measured figures:
PASS or MISS against the issue's own number, REPORTED where the issue gives none, NOT
MEASURED where the run has no figure for it (never a pass)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .results import markdown_table

OPS = {">=": lambda v, t: v >= t, "<=": lambda v, t: v <= t, ">": lambda v, t: v > t,
       "<": lambda v, t: v < t}


@dataclass(frozen=True)
class Goal:
    """One graded goal. ``issue`` is the issue's sentence, verbatim; ``key`` names the figure
    the benchmark computes for it (``what`` says how, in words); ``op`` and ``threshold`` are
    the bar, the issue's own number (``op`` "" when the issue states the goal without a
    number, e.g. "near 1": the figure is then reported, never passed); ``rtts`` the RTTs it
    applies at (empty: every RTT measured)."""

    issue: str
    key: str
    what: str
    op: str  # ">=", "<=", ">", "<", or "" (no number in the issue)
    threshold: float
    rtts: tuple[int, ...] = ()

    def passes(self, value: float) -> bool:
        return OPS[self.op](value, self.threshold) if self.op else False

    def bar(self) -> str:
        return f"{self.op} {self.threshold:g}" if self.op else "(no number in the issue)"


@dataclass
class Grade:
    goal: Goal
    rtt: int | None
    value: float | None
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "NOT MEASURED"
        if not self.goal.op:
            return "REPORTED"
        return "PASS" if self.goal.passes(self.value) else "MISS"


def grade(goals: Sequence[Goal], rtts: Sequence[int | None],
          value_of: Any) -> list[Grade]:
    """One Grade per goal and RTT it applies to; ``value_of(goal, rtt)`` returns
    (value or None, note). Pass ``rtts=[None]`` (and goals without rtts) for goals that do
    not depend on a link."""
    out = []
    for goal in goals:
        for rtt in goal.rtts or tuple(rtts):
            value, note = value_of(goal, rtt)
            out.append(Grade(goal, rtt, value, note))
    return out


def format_grades(grades: Sequence[Grade]) -> str:
    rows = []
    for g in grades:
        value = "-" if g.value is None else f"{g.value:.3f}"
        rows.append([g.verdict, f"{g.rtt} ms" if g.rtt is not None else "",
                     g.goal.what, g.goal.bar(), value, g.note])
    return markdown_table(["verdict", "RTT", "figure", "goal", "measured", "note"], rows)


def grades_json(grades: Sequence[Grade]) -> list[dict[str, Any]]:
    """The grades as the JSON line keeps them."""
    return [{"issue": g.goal.issue, "figure": g.goal.what, "key": g.goal.key, "rtt_ms": g.rtt,
             "op": g.goal.op, "threshold": g.goal.threshold if g.goal.op else None,
             "value": g.value, "verdict": g.verdict, "note": g.note} for g in grades]


def print_goals(issues: Sequence[str], sentences: Sequence[str], grades: Sequence[Grade]) -> str:
    """The issues' goal sentences, then the graded table; printed and returned."""
    names = " and ".join(f'"{i}"' for i in issues)
    text = (f"Goals of {names}, word for word:\n"
            + "\n".join(f"- {s}" for s in sentences) + "\n\n" + format_grades(grades))
    print("\n" + text, flush=True)
    return text
