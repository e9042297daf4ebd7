// cpu.c — the CPU backend: plain C11 fp32 reference implementation of every op. It is the oracle
// the CUDA backend is tested against, and the embedded default on machines without a GPU.
//
// Design: "device memory" is host memory from pd_malloc (64-byte aligned via over-allocation is
// not needed: OpenBLAS handles any alignment). Weights, activations and KV are f32. GEMMs go
// through OpenBLAS (cblas_sgemm, row-major, B transposed since HF Linear weights are (N, K)).
// Attention is threaded with OpenMP over (query row, head); each thread keeps its own score
// buffer, sized by the longest context in the batch. Nothing here is clever on purpose: it must be
// obviously right.
#include <cblas.h>
#include <omp.h>
#include <math.h>
#include <string.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend/backend_impl.h"

typedef struct cpu_backend {
    pd_backend base;
    int n_threads;
} cpu_backend;

static void cpu_free(pd_backend *b) { pd_free(b); }

static void cpu_mem_info(pd_backend *b, size_t *free_bytes, size_t *total_bytes) {
    long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (total_bytes) *total_bytes = (size_t)pages * (size_t)psz;
    if (free_bytes) *free_bytes = (size_t)avail * (size_t)psz;
}

static void *cpu_dev_alloc(pd_backend *b, size_t n) { return pd_malloc(n); }
static void cpu_dev_free(pd_backend *b, void *p) { pd_free(p); }
static void cpu_copy(pd_backend *b, void *d, const void *s, size_t n) { memmove(d, s, n); }
static void cpu_memset(pd_backend *b, void *d, int v, size_t n) { memset(d, v, n); }
static void cpu_sync(pd_backend *b) {}

static void cpu_embed(pd_backend *b, const pd_embed_params *p) {
    const float *table = p->table;
    float *out = p->out;
    for (int i = 0; i < p->n_tokens; i++) {
        int id = p->ids[i];
        PD_ASSERT(id >= 0 && id < p->vocab);
        memcpy(out + (size_t)i * p->dim, table + (size_t)id * p->dim, sizeof(float) * (size_t)p->dim);
    }
}

