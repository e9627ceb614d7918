/* pcache_disk.c — the prefix cache's disk tier (pcache_disk.h, docs/spec.md §4.3.1).
 *
 * The index is a chained hash table of entries keyed by file name, beside a use list, least
 * recently used first: the files found at open in modification-time order (ties by name),
 * then each file as it is written or read. Every file operation is relative to a descriptor of
 * the directory, opened once. A write goes through a temporary file ".<name>.<pid>.<n>.tmp";
 * open removes those whose writer no longer runs (killed between create and rename), which no
 * budget would ever count otherwise. */
#include "core/pcache_disk.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/alloc.h"
#include "base/errors.h"
#include "core/kv_records.h"

typedef struct entry {
    struct entry* next;   /* hash chain                 */
    struct entry* older;  /* the use list               */
    struct entry* newer;
    uint64_t hash;        /* of the name                */
    size_t bytes;         /* the file's size            */
    char name[];          /* NUL-terminated             */
} entry;

struct tl_pdisk {
    int dir;              /* descriptor of the directory */
    tl_block_model model;
    size_t budget, bytes;
    entry** buckets;      /* [n_buckets], a power of two */
    size_t n_buckets, n_entries;
    entry* oldest;
    entry* newest;
    uint64_t failed_writes; /* spills whose file could not be written */
};

/* Temporary files of this process are told apart by this counter (models may share a dir). */
static atomic_ullong temp_serial;

/* ---- the index ------------------------------------------------------------------------------- */

static uint64_t name_hash(const char* name) {
    uint64_t h = 0xcbf29ce484222325u;
    for (const char* p = name; *p; p++) h = (h ^ (unsigned char)*p) * 0x100000001b3u;
    return h ^ (h >> 29);
}

static entry* find(const tl_pdisk* d, const char* name) {
    const uint64_t h = name_hash(name);
    for (entry* e = d->buckets[h & (d->n_buckets - 1)]; e; e = e->next)
        if (e->hash == h && strcmp(e->name, name) == 0) return e;
    return NULL;
}

/* Double the buckets when fuller than one entry per bucket; keeps them if memory is short. */
static void maybe_grow(tl_pdisk* d) {
    if (d->n_entries < d->n_buckets) return;
    const size_t n = d->n_buckets * 2;
    entry** buckets = tl_alloc_zeroed(n, sizeof *buckets);
    if (!buckets) return;
    for (size_t i = 0; i < d->n_buckets; i++)
        for (entry *e = d->buckets[i], *next; e; e = next) {
            next = e->next;
            e->next = buckets[e->hash & (n - 1)];
            buckets[e->hash & (n - 1)] = e;
        }
    tl_free(d->buckets);
    d->buckets = buckets;
    d->n_buckets = n;
}

static void link_newest(tl_pdisk* d, entry* e) {
    e->newer = NULL;
    e->older = d->newest;
    *(d->newest ? &d->newest->newer : &d->oldest) = e;
    d->newest = e;
}

static void unlink_use(tl_pdisk* d, entry* e) {
    *(e->older ? &e->older->newer : &d->oldest) = e->newer;
    *(e->newer ? &e->newer->older : &d->newest) = e->older;
    e->older = e->newer = NULL;
}

/* A new entry for a file of `bytes`, the most recently used; false when memory is short. */
static bool add(tl_pdisk* d, const char* name, size_t bytes) {
    const size_t len = strlen(name) + 1;
    entry* e = tl_alloc_zeroed(1, sizeof *e + len);
    if (!e) return false;
    memcpy(e->name, name, len);
    e->hash = name_hash(name);
    e->bytes = bytes;
    maybe_grow(d);
    entry** b = &d->buckets[e->hash & (d->n_buckets - 1)];
    e->next = *b;
    *b = e;
    d->n_entries++;
    link_newest(d, e);
    d->bytes += bytes;
    return true;
}

/* Forget an entry (the file stays). */
static void drop(tl_pdisk* d, entry* e) {
    for (entry** p = &d->buckets[e->hash & (d->n_buckets - 1)]; *p; p = &(*p)->next)
        if (*p == e) {
            *p = e->next;
            break;
        }
    d->n_entries--;
    unlink_use(d, e);
    d->bytes -= e->bytes;
    tl_free(e);
}

