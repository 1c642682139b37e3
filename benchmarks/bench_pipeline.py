#!/usr/bin/env python3
"""A PyTorch DataLoader over one mount, served by its own process alone and by its native read
loop's threads, local disk beside it:
raw bytes, and real JPEGs through torchvision's ``ImageFolder`` with the ImageNet training
transforms (issue 22, deliverable 5: the DataLoader rows).

Data, made once under ``--work-dir``: ``--files`` JPEGs (default 3,000) in ``--dirs`` class
directories (ImageFolder's layout), synthetic photographs of 500 x 375 (gradients, blotches,
grain; quality 90, ~110 KiB), written with numpy and PIL. One hubd on loopback; the spoke's
cache filled once per invocation by a pass that checks every byte. Then ``--runs`` times, each
mode of ``--modes`` and each configuration in turn:

- ``local``: drop the page cache, one epoch over the source directory;
- ``ceiling``: the same through ``ceiling_fs.py`` (the minimal pyfuse3 filesystem, files in
  memory, the spoke's request path): what any FUSE server in Python costs this pipeline;
- ``wN`` (``w0``, ``w8``, ...): a fresh ``spokefs mount --workers N --open-mode kernel`` on the
  filled cache (a remount; ``w0``: the mount's own process serves alone, ``w8``: 8 threads of
  the native read loop, what ``--workers auto`` gives a 2-core machine), wait for its
  threads, drop the page cache, one epoch over the mount; unmount, clean exit 0 and no block
  fetched required.

Modes, each a DataLoader with ``--loader-workers`` workers (4) and batches of 64, in a child
process (``pipeline_epoch.py``, which imports only torch, torchvision and PIL) that prints its
figures as JSON:

- ``io``: a dataset returning each file's bytes (open, read, close): the I/O of a pipeline;
- ``jpeg``: ``torchvision.datasets.ImageFolder`` with ``RandomResizedCrop(224)``,
  ``RandomHorizontalFlip``, ``ToTensor``, ``Normalize`` (ImageNet's): PIL reads and decodes
  each JPEG. Needs torchvision, which needs another torch than this venv's on this machine:
  ``--torch-python`` names the interpreter that has it (the mode is skipped, and the run says
  so, without one).

Figures: samples/s; x local (the same run's local epoch); the server's CPU (every process of
the spoke, or ceiling_fs's, utime + stime) per sample; the spoke's FUSE READs per file.
Medians (min-max) over runs; graded against issue 22's goal for the real pipeline; one JSON
line to benchmarks/results/pipeline.jsonl.

    python benchmarks/bench_pipeline.py [--runs 3] [--modes io,jpeg] [--configs local,ceiling,w0,w8]
        [--files 3000] [--dirs 30] [--torch-python /var/tmp/tv-venv/bin/python]
        [--work-dir /var/tmp/spokefs-pipeline] [--results F] [--smoke]

Needs root (drop_caches, allow_other), fusermount3, the patched pyfuse3. ``--smoke``: 120
files, 1 run, io only (tests/benchmarks runs it).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import benchlib as bl  # noqa: E402

RESULTS = HERE / "results" / "pipeline.jsonl"
ISSUE = "issue 22: Every core of a training node: one mount served by several workers"
G_PIPE = ("The real pipeline (ImageFolder, real JPEGs, 4 DataLoader workers) after a remount: "
          ">= 0.97 of local.")


# -- data ---------------------------------------------------------------------------------


def make_data(root: Path, files: int, dirs: int, seed: int) -> list[Path]:
    """The JPEGs (made once; a marker says the set is complete)."""
    import io

    import numpy as np
    from PIL import Image
    rels = [Path(f"class{i % dirs:03}") / f"img{i:05}.jpg" for i in range(files)]
    marker = root / ".complete"
    if marker.exists():
        return rels
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(seed)
    h, w = 375, 500
    y, x = np.mgrid[0:h, 0:w]
    for rel in rels:
        base = np.stack([(x * rng.uniform(0.2, 0.6) + y * rng.uniform(0.1, 0.5)
                          + rng.uniform(0, 255)) % 256 for _ in range(3)], -1)
        blotches = np.kron(rng.normal(0, 40, (h // 8 + 1, w // 8 + 1, 3)),
                           np.ones((8, 8, 1)))[:h, :w]
        grain = rng.normal(0, rng.uniform(12, 24), (h, w, 3))
        img = np.clip(base + blotches + grain, 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=90)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(buf.getvalue())
    marker.write_text("")
    return rels


# -- the run ------------------------------------------------------------------------------


def run_epoch(python: str, mode: str, root: Path, args: argparse.Namespace,
              deadline: bl.Deadline) -> dict[str, Any]:
    done = subprocess.run([python, str(HERE / "pipeline_epoch.py"), mode, str(root),
                           "--loader-workers", str(args.loader_workers)],
                          capture_output=True, text=True, check=False,
                          timeout=deadline.timeout(1800))
    if done.returncode != 0:
        raise bl.BenchError(f"the {mode} epoch over {root} exited {done.returncode}: "
                            f"{done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


COUNTERS = ("spokefs_reads_total", "spokefs_block_misses_total", "spokefs_fuse_errors_total")


def spoke_epoch(python: str, mode: str, workers: int, hub: Any, cache: Path,
                run_dir: Path, tag: str, args: argparse.Namespace, deadline: Any
                ) -> dict[str, Any]:
    mnt = run_dir / "mnt"
    with bl.warm_spoke(hub.url, mnt, cache, run_dir / f"spokefs-{tag}.log", deadline,
                       workers) as m:
        pids = bl.tree_pids(m.pid)
        c0 = bl.tree_cpu_ticks(pids)
        k0 = bl.scrape(m.metrics_url, COUNTERS, sum_labels=True)
        got = run_epoch(python, mode, mnt, args, deadline)
        bl.reads_settled(m.metrics_url, deadline)  # the worker's last hits, counted
        k1 = bl.scrape(m.metrics_url, COUNTERS, sum_labels=True)
        c1 = bl.tree_cpu_ticks(bl.tree_pids(m.pid))
        got["spoke_cpu_s"] = sum(c1[p] - c0.get(p, 0) for p in c1) / bl.CLK_TCK
        got["counters"] = {k.removeprefix("spokefs_"): round(k1.get(k, 0) - k0.get(k, 0))
                           for k in COUNTERS}
    got["unmount"] = {"clean": bool(m.result and m.result.clean),
                      "exit_code": m.result.exit_code if m.result else None}
    return got


def ceiling_epoch(python: str, mode: str, data: Path, run_dir: Path,
                  args: argparse.Namespace, deadline: bl.Deadline) -> dict[str, Any]:
    mnt = run_dir / "mnt-ceiling"
    with bl.ceiling_mount(data, mnt, run_dir / "ceiling.log", deadline) as m:
        time.sleep(0.5)  # its read-ahead setting, once INIT is answered
        bl.drop_caches()
        c0 = bl.tree_cpu_ticks([m.pid])
        got = run_epoch(python, mode, mnt, args, deadline)
        c1 = bl.tree_cpu_ticks([m.pid])
        got["spoke_cpu_s"] = (c1[m.pid] - c0[m.pid]) / bl.CLK_TCK  # (the server's CPU)
    if not (m.result and m.result.clean):
        raise bl.BenchError("ceiling_fs did not unmount cleanly")
    return got


def torch_python_for(mode: str, args: argparse.Namespace) -> str | None:
    """The interpreter that runs a mode's epochs, or None when it cannot (jpeg without
    torchvision)."""
    if mode == "io":
        return sys.executable
    for python in [p for p in (args.torch_python, sys.executable) if p]:
        ok = subprocess.run([python, "-c", "import torchvision"], capture_output=True,
                            check=False)
        if ok.returncode == 0:
            return python
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loader-workers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="io,jpeg")
    ap.add_argument("--configs", default="local,ceiling,w0,w8")
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--dirs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=20261204)
    ap.add_argument("--torch-python", help="an interpreter with torchvision (for jpeg)")
    ap.add_argument("--work-dir", type=Path, default=Path("/var/tmp/spokefs-pipeline"))
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--max-seconds", type=float, default=3600.0)
    ap.add_argument("--smoke", action="store_true", help="120 files, 1 run, io only")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.files, args.dirs, args.modes = 1, 120, 4, "io"
    modes = [m for m in args.modes.split(",") if m]
    configs = [c for c in args.configs.split(",") if c]
    if any(m not in ("io", "jpeg") for m in modes) or not modes:
        raise SystemExit("--modes: io and/or jpeg")
    if not configs or configs[0] != "local" or any(
            c != "ceiling" and re.fullmatch(r"w\d+", c) is None for c in configs[1:]):
        raise SystemExit("--configs: local first, then ceiling and/or wN (N serving threads)")
    deadline = bl.Deadline(args.max_seconds)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    data = args.work_dir / f"jpeg-{args.files}x{args.dirs}-s{args.seed}"
    rels = make_data(data, args.files, args.dirs, args.seed)
    record: dict[str, Any] = bl.run_info("bench_pipeline.py")
    record |= {"config": {k: str(v) for k, v in vars(args).items() if k != "results"},
               "open_mode": "kernel", "data_bytes": sum((data / r).stat().st_size
                                                         for r in rels),
               "passes": [], "notes": [], "problems": [], "error": None}
    pythons = {m: torch_python_for(m, args) for m in modes}
    for m, py in pythons.items():
        if py is None:
            record["notes"].append(f"{m}: not run: no interpreter with torchvision "
                                   "(--torch-python)")
            print(record["notes"][-1], flush=True)
    modes = [m for m in modes if pythons[m]]
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=args.work_dir))
    try:
        with bl.run_hub(data, run_dir / "hubd.log", deadline) as hub:
            cache = run_dir / "cache"
            bl.fill_cache(hub.url, data, rels, cache, run_dir / "mnt",
                          run_dir / "spokefs-fill.log", deadline)
            for r in range(args.runs):
                for mode in modes:
                    python = pythons[mode]
                    assert python is not None
                    local = None
                    for cfg in configs:
                        if cfg == "local":
                            bl.drop_caches()
                            got = run_epoch(python, mode, data, args, deadline)
                        elif cfg == "ceiling":
                            got = ceiling_epoch(python, mode, data, run_dir, args, deadline)
                        else:
                            got = spoke_epoch(python, mode, int(cfg[1:]), hub, cache,
                                              run_dir, f"{mode}-{cfg}-{r}", args, deadline)
                        got |= {"mode": mode, "config": cfg, "run": r,
                                "samples_per_s": got["samples"] / got["seconds"]}
                        if got["samples"] != len(rels):
                            record["problems"].append(f"{mode} {cfg} run {r}: "
                                                      f"{got['samples']} samples")
                        if cfg == "local":
                            local = got
                        else:
                            assert local is not None  # (configs start with local)
                            got["ratio"] = got["samples_per_s"] / local["samples_per_s"]
                            got["cpu_ms_per_sample"] = got["spoke_cpu_s"] * 1000 / len(rels)
                        if cfg.startswith("w"):
                            got["reads_per_file"] = got["counters"]["reads_total"] / len(rels)
                            c = got["counters"]
                            if c["block_misses_total"] or c["fuse_errors_total"] or \
                                    got["unmount"] != {"clean": True, "exit_code": 0}:
                                record["problems"].append(f"{mode} {cfg} run {r}: {c}, "
                                                          f"unmount {got['unmount']}")
                        record["passes"].append(got)
                        print(f"run {r} {mode} {cfg}: {got['samples_per_s']:.0f} samples/s"
                              + (f", x{got['ratio']:.3f} local, spoke "
                                 f"{got['cpu_ms_per_sample']:.3f} ms/sample"
                                 if cfg != "local" else "")
                              + (f", {got['reads_per_file']:.2f} READs/file"
                                 if cfg.startswith("w") else ""), flush=True)
    except (bl.BenchError, OSError, subprocess.TimeoutExpired) as e:
        record["error"] = f"{type(e).__name__}: {e}"
        print(f"error: {record['error']}", file=sys.stderr, flush=True)
    finally:
        if bl.is_mounted(run_dir / "mnt"):
            bl.fusermount(run_dir / "mnt", lazy=True)
            record["problems"].append("left mounted (now detached)")
        shutil.rmtree(run_dir, ignore_errors=True)
    figures: dict[str, dict[str, Any]] = {}
    rows = []
    for mode in modes:
        for cfg in configs:
            ps = [p for p in record["passes"] if p["mode"] == mode and p["config"] == cfg]
            if not ps:
                continue
            d = {}
            for k in ("samples_per_s", "ratio", "cpu_ms_per_sample", "reads_per_file"):
                fig = bl.Figure()
                for p in ps:
                    fig.add(p.get(k))
                d[k] = fig
            figures[f"{mode}/{cfg}"] = {k: f.summary() for k, f in d.items()}
            rows.append([mode, cfg, d["samples_per_s"].text("{:,.0f}"),
                         d["ratio"].text("{:.3f}") if cfg != "local" else "1.000",
                         d["cpu_ms_per_sample"].text("{:.3f}"),
                         d["reads_per_file"].text("{:.2f}")])
    print("\n" + bl.markdown_table(["mode", "config", "samples/s", "x local",
                                    "server CPU ms/sample", "READs/file"], rows))
    record["figures"] = figures

    def value_of(goal: Any, _rtt: Any) -> tuple[float | None, str]:
        samples = figures.get(goal.key, {}).get("ratio", {}).get("samples")
        if not samples:
            return None, "not run"
        note = f"median of {len(samples)}, range {min(samples):.3f}-{max(samples):.3f}"
        return round(statistics.median(samples), 3), note + ("; smoke" if args.smoke else "")

    goals = [bl.Goal(G_PIPE, f"jpeg/{c}", f"jpeg: spoke {c} samples/s / local's", ">=", 0.97)
             for c in configs[1:] if c != "ceiling"]
    goals.append(bl.Goal(G_PIPE, "jpeg/ceiling", "jpeg: ceiling_fs samples/s / local's (what "
                         "any Python FUSE server reaches)", "", 0))
    grades = bl.grade(goals, [None], value_of)
    record["grades"] = bl.grades_json(grades)
    bl.print_goals([ISSUE], [G_PIPE], grades)
    for p in record["problems"]:
        print(f"problem: {p}", flush=True)
    bl.save_record(args.results, record)
    return 1 if record["error"] or record["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
