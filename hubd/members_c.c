/* The members of a pack read from their directory in one native call (hubd.members).
 *
 * A pack is up to 3.75 MiB of one directory's small files. Read from Python, each member
 * cost ~10 system calls (a confined walk to its directory, an lstat, an open, two fstats, a
 * read, the closes), each releasing and taking back the GIL that the event loop and the other
 * reading threads want too: hubd spent more CPU on that churn and the Python around it than
 * on reading the bytes (benchmarks/README.md, "Members read in one call"). Here the directory
 * is opened once, by the caller, and every member costs five system calls and its hash with
 * the GIL released once for the whole pack. members.py runs the same steps in Python when
 * this module is not built; the tests compare the two.
 *
 *   read_members(dir_fd, names, sizes, body, pos, record_size) -> list
 *       For each member in order: fstatat(AT_SYMLINK_NOFOLLOW) (a device node swapped in
 *       is not even opened), openat(O_NOFOLLOW|O_NONBLOCK|O_NOCTTY), fstat, its ``size``
 *       bytes read (preadv) into ``body`` at ``pos + record_size``, fstat again, close, and
 *       the xxh3-64 of the bytes. A member read whole moves ``pos`` on by ``record_size +
 *       size``; any other by ``record_size`` (its record header only). Each item is
 *           (dev, ino, size, mtime_ns, ino_after, size_after, mtime_ns_after, digest)
 *       for a member read whole (mtime clamped to int64 nanoseconds, as the scan does), or
 *       an int: an errno of the fstatat or the openat, or NOT_REGULAR, SIZE_DIFFERS,
 *       SHRANK, NOT_LISTED (a size below 0: not in the snapshot, nothing opened). The caller checks ids and versions. OSError: a failed fstat or read of an
 *       open member (the whole pack fails, as in Python). ValueError: ``body`` too small.
 *
 * No library: xxh3 from spokefs/native, as in the spoke's C parts. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "../spokefs/native/xxh3_dispatch.h"

#define NOT_REGULAR (-1)
#define SIZE_DIFFERS (-2)
#define SHRANK (-3)
#define NOT_LISTED (-4)

typedef struct {
    PyObject *owner;  /* a reference to the name's bytes */
    const char *name;
    Py_ssize_t size;
    int code;         /* 0: read whole; else an errno or one of the codes above */
    int read_errno;   /* an fstat or read failed on the open member: the call raises */
    struct stat before, after;
    uint64_t digest;
} member_t;

static int64_t mtime_ns(const struct stat *st)
{
    int64_t ns;
    if (__builtin_mul_overflow((int64_t)st->st_mtim.tv_sec, (int64_t)1000000000, &ns) ||
            __builtin_add_overflow(ns, (int64_t)st->st_mtim.tv_nsec, &ns))
        return st->st_mtim.tv_sec < 0 ? INT64_MIN : INT64_MAX;
    return ns;
}

/* One member into buf[0..m->size); sets m->code, or m->read_errno (then stop). */
static void read_one(int dir_fd, member_t *m, unsigned char *buf)
{
    struct stat st;
    if (m->size < 0) {
        m->code = NOT_LISTED;
        return;
    }
    if (fstatat(dir_fd, m->name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        m->code = errno;
        return;
    }
    if (!S_ISREG(st.st_mode)) {
        m->code = NOT_REGULAR;
        return;
    }
    int fd = openat(dir_fd, m->name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        m->code = errno;
        return;
    }
    if (fstat(fd, &m->before) != 0) {
        m->read_errno = errno;
    } else if (!S_ISREG(m->before.st_mode)) {
        m->code = NOT_REGULAR;
    } else if (m->before.st_size != (off_t)m->size) {
        m->code = SIZE_DIFFERS;
    } else {
        Py_ssize_t got = 0;
        while (got < m->size) {
            struct iovec iov = {buf + got, (size_t)(m->size - got)};
            ssize_t n = preadv(fd, &iov, 1, (off_t)got);
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                m->read_errno = errno;
                break;
            }
            if (n == 0) {
                m->code = SHRANK;
                break;
            }
            got += n;
        }
        if (m->code == 0 && m->read_errno == 0 && fstat(fd, &m->after) != 0)
            m->read_errno = errno;
        if (m->code == 0 && m->read_errno == 0)
            m->digest = sf_xxh3(buf, (size_t)m->size);
    }
    close(fd);
}

