"""Deterministic generators of source trees for the integration tests.

``build_tree(root)`` makes the "everything awkward" tree that the end-to-end tests export with
hubd and mount with spokefs; ``build_dataset(root, n)`` makes a flat-ish set of sample files for
the DataLoader test. Both are seeded, so every run builds the same names, sizes and bytes.

All names are handled as ``bytes`` (the tree holds names that are not valid UTF-8). The special
paths are recorded in the returned :class:`Tree` so tests can refer to them by role instead of
repeating literals.

Layout of ``build_tree`` (relative to the root, which is chmod 0755)::

    sizes/size_<N>           files of the boundary sizes in SIZES, plus rand_<i> of random sizes
    modes/m0644 ... m0444    files with those modes; modes/private/ is a 0700 directory
    names/<awkward>          names with spaces, unicode, a newline, invalid UTF-8, 255 bytes, ...
    deep/d0/d1/.../d9/leaf   nested directories
    many/f00000..f09999      exactly DIR_ENTRIES entries (mostly empty files)
    links/...                symlinks: inside file, inside dir, dangling, absolute, escaping, loop
    hardlinks/a, hardlinks/b one inode with two names
    sparse/sparse-4GiB.bin   4 GiB + 12 KiB, holes except for SPARSE_SEGMENTS
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

SEED = 20240601

# Boundary sizes around the 4 KiB block and a few larger units (1 MiB + 3 crosses many blocks
# and ends mid-block).
SIZES = (0, 1, 4095, 4096, 4097, 8191, 8192, 8193, 65535, 65536, 65537, 1024 * 1024 + 3)
RANDOM_SIZES = 4  # extra files of random sizes up to ~3 MiB
MAX_RANDOM_SIZE = 3 * 1024 * 1024

DIR_ENTRIES = 10_000

SPARSE_NAME = b"sparse-4GiB.bin"
SPARSE_SIZE = 4 * 1024**3 + 12 * 1024

# mtimes get nanosecond precision (not a multiple of 1000) to catch a lossy ns -> s/us path.
BASE_MTIME_NS = 1_600_000_000_123_456_789

# Names that are legal on Linux but trip up code that assumes text paths.
AWKWARD_NAMES: tuple[bytes, ...] = (
    b"with space",
    b" leading and trailing space ",
    "unicode-\u00e9\u65e5\u672c\u8a9e-\U0001f600".encode(),
    b"new\nline",
    b"tab\there",
    b"\xff\xfe",  # invalid UTF-8
    b"latin1-\xe9t\xe9",  # invalid UTF-8 (a bare latin-1 byte)
    b"a" * 255,  # NAME_MAX
    "\u00e9".encode() * 127 + b"z",  # 255 bytes of multi-byte UTF-8
    b"-leading-dash",
    b"--",
    b"*?[glob]",
    b"back\\slash",
    b"quote'\"",
    b"...",
    b".hidden",
    b"percent%2F%00",
    b"#hash&amp;=?",
)


@dataclass
class Tree:
    """What ``build_tree`` made; every path is ``bytes`` relative to ``root`` unless noted.

    Attributes:
        root: the tree root (absolute, bytes).
        sparse: the 4 GiB + 12 KiB sparse file.
        sparse_size: its size.
        sparse_segments: ``(offset, data)`` pairs written into the sparse file; the rest is holes.
        big_dir: the directory with exactly DIR_ENTRIES entries.
        sized: size -> path of the SIZES files.
        random_files: paths of the random-size files.
        modes: mode (e.g. 0o600) -> path of a regular file with that mode.
        private_dir: a 0700 directory.
        awkward: the awkward names' paths (files), plus one awkward directory.
        symlinks: role -> path of a symlink (roles: file, dir, dangling, absolute, escape, loop).
        hardlinks: the two names of one inode.
        deep_leaf: a file ten directories deep.
        mmap_file: a multi-block file for the mmap test.
    """

    root: bytes
    sparse: bytes = b""
    sparse_size: int = SPARSE_SIZE
    sparse_segments: list[tuple[int, bytes]] = field(default_factory=list)
    big_dir: bytes = b""
    sized: dict[int, bytes] = field(default_factory=dict)
    random_files: list[bytes] = field(default_factory=list)
    modes: dict[int, bytes] = field(default_factory=dict)
    private_dir: bytes = b""
    awkward: list[bytes] = field(default_factory=list)
    symlinks: dict[str, bytes] = field(default_factory=dict)
    hardlinks: tuple[bytes, bytes] = (b"", b"")
    deep_leaf: bytes = b""
    mmap_file: bytes = b""

    def abs(self, rel: bytes) -> bytes:
        """The absolute path of a tree-relative path."""
        return os.path.join(self.root, rel) if rel else self.root

    def read(self, rel: bytes) -> bytes:
        """The contents of a tree-relative file."""
        with open(self.abs(rel), "rb") as f:
            return f.read()


def _write(path: bytes, data: bytes, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.chmod(path, mode)  # the umask may have cleared bits


class _Mtimes:
    """Hands out distinct ns-precision mtimes."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._next = BASE_MTIME_NS

    def __call__(self) -> int:
        self._next += self._rng.randrange(1, 10**9) * 1000 + self._rng.randrange(1, 1000)
        return self._next


