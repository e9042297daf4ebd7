// tier_bw — the bandwidths the KV tiers' device path sits on (issue 14), on the CUDA backend:
//   h2d      pd_backend_upload of 1 GiB from pinned host memory (pd_backend_host_alloc): the
//            host->device DMA ceiling;
//   d2h      pd_backend_download of 1 GiB into pinned host memory;
//   load     pd_op_kv_copy_xfer of N blocks (Llama-3-8B geometry: 32 layers, 8 KV heads x 128,
//            bf16, 16-token blocks: 2 MiB a block) from a pinned staging area laid out like a
//            cache into scattered blocks of a device pool, then pd_backend_xfer_sync: what a tier
//            load's upload does;
//   offload  the same, device pool -> pinned staging: what an offload's copy does.
// Usage: tier_bw [n_blocks (default 256)]. Prints one line per measurement (GB/s = 1e9 B/s).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"

static double best_gbs(double bytes, double best_us) { return bytes / (best_us * 1e-6) / 1e9; }

int main(int argc, char **argv) {
    int nb = argc > 1 ? atoi(argv[1]) : 256;
    if (nb <= 0 || nb > 4096) nb = 256;
    pd_err err = {0};
    pd_backend *b = pd_backend_new("cuda", 0, &err);
    if (!b) {
        fprintf(stderr, "tier_bw: %s\n", err.msg);
        return 77;
    }
    printf("device: %s\n", pd_backend_device_name(b));
    size_t big = (size_t)1 << 30;
    void *h = pd_backend_host_alloc(b, big);
    pd_buffer *d = pd_buffer_alloc(b, big);
    if (!h || !d) return 1;
    memset(h, 1, big);
    double best = 1e30;
    for (int r = 0; r < 4; r++) {
        pd_backend_sync(b);
        int64_t t0 = pd_time_us();
        pd_backend_upload(b, pd_buffer_ptr(d), h, big);
        pd_backend_sync(b);
        double us = (double)(pd_time_us() - t0);
        if (r && us < best) best = us;
    }
    printf("h2d      pinned memcpy 1 GiB: %.2f GB/s\n", best_gbs((double)big, best));
    best = 1e30;
    for (int r = 0; r < 4; r++) {
        int64_t t0 = pd_time_us();
        pd_backend_download(b, h, pd_buffer_ptr(d), big);
        double us = (double)(pd_time_us() - t0);
        if (r && us < best) best = us;
    }
    printf("d2h      pinned memcpy 1 GiB: %.2f GB/s\n", best_gbs((double)big, best));

    // A pool of 4 * nb blocks on the device, staging of nb slots in pinned memory.
    const int L = 32, bs = 16;
    const size_t row = 8 * 128 * 2, blk = (size_t)bs * row;
    int pool_blocks = 4 * nb;
    pd_buffer *pool = pd_buffer_alloc(b, (size_t)2 * L * (size_t)pool_blocks * blk);
    uint8_t *stage = pd_backend_host_alloc(b, (size_t)2 * L * (size_t)nb * blk);
    if (!pool || !stage) return 1;
    memset(stage, 3, (size_t)2 * L * (size_t)nb * blk);
    void **pk = malloc(sizeof(void *) * L), **pv = malloc(sizeof(void *) * L);
    void **sk = malloc(sizeof(void *) * L), **sv = malloc(sizeof(void *) * L);
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)nb), *blocks = malloc(sizeof(int32_t) * (size_t)nb);
    int32_t *rows = malloc(sizeof(int32_t) * (size_t)nb);
    for (int l = 0; l < L; l++) {
        pk[l] = (char *)pd_buffer_ptr(pool) + (size_t)(2 * l) * (size_t)pool_blocks * blk;
        pv[l] = (char *)pd_buffer_ptr(pool) + (size_t)(2 * l + 1) * (size_t)pool_blocks * blk;
        sk[l] = stage + (size_t)(2 * l) * (size_t)nb * blk;
        sv[l] = stage + (size_t)(2 * l + 1) * (size_t)nb * blk;
    }
    for (int i = 0; i < nb; i++) slots[i] = i, blocks[i] = (int32_t)((i * 7919) % pool_blocks), rows[i] = bs;
    double bytes = (double)nb * 2 * L * (double)blk;
    for (int dir = 0; dir < 2; dir++) {
        best = 1e30;
        for (int r = 0; r < 4; r++) {
            pd_backend_sync(b);
            pd_backend_xfer_sync(b);
            int64_t t0 = pd_time_us();
            pd_kv_copy_params kp = {.src_k = dir ? pk : sk, .src_v = dir ? pv : sv, .dst_k = dir ? sk : pk,
                                    .dst_v = dir ? sv : pv, .src_blocks = dir ? blocks : slots,
                                    .dst_blocks = dir ? slots : blocks, .n_rows = rows, .n_blocks = nb,
                                    .layer_begin = 0, .layer_end = L, .block_size = bs, .row_bytes = row};
            pd_backend_xfer_mark(b);
            pd_op_kv_copy_xfer(b, &kp);
            pd_backend_xfer_sync(b);
            double us = (double)(pd_time_us() - t0);
            if (r && us < best) best = us;
        }
        printf("%s kv_copy_xfer %d blocks (%.0f MiB, Llama-3-8B bf16): %.2f GB/s\n",
               dir ? "offload " : "load    ", nb, bytes / (1 << 20), best_gbs(bytes, best));
    }
    pd_backend_host_free(b, stage);
    pd_backend_host_free(b, h);
    pd_buffer_free(pool);
    pd_buffer_free(d);
    pd_backend_free(b);
    return 0;
}
