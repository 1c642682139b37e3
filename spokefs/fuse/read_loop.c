/* The native read loop: FUSE requests of one mount answered on several threads, from the
 * namespace and the block cache (LMDB, read-only), without entering Python.
 *
 * A serving worker (spokefs/fuse/worker.py) makes one ReadLoop on its own clone of the
 * mount's /dev/fuse descriptor. Each of its threads reads a request, answers it and reads the
 * next; the kernel wakes one blocked reader per request (read(2) waiters are exclusive), so
 * an idle thread costs nothing. What a thread answers itself:
 *
 *   LOOKUP, GETATTR, READDIR (plain), READLINK, STATFS, OPEN/OPENDIR (ENOSYS after their
 *   checks: the kernel then opens files and directories itself), LISTXATTR, RELEASE(DIR),
 *   FORGET and BATCH_FORGET (nothing kept per inode), every write-like request (EROFS) and
 *   what the mount does not implement (ENOSYS), exactly as spokefs/fuse/ops.py answers them;
 *   READ of bytes that are all in the cache: one read transaction, every block's xxh3
 *   checked, the reply written with writev straight from LMDB's map (no copy in user space).
 *
 * What it hands to Python, as events (take_events): a READ it cannot serve from the cache (a
 * miss, a block that failed its checksum, a record it cannot decode, an LMDB error: the
 * mount's coordinator serves it and finds out what is wrong), a GETXATTR of a control
 * attribute (user.spokefs.*), a directory listed from its start (the prefetcher may fill
 * it), and the end of the session. Python answers the first two with reply()/reply_error()
 * /reply_xattr(). Every READ served is gathered as a hit (take_hits) in the shape of the
 * channel's HIT message (spokefs/fuse/worker_channel.py).
 *
 * The layouts read here are spokefs/namespace/replica.py's (attr, dent, dpos, info) and
 * spokefs/cache/layout.py's (head, data; layout 3): a change there must change this file, and
 * tests/integration/test_workers.py reads every kind of record through a real mount.
 *
 * LMDB: each environment is opened once in this process (LMDB forbids a second open in one
 * process: its locks are per process), read-only, with the writer's map size. Each thread
 * keeps one read transaction per environment and renews it per request, so a request sees one
 * committed state and the writer never reuses a page a reply is still being copied from.
 *
 * Threads never touch Python objects. The queues they fill are guarded by one mutex; an
 * eventfd tells the Python side there is something to take. stop() interrupts the threads'
 * read(2) with a signal (SIG_STOP below, whose handler does nothing) and joins them. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <lmdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "../native/xxh3_dispatch.h"

#define BLOCK_SIZE 4096
#define CHUNK_BLOCKS 16
#define CHUNK_SIZE (BLOCK_SIZE * CHUNK_BLOCKS)
#define NAME_MAX_BYTES 255
#define ROOT_INODE 1
#define PROTECTED 1            /* layout.PROTECTED */
#define ORIGINS 4              /* chunk_reader.ORIGINS */
#define ATTR_BYTES 40          /* replica._ATTR: <IQqIQQ */
#define HEAD_BYTES 28          /* layout._HEAD: <HBBQQQ */
#define MAX_TAIL 16            /* layout._OVERFLOW_PAGE_HEADER */
#define MAX_CHUNKS 17          /* of one READ: 1 MiB, unaligned */
/* The kernel refuses a read(2) of /dev/fuse into less than max_write plus the headers, and
 * libfuse offers max_write = 1 MiB (FUSE_MAX_MAX_PAGES pages) at INIT. */
#define REQUEST_BUFFER ((1 << 20) + 64 * 1024)
/* a READ's stored values read in one pread: MAX_CHUNKS values and their pages' headers */
#define SPAN_BUFFER (MAX_CHUNKS * (CHUNK_SIZE + 4096))
#define HIT_ENOUGH 8           /* hits worth a message 5 ms on (the module's HIT_ENOUGH) */
#define HIT_BATCH 64           /* a full batch wakes Python at once (the module's HIT_BATCH) */
#define HIT_BYTES (4u << 20)   /* ... and so do this many bytes of hits (the module's HIT_BYTES) */
#define HITS_KEPT 8192         /* hits held while Python does not take them; beyond: dropped */
#define CONTROL_PREFIX "user.spokefs."

enum { EV_READ = 1, EV_XATTR, EV_LISTED, EV_END };
/* the handlers' names in spokefs/fuse/ops.py, as spokefs_fuse_errors_total labels them (every
 * write-like request goes through one handler there, ``_read_only``) */
enum { OP_LOOKUP, OP_GETATTR, OP_READLINK, OP_OPEN, OP_OPENDIR, OP_GETXATTR, OP_LISTXATTR,
       OP_READ, OP_WRITE_LIKE, OP_COUNT };
static const char *const op_names[OP_COUNT] = {
    "lookup", "getattr", "readlink", "open", "opendir", "getxattr", "listxattr", "read",
    "_read_only",
};

struct event {
    struct event *next;
    int kind;
    uint64_t unique, ino, file_id, offset;
    uint32_t size, uid;
    char name[NAME_MAX_BYTES + 1];
};

struct visit {
    uint64_t chunk, tick;
    uint8_t protected_;
};

struct hit {
    uint64_t file_id, version, file_size, parent, offset;  /* the version read, as served */
    uint32_t size, nvisits;
    double seconds;
    struct visit visits[MAX_CHUNKS];
};

/* errors counted per (op, errno) as spokefs_fuse_errors_total counts them in Python */
#define ERRNOS 4
static const int counted_errnos[ERRNOS] = {ENOENT, EROFS, ENOTDIR, EIO};

typedef struct {
    PyObject_HEAD
    int fd;
    int event_fd;
    MDB_env *ns_env, *blk_env;
    MDB_dbi attr, dent, dpos, info, data, head;
    uint32_t uid, gid;
    uint64_t timeout_sec;
    uint32_t timeout_nsec;
    uint64_t whole_read_max;
    int nthreads;
    pthread_t *threads;
    int started;
    volatile int stopping;
    pthread_mutex_t lock;       /* everything below */
    struct event *events, *events_tail;
    struct hit *hits;
    size_t nhits;
    uint64_t by_origin[ORIGINS];
    uint64_t hit_bytes;
    uint64_t hits_dropped;
    uint64_t errors[OP_COUNT][ERRNOS];       /* atomics */
    uint64_t served[FUSE_REMOVEMAPPING + 1];   /* requests answered here, by opcode; atomics */
    uint64_t forwarded;
    int ended;
    char *data_path;            /* the block cache's data.mdb, which the threads pread */
    uint64_t map_reads;         /* READs whose data came from the map (the fallback); atomic */
} Loop;

struct thread_state {
    Loop *loop;
    MDB_txn *ns_txn, *blk_txn;
    char *buf;
    int data_fd;                /* its own descriptor of data.mdb: its own read-ahead state */
    unsigned char *span;        /* SPAN_BUFFER bytes: a READ's values, read from data.mdb */
};

/* ---------------------------------------------------------------- byte order helpers */

static uint64_t be64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}

static uint32_t be32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
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

