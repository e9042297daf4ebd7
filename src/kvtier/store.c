// store.c — the tier stores behind pd_kvt_store: host DRAM and local disk.
//
// Both keep their hotset with a pd_kvt_policy (capacity in bytes, exact) under one mutex; the
// policy's eviction callback frees the page (DRAM) or unlinks its file (disk). A get re-verifies the
// page (pd_kvt_page_check against the expected hash): bad bytes are a miss, the entry is dropped and
// counted in bad_pages, and nothing is decoded from it.
//
// Disk: one file per page, DIR/<hash.hi><hash.lo>.kvp (32 hex digits), its length the page rounded
// up to 4096 bytes so that it can be written and read with O_DIRECT from an aligned buffer. I/O goes
// through one io_uring per store (liburing), submitted and reaped under the store's lock: a store
// call blocks its caller, which is a tier thread, never the engine's step loop. O_DIRECT falls back
// to buffered I/O on file systems that refuse it (tmpfs), counted in stats as "direct=0" via
// pd_kvt_store_name. At start the index is rebuilt from the directory: each *.kvp file's header is
// read and checked (magic, version, fingerprint, geometry, hash = its name); files of another model
// fingerprint are refused (left alone, not indexed); files beyond the capacity are evicted.
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <hiredis/hiredis.h>
#include <liburing.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/map.h"
#include "kvtier/kvtier.h"

#define DISK_ALIGN 4096

typedef struct dram_entry {
    pd_hash128 key;
    void *page;
    size_t len;
} dram_entry;

struct pd_kvt_store {
    int kind;  // 1 dram, 2 disk
    char name[48];
    pd_kvt_store_params p;
    pthread_mutex_t mu;   // the store: held across its I/O
    pthread_mutex_t imu;  // the index (pol): taken inside mu for each policy call, never across I/O,
                          // so a probe answers while the store reads or writes
    pd_kvt_policy *pol;
    pd_kvt_store_stats st;
    pd_map pages;  // dram: key -> page
    // disk
    char *dir;
    struct io_uring ring;
    bool ring_ok, direct;
    int64_t refused_foreign;
    // redis
    char *host;
    int port;
    redisContext *rc;
    int64_t retry_at_ms, backoff_ms;
    int64_t reconnects, down_misses, auth_failures;
    char *secret;
    pd_kvt_notify *notify;  // what the server evicts itself (notify.c)
    void (*evict_hook)(void *ud, pd_hash128 key);  // pd_kvt_store_set_evict_hook
    void *evict_ud;
};

static uint64_t hkey(pd_hash128 h) {
    return pd_map_mix64(h.lo ^ (h.hi * 0x9e3779b97f4a7c15ull));
}

static size_t align_up(size_t n) {
    return (n + DISK_ALIGN - 1) / DISK_ALIGN * DISK_ALIGN;
}

static void disk_path(const pd_kvt_store *s, pd_hash128 h, char *out, size_t n) {
    snprintf(out, n, "%s/%016" PRIx64 "%016" PRIx64 ".kvp", s->dir, h.hi, h.lo);
}

static void *page_alloc(pd_kvt_store *s, size_t n) {
    return s->p.page_alloc ? s->p.page_alloc(s->p.page_ud, n) : pd_malloc(n);
}

static void page_free(pd_kvt_store *s, void *p) {
    if (!p) return;
    if (s->p.page_free) s->p.page_free(s->p.page_ud, p);
    else pd_free(p);
}

static void on_evict(void *ud, pd_hash128 key, uint64_t bytes) {
    pd_kvt_store *s = ud;
    s->st.evictions++;
    if (s->evict_hook) s->evict_hook(s->evict_ud, key);
    if (s->kind == 1) {
        dram_entry *e = pd_map_find(&s->pages, hkey(key), &key);
        if (e) {
            page_free(s, e->page);
            pd_map_del_entry(&s->pages, e);
        }
    } else {
        char path[4096];
        disk_path(s, key, path, sizeof path);
        unlink(path);
    }
}

