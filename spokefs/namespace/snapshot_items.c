/* A snapshot's entries turned into the namespace's LMDB items in C (spokefs.namespace.replica,
 * _BulkLoader).
 *
 * The Python loader decodes a million entries into tuples and builds three keys and values per
 * entry from them: ~2 s of a 1M-entry load's ~5.5 s. Here one pass over the inflated stream
 * does the same checks as protocol.SnapshotDecoder._drain_rows (same order, same messages) and
 * writes the items directly:
 *
 *   attr  key  file id (>Q)                   value  <IQqIQQ mode, size, mtime, nlink,
 *                                                     version, parent; then the target
 *   dent  key  parent (>Q) + name             value  child (>Q) + position (>I)
 *   dpos  key  parent (>Q) + position (>I)    value  child (>Q) + name
 *
 * dent and dpos items come back per step as lists of (key, value) tuples. attr items are kept
 * here and handed out sorted by key (`sorted_attrs`): file ids are hashes, so stored in stream
 * order every one lands at a random place in the B-tree (~1.5 us each), while sorted they go
 * in with LMDB's append (~0.3 us). Of an id listed more than once (hard links) the first
 * entry's attributes are kept, as `putmulti(overwrite=False)` does in stream order.
 *
 *   Items(error_class)
 *   .parse(buf, pos, count, seen, root_id) -> (pos, seen)
 *       every whole entry of ``buf[pos:]`` (a bytearray of plain stream bytes), at most up to
 *       ``count`` entries in all; raises error_class for a malformed or hostile one.
 *   .take_names() -> (dents, dposs)        the names parsed since the last take
 *   .sorted_attrs() -> iterator of (key, value), ascending, one per id; empties the store
 *   .attr_bytes       bytes held for attr items (the loader hands them out past a limit)
 *   .total            the sum of the sizes of every entry that is not a directory
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NAME_MAX_BYTES 255     /* protocol.base.NAME_MAX */
#define TARGET_MAX_BYTES 4095  /* protocol.base.TARGET_MAX */
#define MIN_FILE_ID 2          /* protocol.base.MIN_FILE_ID */
#define ENTRY_FIXED 52         /* protocol.tree._ENTRY: <QQIQqIQHH */
#define ATTR_FIXED 40          /* replica._ATTR: <IQqIQQ */
#define MAX_SIZE (1ULL << 62)

#define S_FMT 0170000
#define S_DIR 0040000
#define S_REG 0100000
#define S_LNK 0120000

static uint64_t le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put_be64(unsigned char *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)(v & 0xff);
}

static void put_be32(unsigned char *p, uint32_t v)
{
    for (int i = 3; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)(v & 0xff);
}

static void put_le64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++, v >>= 8)
        p[i] = (unsigned char)(v & 0xff);
}

static void put_le32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++, v >>= 8)
        p[i] = (unsigned char)(v & 0xff);
}

/* -- the directories seen so far, each with its next child's position ------------------- */

typedef struct {
    uint64_t *ids;   /* 0: an empty slot (ids are >= MIN_FILE_ID) */
    uint32_t *next;
    size_t cap, used; /* cap: a power of two */
} DirTable;

static size_t slot_of(const DirTable *t, uint64_t id)
{
    size_t mask = t->cap - 1, i = (size_t)((id * 0x9E3779B97F4A7C15ULL) >> 17) & mask;
    while (t->ids[i] && t->ids[i] != id)
        i = (i + 1) & mask;
    return i;
}

static int dirs_grow(DirTable *t)
{
    size_t cap = t->cap ? t->cap * 2 : 1024;
    uint64_t *ids = calloc(cap, sizeof *ids);
    uint32_t *next = calloc(cap, sizeof *next);
    if (!ids || !next) {
        free(ids);
        free(next);
        PyErr_NoMemory();
        return -1;
    }
    DirTable grown = {ids, next, cap, t->used};
    for (size_t i = 0; i < t->cap; i++) {
        if (t->ids[i]) {
            size_t j = slot_of(&grown, t->ids[i]);
            ids[j] = t->ids[i];
            next[j] = t->next[i];
        }
    }
    free(t->ids);
    free(t->next);
    *t = grown;
    return 0;
}