static uint64_t le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static uint16_t le16(const unsigned char *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------- the namespace */

struct ns_attr {
    uint32_t mode, nlink;
    uint64_t size, version, parent;
    int64_t mtime_ns;
    const char *target;
    size_t target_len;
};

/* 0, ENOENT (no such record) or EIO (an LMDB error or a record that does not decode) */
static int get_u64_info(Loop *l, MDB_txn *txn, const char *name, uint64_t *out)
{
    MDB_val k = {strlen(name), (void *)name}, v;
    int rc = mdb_get(txn, l->info, &k, &v);
    if (rc == MDB_NOTFOUND)
        return ENOENT;
    if (rc != 0 || v.mv_size != 8)
        return EIO;
    *out = le64(v.mv_data);
    return 0;
}

static int get_attr(Loop *l, MDB_txn *txn, uint64_t fid, struct ns_attr *a)
{
    unsigned char key[8];
    put_be64(key, fid);
    MDB_val k = {8, key}, v;
    int rc = mdb_get(txn, l->attr, &k, &v);
    if (rc == MDB_NOTFOUND)
        return ENOENT;
    if (rc != 0 || v.mv_size < ATTR_BYTES)
        return EIO;
    const unsigned char *p = v.mv_data;
    a->mode = le32(p);
    a->size = le64(p + 4);
    a->mtime_ns = (int64_t)le64(p + 12);
    a->nlink = le32(p + 20);
    a->version = le64(p + 24);
    a->parent = le64(p + 32);
    a->target = (const char *)p + ATTR_BYTES;
    a->target_len = v.mv_size - ATTR_BYTES;
    return 0;
}

/* the namespace of one request: its root id (the export root is FUSE's inode 1) */
struct ns_view {
    MDB_txn *txn;
    uint64_t root;
};

static uint64_t fid_of(const struct ns_view *ns, uint64_t ino)
{
    return ino == ROOT_INODE ? ns->root : ino;
}

static uint64_t ino_of(const struct ns_view *ns, uint64_t fid)
{
    return fid == ns->root ? ROOT_INODE : fid;
}

/* io_size.preferred_io_size */
static uint32_t preferred_io_size(uint64_t size, uint64_t whole_read_max)
{
    if (size <= BLOCK_SIZE || size > whole_read_max)
        return BLOCK_SIZE;
    uint64_t p = BLOCK_SIZE;
    while (p < size)
        p <<= 1;
    return (uint32_t)p;
}

static void fill_attr(Loop *l, struct fuse_attr *out, uint64_t ino, const struct ns_attr *a)
{
    memset(out, 0, sizeof(*out));
    uint64_t size = S_ISLNK(a->mode) ? a->target_len : a->size;
    /* floor division, as pyfuse3 splits st_*_ns (Python's // and %) */
    int64_t sec = a->mtime_ns / 1000000000;
    int64_t nsec = a->mtime_ns % 1000000000;
    if (nsec < 0) {
        nsec += 1000000000;
        sec -= 1;
    }
    out->ino = ino;
    out->size = size;
    out->blocks = (size + 511) / 512;
    out->atime = out->mtime = out->ctime = (uint64_t)sec;
    out->atimensec = out->mtimensec = out->ctimensec = (uint32_t)nsec;
    out->mode = a->mode;
    out->nlink = a->nlink;
    out->uid = l->uid;
    out->gid = l->gid;
    out->blksize = S_ISREG(a->mode) ? preferred_io_size(a->size, l->whole_read_max)
                                    : BLOCK_SIZE;
}

/* ---------------------------------------------------------------- replies */

static void send_reply(Loop *l, uint64_t unique, int error, struct iovec *iov, int n)
{
    struct fuse_out_header out;
    size_t len = sizeof(out);
    for (int i = 1; i < n; i++)
        len += iov[i].iov_len;
    out.len = (uint32_t)len;
    out.error = -error;
    out.unique = unique;
    iov[0].iov_base = &out;
    iov[0].iov_len = sizeof(out);
    /* ENOENT: the request was interrupted and is gone; anything else: the connection is
     * ending, which the next read(2) reports */
    while (writev(l->fd, iov, n) < 0 && errno == EINTR)
        ;
}

static void reply_buf(Loop *l, uint64_t unique, const void *data, size_t len)
{
    struct iovec iov[2] = {{0}, {(void *)data, len}};
    send_reply(l, unique, 0, iov, len ? 2 : 1);
}

static void reply_err(Loop *l, uint64_t unique, int error)
{
    struct iovec iov[1];
    send_reply(l, unique, error, iov, 1);
}

static void count_error(Loop *l, int op, int error)
{
    for (int i = 0; i < ERRNOS; i++) {
        if (counted_errnos[i] == error) {
            __atomic_add_fetch(&l->errors[op][i], 1, __ATOMIC_RELAXED);
            return;
        }
    }
}

/* an errno the Python handler would raise as a domain error (counted there too) */
static void reply_counted(Loop *l, uint64_t unique, int op, int error)
{
    count_error(l, op, error);
    reply_err(l, unique, error);
}

static void signal_python(Loop *l)
{
    uint64_t one = 1;
    while (write(l->event_fd, &one, sizeof(one)) < 0 && errno == EINTR)
        ;
}

static void queue_event(Loop *l, struct event *ev)
{
    ev->next = NULL;
    pthread_mutex_lock(&l->lock);
    if (l->events_tail)
        l->events_tail->next = ev;
    else
        l->events = ev;
    l->events_tail = ev;
    l->forwarded++;
    pthread_mutex_unlock(&l->lock);
    signal_python(l);
}

static struct event *new_event(int kind, const struct fuse_in_header *h)
{
    struct event *ev = calloc(1, sizeof(*ev));
    if (ev) {
        ev->kind = kind;
        ev->unique = h->unique;
        ev->ino = h->nodeid;
        ev->uid = h->uid;
    }
    return ev;
}

/* ---------------------------------------------------------------- namespace requests */

static void timeout_of(Loop *l, uint64_t *sec, uint32_t *nsec)
{
    *sec = l->timeout_sec;
    *nsec = l->timeout_nsec;
}

static void do_lookup(Loop *l, struct ns_view *ns, const struct fuse_in_header *h,
                      const char *name, size_t avail)
{
    size_t len = strnlen(name, avail);
    if (len == avail) {
        reply_err(l, h->unique, EINVAL);
        return;
    }
    if (len > NAME_MAX_BYTES) {
        reply_err(l, h->unique, ENAMETOOLONG);
        return;
    }
    unsigned char key[8 + NAME_MAX_BYTES];
    put_be64(key, fid_of(ns, h->nodeid));
    memcpy(key + 8, name, len);
    MDB_val k = {8 + len, key}, v;
    int rc = mdb_get(ns->txn, l->dent, &k, &v);
    if (rc == MDB_NOTFOUND) {
        reply_counted(l, h->unique, OP_LOOKUP, ENOENT);
        return;
    }
    if (rc != 0 || v.mv_size < 8) {
        reply_counted(l, h->unique, OP_LOOKUP, EIO);
        return;
    }
    uint64_t child = be64(v.mv_data);
    struct ns_attr a;
    rc = get_attr(l, ns->txn, child, &a);
    if (rc) {
        reply_counted(l, h->unique, OP_LOOKUP, rc);
        return;
    }
    struct fuse_entry_out e;
    memset(&e, 0, sizeof(e));
    e.nodeid = ino_of(ns, child);
    timeout_of(l, &e.entry_valid, &e.entry_valid_nsec);
    timeout_of(l, &e.attr_valid, &e.attr_valid_nsec);
    fill_attr(l, &e.attr, e.nodeid, &a);
    reply_buf(l, h->unique, &e, sizeof(e));
}

/* the inode's attributes, or the errno to answer (counted for op) */
static int attr_or_reply(Loop *l, struct ns_view *ns, const struct fuse_in_header *h, int op,
                         struct ns_attr *a)
{
    int rc = get_attr(l, ns->txn, fid_of(ns, h->nodeid), a);
    if (rc)
        reply_counted(l, h->unique, op, rc);
    return rc;
}

static void do_getattr(Loop *l, struct ns_view *ns, const struct fuse_in_header *h)
{
    struct ns_attr a;
    if (attr_or_reply(l, ns, h, OP_GETATTR, &a))
        return;
    struct fuse_attr_out out;
    memset(&out, 0, sizeof(out));
    timeout_of(l, &out.attr_valid, &out.attr_valid_nsec);
    fill_attr(l, &out.attr, h->nodeid, &a);
    reply_buf(l, h->unique, &out, sizeof(out));
}

static void do_readlink(Loop *l, struct ns_view *ns, const struct fuse_in_header *h)
{
    struct ns_attr a;
    if (attr_or_reply(l, ns, h, OP_READLINK, &a))
        return;
    if (!S_ISLNK(a.mode))
        reply_err(l, h->unique, EINVAL);
    else
        reply_buf(l, h->unique, a.target, a.target_len);
}

static void do_open(Loop *l, struct ns_view *ns, const struct fuse_in_header *h,
                    const struct fuse_open_in *in, int dir)
{
    if (!dir && ((in->flags & O_ACCMODE) != O_RDONLY || (in->flags & (O_TRUNC | O_APPEND)))) {
        reply_counted(l, h->unique, OP_OPEN, EROFS);
        return;
    }
    struct ns_attr a;
    if (attr_or_reply(l, ns, h, dir ? OP_OPENDIR : OP_OPEN, &a))
        return;
    if (dir && !S_ISDIR(a.mode))
        reply_counted(l, h->unique, OP_OPENDIR, ENOTDIR);
    else if (!dir && S_ISDIR(a.mode))
        reply_err(l, h->unique, EISDIR);
    else  /* success to the kernel: it opens every file (directory) itself from now on */
        reply_err(l, h->unique, ENOSYS);
}

static void do_statfs(Loop *l, struct ns_view *ns, const struct fuse_in_header *h)
{
    uint64_t entries = 0, total = 0;
    get_u64_info(l, ns->txn, "entries", &entries);
    get_u64_info(l, ns->txn, "total_bytes", &total);
    struct fuse_statfs_out out;
    memset(&out, 0, sizeof(out));
    out.st.bsize = out.st.frsize = BLOCK_SIZE;
    out.st.blocks = (total + BLOCK_SIZE - 1) / BLOCK_SIZE;
    out.st.files = entries;
    out.st.namelen = NAME_MAX_BYTES;
    reply_buf(l, h->unique, &out, sizeof(out));
}

static void do_getxattr(Loop *l, struct ns_view *ns, const struct fuse_in_header *h,
                        const struct fuse_getxattr_in *in, const char *name, size_t avail)
{
    struct ns_attr a;
    if (attr_or_reply(l, ns, h, OP_GETXATTR, &a))  /* ENOENT for a vanished inode */
        return;
    size_t len = strnlen(name, avail);
    if (len == avail || len > NAME_MAX_BYTES ||
            strncmp(name, CONTROL_PREFIX, sizeof(CONTROL_PREFIX) - 1) != 0) {
        reply_err(l, h->unique, ENODATA);
        return;
    }
    struct event *ev = new_event(EV_XATTR, h);
    if (!ev) {
        reply_err(l, h->unique, ENOMEM);
        return;
    }
    memcpy(ev->name, name, len);
    ev->size = in->size;
    queue_event(l, ev);
}

static void do_listxattr(Loop *l, struct ns_view *ns, const struct fuse_in_header *h,
                         const struct fuse_getxattr_in *in)
{
    struct ns_attr a;
    if (attr_or_reply(l, ns, h, OP_LISTXATTR, &a))
        return;
    if (in->size == 0) {
        struct fuse_getxattr_out out = {0};
        reply_buf(l, h->unique, &out, sizeof(out));
    } else {
        reply_buf(l, h->unique, NULL, 0);
    }
}

static void do_readdir(Loop *l, struct ns_view *ns, const struct fuse_in_header *h,
                       const struct fuse_read_in *in, char *out, size_t room)
{
    uint64_t parent = fid_of(ns, h->nodeid);
    uint64_t start = in->offset;
    if (start == 0) {
        struct event *ev = new_event(EV_LISTED, h);
        if (ev) {
            ev->file_id = parent;
            queue_event(l, ev);
        }
    }
    size_t size = in->size < room ? in->size : room, used = 0;
    if (start > UINT32_MAX) {
        reply_buf(l, h->unique, NULL, 0);
        return;
    }
    MDB_cursor *cur;
    if (mdb_cursor_open(ns->txn, l->dpos, &cur) != 0) {
        reply_err(l, h->unique, EIO);
        return;
    }
    unsigned char key[12];
    put_be64(key, parent);
    put_be32(key + 8, (uint32_t)start);
    MDB_val k = {12, key}, v;
    int rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
    while (rc == 0) {
        if (k.mv_size != 12 || be64(k.mv_data) != parent || v.mv_size < 8)
            break;
        uint32_t pos = be32((const unsigned char *)k.mv_data + 8);
        uint64_t child = be64(v.mv_data);
        size_t namelen = v.mv_size - 8;
        struct ns_attr a;
        if (get_attr(l, ns->txn, child, &a) == 0) {
            size_t entlen = FUSE_DIRENT_ALIGN(FUSE_NAME_OFFSET + namelen);
            if (used + entlen > size)
                break;
            struct fuse_dirent *d = (struct fuse_dirent *)(out + used);
            d->ino = ino_of(ns, child);
            d->off = (uint64_t)pos + 1;
            d->namelen = (uint32_t)namelen;
            d->type = (a.mode & S_IFMT) >> 12;
            memcpy(d->name, (const char *)v.mv_data + 8, namelen);
            memset(d->name + namelen, 0, entlen - FUSE_NAME_OFFSET - namelen);
            used += entlen;
        }
        rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT);
    }
    mdb_cursor_close(cur);
    reply_buf(l, h->unique, out, used);
}

