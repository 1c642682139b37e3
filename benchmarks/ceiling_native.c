/* ceiling_native: ceiling_fs.py's in-memory, read-only filesystem written in C on libfuse's
 * low-level API: what a FUSE request costs when no Python runs (issue 22: the "native read
 * loop" design, measured before choosing it; benchmarks/bench_request_cost.py).
 *
 * The same request path as ceiling_fs.py and the spoke: OPEN and OPENDIR answered ENOSYS (the
 * kernel opens files and directories itself), plain READDIR (READDIRPLUS not asked for), long
 * entry and attribute timeouts, mount options ro, allow_other, default_permissions; one
 * thread, as one pyfuse3 process is, or THREADS of libfuse's multi-threaded loop (what the
 * spoke's native read loop with as many threads is up against: bench_workers.py). At start
 * the tree under ROOT is read into memory; symlinks and other kinds are skipped. With
 * --passthrough it is not: each READ is a pread of the file under ROOT, so the bytes come
 * from the disk (or the page cache) as a disk cache's do, at the cost of one copy.
 *
 *     cc -O2 -o ceiling_native ceiling_native.c $(pkg-config --cflags --libs fuse3)
 *     ceiling_native [--passthrough] ROOT MNT [THREADS]
 *
 * Prints "ceiling_native: mounted N files (B bytes) at MNT" once mounted; exits 0 after
 * fusermount3 -u MNT or SIGTERM/SIGINT (then it unmounts itself).
 */
#define FUSE_USE_VERSION 34
#include <fuse_lowlevel.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TIMEOUT_S 3600.0

struct child {
    char *name;
    fuse_ino_t ino;
};

struct node {
    struct stat st;
    char *data;            /* a file's bytes */
    int fd;                /* --passthrough: the file, open */
    struct child *kids;    /* a directory's entries, in name order */
    size_t nkids;
};

static struct node *nodes; /* nodes[ino]; ino 1 is the root */
static size_t nnodes, cap;
static size_t nfiles, nbytes;
static int passthrough;    /* files read from their disk at each READ, not kept in memory */

static void die(const char *what, const char *path)
{
    fprintf(stderr, "ceiling_native: %s %s: %s\n", what, path, strerror(errno));
    exit(1);
}

static fuse_ino_t add(const struct stat *st)
{
    if (nnodes == cap) {
        cap = cap ? cap * 2 : 1024;
        nodes = realloc(nodes, cap * sizeof *nodes);
        if (!nodes)
            die("out of memory for", "nodes");
    }
    memset(&nodes[nnodes], 0, sizeof nodes[nnodes]);
    nodes[nnodes].st = *st;
    nodes[nnodes].st.st_ino = nnodes;
    return nnodes++;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const struct child *)a)->name, ((const struct child *)b)->name);
}

static void load(const char *path, fuse_ino_t dir)
{
    DIR *d = opendir(path);
    if (!d)
        die("cannot list", path);
    struct child *kids = NULL;
    size_t n = 0, room = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        char sub[4096];
        snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
        struct stat st;
        if (lstat(sub, &st) != 0)
            die("cannot stat", sub);
        if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode))
            continue;
        fuse_ino_t ino = add(&st);
        if (S_ISREG(st.st_mode) && passthrough) {
            nodes[ino].fd = open(sub, O_RDONLY);
            if (nodes[ino].fd < 0)
                die("cannot open", sub);
            nfiles++;
            nbytes += st.st_size;
        } else if (S_ISREG(st.st_mode)) {
            char *buf = malloc(st.st_size ? st.st_size : 1);
            int fd = open(sub, O_RDONLY);
            if (!buf || fd < 0 || read(fd, buf, st.st_size) != st.st_size)
                die("cannot read", sub);
            close(fd);
            nodes[ino].data = buf;
            nfiles++;
            nbytes += st.st_size;
        } else {
            load(sub, ino);
        }
        if (n == room) {
            room = room ? room * 2 : 64;
            kids = realloc(kids, room * sizeof *kids);
        }
        kids[n].name = strdup(e->d_name);
        kids[n].ino = ino;
        n++;
    }
    closedir(d);
    qsort(kids, n, sizeof *kids, by_name);
    nodes[dir].kids = kids;
    nodes[dir].nkids = n;
}

static struct node *node_of(fuse_ino_t ino)
{
    return ino >= 1 && ino < nnodes ? &nodes[ino] : NULL;
}

static void entry_of(fuse_ino_t ino, struct fuse_entry_param *e)
{
    memset(e, 0, sizeof *e);
    e->ino = ino;
    e->attr = nodes[ino].st;
    e->attr_timeout = e->entry_timeout = TIMEOUT_S;
}

