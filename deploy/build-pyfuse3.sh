#!/usr/bin/env bash
# Build and install pyfuse3 with two changes for spokefs, applied to the pinned sdist and
# checked to apply exactly once:
#
# 1. Reads name the inode. A read of a file that the kernel opened without asking the
#    filesystem (FUSE "no_open": the open handler answered ENOSYS) reaches the read handler
#    with the inode instead of file handle 0. Stock pyfuse3 passes only the handle, so a
#    filesystem cannot use no_open at all; with it, a file costs lookup + reads instead of
#    lookup + open + reads + release (spokefs/fuse/ops.py, "Kernel opens"). Marker:
#    pyfuse3.SPOKEFS_READ_INODE.
# 2. Plain readdir. Stock pyfuse3 answers every listing with READDIRPLUS, so the kernel builds
#    an inode and a dentry for every entry listed: `find` over a million entries spends ~85 %
#    of its time (~9 s here, `perf`) allocating them, and keeps ~1 GB of kernel memory. With
#    this change, an Operations class whose `readdirplus` attribute is False gets FUSE_READDIR
#    (names, inode numbers and types only; a stat of an entry is one LOOKUP), through the same
#    `readdir` handler and `readdir_reply`. And like reads, listings of a directory the kernel
#    opened without asking (FUSE "no_opendir": opendir answered ENOSYS) get the inode as their
#    handle, so a directory costs lookup + readdirs instead of lookup + opendir + readdirs +
#    releasedir. Marker: pyfuse3.SPOKEFS_PLAIN_READDIR.
# 3. One mount, served by a worker process beside the mounting one. `spokefs mount --workers N`
#    serves the mount's requests from the threads of a native read loop in a worker process
#    (spokefs/fuse/workers.py), which reads its own clone of the session's /dev/fuse
#    descriptor (FUSE_DEV_IOC_CLONE). The mounting process receives and answers INIT
#    synchronously before its loop starts (`spokefs_receive_init`: the kernel's read-ahead is
#    set after the INIT reply), hands out its descriptor (`spokefs_session_fd`), and stops
#    reading requests while the worker serves them (`spokefs_pause_reading`: a poll()ing
#    reader is woken by every request, where a thread in read(2) is woken alone). With two
#    readers on one connection, a descriptor that poll() called readable may have been
#    emptied by the other before this one reads: the mounting process's descriptor is
#    non-blocking then, and the loop takes EAGAIN as "nothing after all", as it takes EINTR.
#    Marker: pyfuse3.SPOKEFS_WORKERS (3: reading paused while a worker serves).
#
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


def replace_once(path, old, new):
    text = path.read_text()
    if text.count(old) != 1:
        sys.exit(f"build-pyfuse3: {path.name} is not what this patch expects ({old[:50]!r})")
    path.write_text(text.replace(old, new))

# 2. plain readdir: a flag on the token, a FUSE_READDIR handler, and READDIRPLUS turned off
#    at init when the operations ask for it; and, as for reads, a listing of a directory the
#    kernel opened without asking (opendir answered ENOSYS) names the inode as its handle.
replace_once(handlers, "cdef class ReaddirToken:\n    cdef fuse_req_t req\n",
             "cdef class ReaddirToken:\n    cdef fuse_req_t req\n    cdef int plain\n")
replace_once(handlers, "    conn.want &= ~(<unsigned> FUSE_CAP_READDIRPLUS_AUTO)\n",
             "    conn.want &= ~(<unsigned> FUSE_CAP_READDIRPLUS_AUTO)\n"
             "    if not getattr(operations, 'readdirplus', True):  # spokefs: plain readdir\n"
             "        conn.want &= ~(<unsigned> FUSE_CAP_READDIRPLUS)\n")
replace_once(handlers, "    c.fh = fi.fh\n    save_retval(fuse_readdirplus_async(c))\n",
             "    c.fh = fi.fh if fi.fh else ino\n    c.flags = 0\n    save_retval(fuse_readdirplus_async(c))\n\n"
             "cdef void fuse_readdir (fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,\n"
             "                        fuse_file_info *fi):\n"
             "    global py_retval\n"
             "    cdef _Container c = _Container()\n"
             "    c.req = req\n    c.size = size\n    c.off = off\n    c.fh = fi.fh if fi.fh else ino\n"
             "    c.flags = 1  # spokefs: plain readdir\n"
             "    save_retval(fuse_readdirplus_async(c))\n")
replace_once(handlers, "    token.req = c.req\n\n    try:\n        await operations.readdir(",
             "    token.req = c.req\n    token.plain = c.flags\n\n    try:\n        await operations.readdir(")