/* ---------------------------------------------------------------- READ from the cache */

/* A chunk's header (layout.ChunkHead) as stored, not copied. */
struct head {
    uint16_t bitmap;
    uint8_t origin, segment;
    uint64_t tick, chunk_sum;
    const unsigned char *sums;
    const unsigned char *tail;
    size_t tail_len;
};

static int decode_head(const MDB_val *v, struct head *hd)
{
    const unsigned char *p = v->mv_data;
    if (v->mv_size < HEAD_BYTES)
        return -1;
    hd->bitmap = le16(p);
    hd->origin = p[2];
    hd->segment = p[3];
    hd->tick = le64(p + 12);
    hd->chunk_sum = le64(p + 20);
    size_t nsums = (size_t)__builtin_popcount(hd->bitmap);
    size_t fixed = HEAD_BYTES + 8 * nsums;
    if (v->mv_size < fixed || v->mv_size - fixed > MAX_TAIL || hd->segment > 2)
        return -1;
    hd->sums = p + HEAD_BYTES;
    hd->tail = p + fixed;
    hd->tail_len = v->mv_size - fixed;
    return 0;
}

/* xxh3 of bytes [start, stop) of value + tail */
static uint64_t span_hash(const unsigned char *value, size_t vlen, const struct head *hd,
                          size_t start, size_t stop)
{
    if (stop <= vlen)
        return sf_xxh3(value + start, stop - start);
    size_t t0 = start > vlen ? start - vlen : 0;
    if (start >= vlen)
        return sf_xxh3(hd->tail + t0, stop - vlen - t0);
    return sf_xxh3_pair(value + start, vlen - start, hd->tail, stop - vlen);
}

