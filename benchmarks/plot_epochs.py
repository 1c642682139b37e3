"""Plot epochs recorded by ``train.py`` side by side: samples delivered over time, and the
bytes the link carried (the emulator's counter), for chosen configurations of one line of
``results/train.jsonl``.

    python benchmarks/plot_epochs.py --line 23 --mode train --rtt 60 --run 1 \\
        --configs local,spoke-cold,spoke-order --out benchmarks/results/train-order-train-60ms.png

Needs only matplotlib (not the spoke's environment): ``train.py --plots`` draws its own
figures; this one redraws a recorded run, e.g. from a machine without matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load(path: Path, line: int) -> dict[str, Any]:
    lines = path.read_text().splitlines()
    try:
        return json.loads(lines[line - 1 if line > 0 else line])
    except (IndexError, json.JSONDecodeError) as exc:
        raise SystemExit(f"plot_epochs: no record at line {line} of {path}: {exc}") from None


def pick(rec: dict[str, Any], mode: str, rtt: int, run: int,
         configs: list[str]) -> list[dict[str, Any]]:
    by = {e["config"]: e for e in rec.get("epochs", [])
          if (e["mode"], e["rtt_ms"], e["run"]) == (mode, rtt, run - 1)
          and e.get("epoch_index", 0) == 0}
    missing = [c for c in configs if c not in by]
    if missing:
        raise SystemExit(f"plot_epochs: no {', '.join(missing)} epoch at {rtt} ms, mode {mode}, "
                         f"run {run} in that record")
    return [by[c] for c in configs]


def plot(epochs: list[dict[str, Any]], title: str, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                   gridspec_kw={"height_ratios": [3, 2]})
    for e in epochs:
        done, total = [(0.0, 0)], 0
        for t, n in zip(e["batch_t"], e["batch_n"], strict=True):
            total += n
            done.append((t, total))
        label = f"{e['config']}: {e['seconds']:.1f} s"
        (line,) = ax0.plot(*zip(*done, strict=True), label=label, lw=1.3)
        rows = e.get("series", {}).get("rows", [])
        if rows and e["config"] != "local":
            b0 = rows[0][1]
            ax1.plot([r[0] for r in rows], [(r[1] - b0) / 1e6 for r in rows],
                     color=line.get_color(), lw=1.2, label=e["config"])
    ax0.set_title(title, fontsize=10)
    ax0.set_ylabel("samples delivered")
    ax1.set_ylabel("MB over the link")
    ax1.set_xlabel("seconds from the loader's creation")
    for ax in (ax0, ax1):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, loc="best")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--results", type=Path, default=HERE / "results" / "train.jsonl")
    p.add_argument("--line", type=int, default=-1,
                   help="which line of the file, from 1 (-1: the last)")
    p.add_argument("--mode", default="train")
    p.add_argument("--rtt", type=int, default=60)
    p.add_argument("--run", type=int, default=1, help="run number, from 1")
    p.add_argument("--configs", default="local,spoke-cold,spoke-order")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    rec = load(args.results, args.line)
    epochs = pick(rec, args.mode, args.rtt, args.run, args.configs.split(","))
    title = (f"train.py, mode {args.mode}, {args.rtt} ms RTT, run {args.run}; commit "
             f"{str(rec.get('commit', '?'))[:7]}{' (dirty)' if rec.get('dirty') else ''}")
    plot(epochs, title, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