internal = src / "internal.pxi"
replace_once(internal, "        if res == -errno.EINTR:\n            continue\n",
             "        if res == -errno.EINTR or res == -errno.EAGAIN:  # spokefs: workers\n"
             "            continue\n")
replace_once(internal, "    fuse_ops.readdirplus = fuse_readdirplus\n",
             "    fuse_ops.readdirplus = fuse_readdirplus\n    fuse_ops.readdir = fuse_readdir\n")
# 3. a worker process serves: INIT received and answered synchronously, the session's
#    descriptor, and reading paused while the worker serves (terminate() ends a pause)
WORKERS = '''
# spokefs: one mount served by several processes (spokefs/fuse/workers.py)
import select as _spokefs_select

def spokefs_session_fd():
    """The session's /dev/fuse descriptor (a worker process clones it)."""
    return session_fd

def spokefs_receive_init():
    """Receive the kernel's INIT request, answer it, and return its bytes (blocks)."""
    cdef fuse_buf buf
    cdef int res
    buf.mem = NULL
    buf.size = 0
    buf.pos = 0
    buf.flags = 0
    while True:
        _spokefs_select.select([session_fd], [], [])
        res = fuse_session_receive_buf(session, &buf)
        if res != -errno.EINTR and res != -errno.EAGAIN:
            break
    if res <= 0:
        stdlib.free(buf.mem)
        raise OSError(-res if res < 0 else errno.ENODEV, "no INIT request from the kernel")
    data = PyBytes_FromStringAndSize(<char*> buf.mem, res)
    save_retval(None)
    fuse_session_process_buf(session, &buf)
    stdlib.free(buf.mem)
    return data

_spokefs_gate = None  # a trio.Event while reading is paused

def spokefs_pause_reading(paused):
    """Stop reading the session's requests (another process serves them), or read again."""
    global _spokefs_gate
    if paused:
        if _spokefs_gate is None:
            _spokefs_gate = trio.Event()
    elif _spokefs_gate is not None:
        _spokefs_gate.set()
        _spokefs_gate = None

SPOKEFS_WORKERS = 3  # the patch's version: reading paused while a worker serves
'''
replace_once(internal, "            if fuse_session_exited(session):\n"
                       "                log.debug('FUSE session exit flag set while waiting for FUSE fd '\n",
             "            while _spokefs_gate is not None and not fuse_session_exited(session):\n"
             "                await _spokefs_gate.wait()  # spokefs: a worker serves\n"
             "            if fuse_session_exited(session):\n"
             "                log.debug('FUSE session exit flag set while waiting for FUSE fd '\n")
init = src / "__init__.pyx"
replace_once(init, "    fuse_session_exit(session)\n    trio.lowlevel.notify_closing(session_fd)\n",
             "    fuse_session_exit(session)\n    trio.lowlevel.notify_closing(session_fd)\n"
             "    spokefs_pause_reading(False)  # spokefs: a paused reader sees the exit\n")
replace_once(init, "    len_ = fuse_add_direntry_plus(token.req, token.buf, token.size,\n"
                   "                                  cname, &attr.fuse_param, next_id)\n",
             "    if token.plain:  # spokefs: names, inode numbers and types only\n"
             "        len_ = fuse_add_direntry(token.req, token.buf, token.size,\n"
             "                                 cname, &attr.fuse_param.attr, next_id)\n"
             "    else:\n"
             "        len_ = fuse_add_direntry_plus(token.req, token.buf, token.size,\n"
             "                                      cname, &attr.fuse_param, next_id)\n")
init.write_text(init.read_text()
                + "\n# spokefs: read() gets the inode when the kernel opened without us\nSPOKEFS_READ_INODE = True\n"
                + "# spokefs: Operations.readdirplus = False answers listings with plain FUSE_READDIR\n"
                + "SPOKEFS_PLAIN_READDIR = True\n" + WORKERS)
PATCH
export SETUPTOOLS_SCM_PRETEND_VERSION_FOR_PYFUSE3="$version+spokefs.5"
if [ -n "$wheel_dir" ]; then
  "$py" -m pip wheel -q --no-deps --wheel-dir "$wheel_dir" "$work/pyfuse3-$version"
  echo "build-pyfuse3: wheel of pyfuse3 $version+spokefs.5 in $wheel_dir"
  exit 0
fi
"$py" -m pip install -q --no-deps --force-reinstall "$work/pyfuse3-$version"
"$py" -c 'import pyfuse3; assert pyfuse3.SPOKEFS_READ_INODE and pyfuse3.SPOKEFS_PLAIN_READDIR and pyfuse3.SPOKEFS_WORKERS >= 3; print("build-pyfuse3: installed pyfuse3", pyfuse3.__version__)'