/* A value's pages, page-aligned */
static void page_span(const unsigned char *value, size_t len, void **start, size_t *span)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)value & ~(page - 1);
    *start = (void *)a;
    *span = (uintptr_t)value + len - a;
}

/* (The fallback read path, from the map.) Start the disk reads of a value's pages that are
 * not in RAM (no wait). */
static void will_need(const unsigned char *value, size_t len)
{
    void *start;
    size_t span;
    page_span(value, len, &start, &span);
    madvise(start, span, MADV_WILLNEED);
}

/* Map a value's pages in one call (waiting for their reads), instead of a fault per page. */
static void populate(const unsigned char *value, size_t len)
{
    void *start;
    size_t span;
    page_span(value, len, &start, &span);
    madvise(start, span, MADV_POPULATE_READ);  /* EINVAL before Linux 5.14: faults then */
}

/* The address the block cache's file is mapped at: every LMDB page begins with its own page
 * number (mp_pgno), so any page of the map tells where page 0 is. */
static uintptr_t map_base(const void *in_page)
{
    uintptr_t psize = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)in_page & ~(psize - 1);
    uint64_t pgno;
    memcpy(&pgno, (const void *)start, sizeof(pgno));
    return start - (uintptr_t)(pgno * psize);
}

struct piece { const unsigned char *value; size_t vlen; struct head hd; };

/* Read the pieces' values from data.mdb into t->span and point the pieces at the copies:
 * one pread when they lie in order within SPAN_BUFFER bytes (a file's chunks are stored
 * together), else one per value. 0 when read whole, -1 otherwise (the map serves). */
static int read_values(struct thread_state *t, struct piece *pieces, int n, uintptr_t base)
{
    uint64_t lo = (uintptr_t)pieces[0].value - base, end = lo;
    int in_order = 1;
    for (int i = 0; i < n; i++) {
        uint64_t off = (uintptr_t)pieces[i].value - base;
        if (off < end && i > 0)
            in_order = 0;
        end = off + pieces[i].vlen;
    }
    if (in_order && end - lo <= SPAN_BUFFER) {
        if (pread(t->data_fd, t->span, end - lo, (off_t)lo) != (ssize_t)(end - lo))
            return -1;
        for (int i = 0; i < n; i++)
            pieces[i].value = t->span + ((uintptr_t)pieces[i].value - base - lo);
        return 0;
    }
    size_t pos = 0;
    for (int i = 0; i < n; i++) {
        uint64_t off = (uintptr_t)pieces[i].value - base;
        if (pos + pieces[i].vlen > SPAN_BUFFER ||
                pread(t->data_fd, t->span + pos, pieces[i].vlen, (off_t)off) !=
                    (ssize_t)pieces[i].vlen)
            return -1;
        pieces[i].value = t->span + pos;
        pos += pieces[i].vlen;
    }
    return 0;
}

/* chunk_reader._verify: blocks lo..hi (all present) good? */
static int verify(const unsigned char *value, size_t vlen, const struct head *hd, int lo, int hi)
{
    size_t total = vlen + hd->tail_len;
    if (hi - lo >= 2 && span_hash(value, vlen, hd, 0, total) == hd->chunk_sum)
        return 1;  /* most of a chunk: one hash over all of it */
    int rank = __builtin_popcount(hd->bitmap & ((1u << lo) - 1));
    for (int s = lo; s <= hi; s++, rank++) {
        size_t start = (size_t)rank * BLOCK_SIZE;
        size_t stop = start + BLOCK_SIZE < total ? start + BLOCK_SIZE : total;
        if (start >= total || span_hash(value, vlen, hd, start, stop) != le64(hd->sums + 8 * rank))
            return 0;
    }
    return 1;
}

/* Serve [off, end) of a file version from stored chunks: 1 when answered, 0 when the read
 * must go to the coordinator. */
