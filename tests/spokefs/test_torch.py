"""``spokefs.torch.clairvoyant`` without a mount: a wrapped DataLoader yields what the bare
one yields for the same seed, epoch after epoch, and leaves the RNG where the bare one does;
``set_epoch`` of a DistributedSampler still reaches it; each epoch's announced order is the
files in the order the loader reads them (each once); a loader with nothing to announce, or
a mount that refuses, changes nothing.

The mount is stood in for by two seams: ``_spokefs_root`` (which directory is a spokefs mount
point) and ``_announce`` (the ``getxattr`` that hands the list over), whose lists are parsed
back with ``jobs.trace_file``."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spokefs import torch as spokefs_torch
from spokefs.jobs import trace_file
from spokefs.torch import clairvoyant

torch = pytest.importorskip("torch")
data = torch.utils.data

N_FILES = 48
REPO = Path(__file__).resolve().parents[2]


class Files(data.Dataset):
    """ImageFolder-like: ``samples`` of (path, class); a sample is (index, class, its bytes'
    sum), read from the file; ``read`` lists the paths read in this process, in order."""

    def __init__(self, root: Path) -> None:
        self.samples = sorted((str(p), int(p.parent.name[-1]))
                              for p in root.rglob("*.bin"))
        self.read: list[str] = []

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        with open(path, "rb") as f:
            raw = f.read()
        self.read.append(path)
        return i, label, sum(raw)


class Anonymous(data.Dataset):
    """The same samples, with the paths kept where ``clairvoyant`` does not look."""

    def __init__(self, files: Files) -> None:
        self._where = [p for p, _ in files.samples]
        self._files = files

    def __len__(self) -> int:
        return len(self._where)

    def __getitem__(self, i: int):
        return self._files[i]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path.resolve() / "mnt"  # as the kernel would name a mount point
    for i in range(N_FILES):
        d = root / f"class{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:03}.bin").write_bytes(os.urandom(100 + i))
    return root


class Mount:
    """What was announced: (mount root, the list's header, its paths), one per order."""

    def __init__(self) -> None:
        self.orders: list[tuple[str, dict, list[str]]] = []

    def announce(self, root: str, raw: bytes) -> int:
        head, entries = trace_file.loads(raw, "order")
        assert all(e.version == 0 and e.extents is None for e in entries)
        self.orders.append((root, head, [e.path for e in entries]))
        return len(self.orders)

    def wait(self, n: int) -> list[str]:
        """The paths of the ``n``-th order, once it is sent."""
        deadline = time.monotonic() + 10
        while len(self.orders) < n:
            assert time.monotonic() < deadline, f"order {n} was not sent"
            time.sleep(0.005)
        return self.orders[n - 1][2]


@pytest.fixture
def mount(root: Path, monkeypatch: pytest.MonkeyPatch) -> Mount:
    """``root`` taken for a spokefs mount point."""
    m = Mount()
    monkeypatch.setattr(spokefs_torch, "_spokefs_root",
                        lambda p: str(root) if (p + "/").startswith(f"{root}/") else None)
    monkeypatch.setattr(spokefs_torch, "_announce", m.announce)
    return m


def rel(root: Path, paths: list[str]) -> list[str]:
    return list(dict.fromkeys(str(Path(p).relative_to(root)) for p in paths))


def plain(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return [plain(y) for y in x] if isinstance(x, (list, tuple)) else x


def epochs(loader, n: int = 2, seed: int = 7, each=None) -> list[list]:
    """Every batch of ``n`` epochs from the seed, as lists; ``each(epoch)`` before each."""
    torch.manual_seed(seed)
    out = []
    for e in range(n):
        if each is not None:
            each(e)
        out.append([plain(batch) for batch in loader])
    return out


def run(loader, mount: Mount, n: int = 2, each=None) -> tuple[list[list], list[list[str]]]:
    """``epochs``, each waiting for the last one's order to be sent (an order not sent yet
    when the next is drawn is replaced); the batches and each epoch's order."""
    start = len(mount.orders)

    def before(e: int) -> None:
        if e:
            mount.wait(start + e)
        if each is not None:
            each(e)

    batches = epochs(loader, n, each=before)
    return batches, [mount.wait(start + e + 1) for e in range(n)]


def indices(batches: list[list]) -> list[int]:
    return [i for batch in batches for i in batch[0]]


def paths_of(ds: Files, batches: list[list]) -> list[str]:
    return [ds.samples[i][0] for i in indices(batches)]


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_the_same_batches_and_rng_as_the_bare_loader(root, mount, workers, persistent):
    def make(ds):
        return data.DataLoader(ds, batch_size=5, shuffle=True, num_workers=workers,
                               persistent_workers=persistent)

    ds = Files(root)
    bare = epochs(make(ds))
    state = torch.get_rng_state()
    loader = make(ds)
    wrapped = clairvoyant(loader)
    assert len(wrapped) == len(loader) == -(-N_FILES // 5)
    assert wrapped.dataset is ds and wrapped.batch_size == 5
    got, orders = run(wrapped, mount)
    assert got == bare
    assert torch.equal(torch.get_rng_state(), state)  # the wrapper drew nothing of its own
    assert indices(got[0]) != indices(got[1])  # two shuffles
    assert orders == [rel(root, paths_of(ds, epoch)) for epoch in got]  # each epoch's own
    assert len(mount.orders) == 2
    assert {r for r, _, _ in mount.orders} == {str(root)}
    jobs = {head["job"] for _, head, _ in mount.orders}
    assert len(jobs) == 1 and f":{os.getpid()}:" in jobs.pop()
    assert all(head["source"] == "spokefs.torch" for _, head, _ in mount.orders)


def read_epoch(loader, ds: Files) -> list[str]:
    """One epoch of ``loader`` (in this process); the paths ``ds`` read in it, in order."""
    ds.read.clear()
    for _ in loader:
        pass
    return ds.read


def test_the_order_is_the_order_of_the_reads(root, mount):
    ds = Files(root)
    wrapped = clairvoyant(data.DataLoader(ds, batch_size=4, shuffle=True))
    for n in (1, 2):
        assert len(read_epoch(wrapped, ds)) == N_FILES
        assert mount.wait(n) == rel(root, ds.read)


def test_the_head_of_a_long_epoch_is_there_before_its_first_read(root, mount, monkeypatch):
    """An epoch longer than ``HEAD_FILES``: its first files are announced (as a job of their
    own) before the loader reads a sample, then the whole epoch follows as the job's order."""
    monkeypatch.setattr(spokefs_torch, "HEAD_FILES", 10)

    def slow_whole(where: str, raw: bytes) -> int:  # the whole order, late
        if b':head"' not in raw.split(b"\n", 1)[0]:
            time.sleep(0.2)
        return mount.announce(where, raw)

    monkeypatch.setattr(spokefs_torch, "_announce", slow_whole)

    class Watched(Files):
        def __getitem__(self, i: int):
            if not self.read:
                self.orders_at_first_read = len(mount.orders)
            return super().__getitem__(i)

    ds = Watched(root)
    wrapped = clairvoyant(data.DataLoader(ds, batch_size=4, shuffle=True))
    for n in (1, 2):
        read_epoch(wrapped, ds)
        assert ds.orders_at_first_read == 2 * n - 1  # this epoch's head, sent at once
        whole = mount.wait(2 * n)
        (_, head_of, head), (_, whole_of, _) = mount.orders[2 * n - 2:2 * n]
        assert whole == rel(root, ds.read) and head == whole[:10]
        assert head_of["job"] == whole_of["job"] + ":head"
        assert head_of["part"] == "head" and "part" not in whole_of  # the mount's room


def test_a_distributed_sampler_gets_its_epochs_and_announces_its_share(root, mount):
    ds = Files(root)

    def make(rank: int):
        sampler = data.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        return data.DataLoader(ds, batch_size=4, sampler=sampler)

    shares = []
    for rank in (0, 1):
        bare_loader = make(rank)
        bare = epochs(bare_loader, each=bare_loader.sampler.set_epoch)
        loader = make(rank)
        sampler = loader.sampler
        wrapped = clairvoyant(loader)
        assert wrapped.sampler is sampler  # the loader's sampler is its own
        got, orders = run(wrapped, mount, each=wrapped.sampler.set_epoch)
        assert got == bare and indices(got[0]) != indices(got[1])
        assert orders == [rel(root, paths_of(ds, epoch)) for epoch in got]
        assert all(len(o) == N_FILES // 2 for o in orders)
        wrapped.batch_sampler.sampler.set_epoch(5)  # the stand-in passes it on
        assert sampler.epoch == 5
        shares.append(orders[0])
    assert set(shares[0]).isdisjoint(shares[1])  # each rank its own half
    jobs = [head["job"] for _, head, _ in mount.orders]
    assert jobs[0] == jobs[1] != jobs[2] == jobs[3]  # a job per wrapper


def test_a_subset_maps_its_indices_and_repeats_are_sent_once(root, mount):
    ds = Files(root)
    subset = data.Subset(ds, list(range(1, N_FILES, 3)))
    wrapped = clairvoyant(data.DataLoader(subset, batch_size=3, shuffle=True))
    got = epochs(wrapped, n=1)
    order = mount.wait(1)
    assert order == rel(root, [ds.samples[i][0] for i in indices(got[0])])
    assert len(order) == len(subset)
    draws = data.RandomSampler(ds, replacement=True, num_samples=3 * N_FILES)
    wrapped = clairvoyant(data.DataLoader(ds, batch_size=8, sampler=draws))
    got = epochs(wrapped, n=1)
    read = indices(got[0])
    assert len(read) == 3 * N_FILES and len(set(read)) < len(read)
    assert mount.wait(2) == rel(root, [ds.samples[i][0] for i in read])


@pytest.mark.parametrize("as_function", [True, False])
def test_paths_given_for_a_dataset_of_its_own(root, mount, as_function):
    anon = Anonymous(Files(root))
    paths = anon._where.__getitem__ if as_function else [Path(p) for p in anon._where]
    wrapped = clairvoyant(data.DataLoader(anon, batch_size=6, shuffle=True), paths=paths)
    got = epochs(wrapped, n=1)
    assert mount.wait(1) == rel(root, [anon._where[i] for i in indices(got[0])])
    with pytest.raises(TypeError, match="paths="):
        clairvoyant(data.DataLoader(anon), paths=str(root))


def test_a_symlink_to_the_mount_is_followed_once(root, mount, tmp_path):
    link = tmp_path / "data"
    link.symlink_to(root)
    ds = Files(link)
    assert ds.samples[0][0].startswith(str(link))
    got = epochs(clairvoyant(data.DataLoader(ds, batch_size=8, shuffle=True)), n=1)
    assert mount.wait(1) == rel(link, [ds.samples[i][0] for i in indices(got[0])])
    assert mount.orders[0][0] == str(root)  # the mount point, as the kernel names it


def test_nothing_to_announce_changes_nothing(root, mount, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="spokefs.torch")
    ds, anon = Files(root), Anonymous(Files(root))
    elsewhere = tmp_path / "local"
    elsewhere.mkdir()
    (elsewhere / "class0").mkdir()
    (elsewhere / "class0" / "x.bin").write_bytes(b"x")
    off_mount = Files(elsewhere)
    cases = [
        (lambda: data.DataLoader(anon, batch_size=4, shuffle=True), "no file paths found"),
        (lambda: data.DataLoader(off_mount, batch_size=1, shuffle=True),
         "is not on a spokefs mount"),
        (lambda: data.DataLoader(ds, batch_size=None, shuffle=True), "no indices through a"),
        (lambda: data.DataLoader(data.Subset(ds, []), batch_size=1), "first file of Subset"),
    ]
    for make, why in cases:
        bare = epochs(make())
        caplog.clear()
        loader = make()
        sampler = loader.batch_sampler.sampler if loader.batch_sampler else None
        wrapped = clairvoyant(loader)
        if sampler is not None:
            assert loader.batch_sampler.sampler is sampler  # not even stood in for
        assert epochs(wrapped) == bare
        assert [r.levelno for r in caplog.records] == [logging.INFO], why
        assert why in caplog.text
    # the real mount table: a temporary directory is on no spokefs mount
    monkeypatch.undo()
    assert spokefs_torch._spokefs_root(str(root)) is None
    assert mount.orders == []


def test_a_sampler_without_a_length_is_passed_through(root, mount):
    class Endless(data.Sampler):
        def __iter__(self):
            return iter(range(N_FILES - 1, -1, -1))

    ds = Files(root)
    wrapped = clairvoyant(data.DataLoader(ds, batch_size=7, sampler=Endless()))
    assert isinstance(wrapped.batch_sampler.sampler, spokefs_torch._OrderSampler)
    assert indices(epochs(wrapped, n=1)[0]) == list(range(N_FILES - 1, -1, -1))
    time.sleep(0.05)
    assert mount.orders == []


def test_a_mount_that_refuses_is_logged_once_and_the_loader_goes_on(root, mount,
                                                                    monkeypatch, caplog):
    calls = []

    def refuse(root: str, raw: bytes) -> int:
        calls.append(root)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(spokefs_torch, "_announce", refuse)
    caplog.set_level(logging.DEBUG, logger="spokefs.torch")
    ds = Files(root)
    wrapped = clairvoyant(data.DataLoader(ds, batch_size=8, shuffle=True))
    for n in (1, 2, 3):
        assert sorted(indices(epochs(wrapped, n=1)[0])) == list(range(N_FILES))
        deadline = time.monotonic() + 10
        while len(calls) < n:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    time.sleep(0.05)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Invalid argument" in warnings[0].getMessage()


def test_wrapping_again_stands_in_once(root, mount):
    loader = data.DataLoader(Files(root), batch_size=8, shuffle=True)
    inner = loader.batch_sampler.sampler
    clairvoyant(loader)
    wrapped = clairvoyant(loader)
    assert wrapped.batch_sampler.sampler.inner is inner
    epochs(wrapped, n=1)
    mount.wait(1)
    time.sleep(0.05)
    assert len(mount.orders) == 1


def test_the_module_imports_without_torch_or_the_spoke():
    block = ("import importlib.abc, sys\n"
             "class Block(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in ('torch', 'pyfuse3', 'trio', 'lmdb'):\n"
             "            raise ImportError(name)\n"
             "sys.meta_path.insert(0, Block())\n"
             "from spokefs.torch import clairvoyant\n")
    done = subprocess.run([sys.executable, "-c", block], cwd=REPO, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr
