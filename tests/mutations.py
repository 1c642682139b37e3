"""A hand-made mutation check: does the suite catch the bugs that matter on the data path?

Each mutation below is one small, plausible bug (a flipped checksum comparison, a frame
offset off by 8 bytes, a dropped version check, a range off by one, ...). For each, this
script copies the working tree (tracked and untracked-but-not-ignored files: the tests being
written count) to a temporary directory, applies the mutation there (the working tree is
never touched, so nothing needs restoring), and runs the mutation's tests in the copy with
``pytest -x``. A failing run is a caught mutation; a passing run is a missed one, which
wants a new test.

Run by hand, as root (the integration tests mount FUSE), from the repository root::

    python tests/mutations.py                  # every mutation; a table at the end
    python tests/mutations.py --list
    python tests/mutations.py --only hub-frame-offset --only store-chunk-sum
    python tests/mutations.py --baseline       # the same tests, unmutated: must all pass

The table is copied into docs/contributing.md ("Mutation check"). Not a test module: pytest
collects ``test_*.py`` only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str  # must occur exactly once in ``path``
    new: str
    tests: tuple[str, ...]
    what: str


MUTATIONS = [
    Mutation(
        "store-chunk-sum", "spokefs/cache/chunk_reader.py",
        "        if h.intdigest() == head.chunk_sum:\n            return []",
        "        if h.intdigest() != head.chunk_sum:\n            return []",
        ("tests/spokefs/test_block_cache.py", "tests/integration/test_cache_faults.py"),
        "the cache's chunk checksum comparison flipped (_verify): a damaged chunk passes"),
    Mutation(
        "store-block-sum", "spokefs/cache/chunk_reader.py",
        "        if xxhash.xxh3_64_intdigest(block) != head.sums[rank]:",
        "        if xxhash.xxh3_64_intdigest(block) == head.sums[rank]:",
        ("tests/spokefs/test_block_cache.py", "tests/integration/test_cache_faults.py"),
        "the cache's block checksum comparison flipped (_verify)"),
    Mutation(
        "hub-frame-offset", "hubd/framed.py",
        "        data_start = first_frame * protocol.FRAME_DATA_BYTES\n",
        "        data_start = first_frame * protocol.FRAME_DATA_BYTES + 8\n",
        ("tests/hubd/test_hubd_http.py", "tests/integration/test_foundation.py"),
        "the hub frames data from 8 bytes too far (its sums match the wrong bytes)"),
    Mutation(
        "wire-frame-sum-offset", "spokefs/protocol/frames.py",
        "unpack(frame, len(frame) - FRAME_SUM.size)[0]",
        "unpack(frame, len(frame) - FRAME_SUM.size - 8)[0]",
        ("tests/protocol/test_frames.py", "tests/spokefs/test_hub_client_hostile.py"),
        "deframing reads each frame's sum 8 bytes early (protocol.split_frames, the Python way)"),
    Mutation(
        "spoke-frame-check-dropped", "spokefs/protocol/frames.py",
        "        if digest(chunk, frame_seed(file_id, version, first_frame + k)) != want:",
        "        if False:",
        ("tests/protocol/test_frames.py", "tests/spokefs/test_hub_client_hostile.py"),
        "the spoke stops checking frame sums (protocol.unframe, the Python way)"),
    Mutation(
        "native-frame-check-dropped", "spokefs/protocol/frames_c.c",
        "                != want) {",
        "                != want && 0) {",
        ("tests/protocol/test_frames.py", "tests/spokefs/test_hub_client_hostile.py",
         "tests/integration/test_hostile_hub.py"),
        "the spoke stops checking frame sums (frames_c.unframe, the native way)"),
    Mutation(
        "native-frame-seed-off-by-one", "spokefs/protocol/frames_c.c",
        "seed_of(file_id, version, first + k))\n                != want",
        "seed_of(file_id, version, first + k + 1))\n                != want",
        ("tests/protocol/test_frames.py", "tests/integration/test_foundation.py"),
        "the native check expects each frame's sum with the next frame's seed"),
    Mutation(
        "pack-sum-dropped", "spokefs/hub/client.py",
        "if rec is not None and xxhash.xxh3_64_intdigest(rec[0]) != rec[1]:",
        "if rec is not None and False:",
        ("tests/spokefs/test_hub_client_hostile.py", "tests/integration/test_dir_fill.py"),
        "the spoke stops checking a pack member's checksum"),
    Mutation(
        "hub-version-check-dropped", "hubd/export_root.py",
        "            if version_of(st) != version:\n                raise StaleVersion(",
        "            if False:\n                raise StaleVersion(",
        ("tests/hubd/test_hubd_http.py", "tests/hubd/test_hubd_safety.py",
         "tests/integration/test_lifecycle.py"),
        "the hub opens any version of a file: no 412 before the range is checked"),
    Mutation(
        "hub-read-version-recheck-dropped", "hubd/framed.py",
        "        if version_of(st) != self._version:",
        "        if False:",
        ("tests/hubd/test_hubd_http.py", "tests/hubd/test_hubd_safety.py"),
        "the hub stops re-checking the version after each slice's read (a write during an "
        "answer)"),
    Mutation(
        "spoke-key-without-version", "spokefs/cache/layout.py",
        'KEY = struct.Struct(">QQQ")\n',
        'class _Key(struct.Struct):\n'
        '    def pack(self, file_id, version, ci):  # type: ignore[override]\n'
        '        return super().pack(file_id, 0, ci)\n\n\n'
        'KEY = _Key(">QQQ")\n',
        ("tests/spokefs/test_block_cache.py", "tests/integration/test_lifecycle.py"),
        "the spoke's cache keys lose the file version (old bytes served after a change)"),
    Mutation(
        "hub-range-last-off-by-one", "hubd/range_reader.py",
        "    stop = total if spec.last is None else min(spec.last + 1, total)",
        "    stop = total if spec.last is None else min(spec.last, total)",
        ("tests/hubd/test_hubd_ranges.py", "tests/integration/test_foundation.py"),
        "the hub's Range end is exclusive instead of inclusive"),
    Mutation(
        "spoke-read-end-off-by-one", "spokefs/read/reader.py",
        "        end = min(offset + size, fv.size)\n",
        "        end = min(offset + size, fv.size - 1)\n",
        ("tests/spokefs/test_reader.py", "tests/integration/test_foundation.py"),
        "the spoke's reads stop one byte before the end of the file"),
    Mutation(
        "spoke-range-header-off-by-one", "spokefs/hub/client.py",
        'headers = {"Range": f"bytes={fstart}-{fstop - 1}"}',
        'headers = {"Range": f"bytes={fstart}-{fstop - 2}"}',
        ("tests/spokefs/test_hub_client_hostile.py", "tests/integration/test_foundation.py"),
        "the spoke asks for one framed byte too few"),
    Mutation(
        "spoke-stage-offset-off-by-one", "spokefs/read/block_source.py",
        "                off = (b - run.start) * BLOCK_SIZE\n",
        "                off = (b - run.start + 1) * BLOCK_SIZE\n",
        ("tests/spokefs/test_reader.py", "tests/integration/test_foundation.py"),
        "the block source stages a claimed stretch from the wrong block of the answer"),
    Mutation(
        "eviction-tail-uncounted", "spokefs/cache/store.py",
        "-(len(value) + len(head.tail) if value is not None else 0)",
        "-(len(value) if value is not None else 0)",
        ("tests/spokefs/test_block_cache.py", "tests/integration/test_cache_bound.py"),
        "deleting a chunk forgets to uncount its tail (the cache's byte count drifts up)"),
    Mutation(
        "read-deadline-doubled", "spokefs/read/reader.py",
        "            budget = self._deadline_s\n",
        "            budget = self._deadline_s * 2\n",
        ("tests/spokefs/test_reader.py", "tests/integration/test_faults.py"),
        "a read that misses waits two hub deadlines instead of one"),
]


def _files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f and (REPO / f).is_file()]


def _copy_tree(dest: Path) -> None:
    for rel in _files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)


def _build_native(root: Path) -> None:
    """Compile the package's C part into the copy, as setuptools does at install (the built
    module is not in git, so the copy would otherwise test the Python fallback only)."""
    inc = sysconfig.get_paths()["include"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for src in root.rglob("*.c"):
        if src.parts[len(root.parts)] != "spokefs":
            continue
        subprocess.run(["gcc", "-O3", "-shared", "-fPIC", f"-I{inc}", str(src), "-o",
                        str(src.with_name(src.stem + suffix))], check=True)


def _apply(root: Path, m: Mutation) -> None:
    path = root / m.path
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(f"{m.name}: the text to mutate occurs {count} times in {m.path}")
    path.write_text(text.replace(m.old, m.new))


def line_of(m: Mutation) -> int:
    """The line of ``m.path`` (in the working tree) where the mutated text starts."""
    text = (REPO / m.path).read_text()
    return text[: text.index(m.old)].count("\n") + 1


def run(m: Mutation, *, mutate: bool) -> tuple[str, float, str]:
    """``(verdict, seconds, the test that failed or else pytest's last line)``."""
    with tempfile.TemporaryDirectory(prefix="spokefs-mut-") as d:
        root = Path(d)
        _copy_tree(root)
        if mutate:
            _apply(root, m)
        _build_native(root)
        env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
        env.pop("CI", None)  # a skip must stay a skip, not a failure counted as caught
        env.pop("PYTHONPATH", None)
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests]
        started = time.monotonic()
        try:
            done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                                  errors="replace", timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return "timeout (caught)", time.monotonic() - started, ""
        seconds = time.monotonic() - started
        lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
        failed = [ln.split()[1].split(" - ")[0] for ln in lines
                  if ln.startswith(("FAILED ", "ERROR "))]
        last = failed[0] if failed else lines[-1] if lines else done.stderr.strip()[-200:]
        if done.returncode == 0:
            verdict = "passed" if not mutate else "MISSED"
        elif done.returncode == 1:
            verdict = "caught" if mutate else "FAILED unmutated"
        else:
            verdict = f"error (pytest exit {done.returncode})"
        return verdict, seconds, last


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--only", action="append", default=[], metavar="NAME")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--baseline", action="store_true",
                    help="run each mutation's tests without the mutation (they must pass)")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        ap.error(f"no such mutation: {', '.join(sorted(unknown))}")
    if args.list:
        for m in chosen:
            print(f"{m.name:34} {m.path}:{line_of(m)}  {m.what}")
        return 0
    rows = []
    for m in chosen:
        verdict, seconds, last = run(m, mutate=not args.baseline)
        rows.append((m, verdict, last))
        print(f"{m.name}: {verdict} in {seconds:.0f} s ({last})", flush=True)
    print()
    print("| mutation | where | tests run | caught? (first failing test) |")
    print("| --- | --- | --- | --- |")
    for m, verdict, last in rows:
        tests = ", ".join(f"`{t.removeprefix('tests/')}`" for t in m.tests)
        by = f" (`{last.rsplit('/', 1)[-1]}`)" if verdict == "caught" else ""
        print(f"| {m.what} | `{m.path}:{line_of(m)}` | {tests} | {verdict}{by} |")
    bad = [m for m, v, _ in rows if v.startswith(("MISSED", "FAILED", "error"))]
    if not args.baseline:
        caught = sum(1 for _, v, _ in rows if "caught" in v)
        print(f"\nmutation score: {caught}/{len(rows)} caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