static int serve_cached(Loop *l, struct thread_state *t, const struct fuse_in_header *h,
                        uint64_t fid, const struct ns_attr *attr, uint64_t off, uint64_t end,
                        uint32_t asked, double started)
{
    uint64_t version = attr->version;
    struct iovec iov[1 + 2 * MAX_CHUNKS];
    struct piece pieces[MAX_CHUNKS];
    uintptr_t base = 0;
    int n = 1;
    struct hit hit;
    uint64_t by_origin[ORIGINS] = {0};
    hit.nvisits = 0;
    uint64_t first = off / CHUNK_SIZE, last = (end - 1) / CHUNK_SIZE;
    if (last - first + 1 > MAX_CHUNKS)
        return 0;  /* larger than FUSE's largest READ: never sent */
    if (mdb_txn_renew(t->blk_txn) != 0)
        return 0;
    int ok = 1;
    /* First every chunk's records (from the map), then all their data at once: read with
     * pread from data.mdb into the thread's span (read_values), then the checks and the
     * reply, from that copy. The data's pages are never mapped: the kernel reads them with
     * its read-ahead (large folios, a sequential stream's next pages read ahead, a random
     * read as is), where the map (MADV_RANDOM) read them a page at a time, and each had to
     * be mapped (MADV_POPULATE_READ) and pinned again by the reply's copy (measured in
     * docs/design.md, "Disk reads"). The map is the fallback when a pread comes back short
     * or data.mdb could not be opened. */
    for (uint64_t ci = first; ok && ci <= last; ci++) {
        unsigned char key[24];
        put_be64(key, fid);
        put_be64(key + 8, version);
        put_be64(key + 16, ci);
        MDB_val k = {24, key}, hv, dv;
        struct piece *pc = &pieces[ci - first];
        if (mdb_get(t->blk_txn, l->head, &k, &hv) != 0 || decode_head(&hv, &pc->hd) != 0 ||
                mdb_get(t->blk_txn, l->data, &k, &dv) != 0) {
            ok = 0;
            break;
        }
        pc->value = dv.mv_data;
        pc->vlen = dv.mv_size;
        if (!base)
            base = map_base(hv.mv_data);
    }
    int npieces = (int)(last - first + 1);
    if (ok && !(t->data_fd >= 0 && read_values(t, pieces, npieces, base) == 0)) {
        __atomic_add_fetch(&l->map_reads, 1, __ATOMIC_RELAXED);
        for (uint64_t ci = first; ci <= last; ci++)
            will_need(pieces[ci - first].value, pieces[ci - first].vlen);
        for (uint64_t ci = first; ci <= last; ci++)
            populate(pieces[ci - first].value, pieces[ci - first].vlen);
    }
    for (uint64_t ci = first; ok && ci <= last; ci++) {
        uint64_t base = ci * CHUNK_SIZE;
        size_t a = (size_t)((off > base ? off : base) - base);
        size_t b = (size_t)((end < base + CHUNK_SIZE ? end : base + CHUNK_SIZE) - base);
        struct piece *pc = &pieces[ci - first];
        const struct head *hd = &pc->hd;
        int lo = (int)(a / BLOCK_SIZE), hi = (int)((b - 1) / BLOCK_SIZE);
        unsigned need = ((1u << (hi - lo + 1)) - 1) << lo;
        const unsigned char *value = pc->value;
        size_t vlen = pc->vlen, total = vlen + hd->tail_len;
        int rank_lo = __builtin_popcount(hd->bitmap & ((1u << lo) - 1));
        size_t da = (size_t)rank_lo * BLOCK_SIZE + a - (size_t)lo * BLOCK_SIZE;
        size_t db = da + (b - a);
        if ((hd->bitmap & need) != need || db > total || !verify(value, vlen, hd, lo, hi)) {
            ok = 0;  /* missing blocks, a short value, or a checksum failure */
            break;
        }
        if (da < vlen) {
            iov[n].iov_base = (void *)(value + da);
            iov[n++].iov_len = (db < vlen ? db : vlen) - da;
        }
        if (db > vlen) {
            size_t t0 = da > vlen ? da - vlen : 0;
            iov[n].iov_base = (void *)(hd->tail + t0);
            iov[n++].iov_len = db - vlen - t0;
        }
        by_origin[hd->origin < ORIGINS ? hd->origin : ORIGINS - 1] += (uint64_t)(hi - lo + 1);
        struct visit *vi = &hit.visits[hit.nvisits++];
        vi->chunk = ci;
        vi->tick = hd->tick;
        vi->protected_ = hd->segment == PROTECTED;
    }
    if (!ok) {
        mdb_txn_reset(t->blk_txn);
        return 0;
    }
    hit.file_id = fid;
    hit.version = version;
    hit.file_size = attr->size;
    hit.parent = attr->parent;
    hit.offset = off;
    hit.size = asked;
    hit.seconds = now_s() - started;  /* (the reply's write not included) */
    int wake = 0;
    pthread_mutex_lock(&l->lock);
    if (l->nhits < HITS_KEPT) {
        l->hits[l->nhits++] = hit;
        wake = l->nhits == 1 || l->nhits == HIT_ENOUGH || l->nhits == HIT_BATCH;
    } else {
        l->hits_dropped++;
    }
    for (int i = 0; i < ORIGINS; i++)
        l->by_origin[i] += by_origin[i];
    if (l->hit_bytes < HIT_BYTES && l->hit_bytes + (end - off) >= HIT_BYTES)
        wake = 1;  /* a fast reader: the prefetcher hears of it within HIT_BYTES */
    l->hit_bytes += end - off;
    pthread_mutex_unlock(&l->lock);
    if (wake)
        signal_python(l);
    /* The reply after the hit is gathered: a reader that has its bytes and then asks the
     * coordinator anything (a control attribute) finds the hit counted, since gathered hits
     * go ahead of every request to it (worker_channel.Channel.send). Inside the
     * transaction: the tails are in the map (and, on the fallback, all the data), whose
     * pages the writer cannot reuse before the reset. */
    send_reply(l, h->unique, 0, iov, n);
    mdb_txn_reset(t->blk_txn);
    return 1;
}

static void do_read(Loop *l, struct thread_state *t, struct ns_view *ns,
                    const struct fuse_in_header *h, const struct fuse_read_in *in,
                    double started)
{
    struct ns_attr a;
    uint64_t fid = fid_of(ns, h->nodeid);
    int rc = get_attr(l, ns->txn, fid, &a);
    if (rc == ENOENT) {
        reply_counted(l, h->unique, OP_READ, ENOENT);
        return;
    }
    if (rc == 0 && S_ISREG(a.mode)) {
        uint64_t end = in->offset + in->size;
        if (end > a.size)
            end = a.size;
        if (in->offset >= end) {
            reply_buf(l, h->unique, NULL, 0);
            return;
        }
        if (serve_cached(l, t, h, fid, &a, in->offset, end, in->size, started))
            return;
    }
    struct event *ev = new_event(EV_READ, h);  /* the coordinator serves it */
    if (!ev) {
        reply_err(l, h->unique, ENOMEM);
        return;
    }
    ev->file_id = fid;
    ev->offset = in->offset;
    ev->size = in->size;
    queue_event(l, ev);
}

/* ---------------------------------------------------------------- the loop */

static int is_write_like(uint32_t op)
{
    switch (op) {
    case FUSE_SETATTR: case FUSE_MKNOD: case FUSE_MKDIR: case FUSE_UNLINK: case FUSE_RMDIR:
    case FUSE_SYMLINK: case FUSE_RENAME: case FUSE_RENAME2: case FUSE_LINK: case FUSE_CREATE:
    case FUSE_WRITE: case FUSE_SETXATTR: case FUSE_REMOVEXATTR:
        return 1;
    default:
        return 0;
    }
}