/* ---- open ------------------------------------------------------------------------------------ */

typedef struct found {
    struct timespec mtime;
    size_t bytes;
    char* name;
} found;

static int by_mtime(const void* a, const void* b) {
    const found *x = a, *y = b;
    if (x->mtime.tv_sec != y->mtime.tv_sec) return x->mtime.tv_sec < y->mtime.tv_sec ? -1 : 1;
    if (x->mtime.tv_nsec != y->mtime.tv_nsec) return x->mtime.tv_nsec < y->mtime.tv_nsec ? -1 : 1;
    return strcmp(x->name, y->name);
}

static bool is_block_name(const char* name) {
    const size_t n = strlen(name), suffix = strlen(".tlblock");
    return n > suffix && strcmp(name + n - suffix, ".tlblock") == 0;
}

/* Whether `name` is a temporary file of a writer that no longer runs on this host:
 * ".<name>.<pid>.<n>.tmp" with no process <pid> (a writer on another host sharing the directory
 * may lose its write, never see a partial file: its rename then fails). */
static bool is_stale_temp(const char* name) {
    const size_t n = strlen(name), suffix = strlen(".tmp");
    if (name[0] != '.' || n <= suffix || strcmp(name + n - suffix, ".tmp") != 0) return false;
    const char* end = name + n - suffix; /* the '.' before "tmp" */
    const char* serial = end;
    while (serial > name && serial[-1] != '.') serial--;
    if (serial <= name + 1 || serial == end) return false;
    const char* pid = serial - 1;
    while (pid > name && pid[-1] != '.') pid--;
    char* stop = NULL;
    const long writer = strtol(pid, &stop, 10);
    if (stop != serial - 1 || writer <= 0) return false;
    return kill((pid_t)writer, 0) != 0 && errno == ESRCH;
}

static void free_found(found* f, size_t n) {
    for (size_t i = 0; i < n; i++) tl_free(f[i].name);
    tl_free(f);
}

/* The regular *.tlblock files of the directory into *out (least recently modified first); the
 * stale temporary files go. */
static tl_status list_files(tl_pdisk* d, const char* path, found** out, size_t* n_out) {
    *out = NULL;
    *n_out = 0;
    const int fd = dup(d->dir);
    DIR* dir = fd >= 0 ? fdopendir(fd) : NULL;
    if (!dir) {
        const tl_status st = tl_fail(TL_ERR_IO, "prefix_cache_dir '%s': cannot be read: %s", path, strerror(errno));
        if (fd >= 0) close(fd);
        return st;
    }
    found* f = NULL;
    size_t n = 0, cap = 0;
    tl_status st = TL_OK;
    for (struct dirent* de; st == TL_OK && (de = readdir(dir));) {
        struct stat s;
        if (is_stale_temp(de->d_name)) unlinkat(d->dir, de->d_name, 0);
        if (!is_block_name(de->d_name) || fstatat(d->dir, de->d_name, &s, AT_SYMLINK_NOFOLLOW) != 0 ||
            !S_ISREG(s.st_mode))
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            found* bigger = tl_alloc(cap * sizeof *bigger);
            if (!bigger) {
                st = tl_fail_oom("prefix cache directory index");
                break;
            }
            if (n) memcpy(bigger, f, n * sizeof *f);
            tl_free(f);
            f = bigger;
        }
        const size_t len = strlen(de->d_name) + 1;
        f[n].name = tl_alloc(len);
        if (!f[n].name) {
            st = tl_fail_oom("prefix cache directory index");
            break;
        }
        memcpy(f[n].name, de->d_name, len);
        f[n].mtime = s.st_mtim;
        f[n].bytes = (size_t)s.st_size;
        n++;
    }
    closedir(dir);
    if (st != TL_OK) {
        free_found(f, n);
        return st;
    }
    if (n) qsort(f, n, sizeof *f, by_mtime);
    *out = f;
    *n_out = n;
    return TL_OK;
}

