/* The framed representation of a blob in one native call per body (spokefs.protocol.frames).
 *
 * A framed body is every 4 KiB of file data followed by its xxh3-64, seeded with the file,
 * the version and the frame's index (docs/protocol.md, "Why a version 2"); the last frame may
 * be short. In Python each frame costs a slice, an unpack, a seed and a call (~2 us); here a
 * frame costs its hash and one copy, with the GIL released. frames.py falls back to the
 * Python loop when this module is not built (a hub installed without a compiler).
 *
 *   unframe(body, file_id, version, first_frame) -> (data, -1) | (None, bad frame index)
 *       ValueError: a frame with no data byte (the body was cut inside a sum).
 *   frame(data, file_id, version, first_frame) -> framed bytes
 *       ``data``: a buffer, or a list or tuple of buffers whose bytes follow each other (a
 *       body as it arrived, not joined first).
 *   frame_file(fd, offset, size, file_id, version, first_frame) -> framed bytes | None
 *       ``size`` bytes of the file at ``offset`` read (preadv) straight into their frames:
 *       one copy, no bytes object of the data. None: the file ended first. OSError.
 *   xxh3_unit() -> "avx2" | "baseline": the vector unit the hashes run on.
 *   receive_buffer(size) -> a bytearray of ``size`` bytes, not zeroed: an answer is
 *       received into it and only the bytes received are read (bytearray(size) writes
 *       every byte first, and faults in every page while the kernel zeroes it too).
 *
 * The hashes are xxHash's XXH3_64bits_withSeed (what python-xxhash's xxh3_64 computes), from
 * Debian's libxxhash-dev as a header only, on the widest vector unit the CPU has
 * (spokefs/native/xxh3_dispatch.c): no library to link or ship. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

#include "../native/xxh3_dispatch.h"

#define DATA_BYTES 4096
#define SUM_BYTES 8
#define FRAME_BYTES (DATA_BYTES + SUM_BYTES)

/* frames.frame_seed, modulo 2**64 as there */
static uint64_t seed_of(uint64_t file_id, uint64_t version, uint64_t index)
{
    return file_id * 0x9E3779B97F4A7C15ULL + version * 0xC2B2AE3D27D4EB4FULL + index;
}

static uint64_t load_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static void store_le64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++, v >>= 8)
        p[i] = (unsigned char)(v & 0xff);
}

static PyObject *unframe(PyObject *self, PyObject *args)
{
    Py_buffer body;
    unsigned long long file_id, version, first;
    if (!PyArg_ParseTuple(args, "y*KKK", &body, &file_id, &version, &first))
        return NULL;
    Py_ssize_t n = body.len;
    Py_ssize_t frames = (n + FRAME_BYTES - 1) / FRAME_BYTES;
    Py_ssize_t last = n - (frames - 1) * FRAME_BYTES;
    if (frames > 0 && last <= SUM_BYTES) {
        PyBuffer_Release(&body);
        return PyErr_Format(PyExc_ValueError, "a frame of %zd bytes has no data", last);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n - frames * SUM_BYTES);
    if (out == NULL) {
        PyBuffer_Release(&body);
        return NULL;
    }
    const unsigned char *src = body.buf;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < frames; k++) {
        Py_ssize_t len = (k == frames - 1 ? last : FRAME_BYTES) - SUM_BYTES;
        const unsigned char *frame = src + k * FRAME_BYTES;
        uint64_t want = load_le64(frame + len);
        if (sf_xxh3_seeded(frame, (size_t)len, seed_of(file_id, version, first + k))
                != want) {
            bad = k;
            break;
        }
        memcpy(dst + k * DATA_BYTES, frame, (size_t)len);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&body);
    if (bad >= 0) {
        Py_DECREF(out);
        return Py_BuildValue("(On)", Py_None, bad);
    }
    PyObject *result = Py_BuildValue("(On)", out, (Py_ssize_t)-1);
    Py_DECREF(out);
    return result;
}

/* The buffers of ``data``: itself, or each item of a list or tuple of buffers (their bytes
 * in a row), so a body received in pieces is framed without joining them first. */
static Py_buffer *get_parts(PyObject *data, Py_ssize_t *count, Py_buffer *one)
{
    if (PyObject_CheckBuffer(data)) {
        if (PyObject_GetBuffer(data, one, PyBUF_SIMPLE) < 0)
            return NULL;
        *count = 1;
        return one;
    }
    if (!PyList_Check(data) && !PyTuple_Check(data)) {
        PyErr_Format(PyExc_TypeError, "frame() takes a buffer or a list of buffers, not %.80s",
                     Py_TYPE(data)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(data);
    Py_buffer *views = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(data, i), &views[i], PyBUF_SIMPLE) < 0) {
            while (i-- > 0)
                PyBuffer_Release(&views[i]);
            PyMem_Free(views);
            return NULL;
        }
    }
    *count = n;
    return views;
}

static void release_parts(Py_buffer *views, Py_ssize_t count, Py_buffer *one)
{
    for (Py_ssize_t i = 0; i < count; i++)
        PyBuffer_Release(&views[i]);
    if (views != one)
        PyMem_Free(views);
}