// The policy (the store's index) under imu; callers hold mu too, except pd_kvt_store_probe.
static bool pol_contains(pd_kvt_store *s, pd_hash128 key) {
    pthread_mutex_lock(&s->imu);
    bool r = pd_kvt_policy_contains(s->pol, key);
    pthread_mutex_unlock(&s->imu);
    return r;
}
static bool pol_get(pd_kvt_store *s, pd_hash128 key) {
    pthread_mutex_lock(&s->imu);
    bool r = pd_kvt_policy_get(s->pol, key);
    pthread_mutex_unlock(&s->imu);
    return r;
}
static pd_status pol_put(pd_kvt_store *s, pd_hash128 key, uint64_t bytes) {  // (evictions: on_evict, under both)
    pthread_mutex_lock(&s->imu);
    pd_status r = pd_kvt_policy_put(s->pol, key, bytes);
    pthread_mutex_unlock(&s->imu);
    return r;
}
static void pol_remove(pd_kvt_store *s, pd_hash128 key) {
    pthread_mutex_lock(&s->imu);
    (void)pd_kvt_policy_remove(s->pol, key);
    pthread_mutex_unlock(&s->imu);
}

static pd_kvt_store *store_new(int kind, const pd_kvt_store_params *p, pd_err *err) {
    if (!p || p->capacity == 0 || !pd_kvt_page_bytes(&p->geom, PD_KVT_F32)) {
        pd_err_set(err, PD_ERR_INVALID, "kvtier: bad store parameters (capacity %" PRIu64 ")", p ? p->capacity : 0);
        return NULL;
    }
    pd_kvt_store *s = pd_calloc(1, sizeof *s);
    if (!s) {
        pd_err_set(err, PD_ERR_NOMEM, "kvtier: out of memory");
        return NULL;
    }
    s->kind = kind;
    s->p = *p;
    s->p.dir = NULL;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->imu, NULL);
    s->pol = pd_kvt_policy_new(p->policy ? p->policy : PD_KVT_S3FIFO, p->capacity, on_evict, s);
    pd_map_params mp = {.entry_size = sizeof(dram_entry), .key_size = sizeof(pd_hash128)};
    if (!s->pol || pd_map_init(&s->pages, &mp) != PD_OK) {
        pd_kvt_store_free(s);
        pd_err_set(err, PD_ERR_NOMEM, "kvtier: out of memory");
        return NULL;
    }
    s->st.capacity = p->capacity;
    snprintf(s->name, sizeof s->name, "%s", kind == 1 ? "dram" : "disk");
    return s;
}

pd_kvt_store *pd_kvt_dram_new(const pd_kvt_store_params *p, pd_err *err) {
    return store_new(1, p, err);
}

void pd_kvt_store_free(pd_kvt_store *s) {
    if (!s) return;
    pd_kvt_notify_stop(s->notify);  // first: its callback takes the store's lock
    for (size_t i = 0; i < s->pages.cap; i++) {
        dram_entry *e = pd_map_slot(&s->pages, i);
        if (e) page_free(s, e->page);
    }
    pd_map_fini(&s->pages);
    pd_kvt_policy_free(s->pol);
    if (s->ring_ok) io_uring_queue_exit(&s->ring);
    if (s->rc) redisFree(s->rc);
    pd_free(s->host);
    pd_free(s->secret);
    pd_free(s->dir);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->imu);
    pd_free(s);
}

const char *pd_kvt_store_name(const pd_kvt_store *s) {
    return s->name;
}

// ---- disk I/O through io_uring -------------------------------------------------------------------
static int disk_open(pd_kvt_store *s, const char *path, int flags) {
    int fd = -1;
    if (s->direct) {
        fd = open(path, flags | O_DIRECT | O_CLOEXEC, 0600);
        if (fd < 0 && errno == EINVAL) s->direct = false;  // the file system has no O_DIRECT
    }
    if (fd < 0 && !s->direct) fd = open(path, flags | O_CLOEXEC, 0600);
    return fd;
}