tl_status tl_pdisk_open(const char* path, size_t budget, const tl_block_model* m, tl_pdisk** out) {
    *out = NULL;
    if (mkdir(path, 0777) != 0 && errno != EEXIST)
        return tl_fail(TL_ERR_IO, "prefix_cache_dir '%s': cannot be created: %s", path, strerror(errno));
    struct stat s;
    if (stat(path, &s) != 0) return tl_fail(TL_ERR_IO, "prefix_cache_dir '%s': %s", path, strerror(errno));
    if (!S_ISDIR(s.st_mode)) return tl_fail(TL_ERR_IO, "prefix_cache_dir '%s': not a directory", path);
    tl_pdisk* d = tl_alloc_zeroed(1, sizeof *d);
    if (!d) return tl_fail_oom("prefix cache directory");
    d->model = *m;
    d->budget = budget;
    d->n_buckets = 64;
    d->buckets = tl_alloc_zeroed(d->n_buckets, sizeof *d->buckets);
    d->dir = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    tl_status st = d->buckets ? TL_OK : tl_fail_oom("prefix cache directory");
    if (st == TL_OK && d->dir < 0)
        st = tl_fail(TL_ERR_IO, "prefix_cache_dir '%s': cannot be opened: %s", path, strerror(errno));
    found* f = NULL;
    size_t n = 0;
    if (st == TL_OK) st = list_files(d, path, &f, &n);
    for (size_t i = 0; st == TL_OK && i < n; i++)
        if (!add(d, f[i].name, f[i].bytes)) st = tl_fail_oom("prefix cache directory index");
    free_found(f, n);
    if (st != TL_OK) {
        tl_pdisk_free(d);
        return st;
    }
    *out = d;
    return TL_OK;
}

void tl_pdisk_free(tl_pdisk* d) {
    if (!d) return;
    while (d->oldest) drop(d, d->oldest);
    if (d->dir >= 0) close(d->dir);
    tl_free(d->buckets);
    tl_free(d);
}

size_t tl_pdisk_bytes(const tl_pdisk* d) { return d->bytes; }
uint64_t tl_pdisk_failed_writes(const tl_pdisk* d) { return d->failed_writes; }
size_t tl_pdisk_budget(const tl_pdisk* d) { return d->budget; }
const tl_block_model* tl_pdisk_model(const tl_pdisk* d) { return &d->model; }

/* ---- files ----------------------------------------------------------------------------------- */

/* File `name`, of `bytes`, read: its modification time set to now, its entry the most recently
 * used, with its size now; a file the tier did not count (another process's) joins it. */
static void mark_used(tl_pdisk* d, const char* name, size_t bytes) {
    utimensat(d->dir, name, NULL, 0);
    entry* e = find(d, name);
    if (e) drop(d, e);
    add(d, name, bytes); /* out of memory: the file stays, uncounted */
}

/* The layer count a file of `bytes` bytes at `at` would have by its size alone (0: none). */
static uint32_t layers_by_size(const tl_pdisk* d, const tl_block_place* at, uint64_t bytes) {
    const size_t salt_bytes = strlen(at->salt);
    const uint64_t base = tl_block_file_size(&d->model, salt_bytes, at->index, 0);
    const uint64_t layer = tl_block_file_size(&d->model, salt_bytes, at->index, 1) - base;
    if (bytes <= base || (bytes - base) % layer || (bytes - base) / layer > TL_BLOCK_MAX_LAYERS) return 0;
    return (uint32_t)((bytes - base) / layer);
}

/* The checked contents of file `name` holding the block at `at` and serving n_layers (tl_free
 * them), or NULL. Nothing is allocated before the file's size is one such a block can have. */