static PyObject *frame(PyObject *self, PyObject *args)
{
    PyObject *data;
    unsigned long long file_id, version, first;
    if (!PyArg_ParseTuple(args, "OKKK", &data, &file_id, &version, &first))
        return NULL;
    Py_buffer one;
    Py_ssize_t count = 0;
    Py_buffer *parts = get_parts(data, &count, &one);
    if (parts == NULL)
        return NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        n += parts[i].len;
    Py_ssize_t frames = (n + DATA_BYTES - 1) / DATA_BYTES;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n + frames * SUM_BYTES);
    if (out == NULL) {
        release_parts(parts, count, &one);
        return NULL;
    }
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t part = 0, at = 0;  /* the next byte to copy: parts[part].buf + at */
    for (Py_ssize_t k = 0; k < frames; k++) {
        Py_ssize_t len = k == frames - 1 ? n - k * DATA_BYTES : DATA_BYTES;
        unsigned char *to = dst + k * FRAME_BYTES;
        for (Py_ssize_t done = 0; done < len;) {  /* a frame may span parts */
            while (at == parts[part].len) {
                part++;
                at = 0;
            }
            Py_ssize_t take = parts[part].len - at;
            if (take > len - done)
                take = len - done;
            memcpy(to + done, (const unsigned char *)parts[part].buf + at, (size_t)take);
            done += take;
            at += take;
        }
        store_le64(to + len, sf_xxh3_seeded(to, (size_t)len,
                                            seed_of(file_id, version, first + k)));
    }
    Py_END_ALLOW_THREADS
    release_parts(parts, count, &one);
    return out;
}

#define READ_IOVS 256  /* one slice (1 MiB of data) per preadv; IOV_MAX is 1024 */

static PyObject *frame_file(PyObject *self, PyObject *args)
{
    int fd;
    long long offset;
    Py_ssize_t n;
    unsigned long long file_id, version, first;
    if (!PyArg_ParseTuple(args, "iLnKKK", &fd, &offset, &n, &file_id, &version, &first))
        return NULL;
    if (n < 0 || offset < 0)
        return PyErr_Format(PyExc_ValueError, "a negative offset or size");
    Py_ssize_t frames = (n + DATA_BYTES - 1) / DATA_BYTES;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n + frames * SUM_BYTES);
    if (out == NULL)
        return NULL;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    int err = 0, ended = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t done = 0;
    while (done < n) {
        struct iovec iov[READ_IOVS];
        int count = 0;
        for (Py_ssize_t pos = done; count < READ_IOVS && pos < n; count++) {
            Py_ssize_t k = pos / DATA_BYTES, in = pos % DATA_BYTES;
            Py_ssize_t len = DATA_BYTES - in < n - pos ? DATA_BYTES - in : n - pos;
            iov[count].iov_base = dst + k * FRAME_BYTES + in;
            iov[count].iov_len = (size_t)len;
            pos += len;
        }
        ssize_t got = preadv(fd, iov, count, (off_t)(offset + done));
        if (got < 0) {
            if (errno == EINTR)
                continue;
            err = errno;
            break;
        }
        if (got == 0) {
            ended = 1;
            break;
        }
        done += got;
    }
    if (!err && !ended) {
        for (Py_ssize_t k = 0; k < frames; k++) {
            Py_ssize_t len = k == frames - 1 ? n - k * DATA_BYTES : DATA_BYTES;
            unsigned char *at = dst + k * FRAME_BYTES;
            store_le64(at + len, sf_xxh3_seeded(at, (size_t)len,
                                                      seed_of(file_id, version, first + k)));
        }
    }
    Py_END_ALLOW_THREADS
    if (err) {
        Py_DECREF(out);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (ended) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

static PyObject *xxh3_unit(PyObject *self, PyObject *unused)
{
    return PyUnicode_FromString(sf_xxh3_unit());
}

static PyObject *receive_buffer(PyObject *self, PyObject *args)
{
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "n", &size))
        return NULL;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "a buffer of negative size");
        return NULL;
    }
    return PyByteArray_FromStringAndSize(NULL, size);
}

static PyMethodDef methods[] = {
    {"receive_buffer", receive_buffer, METH_VARARGS,
     "receive_buffer(size) -> a bytearray of size bytes, not zeroed"},
    {"xxh3_unit", xxh3_unit, METH_NOARGS,
     "xxh3_unit() -> \"avx2\" or \"baseline\": the vector unit the hashes run on"},
    {"unframe", unframe, METH_VARARGS,
     "unframe(body, file_id, version, first_frame) -> (data, -1) or (None, bad frame)"},
    {"frame", frame, METH_VARARGS,
     "frame(data, file_id, version, first_frame) -> the framed representation; data: a "
     "buffer, or a list of buffers in a row"},
    {"frame_file", frame_file, METH_VARARGS,
     "frame_file(fd, offset, size, file_id, version, first_frame) -> framed bytes, or None "
     "if the file ended first"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "spokefs.protocol.frames_c",
    "Framed blobs checked and written in one native call per body.", -1, methods,
};

PyMODINIT_FUNC PyInit_frames_c(void)
{
    return PyModule_Create(&module);
}