// One read or write of len bytes at offset 0, looping over short transfers. 0 or -errno.
static int ring_rw(pd_kvt_store *s, int fd, void *buf, size_t len, bool write) {
    size_t done = 0;
    while (done < len) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(&s->ring);
        if (!sqe) return -EBUSY;
        if (write) io_uring_prep_write(sqe, fd, (char *)buf + done, (unsigned)(len - done), (uint64_t)done);
        else io_uring_prep_read(sqe, fd, (char *)buf + done, (unsigned)(len - done), (uint64_t)done);
        int r = io_uring_submit(&s->ring);
        if (r < 0) return r;
        struct io_uring_cqe *cqe;
        r = io_uring_wait_cqe(&s->ring, &cqe);
        if (r < 0) return r;
        int res = cqe->res;
        io_uring_cqe_seen(&s->ring, cqe);
        if (res < 0) return res;
        if (res == 0) return write ? -EIO : -ENODATA;  // end of file: truncated
        done += (size_t)res;
    }
    return 0;
}

static bool parse_name(const char *name, pd_hash128 *h) {
    size_t n = strlen(name);
    if (n != 36 || strcmp(name + 32, ".kvp")) return false;
    char hi[17], lo[17];
    memcpy(hi, name, 16);
    hi[16] = 0;
    memcpy(lo, name + 16, 16);
    lo[16] = 0;
    char *e1, *e2;
    h->hi = strtoull(hi, &e1, 16);
    h->lo = strtoull(lo, &e2, 16);
    return *e1 == 0 && *e2 == 0;
}

// Rebuilds the index from the directory (lock held, at start).
static void disk_scan(pd_kvt_store *s) {
    DIR *d = opendir(s->dir);
    if (!d) return;
    size_t page = pd_kvt_page_bytes(&s->p.geom, PD_KVT_F32);  // any dtype's header fits in 4096
    (void)page;
    void *hdr = NULL;
    if (posix_memalign(&hdr, DISK_ALIGN, DISK_ALIGN)) {
        closedir(d);
        return;
    }
    struct dirent *de;
    while ((de = readdir(d))) {
        pd_hash128 h;
        if (!parse_name(de->d_name, &h)) continue;
        char path[4096];
        disk_path(s, h, path, sizeof path);
        struct stat sb;
        if (stat(path, &sb) || !S_ISREG(sb.st_mode) || sb.st_size < PD_KVT_HDR_BYTES) continue;
        int fd = disk_open(s, path, O_RDONLY);
        if (fd < 0) continue;
        memset(hdr, 0, DISK_ALIGN);
        ssize_t r = pread(fd, hdr, DISK_ALIGN, 0);  // one aligned read of the header block
        close(fd);
        if (r < PD_KVT_HDR_BYTES) continue;
        pd_kvt_page_info in;
        const uint8_t *b = hdr;
        uint64_t pb = 0;
        for (int i = 0; i < 8; i++) pb |= (uint64_t)b[72 + i] << (8 * i);
        // The header only: hdr holds one 4 KiB block, the page is longer (its checksum is checked
        // when the page is read).
        bool foreign = pd_kvt_page_check_header(hdr, DISK_ALIGN, s->p.fingerprint, &s->p.geom, &h, &in) == PD_KVT_BAD_FOREIGN;
        if (foreign) {
            s->refused_foreign++;
            continue;
        }
        if ((uint64_t)sb.st_size != align_up(PD_KVT_HDR_BYTES + pb)) {  // truncated: drop it
            unlink(path);
            s->st.bad_pages++;
            continue;
        }
        (void)pol_put(s, h, (uint64_t)sb.st_size);
    }
    free(hdr);  // posix_memalign (O_DIRECT alignment): libc free
    closedir(d);
}

pd_kvt_store *pd_kvt_disk_new(const pd_kvt_store_params *p, pd_err *err) {
    if (!p || !p->dir || !*p->dir) {
        pd_err_set(err, PD_ERR_INVALID, "kvtier: the disk tier needs a directory");
        return NULL;
    }
    if (mkdir(p->dir, 0700) && errno != EEXIST) {
        pd_err_set(err, PD_ERR_IO, "kvtier: mkdir %s: %s", p->dir, strerror(errno));
        return NULL;
    }
    pd_kvt_store *s = store_new(2, p, err);
    if (!s) return NULL;
    s->dir = pd_strdup(p->dir);
    s->direct = true;
    int r = io_uring_queue_init(8, &s->ring, 0);
    if (r < 0 || !s->dir) {
        pd_kvt_store_free(s);
        pd_err_set(err, PD_ERR_IO, "kvtier: io_uring_queue_init: %s", strerror(-r));
        return NULL;
    }
    s->ring_ok = true;
    disk_scan(s);
    snprintf(s->name, sizeof s->name, "disk");
    return s;
}