static uint8_t* read_checked(tl_pdisk* d, const char* name, const tl_block_place* at, uint32_t n_layers) {
    const int fd = openat(d->dir, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return NULL;
    struct stat s;
    uint8_t* buf = NULL;
    if (fstat(fd, &s) == 0 && S_ISREG(s.st_mode) && layers_by_size(d, at, (uint64_t)s.st_size))
        buf = tl_alloc((size_t)s.st_size);
    size_t got = 0;
    while (buf && got < (size_t)s.st_size) {
        const ssize_t r = pread(fd, buf + got, (size_t)s.st_size - got, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break; /* an error, or the file shrank */
        got += (size_t)r;
    }
    close(fd);
    if (buf && (got != (size_t)s.st_size || tl_block_file_check(&d->model, buf, got, at, n_layers) != TL_OK)) {
        tl_free(buf);
        buf = NULL;
    }
    return buf;
}

static bool write_all(int fd, const uint8_t* buf, size_t n) {
    for (size_t done = 0; done < n;) {
        const ssize_t w = write(fd, buf + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        done += (size_t)w;
    }
    return true;
}

/* buf[0 .. n) as file `name`, whole or not at all (a temporary file renamed over it). */
static bool write_file(tl_pdisk* d, const char* name, const uint8_t* buf, size_t n) {
    char temp[96];
    snprintf(temp, sizeof temp, ".%s.%ld.%llu.tmp", name, (long)getpid(),
             (unsigned long long)atomic_fetch_add(&temp_serial, 1));
    const int fd = openat(d->dir, temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) return false;
    bool ok = write_all(fd, buf, n);
    ok = close(fd) == 0 && ok;
    ok = ok && renameat(d->dir, temp, d->dir, name) == 0;
    if (!ok) unlinkat(d->dir, temp, 0);
    return ok;
}

/* ---- the interface --------------------------------------------------------------------------- */

bool tl_pdisk_spill(tl_pdisk* d, const tl_block_place* at, uint64_t name, tl_kv_block* b) {
    char file[32];
    tl_block_name_format(name, file);
    const size_t salt_bytes = strlen(at->salt);
    if (salt_bytes > TL_BLOCK_MAX_SALT) return false;
    uint8_t* serving = read_checked(d, file, at, b->n_layers);
    if (serving) { /* it holds as many layers or more already (a check, not a use: no touch) */
        tl_free(serving);
        return false;
    }
    const size_t n = tl_block_file_size(&d->model, salt_bytes, at->index, b->n_layers);
    if (d->budget && n > d->budget) return false;
    uint8_t* buf = tl_alloc(n);
    void* stage = NULL;
    bool ok = buf && tl_kv_stage_new(&d->model.geom, "prefix cache spill", &stage) == TL_OK &&
              tl_block_file_encode(&d->model, at, b, stage, buf) == TL_OK;
    tl_free(stage);
    entry* const old = find(d, file); /* shallower or broken: the new file replaces it */
    const size_t replaced = old ? old->bytes : 0;
    while (ok && d->budget && d->bytes - replaced > d->budget - n) {
        entry* victim = d->oldest == old ? old->newer : d->oldest; /* one is left: bytes > replaced */
        unlinkat(d->dir, victim->name, 0);
        drop(d, victim);
    }
    if (ok && !write_file(d, file, buf, n)) {
        d->failed_writes++;
        ok = false;
    }
    tl_free(buf);
    if (!ok) return false;
    if (old) drop(d, old);
    add(d, file, n); /* out of memory: the file stays, uncounted */
    return true;
}

bool tl_pdisk_fetch(tl_pdisk* d, const tl_block_place* at, uint64_t name, uint32_t n_layers, tl_kv_table* t) {
    if (strlen(at->salt) > TL_BLOCK_MAX_SALT) return false;
    char file[32];
    tl_block_name_format(name, file);
    uint8_t* buf = read_checked(d, file, at, n_layers);
    if (!buf) return false;
    const tl_kv_geom* g = &d->model.geom;
    const uint32_t n_file_layers = tl_block_file_layers(buf);
    const size_t bytes = tl_block_file_size(&d->model, strlen(at->salt), at->index, n_file_layers);
    const tl_kv_mark mark = tl_kv_mark_now(t);
    void* stage = NULL;
    bool ok = tl_kv_reserve(t, g, n_file_layers, (size_t)at->index * g->block_size, g->block_size) == TL_OK;
    ok = ok && tl_kv_stage_new(g, "prefix cache read", &stage) == TL_OK &&
         tl_block_file_decode(&d->model, buf, t->spans[t->n_spans - 1].block, stage) == TL_OK;
    tl_free(stage);
    tl_free(buf);
    if (!ok) {
        tl_kv_rollback(t, mark);
        return false;
    }
    mark_used(d, file, bytes);
    return true;
}