static void cpu_rmsnorm(pd_backend *b, const pd_rmsnorm_params *p) {
    float *x = p->x, *out = p->out;
    const float *add = p->add, *w = p->w;
    int dim = p->dim;
#pragma omp parallel for schedule(static) if (p->n_rows > 4)
    for (int r = 0; r < p->n_rows; r++) {
        float *xr = x + (size_t)r * dim, *o = out + (size_t)r * dim;
        if (add) {
            const float *ar = add + (size_t)r * dim;
            for (int i = 0; i < dim; i++) xr[i] += ar[i];
        }
        double ss = 0;
        for (int i = 0; i < dim; i++) ss += (double)xr[i] * xr[i];
        float inv = 1.0f / sqrtf((float)(ss / dim) + p->eps);
        for (int i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

static void cpu_gemm(const pd_matmul_params *p);
static void cpu_silu_mul(pd_backend *b, const pd_silu_mul_params *p);
static void cpu_rope_kv(pd_backend *b, const pd_rope_kv_params *p);

// The fused forms (backend.h) as the unfused ops compute them: the norm into a temporary, the GEMM
// into (M, 2N) then silu_mul for glu; the residual add is accumulate in f32; rope_kv after.
static void cpu_matmul(pd_backend *b, const pd_matmul_params *p) {
    pd_matmul_params q = *p;
    float *normed = NULL, *gu = NULL;
    if (p->norm_w) {
        normed = pd_malloc(sizeof(float) * (size_t)p->M * (size_t)p->K);
        PD_ASSERT(normed);
        cpu_rmsnorm(b, &(pd_rmsnorm_params){.x = (void *)p->a, .w = p->norm_w, .out = normed, .n_rows = p->M,
                                            .dim = p->K, .eps = p->norm_eps});
        q.a = normed, q.lda = 0;
    }
    if (p->glu) {
        gu = pd_malloc(sizeof(float) * (size_t)p->M * 2 * (size_t)p->N);
        PD_ASSERT(gu);
        q.out = gu, q.N = 2 * p->N;
        cpu_gemm(&q);
        cpu_silu_mul(b, &(pd_silu_mul_params){.gu = gu, .out = p->out, .n_rows = p->M, .F = p->N});
    } else {
        q.accumulate = p->accumulate || p->residual;
        cpu_gemm(&q);
        if (p->rope) cpu_rope_kv(b, p->rope);
    }
    pd_free(normed);
    pd_free(gu);
}

static void cpu_gemm(const pd_matmul_params *p) {
    int lda = p->lda ? p->lda : p->K;
    float *out = p->out;
    const float *bias = p->bias;
    float beta = p->accumulate ? 1.0f : 0.0f;
    if (bias && !p->accumulate) {
        for (int m = 0; m < p->M; m++) memcpy(out + (size_t)m * p->N, bias, sizeof(float) * (size_t)p->N);
        beta = 1.0f;
    } else if (bias) {
        for (int m = 0; m < p->M; m++)
            for (int n = 0; n < p->N; n++) out[(size_t)m * p->N + n] += bias[n];
    }
    // NOTE: OpenBLAS runs single-threaded (set at backend creation) and we split N across OpenMP
    // threads ourselves: two thread pools (OpenMP for attention, OpenBLAS's pthreads for GEMMs)
    // spinning against each other made small decode steps ~10x slower on a 2-core machine.
    double work = (double)p->M * p->N * p->K;
    int n_chunks = work < 2e6 ? 1 : omp_get_max_threads();
    int chunk = ((p->N + n_chunks - 1) / n_chunks + 15) / 16 * 16;
#pragma omp parallel for schedule(static) if (n_chunks > 1)
    for (int c = 0; c < n_chunks; c++) {
        int n0 = c * chunk, n1 = PD_MIN(p->N, n0 + chunk);
        if (n0 >= n1) continue;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p->M, n1 - n0, p->K, 1.0f, p->a, lda,
                    (const float *)p->w + (size_t)n0 * p->K, p->K, beta, out + n0, p->N);
    }
}

// The fp8 KV row (backend.h, PD_KV_FP8): per kv head, scale = amax / 448 and q = e4m3(x * 448 /
// amax), computed in f32 exactly as the CUDA KV write computes them.
static void fp8_write_row(uint8_t *dst, const float *x, int Hkv, int hd) {
    float *scales = (float *)(dst + (size_t)Hkv * hd);
    for (int h = 0; h < Hkv; h++) {
        const float *xh = x + (size_t)h * hd;
        float amax = 0.0f;
        for (int i = 0; i < hd; i++) amax = fmaxf(amax, fabsf(xh[i]));
        float inv = amax > 0.0f ? 448.0f / amax : 0.0f;
        for (int i = 0; i < hd; i++) dst[(size_t)h * hd + i] = pd_fp8_e4m3_from_f32(xh[i] * inv);
        scales[h] = amax / 448.0f;
    }
}

// Dequantises head kvh of an fp8 row into out (hd floats).
static void fp8_read_head(const uint8_t *row, int Hkv, int hd, int kvh, const float *lut, float *out) {
    float sc = ((const float *)(row + (size_t)Hkv * hd))[kvh];
    const uint8_t *q = row + (size_t)kvh * hd;
    for (int i = 0; i < hd; i++) out[i] = lut[q[i]] * sc;
}

static void cpu_rope_kv(pd_backend *b, const pd_rope_kv_params *p) {
    int hd = p->head_dim, half = hd / 2, H = p->n_heads, Hkv = p->n_kv_heads;
    int row = (H + 2 * Hkv) * hd;
    float *qkv = p->qkv, *kc = p->k_cache, *vc = p->v_cache;
#pragma omp parallel for schedule(static) if (p->n_tokens > 4)
    for (int t = 0; t < p->n_tokens; t++) {
        float *r = qkv + (size_t)t * row;
        float pos = (float)p->positions[t];
        float cs[512], sn[512];
        PD_ASSERT(half <= 512);
        for (int i = 0; i < half; i++) {
            // HF computes freqs = position * inv_freq in fp32, then cos/sin of that.
            float f = pos * p->inv_freq[i];
            cs[i] = cosf(f) * p->attn_scaling;
            sn[i] = sinf(f) * p->attn_scaling;
        }
        for (int h = 0; h < H + Hkv; h++) {  // q heads then k heads are contiguous
            float *v = r + (size_t)h * hd;
            for (int i = 0; i < half; i++) {
                float x0 = v[i], x1 = v[i + half];
                v[i] = x0 * cs[i] - x1 * sn[i];
                v[i + half] = x1 * cs[i] + x0 * sn[i];
            }
        }
        if (p->slot_mapping[t] < 0) continue;  // a padding row: rotate only, write no KV
        size_t slot = (size_t)p->slot_mapping[t], kvw = (size_t)Hkv * hd;
        if (p->kv_dtype == PD_KV_FP8) {
            size_t rb = pd_kv_row_bytes(b, PD_KV_FP8, Hkv, hd);
            fp8_write_row((uint8_t *)p->k_cache + slot * rb, r + (size_t)H * hd, Hkv, hd);
            fp8_write_row((uint8_t *)p->v_cache + slot * rb, r + (size_t)(H + Hkv) * hd, Hkv, hd);
            continue;
        }
        memcpy(kc + slot * kvw, r + (size_t)H * hd, sizeof(float) * kvw);
        memcpy(vc + slot * kvw, r + (size_t)(H + Hkv) * hd, sizeof(float) * kvw);
    }
}

static void cpu_attention(pd_backend *b, const pd_attention_params *p) {
    int H = p->n_heads, Hkv = p->n_kv_heads, hd = p->head_dim, bs = p->block_size;
    int group = H / Hkv;
    size_t kvw = (size_t)Hkv * hd;
    const float *kc = p->k_cache, *vc = p->v_cache, *q = p->q;
    float *out = p->out;
    int max_kv = p->max_kv_len;
    double work = (double)p->n_tokens * H * max_kv * hd;
    bool fp8 = p->kv_dtype == PD_KV_FP8;
    size_t rb = pd_kv_row_bytes(b, p->kv_dtype, Hkv, hd);
    float lut[256];
    for (int i = 0; i < 256; i++) lut[i] = pd_fp8_e4m3_to_f32((uint8_t)i);
#pragma omp parallel if (work > 2e5)
    {
        float *sc = pd_malloc(sizeof(float) * (size_t)(max_kv > 0 ? max_kv : 1));
        float *deq = pd_malloc(sizeof(float) * (size_t)hd);
        PD_ASSERT(sc && deq);
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int t = 0; t < p->n_tokens; t++) {
            for (int h = 0; h < H; h++) {
                int s = p->token_seq[t];
                int q_len = p->q_indptr[s + 1] - p->q_indptr[s];
                int kv_len = p->kv_lens[s];
                int pos = kv_len - q_len + (t - p->q_indptr[s]);
                const int32_t *bt = p->bt_indices + p->bt_indptr[s];
                const float *qh = q + (size_t)t * p->q_stride + (size_t)h * hd;
                int kvh = h / group;
                int n = pos + 1;
                PD_ASSERT(n <= max_kv);
                float mx = -INFINITY;
                for (int j = 0; j < n; j++) {
                    size_t slot = (size_t)bt[j / bs] * bs + (size_t)(j % bs);
                    const float *kj = kc + slot * kvw + (size_t)kvh * hd;
                    if (fp8) {
                        fp8_read_head((const uint8_t *)p->k_cache + slot * rb, Hkv, hd, kvh, lut, deq);
                        kj = deq;
                    }
                    float d = 0;
                    for (int i = 0; i < hd; i++) d += qh[i] * kj[i];
                    sc[j] = d * p->scale;
                    if (sc[j] > mx) mx = sc[j];
                }
                double sum = 0;
                for (int j = 0; j < n; j++) {
                    sc[j] = expf(sc[j] - mx);
                    sum += sc[j];
                }
                float inv = (float)(1.0 / sum);
                float *o = out + (size_t)t * H * hd + (size_t)h * hd;
                for (int i = 0; i < hd; i++) o[i] = 0;
                for (int j = 0; j < n; j++) {
                    size_t slot = (size_t)bt[j / bs] * bs + (size_t)(j % bs);
                    const float *vj = vc + slot * kvw + (size_t)kvh * hd;
                    if (fp8) {
                        fp8_read_head((const uint8_t *)p->v_cache + slot * rb, Hkv, hd, kvh, lut, deq);
                        vj = deq;
                    }
                    float w = sc[j] * inv;
                    for (int i = 0; i < hd; i++) o[i] += w * vj[i];
                }
            }
        }
        pd_free(sc);
        pd_free(deq);
    }
}

static void cpu_silu_mul(pd_backend *b, const pd_silu_mul_params *p) {
    const float *gu = p->gu;
    float *out = p->out;
    int F = p->F;
#pragma omp parallel for schedule(static) if (p->n_rows > 4)
    for (int r = 0; r < p->n_rows; r++) {
        const float *g = gu + (size_t)r * 2 * F, *u = g + F;
        float *o = out + (size_t)r * F;
        for (int i = 0; i < F; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static void cpu_get_rows(pd_backend *b, const pd_get_rows_params *p) {
    const float *x = p->x;
    float *out = p->out;
    for (int r = 0; r < p->n_rows; r++)
        memmove(out + (size_t)r * p->dim, x + (size_t)p->idx[r] * p->dim, sizeof(float) * (size_t)p->dim);
}

static void cpu_fill_normal(pd_backend *b, void *dst, pd_dtype dtype, size_t n, uint64_t seed, float mean, float std) {
    PD_ASSERT(dtype == PD_DTYPE_F32 || dtype == PD_DTYPE_FP8_E4M3);
    pd_rng r;
    pd_rng_seed(&r, seed);
    if (dtype == PD_DTYPE_FP8_E4M3) {
        uint8_t *d = dst;
        for (size_t i = 0; i < n; i++) d[i] = pd_fp8_e4m3_from_f32(mean + std * pd_rng_normal(&r));
        return;
    }
    float *d = dst;
    for (size_t i = 0; i < n; i++) d[i] = mean + std * pd_rng_normal(&r);
}

// Shared buffers are anonymous memfds: nothing in /dev/shm, no name another process could open.
// The exporter keeps the descriptor in the handle; a peer gets a copy only over a unix socket
// (SCM_RIGHTS, src/xfer) after it authenticated, and maps it here. The memory goes away when the
// last mapping and descriptor do (any exit, SIGKILL included).
static void *cpu_alloc_shared(pd_backend *b, size_t n, pd_buffer_handle *h, pd_err *err) {
    memset(h, 0, sizeof *h);
    snprintf(h->kind, sizeof h->kind, "memfd");
    h->n_bytes = n;
    h->pid = (int32_t)getpid();
    int fd = memfd_create("pdserve-kv", MFD_CLOEXEC);
    if (fd < 0) {
        pd_err_set(err, PD_ERR_IO, "memfd_create: %m");
        return NULL;
    }
    void *p = MAP_FAILED;
    if (ftruncate(fd, (off_t)n) == 0) p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        pd_err_set(err, PD_ERR_NOMEM, "cannot map %zu bytes of shared memory", n);
        close(fd);
        return NULL;
    }
    h->fd = fd;
    return p;
}

static void cpu_free_shared(pd_backend *b, void *p, const pd_buffer_handle *h) {
    munmap(p, h->n_bytes);
    if (h->fd >= 0) close(h->fd);
}

// Maps h->fd (a memfd received from the pool's owner). The mapping covers exactly h->n_bytes and
// is refused when the object is smaller: the size a peer announces is checked against what is
// really there, so no access past the end can happen.
static void *cpu_import(pd_backend *b, const pd_buffer_handle *h, pd_err *err) {
    if (strcmp(h->kind, "memfd") || h->fd < 0) {
        pd_err_set(err, PD_ERR_UNSUPPORTED, "the cpu backend imports only a memfd received from its owner");
        return NULL;
    }
    struct stat st;
    if (fstat(h->fd, &st) || !S_ISREG(st.st_mode) || h->n_bytes == 0 || (uint64_t)st.st_size < h->n_bytes) {
        pd_err_set(err, PD_ERR_INVALID, "shared KV pool: %llu bytes announced, %lld mapped by its owner",
                   (unsigned long long)h->n_bytes, (long long)st.st_size);
        return NULL;
    }
    void *p = mmap(NULL, h->n_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, h->fd, 0);
    if (p == MAP_FAILED) {
        pd_err_set(err, PD_ERR_IO, "cannot map the shared KV pool (%llu bytes): %m", (unsigned long long)h->n_bytes);
        return NULL;
    }
    return p;
}

static void cpu_unimport(pd_backend *b, void *p, const pd_buffer_handle *h) { munmap(p, h->n_bytes); }

static const pd_backend_iface cpu_iface = {
    .api_version = PD_BACKEND_API_VERSION,
    .name = "cpu",
    .free = cpu_free,
    .weight_dtype = PD_DTYPE_F32,
    .act_dtype = PD_DTYPE_F32,
    .mem_info = cpu_mem_info,
    .dev_alloc = cpu_dev_alloc,
    .dev_free = cpu_dev_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .memset = cpu_memset,
    .sync = cpu_sync,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .rope_kv = cpu_rope_kv,
    .attention = cpu_attention,
    .silu_mul = cpu_silu_mul,
    .get_rows = cpu_get_rows,
    .copy_blocks = NULL,
    .copy_d2d = cpu_copy,
    .fill_normal = cpu_fill_normal,
    .dev_alloc_shared = cpu_alloc_shared,
    .dev_free_shared = cpu_free_shared,
    .import = cpu_import,
    .unimport = cpu_unimport,
};

pd_backend *pd_backend_cpu_new(int n_threads) {
    cpu_backend *c = pd_calloc(1, sizeof *c);
    if (!c) return NULL;
    c->base.iface = &cpu_iface;
    c->n_threads = n_threads;
    openblas_set_num_threads(1);
    if (n_threads > 0) omp_set_num_threads(n_threads);
    return &c->base;
}