// ---- redis: the cluster KV pool ------------------------------------------------------------------
// Keys are "pdkv:<fingerprint>:<hash.hi><hash.lo>" (hex), values whole pages; every worker of the
// same model shares them. Capacity and eviction are Redis's own (maxmemory + its policy): this
// store keeps no local index, so a prefix any worker computed is visible to all. Connection loss:
// the context is dropped and reconnects are attempted with exponential backoff (100 ms .. 5 s);
// while down, gets are misses (counted in down_misses too) and puts fail fast — serving goes on.
#define REDIS_TIMEOUT_MS 200

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void redis_drop(pd_kvt_store *s) {
    if (s->rc) redisFree(s->rc);
    s->rc = NULL;
    s->backoff_ms = s->backoff_ms ? (s->backoff_ms * 2 > 5000 ? 5000 : s->backoff_ms * 2) : 100;
    s->retry_at_ms = now_ms() + s->backoff_ms;
}

static bool redis_up(pd_kvt_store *s) {
    if (s->rc) return true;
    if (now_ms() < s->retry_at_ms) return false;
    struct timeval tv = {0, REDIS_TIMEOUT_MS * 1000};
    s->rc = redisConnectWithTimeout(s->host, s->port, tv);
    if (!s->rc || s->rc->err || redisSetTimeout(s->rc, tv) != REDIS_OK) {
        redis_drop(s);
        return false;
    }
    if (s->secret) {  // the pool moves KV: only workers that hold the shared secret may use it
        const char *argv[] = {"AUTH", s->secret};
        size_t lens[] = {4, strlen(s->secret)};
        redisReply *r = redisCommandArgv(s->rc, 2, argv, lens);
        bool ok = r && r->type == REDIS_REPLY_STATUS && !s->rc->err;
        if (r) freeReplyObject(r);
        if (!ok) {
            s->auth_failures++;
            redis_drop(s);
            return false;
        }
    }
    s->reconnects++;
    s->backoff_ms = 0;
    return true;
}

static void redis_key(const pd_kvt_store *s, pd_hash128 h, char *out, size_t n) {
    snprintf(out, n, "pdkv:%016" PRIx64 ":%016" PRIx64 "%016" PRIx64, s->p.fingerprint, h.hi, h.lo);
}

// Runs one command; NULL when the server is down or the connection broke (then dropped).
static redisReply *redis_cmd(pd_kvt_store *s, int argc, const char **argv, const size_t *lens) {
    if (!redis_up(s)) {
        s->down_misses++;
        return NULL;
    }
    redisReply *r = redisCommandArgv(s->rc, argc, argv, lens);
    if (!r || s->rc->err) {
        if (r) freeReplyObject(r);
        redis_drop(s);
        s->down_misses++;
        return NULL;
    }
    return r;
}

static pd_status redis_put(pd_kvt_store *s, pd_hash128 key, const void *page, size_t len) {
    char k[96];
    redis_key(s, key, k, sizeof k);
    const char *argv[] = {"SET", k, page};
    size_t lens[] = {3, strlen(k), len};
    redisReply *r = redis_cmd(s, 3, argv, lens);
    if (!r) return PD_ERR_IO;
    pd_status st = r->type == REDIS_REPLY_STATUS ? PD_OK : PD_ERR_IO;
    freeReplyObject(r);
    return st;
}

static pd_status redis_get(pd_kvt_store *s, pd_hash128 key, void *buf, size_t cap, size_t *len) {
    char k[96];
    redis_key(s, key, k, sizeof k);
    const char *argv[] = {"GET", k};
    size_t lens[] = {3, strlen(k)};
    redisReply *r = redis_cmd(s, 2, argv, lens);
    if (!r) return PD_ERR_IO;
    pd_status st = PD_ERR_NOTFOUND;
    if (r->type == REDIS_REPLY_STRING && r->len <= cap) {
        memcpy(buf, r->str, r->len);
        *len = r->len;
        st = PD_OK;
    } else if (r->type == REDIS_REPLY_STRING) {  // longer than any page of ours: bad
        *len = 0;
        st = PD_OK;
    }
    freeReplyObject(r);
    return st;
}