def _set_mtime(path: bytes, mtime_ns: int) -> None:
    os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)


def build_tree(root: Path | str | bytes, seed: int = SEED) -> Tree:
    """Build the awkward tree under ``root`` (created if missing, must be empty).

    Costs about a second and ~10 MB of real disk (the 4 GiB file is sparse).
    """
    rng = random.Random(seed)
    mtime = _Mtimes(rng)
    broot = os.fsencode(root)
    os.makedirs(broot, exist_ok=True)
    if os.listdir(broot):
        raise ValueError(f"{root!r} is not empty")
    tree = Tree(root=broot)
    j = tree.abs
    files_to_time: list[bytes] = []

    # sizes/
    os.mkdir(j(b"sizes"))
    for size in SIZES:
        rel = b"sizes/size_%d" % size
        _write(j(rel), rng.randbytes(size))
        tree.sized[size] = rel
        files_to_time.append(rel)
    for i in range(RANDOM_SIZES):
        rel = b"sizes/rand_%d" % i
        _write(j(rel), rng.randbytes(rng.randrange(1, MAX_RANDOM_SIZE)))
        tree.random_files.append(rel)
        files_to_time.append(rel)
    tree.mmap_file = tree.sized[1024 * 1024 + 3]

    # modes/
    os.mkdir(j(b"modes"))
    for mode in (0o644, 0o600, 0o755, 0o444, 0o640, 0o400):
        rel = b"modes/m%04o" % mode
        _write(j(rel), b"mode %04o\n" % mode + rng.randbytes(100), mode)
        tree.modes[mode] = rel
        files_to_time.append(rel)
    tree.private_dir = b"modes/private"
    os.mkdir(j(tree.private_dir))
    _write(j(b"modes/private/secret"), b"secret\n")
    files_to_time.append(b"modes/private/secret")

    # names/
    os.mkdir(j(b"names"))
    for name in AWKWARD_NAMES:
        rel = b"names/" + name
        _write(j(rel), name + b"\n" + rng.randbytes(rng.randrange(0, 5000)))
        tree.awkward.append(rel)
        files_to_time.append(rel)
    awk_dir = b"names/dir \xff\n-*?["
    os.mkdir(j(awk_dir))
    _write(j(awk_dir + b"/inner \xfe"), b"inner\n")
    tree.awkward.append(awk_dir)
    files_to_time.append(awk_dir + b"/inner \xfe")

    # deep/
    deep = b"deep/" + b"/".join(b"d%d" % i for i in range(10))
    os.makedirs(j(deep))
    tree.deep_leaf = deep + b"/leaf"
    _write(j(tree.deep_leaf), b"deep leaf\n")
    files_to_time.append(tree.deep_leaf)

    # many/: exactly DIR_ENTRIES entries, mostly empty (so reading them all stays cheap)
    tree.big_dir = b"many"
    os.mkdir(j(tree.big_dir))
    for i in range(DIR_ENTRIES):
        data = b"" if i % 10 else b"%d\n" % i
        _write(j(b"many/f%05d" % i), data)

    # links/
    os.mkdir(j(b"links"))
    targets = {
        "file": b"../sizes/size_4096",
        "dir": b"../deep/d0",
        "dangling": b"does-not-exist",
        "absolute": b"/etc/passwd",
        "escape": b"../../outside-of-the-export",
        "loop": b"loop",
    }
    for role, target in targets.items():
        rel = b"links/" + role.encode()
        os.symlink(target, j(rel))
        tree.symlinks[role] = rel
        files_to_time.append(rel)

    # hardlinks/
    os.mkdir(j(b"hardlinks"))
    _write(j(b"hardlinks/a"), b"one inode, two names\n" + rng.randbytes(5000))
    os.link(j(b"hardlinks/a"), j(b"hardlinks/b"))
    tree.hardlinks = (b"hardlinks/a", b"hardlinks/b")
    files_to_time.append(b"hardlinks/a")

    # sparse/
    os.mkdir(j(b"sparse"))
    tree.sparse = b"sparse/" + SPARSE_NAME
    tree.sparse_segments = [
        (0, rng.randbytes(4096 + 17)),
        (2**32 - 100, rng.randbytes(300)),  # crosses the 4 GiB line
        (SPARSE_SIZE - 5000, rng.randbytes(5000)),  # ends at EOF
    ]
    fd = os.open(j(tree.sparse), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, SPARSE_SIZE)
        for offset, data in tree.sparse_segments:
            assert os.pwrite(fd, data, offset) == len(data)
    finally:
        os.close(fd)
    files_to_time.append(tree.sparse)

    for rel in files_to_time:
        _set_mtime(j(rel), mtime())
    # Directories last, deepest first: creating entries changed their mtimes.
    dirs = [os.path.relpath(d, broot) for d, _, _ in os.walk(broot)]
    for rel in sorted(dirs, key=lambda d: d.count(b"/"), reverse=True):
        if rel != b".":
            _set_mtime(j(rel), mtime())
    os.chmod(j(tree.private_dir), 0o700)
    os.chmod(broot, 0o755)
    _set_mtime(broot, mtime())
    return tree


