"""``clairvoyant(loader)``: a PyTorch DataLoader that tells the spokefs mount under its files
the order in which it will read them, as soon as its sampler has drawn an epoch.

A shuffled epoch is known from the moment the sampler draws its permutation, yet a loader
reads it a few batches at a time, and on a cold cache each file is a miss: the link carries
only what the workers have asked for so far. Told the whole order, the mount fetches it in
that order ahead of the workers (``spokefs.jobs.orders``: small files in picks, the packs of
the list in its order; the workers' misses first; within the cache), so that they find most
of it cached::

    from spokefs.torch import clairvoyant
    loader = clairvoyant(DataLoader(dataset, batch_size=32, shuffle=True, num_workers=4))

How the order is seen: a loader that batches automatically draws its indices through
``loader.batch_sampler``, a ``BatchSampler`` whose ``sampler`` is a plain attribute (the
loader guards its own ``sampler`` and ``batch_sampler`` after ``__init__``, the batch sampler
does not). ``clairvoyant`` puts an ``_OrderSampler`` there: each epoch it takes the inner
sampler's ``len()`` indices at once, hands them to a background thread and yields them. Those
are the calls the batch sampler would have made, on the same generators and in the same
order, so the epoch is the same sample for sample; only a sampler that reads, while an epoch
runs, state that the training loop changes would now be read at the epoch's start. The
loader's ``sampler`` is left as it is (``loader.sampler.set_epoch(e)`` reaches it; so does
any attribute asked of the stand-in), and ``ClairvoyantLoader`` iterates the loader and passes
every attribute through to it.

Which files: ``dataset.samples[i][0]`` (torchvision's ImageFolder and DatasetFolder),
``dataset.imgs[i][0]``, ``dataset.files[i]`` or ``dataset.paths[i]``, through the indices of a
``Subset``; or ``paths=`` (a sequence, or a function of the index) for any other dataset. A
loader whose files are not found, or not on a spokefs mount, or that draws no indices
through a ``BatchSampler`` (``batch_size=None``, a batch sampler of its own), is left as it
is, and one line at info says why.

How it is sent: the paths relative to the mount root (each once, where first drawn) go into
a list file (``jobs.trace_file``; version 0: whatever is current), and its path to the mount,
in ``getxattr(root, "user.spokefs.order:" + path)``; the daemon has read the file when the
call returns. The list's header names the job (host, process, and which wrapper of the
process), so that the mount replaces this loader's last order and leaves the orders of other
loaders alone (the other ranks of a job, a validation loader).

The epoch's first ``HEAD_FILES`` files are sent at once, on the loop's own thread, before the
first index reaches a worker (a few milliseconds): a worker's first miss would otherwise come
before the order, and a fresh mount would answer it the way it answers a job it knows nothing
of, with its directory's pack. The head goes as an order of a job of its own (the job's name
and ``:head``), so that the whole order, which follows from a background thread (a million
files take a second to write), does not replace it while its picks are on the link; its
header says ``"part": "head"``, and the mount fetches it only into room the cache does not
use (what the cache holds may be the epoch's later files, which only the whole order
names). An epoch drawn while the last one is still being sent replaces it. A mount that
fails (an older spokefs, one mounted with ``--no-prefetch``) is logged once at warning and
never raised into the training loop. The thread lives only while there is something to
send, so none is left running when the next epoch forks its workers.

Imports neither torch nor pyfuse3, and ``jobs.trace_file`` (with the spoke's modules beneath
it) only for a loader that has a mount to tell: a job on none pays for none of them.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from spokefs.mounttab import find_mount

log = logging.getLogger(__name__)

_ORDER_START = "user.spokefs.order:"
_NAME_MAX = 255  # XATTR_NAME_MAX: the list file's path must fit in the attribute's name
_TEMP_NAME = len("/spokefs-order-12345678.trace")  # what mkstemp adds to its directory
_wrappers = itertools.count(1)  # which wrapper of the process: part of the job's name
HEAD_FILES = 512  # an epoch's first files, announced before its first index is handed out

PathOf = Callable[[Any], Any]


def clairvoyant(loader: Any, *,
                paths: Callable[[int], Any] | Sequence[Any] | None = None) -> ClairvoyantLoader:
    """``loader``, telling the spokefs mount of its files each epoch's order as it draws it.

    Args:
        loader: a ``torch.utils.data.DataLoader``. It is changed in place (its batch sampler
            draws through the stand-in), so iterating it bare announces as well.
        paths: the file of each index of ``loader.dataset`` (a sequence of paths, or a
            function of the index), for a dataset whose files are not found otherwise.

    Raises:
        TypeError: ``paths`` is neither a function nor a sequence of paths.
    """
    announcer = _announcer_for(loader, paths)
    if announcer is not None:
        batches = loader.batch_sampler
        inner = batches.sampler
        if isinstance(inner, _OrderSampler):  # wrapped again: the new wrapper's turn
            inner = inner.inner
        batches.sampler = _OrderSampler(inner, announcer)
    return ClairvoyantLoader(loader)


class ClairvoyantLoader:
    """What ``clairvoyant`` returns: iterating it iterates the loader (each time an epoch),
    and every other attribute is the loader's."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self._loader)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        if name == "_loader":  # not set yet (a copy being made): not the loader's either
            raise AttributeError(name)
        return getattr(self._loader, name)

    def __repr__(self) -> str:
        return f"clairvoyant({self._loader!r})"