static PyObject *read_members(PyObject *self, PyObject *args)
{
    int dir_fd;
    PyObject *names, *sizes;
    Py_buffer body;
    Py_ssize_t pos, record_size;
    if (!PyArg_ParseTuple(args, "iO!O!w*nn", &dir_fd, &PyList_Type, &names, &PyList_Type,
                          &sizes, &body, &pos, &record_size))
        return NULL;
    PyObject *result = NULL;
    member_t *ms = NULL;
    Py_ssize_t count = PyList_GET_SIZE(names);
    if (PyList_GET_SIZE(sizes) != count) {
        PyErr_SetString(PyExc_ValueError, "names and sizes differ in length");
        goto done;
    }
    ms = PyMem_Calloc((size_t)(count ? count : 1), sizeof(member_t));
    if (ms == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* Checked before any read: every member read whole fits, headers included. */
    Py_ssize_t need = pos;
    for (Py_ssize_t i = 0; i < count; i++) {
        /* borrowed while the GIL is held; each name's bytes get a reference of their own
         * below, so they outlive any change to the list while the GIL is released */
        PyObject *name = PyList_GET_ITEM(names, i);
        PyObject *size = PyList_GET_ITEM(sizes, i);
        if (!PyBytes_Check(name) ||
                (Py_ssize_t)strlen(PyBytes_AS_STRING(name)) != PyBytes_GET_SIZE(name)) {
            PyErr_SetString(PyExc_ValueError, "a member name is not bytes without NUL");
            goto done;
        }
        Py_INCREF(name);
        ms[i].owner = name;
        ms[i].name = PyBytes_AS_STRING(name);
        ms[i].size = PyLong_AsSsize_t(size);
        if (ms[i].size == -1 && PyErr_Occurred())
            goto done;
        need += record_size + (ms[i].size > 0 ? ms[i].size : 0);
    }
    if (pos < 0 || record_size < 0 || need > body.len) {
        PyErr_SetString(PyExc_ValueError, "the body is too small for the members");
        goto done;
    }
    int read_errno = 0;
    Py_BEGIN_ALLOW_THREADS
    unsigned char *base = body.buf;
    Py_ssize_t at = pos;
    for (Py_ssize_t i = 0; i < count; i++) {
        read_one(dir_fd, &ms[i], base + at + record_size);
        if (ms[i].read_errno) {
            read_errno = ms[i].read_errno;
            break;
        }
        at += record_size + (ms[i].code == 0 ? ms[i].size : 0);
    }
    Py_END_ALLOW_THREADS
    if (read_errno) {
        errno = read_errno;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = PyList_New(count);
    if (result == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        member_t *m = &ms[i];
        PyObject *item = m->code != 0 ? PyLong_FromLong(m->code) : Py_BuildValue(
            "(KKnLKnLK)",
            (unsigned long long)m->before.st_dev, (unsigned long long)m->before.st_ino,
            (Py_ssize_t)m->before.st_size, (long long)mtime_ns(&m->before),
            (unsigned long long)m->after.st_ino, (Py_ssize_t)m->after.st_size,
            (long long)mtime_ns(&m->after), (unsigned long long)m->digest);
        if (item == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, item);
    }
done:
    if (ms != NULL)
        for (Py_ssize_t i = 0; i < count; i++)
            Py_XDECREF(ms[i].owner);
    PyMem_Free(ms);
    PyBuffer_Release(&body);
    return result;
}

static PyMethodDef methods[] = {
    {"read_members", read_members, METH_VARARGS,
     "read_members(dir_fd, names, sizes, body, pos, record_size) -> list (see the source)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hubd.members_c",
    "A pack's members read from their directory in one call (see members_c.c).", -1, methods,
};

PyMODINIT_FUNC PyInit_members_c(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "NOT_REGULAR", NOT_REGULAR) ||
            PyModule_AddIntConstant(m, "SIZE_DIFFERS", SIZE_DIFFERS) ||
            PyModule_AddIntConstant(m, "SHRANK", SHRANK) ||
            PyModule_AddIntConstant(m, "NOT_LISTED", NOT_LISTED)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
