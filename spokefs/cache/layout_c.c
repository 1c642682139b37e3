/* A new chunk's ``head`` record in one native call (spokefs.cache.layout.new_chunk_record).
 *
 * Every chunk a cold read stores gets a header: presence bitmap, origin, segment, order seq,
 * stored tick, the xxh3-64 of all its data, one xxh3-64 per 4 KiB block, and the data's last
 * few bytes (the page-exact split: spokefs/cache/layout.py, "Why a tail"). In Python that is
 * seventeen hash calls, a list, a dataclass and three packs per 64 KiB chunk, a sixth of the
 * block cache writer's CPU on a cold read; here it is the hashes and the packing, with the
 * GIL released while hashing (the writer runs beside the event loop). layout.py builds the
 * same bytes in Python when this module is not built.
 *
 *   new_chunk_record(piece, slot, origin, segment, seq, tick, page_size) -> (record, cut)
 *       ``piece``: the chunk's blocks from ``slot`` on (the last may be short); ``cut``: the
 *       length of the data value (the rest, the tail, ends the record).
 *       ValueError: an empty piece, or one that does not fit the chunk from ``slot``.
 *
 * The hashes are XXH3_64bits (python-xxhash's xxh3_64 with seed 0) on the widest vector
 * unit the CPU has (spokefs/native/xxh3_dispatch.c). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../native/xxh3_dispatch.h"

#define BLOCK 4096
#define CHUNK_BLOCKS 16
#define HEAD_FIXED 28          /* <HBBQQQ: bitmap, origin, segment, seq, tick, chunk sum */
#define OVERFLOW_HEADER 16     /* LMDB's PAGEHDRSZ on 64-bit builds (layout.tail_len) */

static void put_le(unsigned char *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++, v >>= 8)
        p[i] = (unsigned char)(v & 0xff);
}

/* layout.tail_len */
static Py_ssize_t tail_len(Py_ssize_t n, Py_ssize_t page)
{
    Py_ssize_t pages = (n + page - 1) / page;
    Py_ssize_t t = n + OVERFLOW_HEADER - pages * page;
    return t > 0 ? t : 0;
}

static PyObject *new_chunk_record(PyObject *self, PyObject *args)
{
    Py_buffer piece;
    int slot, origin, segment;
    unsigned long long seq, tick;
    Py_ssize_t page;
    if (!PyArg_ParseTuple(args, "y*iiiKKn", &piece, &slot, &origin, &segment, &seq, &tick,
                          &page))
        return NULL;
    Py_ssize_t n = piece.len;
    Py_ssize_t blocks = (n + BLOCK - 1) / BLOCK;
    if (n <= 0 || slot < 0 || slot + blocks > CHUNK_BLOCKS || origin < 0 || origin > 255 ||
            segment < 0 || segment > 255 || page <= OVERFLOW_HEADER) {
        PyBuffer_Release(&piece);
        PyErr_SetString(PyExc_ValueError, "a piece that does not fit its chunk");
        return NULL;
    }
    Py_ssize_t tail = tail_len(n, page);
    PyObject *rec = PyBytes_FromStringAndSize(NULL, HEAD_FIXED + 8 * blocks + tail);
    if (rec == NULL) {
        PyBuffer_Release(&piece);
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(rec);
    const unsigned char *data = piece.buf;
    Py_BEGIN_ALLOW_THREADS
    put_le(out, ((1u << blocks) - 1) << slot, 2);
    out[2] = (unsigned char)origin;
    out[3] = (unsigned char)segment;
    put_le(out + 4, seq, 8);
    put_le(out + 12, tick, 8);
    put_le(out + 20, sf_xxh3(data, (size_t)n), 8);
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t len = n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK;
        put_le(out + HEAD_FIXED + 8 * b, sf_xxh3(data + b * BLOCK, (size_t)len), 8);
    }
    memcpy(out + HEAD_FIXED + 8 * blocks, data + n - tail, (size_t)tail);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&piece);
    return Py_BuildValue("(Nn)", rec, n - tail);
}

static PyMethodDef methods[] = {
    {"new_chunk_record", new_chunk_record, METH_VARARGS,
     "new_chunk_record(piece, slot, origin, segment, seq, tick, page_size) -> (record, cut)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "layout_c", "A new chunk's head record in one native call.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_layout_c(void)
{
    return PyModule_Create(&module);
}