class _OrderSampler:
    """Stands in for a ``BatchSampler``'s sampler: draws each epoch from it at once and hands
    the order to the announcer, then yields it (and whatever the sampler yields beyond its
    length). A sampler without a length (an endless one) is passed through, unannounced.

    Attributes:
        inner: the sampler it stands in for; every other attribute is looked up there.
    """

    def __init__(self, inner: Any, announcer: _Announcer) -> None:
        self.inner = inner
        self._announcer = announcer

    def __iter__(self) -> Iterator[Any]:
        drawn = iter(self.inner)
        try:
            n = len(self.inner)
        except TypeError:
            yield from drawn
            return
        epoch = list(itertools.islice(drawn, n))
        if epoch:
            self._announcer.announce(epoch)
        yield from epoch
        yield from drawn

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class _Announcer:
    """Sends one wrapped loader's orders to its mount, from a thread that runs while there is
    an order to send."""

    def __init__(self, path_of: PathOf, spelled_root: str, root: str) -> None:
        # here, not at the top (see the module docstring), nor when the first epoch is sent,
        # which would be a quarter of a second later with the import in its way
        from spokefs.jobs.trace_file import Entry, dumps

        self._entry, self._dumps = Entry, dumps
        self._path_of = path_of
        self._prefix = os.path.join(spelled_root, "")  # how the paths spell the root, with "/"
        self._root = root
        self._wrapper = next(_wrappers)
        self._lock = threading.Lock()
        self._pending: list[Any] | None = None
        self._sending = False
        self._warned = False

    def announce(self, order: list[Any]) -> None:
        """Send ``order`` (dataset indices): its first ``HEAD_FILES`` files now, before any
        of its indices reaches a worker, and the whole of it soon (``submit``)."""
        head = order if len(order) <= HEAD_FILES else order[:HEAD_FILES]
        try:
            self._send(head, "" if head is order else ":head")
        except Exception as exc:  # a dataset's lookup, the mount: never into the loop
            self._warn_once("the first %d samples of an epoch were not announced to the "
                            "mount at %s: %s", len(head), self._root, exc)
        if head is not order:
            self.submit(order)

    def submit(self, order: list[Any]) -> None:
        """Send ``order`` (dataset indices) soon, in place of one not sent yet; returns at
        once."""
        with self._lock:
            self._pending = order
            if self._sending:
                return
            self._sending = True
        threading.Thread(target=self._run, name="spokefs-order", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._lock:
                order, self._pending = self._pending, None
                if order is None:
                    self._sending = False
                    return
            try:
                self._send(order)
            except Exception as exc:  # a dataset's lookup, the mount: never into the loop
                self._warn_once("the order of %d samples was not sent to the mount at %s: "
                                "%s", len(order), self._root, exc)

    def _send(self, order: list[Any], part: str = "") -> None:
        """Send the files of ``order`` as the order of this wrapper's job (``part``: of a
        job of its own beside it, the head's)."""
        prefix, cut = self._prefix, len(self._prefix)
        files: dict[str, None] = {}  # insertion order: where each file is first drawn
        for i in order:
            path = os.fsdecode(self._path_of(i))
            if not path.startswith(prefix) or "/." in path or "//" in path or \
                    path.endswith("/"):
                path = os.path.abspath(path)  # (abspath costs a microsecond a file)
            if path.startswith(prefix):
                files.setdefault(path[cut:])
        if not files:
            return
        job = f"{socket.gethostname()}:{os.getpid()}:{self._wrapper}{part}"
        raw = self._dumps([self._entry(f, 0, 0, None) for f in files],
                          source="spokefs.torch", job=job, **({"part": "head"} if part else {}))
        order_id = _announce(self._root, raw)
        log.debug("order %d of job %s: %d files on %s", order_id, job, len(files), self._root)

    def _warn_once(self, msg: str, *args: object) -> None:
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(level, msg, *args)


def _announce(root: str, raw: bytes) -> int:
    """Hand the list ``raw`` to the mount at ``root``; the order's id. The daemon reads the
    file (as root, checking that its caller may) before it answers, so it goes at once.

    Raises:
        OSError: the mount refused it, or is not there.
    """
    tmp = tempfile.gettempdir()
    if len(os.fsencode(tmp)) + _TEMP_NAME + len(_ORDER_START) > _NAME_MAX:
        tmp = "/tmp"
    fd, name = tempfile.mkstemp(prefix="spokefs-order-", suffix=".trace", dir=tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        return int(os.getxattr(root, _ORDER_START + name))
    finally:
        os.unlink(name)


# -- what a loader reads, and where --------------------------------------------------------


def _announcer_for(loader: Any, paths: Callable[[int], Any] | Sequence[Any] | None
                   ) -> _Announcer | None:
    """The announcer of ``loader``'s orders; None (and why, at info) if there is nothing to
    announce."""
    dataset = getattr(loader, "dataset", None)
    what = type(dataset).__name__
    data = sys.modules.get("torch.utils.data")  # loaded: the loader is torch's
    batches = getattr(loader, "batch_sampler", None)
    if data is None or not isinstance(batches, data.BatchSampler):
        log.info("spokefs.torch: this loader of %s draws no indices through a BatchSampler "
                 "(batch_size=None, or a batch sampler of its own): its order is not announced",
                 what)
        return None
    path_of = _path_source(dataset, paths)
    if path_of is None:
        log.info("spokefs.torch: no file paths found in %s (give clairvoyant(..., paths=)): "
                 "its order is not announced", what)
        return None
    try:
        first = os.fsdecode(path_of(0))
    except Exception as exc:  # the dataset's own lookup: anything
        log.info("spokefs.torch: the first file of %s is unknown (%s): its order is not "
                 "announced", what, exc)
        return None
    where = _mount_prefix(first)
    if where is None:
        log.info("spokefs.torch: %s is not on a spokefs mount: the order of %s is not "
                 "announced", first, what)
        return None
    return _Announcer(path_of, *where)


def _path_source(dataset: Any, paths: Callable[[int], Any] | Sequence[Any] | None
                 ) -> PathOf | None:
    """The function from an index of ``dataset`` to its file, or None if it has none."""
    if paths is not None:
        if callable(paths):
            return paths
        if isinstance(paths, Sequence) and not isinstance(paths, (str, bytes)):
            return paths.__getitem__
        raise TypeError("paths= takes a function of the index or a sequence of paths, "
                        f"not {type(paths).__name__}")
    indices, inner = getattr(dataset, "indices", None), getattr(dataset, "dataset", None)
    if indices is not None and inner is not None:  # a Subset
        of_inner = _path_source(inner, None)
        return None if of_inner is None else lambda i: of_inner(indices[i])
    for name in ("samples", "imgs"):  # (path, target) pairs
        pairs = getattr(dataset, name, None)
        if isinstance(pairs, Sequence) and pairs and isinstance(pairs[0], (tuple, list)):
            return lambda i: pairs[i][0]
    for name in ("files", "paths"):
        seq = getattr(dataset, name, None)
        if isinstance(seq, Sequence) and not isinstance(seq, (str, bytes)):
            return seq.__getitem__
    return None


def _mount_prefix(path: str) -> tuple[str, str] | None:
    """How the job's paths spell the root of the spokefs mount that ``path`` is on, and that
    root (they differ when the job reaches the mount through a symlink); None if it is on no
    spokefs mount, or reached through a symlink inside one."""
    spelled = os.path.dirname(os.path.abspath(path))
    real = os.path.realpath(spelled)
    root = _spokefs_root(real)
    if root is None:
        return None
    inside = os.path.relpath(real, root)
    for part in reversed([] if inside == "." else inside.split(os.sep)):
        spelled, tail = os.path.split(spelled)
        if tail != part:
            return None
    return spelled, root


def _spokefs_root(path: str) -> str | None:
    """The mount point at or above ``path`` (a real path) if that mount is a spokefs mount."""
    while True:
        entry = find_mount(path)
        if entry is not None:
            return path if entry.fstype == "fuse.spokefs" else None
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