static void redis_del(pd_kvt_store *s, pd_hash128 key) {
    char k[96];
    redis_key(s, key, k, sizeof k);
    const char *argv[] = {"DEL", k};
    size_t lens[] = {3, strlen(k)};
    redisReply *r = redis_cmd(s, 2, argv, lens);
    if (r) freeReplyObject(r);
}

static bool redis_exists(pd_kvt_store *s, pd_hash128 key) {
    char k[96];
    redis_key(s, key, k, sizeof k);
    const char *argv[] = {"EXISTS", k};
    size_t lens[] = {6, strlen(k)};
    redisReply *r = redis_cmd(s, 2, argv, lens);
    bool e = r && r->type == REDIS_REPLY_INTEGER && r->integer > 0;
    if (r) freeReplyObject(r);
    return e;
}

// On the notification thread: one of our keys is gone from Redis (evicted, expired, deleted).
static void redis_removed(void *ud, pd_hash128 key, pd_kvt_notify_kind kind) {
    pd_kvt_store *s = ud;
    (void)kind;
    pthread_mutex_lock(&s->mu);  // the hook is called under the store's lock, as from a put
    if (s->evict_hook) s->evict_hook(s->evict_ud, key);
    pthread_mutex_unlock(&s->mu);
}

pd_kvt_store *pd_kvt_redis_new(const pd_kvt_store_params *p, const char *url, pd_err *err) {
    // redis://HOST:PORT
    const char *pre = "redis://";
    if (!url || strncmp(url, pre, strlen(pre))) {
        pd_err_set(err, PD_ERR_INVALID, "kvtier: --kv-remote wants redis://HOST:PORT, got '%s'", url ? url : "");
        return NULL;
    }
    const char *hp = url + strlen(pre);
    const char *colon = strrchr(hp, ':');
    char *end = NULL;
    long port = colon ? strtol(colon + 1, &end, 10) : 0;
    if (!colon || colon == hp || !end || *end || port <= 0 || port > 65535 || colon - hp > 255) {
        pd_err_set(err, PD_ERR_INVALID, "kvtier: bad redis address '%s' (redis://HOST:PORT)", url);
        return NULL;
    }
    pd_kvt_store_params q = *p;
    if (!q.capacity) q.capacity = 1;  // Redis owns capacity; the local policy is unused
    pd_kvt_store *s = store_new(3, &q, err);
    if (!s) return NULL;
    s->host = pd_strndup(hp, (size_t)(colon - hp));
    s->port = (int)port;
    s->secret = p->secret ? pd_strdup(p->secret) : NULL;
    snprintf(s->name, sizeof s->name, "redis");
    if (!s->host || (p->secret && !s->secret)) {
        pd_kvt_store_free(s);
        pd_err_set(err, PD_ERR_NOMEM, "kvtier: out of memory");
        return NULL;
    }
    redis_up(s);  // a server down at start is not an error: it is retried with backoff
    // Keys the server removes itself (maxmemory, TTL, DEL) reach the evict hook: routers drop them.
    if (!(s->notify = pd_kvt_notify_start(s->host, s->port, s->secret, s->p.fingerprint, redis_removed, s, err))) {
        pd_kvt_store_free(s);
        return NULL;
    }
    return s;
}

void pd_kvt_redis_notify_stats(pd_kvt_store *s, pd_kvt_notify_stats *out) {
    pd_kvt_notify_stats_get(s && s->kind == 3 ? s->notify : NULL, out);
}

int64_t pd_kvt_redis_auth_failures(pd_kvt_store *s) {
    pthread_mutex_lock(&s->mu);
    int64_t r = s->auth_failures;
    pthread_mutex_unlock(&s->mu);
    return r;
}

int64_t pd_kvt_redis_down_misses(pd_kvt_store *s) {
    pthread_mutex_lock(&s->mu);
    int64_t r = s->down_misses;
    pthread_mutex_unlock(&s->mu);
    return r;
}