/* one request; the namespace transaction is renewed around it */
static void handle(Loop *l, struct thread_state *t, size_t n, double started)
{
    struct fuse_in_header *h = (struct fuse_in_header *)t->buf;
    char *arg = t->buf + sizeof(*h);
    size_t avail = n - sizeof(*h);
    uint32_t op = h->opcode;
    switch (op) {  /* no reply, nothing to read */
    case FUSE_FORGET: case FUSE_BATCH_FORGET: case FUSE_INTERRUPT: case FUSE_NOTIFY_REPLY:
        return;
    }
    if (is_write_like(op)) {
        reply_counted(l, h->unique, OP_WRITE_LIKE, EROFS);
        return;
    }
    struct ns_view ns = {t->ns_txn, 0};
    if (mdb_txn_renew(t->ns_txn) != 0) {
        reply_err(l, h->unique, EIO);
        return;
    }
    if (get_u64_info(l, t->ns_txn, "root", &ns.root) != 0) {
        mdb_txn_reset(t->ns_txn);
        reply_err(l, h->unique, EIO);  /* no namespace: never the case once mounted */
        return;
    }
#define NEED(type) if (avail < sizeof(type)) { reply_err(l, h->unique, EINVAL); break; }
    switch (op) {
    case FUSE_LOOKUP:
        do_lookup(l, &ns, h, arg, avail);
        break;
    case FUSE_GETATTR:
        do_getattr(l, &ns, h);
        break;
    case FUSE_READ:
        NEED(struct fuse_read_in)
        do_read(l, t, &ns, h, (struct fuse_read_in *)arg, started);
        break;
    case FUSE_READDIR:
        NEED(struct fuse_read_in)
        /* the listing is built in the request buffer past the request itself */
        do_readdir(l, &ns, h, (struct fuse_read_in *)arg, t->buf + 4096, REQUEST_BUFFER - 4096);
        break;
    case FUSE_READLINK:
        do_readlink(l, &ns, h);
        break;
    case FUSE_OPEN:
        NEED(struct fuse_open_in)
        do_open(l, &ns, h, (struct fuse_open_in *)arg, 0);
        break;
    case FUSE_OPENDIR:
        NEED(struct fuse_open_in)
        do_open(l, &ns, h, (struct fuse_open_in *)arg, 1);
        break;
    case FUSE_RELEASE: case FUSE_RELEASEDIR: case FUSE_DESTROY:
        reply_err(l, h->unique, 0);
        break;
    case FUSE_STATFS:
        do_statfs(l, &ns, h);
        break;
    case FUSE_GETXATTR:
        NEED(struct fuse_getxattr_in)
        do_getxattr(l, &ns, h, (struct fuse_getxattr_in *)arg,
                    arg + sizeof(struct fuse_getxattr_in), avail - sizeof(struct fuse_getxattr_in));
        break;
    case FUSE_LISTXATTR:
        NEED(struct fuse_getxattr_in)
        do_listxattr(l, &ns, h, (struct fuse_getxattr_in *)arg);
        break;
    default:  /* FLUSH, FSYNC, locks, IOCTL, POLL, ...: what the mount does not implement */
        reply_err(l, h->unique, ENOSYS);
        break;
    }
#undef NEED
    mdb_txn_reset(t->ns_txn);
    if (op < sizeof(l->served) / sizeof(l->served[0]))
        __atomic_add_fetch(&l->served[op], 1, __ATOMIC_RELAXED);
}

static void end_session(Loop *l)
{
    pthread_mutex_lock(&l->lock);
    int first = !l->ended;
    l->ended = 1;
    pthread_mutex_unlock(&l->lock);
    if (first) {
        struct event *ev = calloc(1, sizeof(*ev));
        if (ev) {
            ev->kind = EV_END;
            queue_event(l, ev);
        } else {
            signal_python(l);
        }
    }
}

static void *serve_thread(void *arg)
{
    struct thread_state *t = arg;
    Loop *l = t->loop;
    while (!l->stopping) {
        ssize_t n = read(l->fd, t->buf, REQUEST_BUFFER);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            if (errno == ENOENT)  /* the request was interrupted before we read it */
                continue;
            end_session(l);  /* ENODEV: unmounted; anything else: the connection is unusable */
            break;
        }
        if ((size_t)n < sizeof(struct fuse_in_header))
            continue;
        handle(l, t, (size_t)n, now_s());
    }
    mdb_txn_abort(t->ns_txn);
    mdb_txn_abort(t->blk_txn);
    if (t->data_fd >= 0)
        close(t->data_fd);
    free(t->buf);
    free(t->span);
    free(t);
    return NULL;
}

/* ---------------------------------------------------------------- Python side */

#define SIG_STOP (SIGRTMIN + 3)

static void on_stop_signal(int sig)
{
    (void)sig;  /* only there to make read(2) return EINTR */
}

static int open_env(MDB_env **env, const char *path, size_t map_size)
{
    int rc = mdb_env_create(env);
    if (rc == 0)
        rc = mdb_env_set_maxdbs(*env, 8);
    if (rc == 0)
        rc = mdb_env_set_mapsize(*env, map_size);
    if (rc == 0)
        rc = mdb_env_open(*env, path, MDB_RDONLY | MDB_NORDAHEAD, 0600);
    if (rc != 0) {
        mdb_env_close(*env);
        *env = NULL;
        PyErr_Format(PyExc_OSError, "cannot open the LMDB environment %s: %s", path,
                     mdb_strerror(rc));
    }
    return rc;
}

static int open_dbis(MDB_env *env, const char *const *names, MDB_dbi *const *out, int n,
                     const char *path)
{
    MDB_txn *txn;
    int rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
    for (int i = 0; rc == 0 && i < n; i++)
        rc = mdb_dbi_open(txn, names[i], 0, out[i]);
    if (rc == 0)
        rc = mdb_txn_commit(txn);  /* the handles outlive the transaction */
    else
        mdb_txn_abort(txn);
    if (rc != 0)
        PyErr_Format(PyExc_OSError, "cannot open the databases of %s: %s", path,
                     mdb_strerror(rc));
    return rc;
}

static void split_timeout(double t, uint64_t *sec, uint32_t *nsec)
{
    /* libfuse's calc_timeout_sec and calc_timeout_nsec */
    *sec = t > (double)UINT64_MAX ? UINT64_MAX : t < 0.0 ? 0 : (uint64_t)t;
    double f = t - (double)*sec;
    *nsec = f < 0.0 ? 0 : f >= 0.999999999 ? 999999999 : (uint32_t)(f * 1.0e9);
}

static int Loop_init(Loop *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"fd", "namespace", "blocks", "blocks_map_bytes", "uid", "gid",
                         "attr_timeout_s", "whole_read_max", "threads", NULL};
    const char *ns_path, *blk_path;
    unsigned long long map_bytes, whole;
    unsigned int uid, gid;
    double timeout;
    int fd, threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "issKIIdKi", kw, &fd, &ns_path, &blk_path,
                                     &map_bytes, &uid, &gid, &timeout, &whole, &threads))
        return -1;
    if (threads < 1 || threads > 256) {
        PyErr_SetString(PyExc_ValueError, "threads must be 1 to 256");
        return -1;
    }
    self->fd = fd;
    self->uid = uid;
    self->gid = gid;
    split_timeout(timeout, &self->timeout_sec, &self->timeout_nsec);
    self->whole_read_max = whole;
    self->nthreads = threads;
    size_t plen = strlen(blk_path);
    self->data_path = malloc(plen + sizeof("/data.mdb"));
    if (!self->data_path) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(self->data_path, blk_path, plen);
    memcpy(self->data_path + plen, "/data.mdb", sizeof("/data.mdb"));
    self->hits = malloc(sizeof(struct hit) * HITS_KEPT);
    self->threads = calloc((size_t)threads, sizeof(pthread_t));
    if (!self->hits || !self->threads) {
        PyErr_NoMemory();
        return -1;
    }
    pthread_mutex_init(&self->lock, NULL);
    self->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->event_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    /* Both maps without read-ahead (MADV_RANDOM): a fault reads its page alone. The mapping's
     * read-around would otherwise read the disk's whole read_ahead_kb (8 MiB on this VM's
     * disk) around every fault in the block cache's file, whose chunks lie in fill order,
     * not read order. A READ's data is read with pread instead (read_values), whose
     * read-ahead follows the reads on that descriptor and the pages cached before them;
     * the map is read for the records, and for the data only on the fallback (will_need). */
    if (open_env(&self->ns_env, ns_path, (size_t)1 << 36) != 0 ||
            open_env(&self->blk_env, blk_path, (size_t)map_bytes) != 0)
        return -1;
    const char *ns_names[] = {"attr", "dent", "dpos", "info"};
    MDB_dbi *ns_out[] = {&self->attr, &self->dent, &self->dpos, &self->info};
    const char *blk_names[] = {"data", "head"};
    MDB_dbi *blk_out[] = {&self->data, &self->head};
    if (open_dbis(self->ns_env, ns_names, ns_out, 4, ns_path) != 0 ||
            open_dbis(self->blk_env, blk_names, blk_out, 2, blk_path) != 0)
        return -1;
    return 0;
}