static void ll_init(void *userdata, struct fuse_conn_info *conn)
{
    (void)userdata;
    conn->want &= ~FUSE_CAP_READDIRPLUS; /* plain READDIR, as the spoke */
}

static void ll_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct node *p = node_of(parent);
    if (!p || !S_ISDIR(p->st.st_mode)) {
        fuse_reply_err(req, p ? ENOTDIR : ENOENT);
        return;
    }
    struct child key = {(char *)name, 0};
    struct child *c = bsearch(&key, p->kids, p->nkids, sizeof *c, by_name);
    if (!c) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    struct fuse_entry_param e;
    entry_of(c->ino, &e);
    fuse_reply_entry(req, &e);
}

static void ll_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)fi;
    struct node *n = node_of(ino);
    if (!n)
        fuse_reply_err(req, ENOENT);
    else
        fuse_reply_attr(req, &n->st, TIMEOUT_S);
}

static void ll_enosys(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    (void)fi;
    fuse_reply_err(req, ENOSYS); /* the kernel opens by itself from now on */
}

static void ll_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi)
{
    (void)fi;
    struct node *n = node_of(ino);
    if (!n || !S_ISREG(n->st.st_mode)) {
        fuse_reply_err(req, n ? EISDIR : ENOENT);
        return;
    }
    if (off >= n->st.st_size) {
        fuse_reply_buf(req, NULL, 0);
        return;
    }
    size_t left = n->st.st_size - off;
    size_t len = size < left ? size : left;
    if (passthrough) {  /* one pread into a buffer, as a server reading its disk cache */
        char *buf = malloc(len);
        ssize_t got = buf ? pread(n->fd, buf, len, off) : -1;
        if (got < 0)
            fuse_reply_err(req, buf ? errno : ENOMEM);
        else
            fuse_reply_buf(req, buf, (size_t)got);
        free(buf);
        return;
    }
    fuse_reply_buf(req, n->data + off, len);
}

static void ll_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                       struct fuse_file_info *fi)
{
    (void)fi;
    struct node *n = node_of(ino);
    if (!n || !S_ISDIR(n->st.st_mode)) {
        fuse_reply_err(req, n ? ENOTDIR : ENOENT);
        return;
    }
    char *buf = malloc(size);
    size_t used = 0;
    for (size_t i = off; buf && i < n->nkids; i++) {
        struct stat st = nodes[n->kids[i].ino].st;
        size_t len = fuse_add_direntry(req, buf + used, size - used, n->kids[i].name, &st,
                                       (off_t)(i + 1));
        if (len > size - used)
            break;
        used += len;
    }
    if (!buf)
        fuse_reply_err(req, ENOMEM);
    else
        fuse_reply_buf(req, buf, used);
    free(buf);
}

static const struct fuse_lowlevel_ops ops = {
    .init = ll_init,
    .lookup = ll_lookup,
    .getattr = ll_getattr,
    .open = ll_enosys,
    .opendir = ll_enosys,
    .read = ll_read,
    .readdir = ll_readdir,
};

int main(int argc, char **argv)
{
    char *prog = argv[0];
    if (argc > 1 && !strcmp(argv[1], "--passthrough")) {
        passthrough = 1;
        argv++;
        argc--;
    }
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: %s [--passthrough] ROOT MNT [THREADS]\n", prog);
        return 2;
    }
    int threads = argc == 4 ? atoi(argv[3]) : 1;
    struct stat st;
    if (stat(argv[1], &st) != 0 || !S_ISDIR(st.st_mode))
        die("not a directory:", argv[1]);
    add(&st); /* ino 0: unused */
    add(&st); /* ino 1: the root */
    load(argv[1], FUSE_ROOT_ID);

    char *fargv[] = {prog, "-o", "ro,allow_other,default_permissions,fsname=ceilingnative"};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof ops, NULL);
    if (!se || fuse_set_signal_handlers(se) != 0 || fuse_session_mount(se, argv[2]) != 0) {
        fprintf(stderr, "ceiling_native: cannot mount %s\n", argv[2]);
        return 1;
    }
    printf("ceiling_native: mounted %zu files (%zu bytes) at %s\n", nfiles, nbytes, argv[2]);
    fflush(stdout);
    /* THREADS > 1: libfuse's multi-threaded loop on the one descriptor (no clone_fd), up to
     * THREADS idle threads kept; 1: the single-threaded loop, as one pyfuse3 process is */
    struct fuse_loop_config lc = {.clone_fd = 0, .max_idle_threads = (unsigned)threads};
    int rc = threads > 1 ? fuse_session_loop_mt(se, &lc) : fuse_session_loop(se);
    fuse_session_unmount(se);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return rc < 0 ? 1 : 0;
}