// ---- the interface ---------------------------------------------------------------------------------
pd_status pd_kvt_store_put(pd_kvt_store *s, pd_hash128 key, const void *page, size_t len) {
    if (pd_kvt_page_check(page, len, s->p.fingerprint, &s->p.geom, &key, NULL) != PD_KVT_PAGE_OK)
        return PD_ERR_INVALID;
    pthread_mutex_lock(&s->mu);
    pd_status st = PD_OK;
    if (s->kind == 3) {
        st = redis_put(s, key, page, len);
        if (st != PD_OK) goto fail;
        s->st.puts++;
        s->st.bytes_in += (int64_t)len;
        goto out;
    }
    if (pol_contains(s, key)) goto out;  // content-addressed: same key, same page
    if (s->kind == 1) {
        void *copy = page_alloc(s, len);
        if (!copy) {
            st = PD_ERR_NOMEM;
            goto fail;
        }
        memcpy(copy, page, len);
        st = pol_put(s, key, len);
        if (st != PD_OK) {
            page_free(s, copy);
            goto fail;
        }
        dram_entry *e = pd_map_put(&s->pages, hkey(key), &key, NULL);
        if (!e) {
            page_free(s, copy);
            pol_remove(s, key);
            st = PD_ERR_NOMEM;
            goto fail;
        }
        e->page = copy;
        e->len = len;
    } else {
        size_t al = align_up(len);
        if (al > s->p.capacity) {
            st = PD_NOSPACE;
            goto fail;
        }
        void *buf = NULL;
        if (posix_memalign(&buf, DISK_ALIGN, al)) {
            st = PD_ERR_NOMEM;
            goto fail;
        }
        memcpy(buf, page, len);
        memset((char *)buf + len, 0, al - len);
        // Make room first (the policy unlinks evicted files), then write under a temporary name
        // and rename, so that a crash never leaves a half-written page under a valid name.
        st = pol_put(s, key, al);
        if (st != PD_OK) {
            free(buf);
            goto fail;
        }
        char path[4096], tmp[4200];
        disk_path(s, key, path, sizeof path);
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        int fd = disk_open(s, tmp, O_WRONLY | O_CREAT | O_TRUNC);
        int r = fd < 0 ? -errno : ring_rw(s, fd, buf, al, true);
        if (fd >= 0) close(fd);
        free(buf);
        if (r < 0 || rename(tmp, path)) {
            unlink(tmp);
            pol_remove(s, key);
            st = PD_ERR_IO;
            goto fail;
        }
    }
    s->st.puts++;
    s->st.bytes_in += (int64_t)len;
    goto out;
fail:
    s->st.put_failures++;
out:
    pthread_mutex_unlock(&s->mu);
    return st;
}