/* -- attr items, kept until handed out sorted --------------------------------------------- */

typedef struct {
    uint64_t id;
    size_t off; /* of the record in the arena: u16 target length, ATTR_FIXED bytes, target */
} AttrRef;

typedef struct {
    unsigned char *arena;
    size_t len, cap;
    AttrRef *refs;
    size_t n, refs_cap;
} AttrStore;

static void attrs_free(AttrStore *s)
{
    free(s->arena);
    free(s->refs);
    memset(s, 0, sizeof *s);
}

static unsigned char *attrs_add(AttrStore *s, uint64_t id, size_t tlen)
{
    size_t need = 2 + ATTR_FIXED + tlen;
    if (s->len + need > s->cap) {
        size_t cap = s->cap ? s->cap : (1 << 20);
        while (cap < s->len + need)
            cap *= 2;
        unsigned char *arena = realloc(s->arena, cap);
        if (!arena) {
            PyErr_NoMemory();
            return NULL;
        }
        s->arena = arena;
        s->cap = cap;
    }
    if (s->n == s->refs_cap) {
        size_t cap = s->refs_cap ? s->refs_cap * 2 : 16384;
        AttrRef *refs = realloc(s->refs, cap * sizeof *refs);
        if (!refs) {
            PyErr_NoMemory();
            return NULL;
        }
        s->refs = refs;
        s->refs_cap = cap;
    }
    s->refs[s->n].id = id;
    s->refs[s->n].off = s->len;
    s->n++;
    unsigned char *rec = s->arena + s->len;
    s->len += need;
    rec[0] = (unsigned char)(tlen & 0xff);
    rec[1] = (unsigned char)(tlen >> 8);
    return rec + 2;
}

static int ref_order(const void *a, const void *b)
{
    const AttrRef *x = a, *y = b;
    if (x->id != y->id)
        return x->id < y->id ? -1 : 1;
    return x->off < y->off ? -1 : (x->off > y->off); /* the first listed first */
}

/* -- the iterator sorted_attrs returns ------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    AttrStore store;
    size_t at;
} SortedAttrs;

static void sorted_dealloc(SortedAttrs *self)
{
    attrs_free(&self->store);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *sorted_next(SortedAttrs *self)
{
    AttrStore *s = &self->store;
    while (self->at < s->n && self->at > 0 && s->refs[self->at].id == s->refs[self->at - 1].id)
        self->at++; /* a hard link's later entries: the first one's attributes stay */
    if (self->at >= s->n)
        return NULL;
    const AttrRef *ref = &s->refs[self->at++];
    const unsigned char *rec = s->arena + ref->off;
    size_t tlen = (size_t)rec[0] | (size_t)rec[1] << 8;
    unsigned char key[8];
    put_be64(key, ref->id);
    PyObject *k = PyBytes_FromStringAndSize((const char *)key, 8);
    PyObject *v = PyBytes_FromStringAndSize((const char *)rec + 2, ATTR_FIXED + tlen);
    if (!k || !v) {
        Py_XDECREF(k);
        Py_XDECREF(v);
        return NULL;
    }
    PyObject *item = PyTuple_Pack(2, k, v);
    Py_DECREF(k);
    Py_DECREF(v);
    return item;
}

static PyTypeObject SortedAttrsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spokefs.namespace.snapshot_items.SortedAttrs",
    .tp_basicsize = sizeof(SortedAttrs),
    .tp_dealloc = (destructor)sorted_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)sorted_next,
};

/* -- Items ---------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *error;  /* the class raised for a bad entry (protocol.WireError) */
    PyObject *dents, *dposs;
    DirTable dirs;
    AttrStore attrs;
    unsigned __int128 total;
} Items;

