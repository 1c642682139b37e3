#!/usr/bin/env bash
# Build and install pyfuse3 with one change for spokefs: a read of a file that the kernel
# opened without asking the filesystem (FUSE "no_open": the open handler answered ENOSYS)
# reaches the read handler with the inode instead of file handle 0. Stock pyfuse3 passes only
# the handle, so a filesystem cannot use no_open at all; with it, a file costs lookup + reads
# instead of lookup + open + reads + release (spokefs/fuse_ops.py, "Kernel opens").
#
# The change is two lines of the Cython source (handlers.pxi's fuse_read, and a marker that
# spokefs checks at mount), applied to the pinned sdist and checked to apply exactly once.
# Needs gcc, pkg-config and libfuse3-dev (deploy/setup.sh installs them).
# Usage: bash deploy/build-pyfuse3.sh PYTHON [--wheel-dir DIR]
#   (with --wheel-dir: build the wheel into DIR instead of installing it, for images)
set -euo pipefail
py=${1:?usage: build-pyfuse3.sh PYTHON [--wheel-dir DIR]}
wheel_dir=
[ "${2:-}" = "--wheel-dir" ] && wheel_dir=${3:?--wheel-dir needs a directory}
version=3.5.0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m pip download -q --no-deps --no-binary :all: "pyfuse3==$version" -d "$work"
tar xzf "$work/pyfuse3-$version.tar.gz" -C "$work"
"$py" - "$work/pyfuse3-$version/src/pyfuse3" <<'PATCH'
import pathlib, sys
src = pathlib.Path(sys.argv[1])
handlers = src / "handlers.pxi"
text = handlers.read_text()
head = "cdef void fuse_read (fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,"
start = text.index(head)
old = "    c.fh = fi.fh\n"
at = text.index(old, start)
if text.count(head) != 1 or at - start > 400:
    sys.exit("build-pyfuse3: fuse_read is not where this patch expects it")
new = "    c.fh = fi.fh if fi.fh else ino  # spokefs: no_open reads carry the inode\n"
handlers.write_text(text[:at] + new + text[at + len(old):])
init = src / "__init__.pyx"
init.write_text(init.read_text() + "\n# spokefs: read() gets the inode when the kernel opened without us\nSPOKEFS_READ_INODE = True\n")
PATCH
export SETUPTOOLS_SCM_PRETEND_VERSION_FOR_PYFUSE3="$version+spokefs.inoread"
if [ -n "$wheel_dir" ]; then
  "$py" -m pip wheel -q --no-deps --wheel-dir "$wheel_dir" "$work/pyfuse3-$version"
  echo "build-pyfuse3: wheel of pyfuse3 $version+spokefs.inoread in $wheel_dir"
  exit 0
fi
"$py" -m pip install -q --no-deps --force-reinstall "$work/pyfuse3-$version"
"$py" -c 'import pyfuse3; assert pyfuse3.SPOKEFS_READ_INODE; print("build-pyfuse3: installed pyfuse3", pyfuse3.__version__)'