@dataclass(frozen=True)
class Sample:
    """One dataset file: its path relative to the dataset root and the sha256 of its bytes."""

    rel: bytes
    sha256: str


def build_dataset(
    root: Path | str | bytes,
    n: int = 200,
    min_size: int = 1024,
    max_size: int = 64 * 1024,
    seed: int = SEED + 1,
    per_dir: int = 50,
) -> list[Sample]:
    """Write ``n`` sample files of random sizes in ``[min_size, max_size]`` under ``root``.

    Files go into ``shard_XX/`` directories of ``per_dir`` files each. Returns the samples in
    index order.
    """
    rng = random.Random(seed)
    broot = os.fsencode(root)
    os.makedirs(broot, exist_ok=True)
    os.chmod(broot, 0o755)
    samples = []
    for i in range(n):
        shard = b"shard_%02d" % (i // per_dir)
        os.makedirs(os.path.join(broot, shard), exist_ok=True)
        rel = shard + b"/sample_%05d.bin" % i
        data = rng.randbytes(rng.randint(min_size, max_size))
        _write(os.path.join(broot, rel), data)
        samples.append(Sample(rel, hashlib.sha256(data).hexdigest()))
    return samples


def sha256_file(path: bytes | str, chunk: int = 1024 * 1024) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tar_of_members(rng: random.Random, members: int = 8) -> bytes:
    """A tar of ``members`` random members of 8-20 KiB each (about 110 KiB for 8): what a
    reader of sample archives (``tarfile``) reads in small pieces."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tf:
        for i in range(members):
            data = rng.randbytes(rng.randint(8 << 10, 20 << 10))
            info = tarfile.TarInfo(f"{i:02d}.bin")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return out.getvalue()