static void items_dealloc(Items *self)
{
    Py_XDECREF(self->error);
    Py_XDECREF(self->dents);
    Py_XDECREF(self->dposs);
    free(self->dirs.ids);
    free(self->dirs.next);
    attrs_free(&self->attrs);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int items_init(Items *self, PyObject *args, PyObject *kwds)
{
    PyObject *error;
    if (!PyArg_ParseTuple(args, "O", &error))
        return -1;
    Py_INCREF(error);
    Py_XSETREF(self->error, error);
    Py_XSETREF(self->dents, PyList_New(0));
    Py_XSETREF(self->dposs, PyList_New(0));
    if (!self->dents || !self->dposs)
        return -1;
    if (!self->dirs.cap && dirs_grow(&self->dirs) < 0)
        return -1;
    return 0;
}

/* Raise the error class with a message that quotes a name as Python's repr(bytes) does. */
static void fail_name(Items *self, const char *before, const unsigned char *name, size_t len,
                      const char *after)
{
    PyObject *raw = PyBytes_FromStringAndSize((const char *)name, len > 40 ? 40 : len);
    PyObject *repr = raw ? PyObject_Repr(raw) : NULL;
    if (repr)
        PyErr_Format(self->error, "%s%U%s", before, repr, after);
    Py_XDECREF(raw);
    Py_XDECREF(repr);
}

static int add_dir(Items *self, uint64_t id)
{
    if ((self->dirs.used + 1) * 2 > self->dirs.cap && dirs_grow(&self->dirs) < 0)
        return -1;
    size_t i = slot_of(&self->dirs, id);
    self->dirs.ids[i] = id;
    self->dirs.next[i] = 0;
    self->dirs.used++;
    return 0;
}

static int append_pair(PyObject *list, const unsigned char *k, size_t klen,
                       const unsigned char *v, size_t vlen)
{
    PyObject *key = PyBytes_FromStringAndSize((const char *)k, klen);
    PyObject *value = PyBytes_FromStringAndSize((const char *)v, vlen);
    PyObject *pair = key && value ? PyTuple_Pack(2, key, value) : NULL;
    Py_XDECREF(key);
    Py_XDECREF(value);
    if (!pair)
        return -1;
    int rc = PyList_Append(list, pair);
    Py_DECREF(pair);
    return rc;
}

/* The items of one checked entry. */
static int emit(Items *self, uint64_t fid, uint64_t parent, uint32_t mode, uint64_t size,
                uint64_t mtime, uint32_t nlink, uint64_t version, const unsigned char *name,
                size_t nlen, const unsigned char *target, size_t tlen)
{
    unsigned char *value = attrs_add(&self->attrs, fid, tlen);
    if (!value)
        return -1;
    put_le32(value, mode);
    put_le64(value + 4, size);
    put_le64(value + 12, mtime);
    put_le32(value + 20, nlink);
    put_le64(value + 24, version);
    put_le64(value + 32, parent);
    memcpy(value + ATTR_FIXED, target, tlen);
    if ((mode & S_FMT) != S_DIR)
        self->total += size;
    if (!parent)
        return 0; /* the root has no name */
    size_t slot = slot_of(&self->dirs, parent); /* checked to be there */
    uint32_t pos = self->dirs.next[slot]++;
    unsigned char buf[8 + 4 + NAME_MAX_BYTES], val[8 + 4 + NAME_MAX_BYTES];
    put_be64(buf, parent);
    memcpy(buf + 8, name, nlen);
    put_be64(val, fid);
    put_be32(val + 8, pos);
    if (append_pair(self->dents, buf, 8 + nlen, val, 12) < 0)
        return -1;
    put_be32(buf + 8, pos);
    memcpy(val + 8, name, nlen);
    return append_pair(self->dposs, buf, 12, val, 8 + nlen);
}

static int name_is_bad(const unsigned char *name, size_t nlen)
{
    if (!nlen || memchr(name, '/', nlen) || memchr(name, 0, nlen))
        return 1;
    return (nlen == 1 && name[0] == '.') || (nlen == 2 && name[0] == '.' && name[1] == '.');
}

static PyObject *items_parse(Items *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t pos;
    unsigned long long count, seen, root_id;
    if (!PyArg_ParseTuple(args, "y*nKKK", &view, &pos, &count, &seen, &root_id))
        return NULL;
    const unsigned char *buf = view.buf;
    size_t end_buf = (size_t)view.len, at = (size_t)(pos < 0 ? 0 : pos);
    char msg[160];
    while (seen < count && at <= end_buf && end_buf - at >= ENTRY_FIXED) {
        const unsigned char *p = buf + at;
        uint64_t fid = le64(p), parent = le64(p + 8), size = le64(p + 20), mtime = le64(p + 28),
                 version = le64(p + 40);
        uint32_t mode = le32(p + 16), nlink = le32(p + 36);
        size_t nlen = (size_t)p[48] | (size_t)p[49] << 8, tlen = (size_t)p[50] | (size_t)p[51] << 8;
        if (nlen > NAME_MAX_BYTES || tlen > TARGET_MAX_BYTES) {
            snprintf(msg, sizeof msg, "over-long name (%zu) or target (%zu)", nlen, tlen);
            goto fail;
        }
        size_t start = at + ENTRY_FIXED, end = start + nlen + tlen;
        if (end > end_buf)
            break;
        const unsigned char *name = buf + start, *target = buf + start + nlen;
        uint32_t kind = mode & S_FMT;
        if (seen == 0) { /* the root, as SnapshotDecoder checks it (_check_attrs and more) */
            if (kind != S_DIR && kind != S_REG && kind != S_LNK) {
                snprintf(msg, sizeof msg, "entry %llx: unsupported file type %o",
                         (unsigned long long)fid, mode);
                goto fail;
            }
            if (fid < MIN_FILE_ID) {
                snprintf(msg, sizeof msg, "entry id %llu below %d", (unsigned long long)fid,
                         MIN_FILE_ID);
                goto fail;
            }
            if ((tlen && kind != S_LNK) || (kind == S_LNK && (!tlen || memchr(target, 0, tlen)))) {
                snprintf(msg, sizeof msg, "entry %llx: bad symlink target", (unsigned long long)fid);
                goto fail;
            }
            if (size > MAX_SIZE) {
                snprintf(msg, sizeof msg, "entry %llx: absurd size %llu", (unsigned long long)fid,
                         (unsigned long long)size);
                goto fail;
            }
            if (fid != root_id || parent != 0 || nlen || kind != S_DIR) {
                snprintf(msg, sizeof msg, "the first entry must be the root directory");
                goto fail;
            }
            if (add_dir(self, fid) < 0 || emit(self, fid, 0, mode, size, mtime, nlink, version,
                                               name, 0, target, 0) < 0)
                goto error;
        } else {
            if (tlen ? (kind != S_LNK || memchr(target, 0, tlen)) : kind == S_LNK) {
                snprintf(msg, sizeof msg, "entry %llx: bad symlink target", (unsigned long long)fid);
                goto fail;
            }
            if (kind != S_DIR && kind != S_REG && kind != S_LNK) {
                snprintf(msg, sizeof msg, "entry %llx: unsupported file type %o",
                         (unsigned long long)fid, mode);
                goto fail;
            }
            if (fid < MIN_FILE_ID) {
                snprintf(msg, sizeof msg, "entry id %llu below %d", (unsigned long long)fid,
                         MIN_FILE_ID);
                goto fail;
            }
            if (size > MAX_SIZE) {
                snprintf(msg, sizeof msg, "entry %llx: absurd size %llu", (unsigned long long)fid,
                         (unsigned long long)size);
                goto fail;
            }
            if (name_is_bad(name, nlen)) {
                if (!nlen)
                    PyErr_SetString(self->error, "bad name length 0");
                else
                    fail_name(self, "bad name ", name, nlen, "");
                goto error;
            }
            if (!self->dirs.ids[slot_of(&self->dirs, parent)]) {
                snprintf(msg, sizeof msg, ": parent %llx not seen yet", (unsigned long long)parent);
                fail_name(self, "entry ", name, nlen, msg);
                goto error;
            }
            if (kind == S_DIR) {
                if (self->dirs.ids[slot_of(&self->dirs, fid)]) {
                    snprintf(msg, sizeof msg, "directory %llx listed twice (a cycle)",
                             (unsigned long long)fid);
                    goto fail;
                }
                if (add_dir(self, fid) < 0)
                    goto error;
            }
            if (emit(self, fid, parent, mode, size, mtime, nlink, version, name, nlen, target,
                     tlen) < 0)
                goto error;
        }
        seen++;
        at = end;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("nK", (Py_ssize_t)at, seen);
fail:
    PyErr_SetString(self->error, msg);
error:
    PyBuffer_Release(&view);
    return NULL;
}

static PyObject *items_take_names(Items *self, PyObject *unused)
{
    PyObject *dents = PyList_New(0), *dposs = PyList_New(0);
    if (!dents || !dposs) {
        Py_XDECREF(dents);
        Py_XDECREF(dposs);
        return NULL;
    }
    PyObject *out = Py_BuildValue("NN", self->dents, self->dposs);
    self->dents = dents;
    self->dposs = dposs;
    return out;
}

static PyObject *items_sorted_attrs(Items *self, PyObject *unused)
{
    SortedAttrs *it = PyObject_New(SortedAttrs, &SortedAttrsType);
    if (!it)
        return NULL;
    it->store = self->attrs;
    it->at = 0;
    memset(&self->attrs, 0, sizeof self->attrs);
    Py_BEGIN_ALLOW_THREADS
    qsort(it->store.refs, it->store.n, sizeof(AttrRef), ref_order);
    Py_END_ALLOW_THREADS
    return (PyObject *)it;
}

static PyObject *items_attr_bytes(Items *self, void *closure)
{
    return PyLong_FromSize_t(self->attrs.len + self->attrs.n * sizeof(AttrRef));
}

static PyObject *items_total(Items *self, void *closure)
{
    PyObject *high = PyLong_FromUnsignedLongLong((unsigned long long)(self->total >> 64));
    PyObject *shift = PyLong_FromLong(64);
    PyObject *low = PyLong_FromUnsignedLongLong((unsigned long long)self->total);
    PyObject *shifted = high && shift ? PyNumber_Lshift(high, shift) : NULL;
    PyObject *total = shifted && low ? PyNumber_Add(shifted, low) : NULL;
    Py_XDECREF(high);
    Py_XDECREF(shift);
    Py_XDECREF(low);
    Py_XDECREF(shifted);
    return total;
}

static PyMethodDef items_methods[] = {
    {"parse", (PyCFunction)items_parse, METH_VARARGS,
     "parse(buf, pos, count, seen, root_id) -> (pos, seen): the whole entries of buf[pos:]"},
    {"take_names", (PyCFunction)items_take_names, METH_NOARGS,
     "take_names() -> (dents, dposs): the dent and dpos items parsed since the last take"},
    {"sorted_attrs", (PyCFunction)items_sorted_attrs, METH_NOARGS,
     "sorted_attrs() -> iterator of (key, value): the attr items held, ascending, one per id"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef items_getset[] = {
    {"attr_bytes", (getter)items_attr_bytes, NULL, "bytes held for attr items", NULL},
    {"total", (getter)items_total, NULL, "the sum of the sizes of every non-directory", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ItemsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spokefs.namespace.snapshot_items.Items",
    .tp_basicsize = sizeof(Items),
    .tp_dealloc = (destructor)items_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A snapshot's entries turned into the namespace's LMDB items",
    .tp_methods = items_methods,
    .tp_getset = items_getset,
    .tp_init = (initproc)items_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "spokefs.namespace.snapshot_items",
    "A snapshot's entries turned into the namespace's LMDB items in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit_snapshot_items(void)
{
    if (PyType_Ready(&ItemsType) < 0 || PyType_Ready(&SortedAttrsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&ItemsType);
    if (PyModule_AddObject(m, "Items", (PyObject *)&ItemsType) < 0) {
        Py_DECREF(&ItemsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