pd_status pd_kvt_store_get(pd_kvt_store *s, pd_hash128 key, void *buf, size_t cap, size_t *len) {
    pthread_mutex_lock(&s->mu);
    pd_status st = PD_ERR_NOTFOUND;
    size_t n = 0;
    if (s->kind == 3) {
        if (redis_get(s, key, buf, cap, &n) != PD_OK) {
            s->st.misses++;
            goto out;
        }
        goto check;
    }
    if (!pol_get(s, key)) {
        s->st.misses++;
        goto out;
    }
    if (s->kind == 1) {
        dram_entry *e = pd_map_find(&s->pages, hkey(key), &key);
        if (!e || e->len > cap) {
            s->st.misses++;
            goto out;
        }
        memcpy(buf, e->page, e->len);
        n = e->len;
    } else {
        char path[4096];
        disk_path(s, key, path, sizeof path);
        struct stat sb;
        void *ab = NULL;
        int fd = disk_open(s, path, O_RDONLY);
        bool ok = fd >= 0 && fstat(fd, &sb) == 0 && sb.st_size >= PD_KVT_HDR_BYTES &&
                  (size_t)sb.st_size % DISK_ALIGN == 0 && !posix_memalign(&ab, DISK_ALIGN, (size_t)sb.st_size) &&
                  ring_rw(s, fd, ab, (size_t)sb.st_size, false) == 0;
        if (fd >= 0) close(fd);
        if (ok) {
            const uint8_t *b = ab;
            uint64_t pb = 0;
            for (int i = 0; i < 8; i++) pb |= (uint64_t)b[72 + i] << (8 * i);
            ok = pb <= (uint64_t)sb.st_size - PD_KVT_HDR_BYTES && PD_KVT_HDR_BYTES + pb <= cap;
            if (ok) {
                n = PD_KVT_HDR_BYTES + pb;
                memcpy(buf, ab, n);
            }
        }
        free(ab);
        if (!ok) {  // unreadable or truncated: a miss, the entry goes
            s->st.misses++;
            s->st.bad_pages++;
            pol_remove(s, key);
            unlink(path);
            goto out;
        }
    }
check:
    if (pd_kvt_page_check(buf, n, s->p.fingerprint, &s->p.geom, &key, NULL) != PD_KVT_PAGE_OK) {
        s->st.misses++;
        s->st.bad_pages++;
        if (s->kind == 3) {
            redis_del(s, key);
            goto out;
        }
        pol_remove(s, key);
        if (s->kind == 1) {
            dram_entry *e = pd_map_find(&s->pages, hkey(key), &key);
            if (e) {
                page_free(s, e->page);
                pd_map_del_entry(&s->pages, e);
            }
        } else {
            char path[4096];
            disk_path(s, key, path, sizeof path);
            unlink(path);
        }
        goto out;
    }
    s->st.hits++;
    s->st.bytes_out += (int64_t)n;
    *len = n;
    st = PD_OK;
out:
    pthread_mutex_unlock(&s->mu);
    return st;
}

bool pd_kvt_store_seen_before(pd_kvt_store *s, pd_hash128 key) {
    if (s->kind == 3) return true;
    pthread_mutex_lock(&s->mu);
    pthread_mutex_lock(&s->imu);
    bool r = pd_kvt_policy_seen_before(s->pol, key);
    pthread_mutex_unlock(&s->imu);
    pthread_mutex_unlock(&s->mu);
    return r;
}

bool pd_kvt_store_contains(pd_kvt_store *s, pd_hash128 key) {
    pthread_mutex_lock(&s->mu);
    bool r = s->kind == 3 ? redis_exists(s, key) : pol_contains(s, key);
    pthread_mutex_unlock(&s->mu);
    return r;
}

void pd_kvt_store_set_evict_hook(pd_kvt_store *s, void (*fn)(void *ud, pd_hash128 key), void *ud) {
    pthread_mutex_lock(&s->mu);
    s->evict_hook = fn;
    s->evict_ud = ud;
    pthread_mutex_unlock(&s->mu);
}

int pd_kvt_store_probe(pd_kvt_store *s, pd_hash128 key) {
    if (s->kind == 3) return -1;  // a network round trip: the tier thread finds out
    // The index alone (imu is never held across I/O): a store busy writing still answers. (It used
    // to answer "unknown" while busy, and a chain of unknowns matched whole prompts a busy disk did
    // not hold: the request waited for a load that found nothing.)
    return pol_contains(s, key) ? 1 : 0;
}

void pd_kvt_store_stats_get(pd_kvt_store *s, pd_kvt_store_stats *out) {
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    if (s->kind == 3) {  // Redis evicts by itself: what the notifications told us
        pd_kvt_notify_stats ns;
        pd_kvt_notify_stats_get(s->notify, &ns);
        out->evictions = ns.evicted + ns.expired;
    } else {
        pd_kvt_policy_stats ps;
        pthread_mutex_lock(&s->imu);
        pd_kvt_policy_stats_get(s->pol, &ps);
        pthread_mutex_unlock(&s->imu);
        out->bytes_used = ps.bytes_used;
        out->n_items = ps.n_items;
        out->capacity = ps.capacity;
    }
    pthread_mutex_unlock(&s->mu);
}

// Files refused at start because they belong to another model (disk only; 0 for DRAM).
int64_t pd_kvt_disk_refused(pd_kvt_store *s) {
    pthread_mutex_lock(&s->mu);
    int64_t r = s->refused_foreign;
    pthread_mutex_unlock(&s->mu);
    return r;
}
