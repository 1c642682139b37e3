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
 * Every item is held here and handed out sorted (`sorted_attrs`, `sorted_names`), so the
 * loader stores them with LMDB's append: file ids are hashes, so in stream order each attr
 * item lands at a random place in the B-tree and each directory's names at another (1M
 * entries: ~1.5 s for attr, ~0.6 s for dent and for dpos; appended, ~0.3 s each, in pages
 * filled instead of split in half). About 100 bytes an entry are held (the loader stores a
 * batch past a limit). Of an id listed more than once (hard links) the first entry's
 * attributes are kept, as `putmulti(overwrite=False)` does in stream order.
 *
 *   Items(error_class)
 *   .parse(buf, pos, count, seen, root_id) -> (pos, seen)
 *       every whole entry of ``buf[pos:]`` (a bytearray of plain stream bytes), at most up to
 *       ``count`` entries in all; raises error_class for a malformed or hostile one.
 *   .sorted_attrs() -> iterator of (key, value), ascending, one per id; empties the store
 *   .sorted_names() -> (dents, dposs), iterators of (key, value), ascending; empties the
 *       store; raises error_class for a name listed twice in a directory
 *   .held_bytes       bytes held for items
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

/* -- items held until handed out sorted ----------------------------------------------------
 *
 * A Store is an arena of records and one Ref per record: the key it sorts by (a file id for
 * attr records, the parent's id for name records) and where the record sits. */

typedef struct {
    uint64_t key;
    size_t off;
} Ref;

typedef struct {
    unsigned char *arena;
    size_t len, cap;
    Ref *refs;
    size_t n, refs_cap;
} Store;

static void store_free(Store *s)
{
    free(s->arena);
    free(s->refs);
    memset(s, 0, sizeof *s);
}

/* room for one record of ``need`` bytes under ``key`` */
static unsigned char *store_add(Store *s, uint64_t key, size_t need)
{
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
        Ref *refs = realloc(s->refs, cap * sizeof *refs);
        if (!refs) {
            PyErr_NoMemory();
            return NULL;
        }
        s->refs = refs;
        s->refs_cap = cap;
    }
    s->refs[s->n].key = key;
    s->refs[s->n].off = s->len;
    s->n++;
    unsigned char *rec = s->arena + s->len;
    s->len += need;
    return rec;
}

/* Stable sort of refs by key (LSD radix, a byte per pass; a pass where every key has the
 * same byte is skipped): records of one key stay in the order they were added. */
static int radix_sort(Ref *refs, size_t n)
{
    Ref *tmp = malloc((n ? n : 1) * sizeof *tmp);
    if (!tmp) {
        PyErr_NoMemory();
        return -1;
    }
    Ref *src = refs, *dst = tmp;
    for (int shift = 0; shift < 64; shift += 8) {
        size_t count[256] = {0};
        for (size_t i = 0; i < n; i++)
            count[(src[i].key >> shift) & 0xff]++;
        if (n == 0 || count[(src[0].key >> shift) & 0xff] == n)
            continue;
        size_t at = 0;
        for (int d = 0; d < 256; d++) {
            size_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (size_t i = 0; i < n; i++)
            dst[count[(src[i].key >> shift) & 0xff]++] = src[i];
        Ref *swap = src;
        src = dst;
        dst = swap;
    }
    if (src != refs)
        memcpy(refs, src, n * sizeof *refs);
    free(tmp);
    return 0;
}

/* attr record: u16 target length, ATTR_FIXED bytes, the target
 * name record: child id (u64), position (u32), u8 name length, the name */
#define NAME_REC_FIXED 13

static const unsigned char *name_of(const unsigned char *arena, const Ref *ref, size_t *len)
{
    const unsigned char *rec = arena + ref->off;
    *len = rec[12];
    return rec + NAME_REC_FIXED;
}

/* LMDB's default order of the dent keys of one parent: bytewise, a prefix first */
static const unsigned char *sort_arena;

static int name_order(const void *a, const void *b)
{
    size_t la, lb;
    const unsigned char *na = name_of(sort_arena, a, &la), *nb = name_of(sort_arena, b, &lb);
    int c = memcmp(na, nb, la < lb ? la : lb);
    if (c || la == lb)
        return c ? c : (((const Ref *)a)->off > ((const Ref *)b)->off) -
                       (((const Ref *)a)->off < ((const Ref *)b)->off);
    return la < lb ? -1 : 1;
}

/* -- what sorted_attrs and sorted_names return ------------------------------------------------
 *
 * Held owns a store's arena and its refs in the order handed out (refs2: a second order of
 * the same records); each iterator walks one order and keeps its Held alive. */

typedef struct {
    PyObject_HEAD
    Store store;
    Ref *refs2;
} Held;

static void held_dealloc(Held *self)
{
    store_free(&self->store);
    free(self->refs2);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject HeldType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spokefs.namespace.snapshot_items.Held",
    .tp_basicsize = sizeof(Held),
    .tp_dealloc = (destructor)held_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
};

enum { ATTR_ITEMS, DENT_ITEMS, DPOS_ITEMS };

typedef struct {
    PyObject_HEAD
    Held *held;
    size_t at;
    int kind;
} Sorted;

static void sorted_dealloc(Sorted *self)
{
    Py_XDECREF(self->held);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *pair(const unsigned char *k, size_t klen, const unsigned char *v, size_t vlen)
{
    PyObject *key = PyBytes_FromStringAndSize((const char *)k, klen);
    PyObject *value = PyBytes_FromStringAndSize((const char *)v, vlen);
    PyObject *out = key && value ? PyTuple_Pack(2, key, value) : NULL;
    Py_XDECREF(key);
    Py_XDECREF(value);
    return out;
}

static PyObject *sorted_next(Sorted *self)
{
    Store *s = &self->held->store;
    const Ref *refs = self->kind == DPOS_ITEMS ? self->held->refs2 : s->refs;
    if (self->kind == ATTR_ITEMS) /* a hard link's later entries: the first one's stay */
        while (self->at < s->n && self->at > 0 && refs[self->at].key == refs[self->at - 1].key)
            self->at++;
    if (self->at >= s->n)
        return NULL;
    const Ref *ref = &refs[self->at++];
    const unsigned char *rec = s->arena + ref->off;
    unsigned char key[8 + NAME_MAX_BYTES], value[8 + NAME_MAX_BYTES];
    put_be64(key, ref->key);
    if (self->kind == ATTR_ITEMS)
        return pair(key, 8, rec + 2, ATTR_FIXED + ((size_t)rec[0] | (size_t)rec[1] << 8));
    size_t nlen;
    const unsigned char *name = name_of(s->arena, ref, &nlen);
    uint64_t child;
    uint32_t pos;
    memcpy(&child, rec, 8);
    memcpy(&pos, rec + 8, 4);
    put_be64(value, child);
    if (self->kind == DENT_ITEMS) {
        memcpy(key + 8, name, nlen);
        put_be32(value + 8, pos);
        return pair(key, 8 + nlen, value, 12);
    }
    put_be32(key + 8, pos);
    memcpy(value + 8, name, nlen);
    return pair(key, 12, value, 8 + nlen);
}

static PyTypeObject SortedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spokefs.namespace.snapshot_items.Sorted",
    .tp_basicsize = sizeof(Sorted),
    .tp_dealloc = (destructor)sorted_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)sorted_next,
};