static PyObject *Loop_start(Loop *self, PyObject *unused)
{
    if (self->started) {
        PyErr_SetString(PyExc_RuntimeError, "already started");
        return NULL;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_stop_signal;  /* no SA_RESTART: read(2) returns EINTR */
    sigaction(SIG_STOP, &sa, NULL);
    for (int i = 0; i < self->nthreads; i++) {
        struct thread_state *t = calloc(1, sizeof(*t));
        int rc = t ? 0 : ENOMEM;
        if (t) {
            t->loop = self;
            t->buf = malloc(REQUEST_BUFFER);
            t->span = malloc(SPAN_BUFFER);
            rc = t->buf && t->span ? 0 : ENOMEM;
            /* (-1: the thread serves from the map, as before pread) */
            t->data_fd = rc == 0 ? open(self->data_path, O_RDONLY | O_CLOEXEC) : -1;
        }
        if (rc == 0)
            rc = mdb_txn_begin(self->ns_env, NULL, MDB_RDONLY, &t->ns_txn);
        if (rc == 0)
            rc = mdb_txn_begin(self->blk_env, NULL, MDB_RDONLY, &t->blk_txn);
        if (rc == 0) {
            mdb_txn_reset(t->ns_txn);
            mdb_txn_reset(t->blk_txn);
            /* read transactions are bound to the thread that began them (no MDB_NOTLS),
             * but a reset one is renewed by any thread: each thread owns its pair */
            rc = pthread_create(&self->threads[i], NULL, serve_thread, t);
        }
        if (rc != 0) {
            if (t) {
                if (t->ns_txn)
                    mdb_txn_abort(t->ns_txn);
                if (t->blk_txn)
                    mdb_txn_abort(t->blk_txn);
                if (t->data_fd >= 0)
                    close(t->data_fd);
                free(t->buf);
                free(t->span);
                free(t);
            }
            self->nthreads = i;
            self->started = 1;
            errno = rc > 0 ? rc : EIO;
            return PyErr_Format(PyExc_OSError, "cannot start serving thread %d: %s", i,
                                rc > 0 ? strerror(rc) : mdb_strerror(rc));
        }
    }
    self->started = 1;
    Py_RETURN_NONE;
}

static void stop_threads(Loop *self)
{
    if (!self->started)
        return;
    self->stopping = 1;
    for (int i = 0; i < self->nthreads; i++) {
        /* a thread may be about to enter read(2): signal it until it is gone */
        for (;;) {
            pthread_kill(self->threads[i], SIG_STOP);
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 20 * 1000 * 1000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            if (pthread_timedjoin_np(self->threads[i], NULL, &ts) == 0)
                break;
        }
    }
    self->started = 0;
    self->nthreads = 0;
}

static PyObject *Loop_stop(Loop *self, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS
    stop_threads(self);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static void Loop_dealloc(Loop *self)
{
    stop_threads(self);
    struct event *ev = self->events;
    while (ev) {
        struct event *next = ev->next;
        free(ev);
        ev = next;
    }
    if (self->ns_env)
        mdb_env_close(self->ns_env);
    if (self->blk_env)
        mdb_env_close(self->blk_env);
    if (self->event_fd > 0)
        close(self->event_fd);
    free(self->hits);
    free(self->threads);
    free(self->data_path);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Loop_take_events(Loop *self, PyObject *unused)
{
    uint64_t drained;
    (void)!read(self->event_fd, &drained, sizeof(drained));  /* EAGAIN: nothing signalled */
    pthread_mutex_lock(&self->lock);
    struct event *ev = self->events;
    self->events = self->events_tail = NULL;
    pthread_mutex_unlock(&self->lock);
    PyObject *out = PyList_New(0);
    while (ev) {
        struct event *next = ev->next;
        PyObject *item = NULL;
        if (out) {
            switch (ev->kind) {
            case EV_READ:
                item = Py_BuildValue("(sKKKI)", "read", ev->unique, ev->file_id, ev->offset,
                                     ev->size);
                break;
            case EV_XATTR:
                item = Py_BuildValue("(sKKy#II)", "xattr", ev->unique, ev->ino, ev->name,
                                     (Py_ssize_t)strlen(ev->name), ev->uid, ev->size);
                break;
            case EV_LISTED:
                item = Py_BuildValue("(sK)", "listed", ev->file_id);
                break;
            default:
                item = Py_BuildValue("(s)", "end");
                break;
            }
            if (!item || PyList_Append(out, item) != 0)
                Py_CLEAR(out);
            Py_XDECREF(item);
        }
        free(ev);
        ev = next;
    }
    return out;
}

/* (hits gathered, their bytes) */
static PyObject *Loop_pending_hits(Loop *self, PyObject *unused)
{
    pthread_mutex_lock(&self->lock);
    size_t n = self->nhits;
    uint64_t nbytes = self->hit_bytes;
    pthread_mutex_unlock(&self->lock);
    return Py_BuildValue("(nK)", (Py_ssize_t)n, (unsigned long long)nbytes);
}

/* the HIT message's body: (reads, by_origin, nbytes, seconds, errors) */
static PyObject *Loop_take_hits(Loop *self, PyObject *unused)
{
    pthread_mutex_lock(&self->lock);
    size_t n = self->nhits;
    struct hit *hits = malloc(sizeof(struct hit) * (n ? n : 1));
    if (!hits) {
        pthread_mutex_unlock(&self->lock);
        return PyErr_NoMemory();
    }
    memcpy(hits, self->hits, sizeof(struct hit) * n);
    uint64_t by_origin[ORIGINS], nbytes = self->hit_bytes;
    memcpy(by_origin, self->by_origin, sizeof(by_origin));
    uint64_t errors[OP_COUNT][ERRNOS];
    for (int op = 0; op < OP_COUNT; op++)
        for (int e = 0; e < ERRNOS; e++)
            errors[op][e] = __atomic_exchange_n(&self->errors[op][e], 0, __ATOMIC_RELAXED);
    self->nhits = 0;
    self->hit_bytes = 0;
    memset(self->by_origin, 0, sizeof(self->by_origin));
    pthread_mutex_unlock(&self->lock);
    PyObject *reads = PyList_New((Py_ssize_t)n), *seconds = PyList_New((Py_ssize_t)n);
    PyObject *errs = PyList_New(0), *result = NULL;
    if (!reads || !seconds || !errs)
        goto done;
    for (size_t i = 0; i < n; i++) {
        struct hit *h = &hits[i];
        PyObject *visits = PyList_New(h->nvisits);
        if (!visits)
            goto done;
        for (uint32_t j = 0; j < h->nvisits; j++) {
            unsigned char key[24];
            put_be64(key, h->file_id);
            put_be64(key + 8, h->version);
            put_be64(key + 16, h->visits[j].chunk);
            PyObject *v = Py_BuildValue("(y#OK)", key, (Py_ssize_t)24,
                                        h->visits[j].protected_ ? Py_True : Py_False,
                                        h->visits[j].tick);
            if (!v) {
                Py_DECREF(visits);
                goto done;
            }
            PyList_SET_ITEM(visits, j, v);
        }
        PyObject *r = Py_BuildValue("(KKKKKIN)", h->file_id, h->version, h->file_size,
                                    h->parent, h->offset, h->size, visits);
        PyObject *s = PyFloat_FromDouble(h->seconds);
        if (!r || !s) {
            Py_XDECREF(r);
            Py_XDECREF(s);
            goto done;
        }
        PyList_SET_ITEM(reads, (Py_ssize_t)i, r);
        PyList_SET_ITEM(seconds, (Py_ssize_t)i, s);
    }
    for (int op = 0; op < OP_COUNT; op++) {
        for (int e = 0; e < ERRNOS; e++) {
            if (!errors[op][e])
                continue;
            PyObject *item = Py_BuildValue("(siK)", op_names[op], counted_errnos[e],
                                           errors[op][e]);
            if (!item || PyList_Append(errs, item) != 0) {
                Py_XDECREF(item);
                goto done;
            }
            Py_DECREF(item);
        }
    }
    result = Py_BuildValue("(O[KKKK]KOO)", reads, by_origin[0], by_origin[1], by_origin[2],
                           by_origin[3], nbytes, seconds, errs);
done:
    Py_XDECREF(reads);
    Py_XDECREF(seconds);
    Py_XDECREF(errs);
    free(hits);
    return result;
}

static PyObject *Loop_reply_error(Loop *self, PyObject *args)
{
    unsigned long long unique;
    int error;
    if (!PyArg_ParseTuple(args, "Ki", &unique, &error))
        return NULL;
    if (error <= 0) {
        PyErr_SetString(PyExc_ValueError, "an errno is positive");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    reply_err(self, unique, error);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* a GETXATTR's answer for the size the kernel offered, as libfuse's fuse_reply_xattr and
 * pyfuse3's getxattr handler give it: size 0 asks for the length, a value longer than the
 * buffer is ERANGE */
static PyObject *Loop_reply_xattr(Loop *self, PyObject *args)
{
    unsigned long long unique;
    unsigned int size;
    Py_buffer value;
    if (!PyArg_ParseTuple(args, "KIy*", &unique, &size, &value))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (size == 0) {
        struct fuse_getxattr_out out = {0};
        out.size = (uint32_t)value.len;
        reply_buf(self, unique, &out, sizeof(out));
    } else if ((size_t)value.len > size) {
        reply_err(self, unique, ERANGE);
    } else {
        reply_buf(self, unique, value.buf, (size_t)value.len);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&value);
    Py_RETURN_NONE;
}

static PyObject *Loop_statistics(Loop *self, PyObject *unused)
{
    PyObject *served = PyDict_New();
    if (!served)
        return NULL;
    static const struct { uint32_t op; const char *name; } ops[] = {
        {FUSE_LOOKUP, "lookup"}, {FUSE_GETATTR, "getattr"}, {FUSE_READ, "read"},
        {FUSE_READDIR, "readdir"}, {FUSE_READLINK, "readlink"}, {FUSE_OPEN, "open"},
        {FUSE_OPENDIR, "opendir"}, {FUSE_STATFS, "statfs"}, {FUSE_GETXATTR, "getxattr"},
        {FUSE_LISTXATTR, "listxattr"},
    };
    pthread_mutex_lock(&self->lock);
    uint64_t counts[sizeof(ops) / sizeof(ops[0])];
    for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++)
        counts[i] = __atomic_load_n(&self->served[ops[i].op], __ATOMIC_RELAXED);
    uint64_t forwarded = self->forwarded, dropped = self->hits_dropped;
    uint64_t map_reads = __atomic_load_n(&self->map_reads, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&self->lock);
    for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(counts[i]);
        if (!v || PyDict_SetItemString(served, ops[i].name, v) != 0) {
            Py_XDECREF(v);
            Py_DECREF(served);
            return NULL;
        }
        Py_DECREF(v);
    }
    return Py_BuildValue("{sNsKsKsKsi}", "requests", served, "forwarded", forwarded,
                         "hits_dropped", dropped, "map_reads", map_reads,
                         "threads", self->nthreads);
}

static PyObject *Loop_event_fd(Loop *self, void *closure)
{
    return PyLong_FromLong(self->event_fd);
}

static PyMethodDef Loop_methods[] = {
    {"start", (PyCFunction)Loop_start, METH_NOARGS, "Start the serving threads."},
    {"stop", (PyCFunction)Loop_stop, METH_NOARGS, "Stop the serving threads and wait for them."},
    {"take_events", (PyCFunction)Loop_take_events, METH_NOARGS,
     "The events since the last call: ('read', unique, file_id, offset, size), "
     "('xattr', unique, ino, name, uid, size), ('listed', dir_id), ('end',)."},
    {"pending_hits", (PyCFunction)Loop_pending_hits, METH_NOARGS,
     "(hits, bytes) gathered, not taken."},
    {"take_hits", (PyCFunction)Loop_take_hits, METH_NOARGS,
     "(reads, by_origin, nbytes, seconds, errors) since the last call."},
    {"reply_error", (PyCFunction)Loop_reply_error, METH_VARARGS,
     "reply_error(unique, errno): answer a forwarded request with an error."},
    {"reply_xattr", (PyCFunction)Loop_reply_xattr, METH_VARARGS,
     "reply_xattr(unique, size, value): answer a GETXATTR."},
    {"statistics", (PyCFunction)Loop_statistics, METH_NOARGS, "Counts of what was served."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Loop_getset[] = {
    {"event_fd", (getter)Loop_event_fd, NULL, "Readable when there is something to take.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LoopType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spokefs.fuse.read_loop.ReadLoop",
    .tp_basicsize = sizeof(Loop),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ReadLoop(fd, namespace, blocks, blocks_map_bytes, uid, gid, attr_timeout_s, "
              "whole_read_max, threads): the native read loop (see the module source).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Loop_init,
    .tp_dealloc = (destructor)Loop_dealloc,
    .tp_methods = Loop_methods,
    .tp_getset = Loop_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "spokefs.fuse.read_loop",
    "FUSE requests of one mount answered on several threads from the LMDB namespace and block "
    "cache, without entering Python.", -1, NULL,
};

PyMODINIT_FUNC PyInit_read_loop(void)
{
    if (PyType_Ready(&LoopType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddIntConstant(m, "HIT_ENOUGH", HIT_ENOUGH) < 0 ||
            PyModule_AddIntConstant(m, "HIT_BATCH", HIT_BATCH) < 0 ||
            PyModule_AddIntConstant(m, "HIT_BYTES", HIT_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&LoopType);
    if (PyModule_AddObject(m, "ReadLoop", (PyObject *)&LoopType) < 0) {
        Py_DECREF(&LoopType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