static PyObject *sorted_iter(Held *held, int kind)
{
    Sorted *it = PyObject_New(Sorted, &SortedType);
    if (!it)
        return NULL;
    Py_INCREF(held);
    it->held = held;
    it->at = 0;
    it->kind = kind;
    return (PyObject *)it;
}

/* a Held that takes over ``store`` (left empty) */
static Held *hold(Store *store)
{
    Held *held = PyObject_New(Held, &HeldType);
    if (!held)
        return NULL;
    held->store = *store;
    held->refs2 = NULL;
    memset(store, 0, sizeof *store);
    return held;
}

/* -- Items ---------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *error;  /* the class raised for a bad entry (protocol.WireError) */
    DirTable dirs;
    Store attrs, names;
    unsigned __int128 total;
} Items;

static void items_dealloc(Items *self)
{
    Py_XDECREF(self->error);
    free(self->dirs.ids);
    free(self->dirs.next);
    store_free(&self->attrs);
    store_free(&self->names);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int items_init(Items *self, PyObject *args, PyObject *kwds)
{
    PyObject *error;
    if (!PyArg_ParseTuple(args, "O", &error))
        return -1;
    Py_INCREF(error);
    Py_XSETREF(self->error, error);
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

/* The items of one checked entry. */
static int emit(Items *self, uint64_t fid, uint64_t parent, uint32_t mode, uint64_t size,
                uint64_t mtime, uint32_t nlink, uint64_t version, const unsigned char *name,
                size_t nlen, const unsigned char *target, size_t tlen)
{
    unsigned char *rec = store_add(&self->attrs, fid, 2 + ATTR_FIXED + tlen);
    if (!rec)
        return -1;
    rec[0] = (unsigned char)(tlen & 0xff);
    rec[1] = (unsigned char)(tlen >> 8);
    unsigned char *value = rec + 2;
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
    rec = store_add(&self->names, parent, NAME_REC_FIXED + nlen);
    if (!rec)
        return -1;
    memcpy(rec, &fid, 8);
    memcpy(rec + 8, &pos, 4);
    rec[12] = (unsigned char)nlen;
    memcpy(rec + NAME_REC_FIXED, name, nlen);
    return 0;
}

static int name_is_bad(const unsigned char *name, size_t nlen)
{
    if (!nlen || memchr(name, '/', nlen) || memchr(name, 0, nlen))
        return 1;
    return (nlen == 1 && name[0] == '.') || (nlen == 2 && name[0] == '.' && name[1] == '.');
}

/* The checks every entry passes, in SnapshotDecoder's order: ``_check_attrs`` for the root
 * (the target after the type and the id), the loop's for the others (the target first).
 * Nonzero, with the message in ``msg``, for a bad one. */
static int bad_attrs(char *msg, size_t room, int root, uint64_t fid, uint32_t mode,
                     uint64_t size, const unsigned char *target, size_t tlen)
{
    uint32_t kind = mode & S_FMT;
    int bad_target = tlen ? (kind != S_LNK || memchr(target, 0, tlen) != NULL) : kind == S_LNK;
    if (!root && bad_target)
        return snprintf(msg, room, "entry %llx: bad symlink target", (unsigned long long)fid) > 0;
    if (kind != S_DIR && kind != S_REG && kind != S_LNK)
        return snprintf(msg, room, "entry %llx: unsupported file type %o",
                        (unsigned long long)fid, mode) > 0;
    if (fid < MIN_FILE_ID)
        return snprintf(msg, room, "entry id %llu below %d", (unsigned long long)fid,
                        MIN_FILE_ID) > 0;
    if (root && bad_target)
        return snprintf(msg, room, "entry %llx: bad symlink target", (unsigned long long)fid) > 0;
    if (size > MAX_SIZE)
        return snprintf(msg, room, "entry %llx: absurd size %llu", (unsigned long long)fid,
                        (unsigned long long)size) > 0;
    return 0;
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
        if (bad_attrs(msg, sizeof msg, seen == 0, fid, mode, size, target, tlen))
            goto fail;
        if (seen == 0) { /* the root, as SnapshotDecoder checks it */
            if (fid != root_id || parent != 0 || nlen || kind != S_DIR) {
                snprintf(msg, sizeof msg, "the first entry must be the root directory");
                goto fail;
            }
            if (add_dir(self, fid) < 0 || emit(self, fid, 0, mode, size, mtime, nlink, version,
                                               name, 0, target, 0) < 0)
                goto error;
        } else {
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

static PyObject *items_sorted_attrs(Items *self, PyObject *unused)
{
    if (radix_sort(self->attrs.refs, self->attrs.n) < 0)
        return NULL;
    Held *held = hold(&self->attrs);
    if (!held)
        return NULL;
    PyObject *it = sorted_iter(held, ATTR_ITEMS);
    Py_DECREF(held);
    return it;
}

/* The names held, in the dent db's order and in the dpos db's; a name listed twice in one
 * directory raises the error class (as the loader's Python way words it). */
static PyObject *items_sorted_names(Items *self, PyObject *unused)
{
    Store *s = &self->names;
    if (radix_sort(s->refs, s->n) < 0) /* by parent; each parent's in stream = position order */
        return NULL;
    Ref *by_pos = malloc((s->n ? s->n : 1) * sizeof *by_pos);
    if (!by_pos)
        return PyErr_NoMemory();
    memcpy(by_pos, s->refs, s->n * sizeof *by_pos);
    sort_arena = s->arena; /* under the GIL: no other sort runs */
    for (size_t start = 0, end; start < s->n; start = end) {
        int sorted = 1;
        for (end = start + 1; end < s->n && s->refs[end].key == s->refs[start].key; end++)
            if (sorted && name_order(&s->refs[end - 1], &s->refs[end]) > 0)
                sorted = 0;
        if (!sorted) /* hubd lists a directory's names in order: this is for other hubs */
            qsort(s->refs + start, end - start, sizeof(Ref), name_order);
        for (size_t i = start + 1; i < end; i++) {
            size_t la, lb;
            const unsigned char *a = name_of(s->arena, &s->refs[i - 1], &la);
            const unsigned char *b = name_of(s->arena, &s->refs[i], &lb);
            if (la == lb && memcmp(a, b, la) == 0) {
                char where[40];
                snprintf(where, sizeof where, " listed twice in %llx",
                         (unsigned long long)s->refs[i].key);
                fail_name(self, "name ", a, la, where);
                free(by_pos);
                return NULL;
            }
        }
    }
    Held *held = hold(s);
    if (!held) {
        free(by_pos);
        return NULL;
    }
    held->refs2 = by_pos;
    PyObject *dents = sorted_iter(held, DENT_ITEMS), *dposs = sorted_iter(held, DPOS_ITEMS);
    Py_DECREF(held);
    if (!dents || !dposs) {
        Py_XDECREF(dents);
        Py_XDECREF(dposs);
        return NULL;
    }
    return Py_BuildValue("NN", dents, dposs);
}

static PyObject *items_held_bytes(Items *self, void *closure)
{
    return PyLong_FromSize_t(self->attrs.len + self->names.len +
                             (self->attrs.n + self->names.n) * sizeof(Ref));
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
    {"sorted_attrs", (PyCFunction)items_sorted_attrs, METH_NOARGS,
     "sorted_attrs() -> iterator of (key, value): the attr items held, ascending, one per id"},
    {"sorted_names", (PyCFunction)items_sorted_names, METH_NOARGS,
     "sorted_names() -> (dents, dposs): iterators of the dent and dpos items held, ascending"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef items_getset[] = {
    {"held_bytes", (getter)items_held_bytes, NULL, "bytes held for items", NULL},
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
    if (PyType_Ready(&ItemsType) < 0 || PyType_Ready(&HeldType) < 0 ||
        PyType_Ready(&SortedType) < 0)
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
