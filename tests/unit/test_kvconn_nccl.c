// test_kvconn_nccl.c — the CPU-side logic of the layer-wise nccl KV transport (src/kvconn/nccl.c),
// on the CPU backend (its transfer-stream ops run inline, so what the GPU enqueues happens here
// at once): the per-layer KV_NCCL announcement (a valid v4 header), the gather of one layer of a
// request into its one-layer slab — scattered back exactly as the decode side does (xfer.c
// land_nccl: split, then kv_copy of that layer from slab block i into destination block i), the
// destination blocks must hold the source rows and nothing else, and the per-layer checksum
// computed with the gather must equal the destination's — and the staging pool's bookkeeping.
#include "test.h"

#include <string.h>

#include "kvconn/kvconn_impl.h"

enum { L = 3, NB = 8, BS = 4, ROW = 16 };  // a cache of 8 blocks of 4 rows of 16 bytes, 3 layers

typedef struct cache {
    pd_buffer *buf;
    void *k[L], *v[L];
} cache;

static void cache_new(pd_backend *b, cache *c, uint8_t seed) {
    size_t layer = (size_t)NB * BS * ROW;
    c->buf = pd_buffer_alloc(b, 2 * L * layer);
    PD_ASSERT(c->buf);
    uint8_t *p = pd_buffer_ptr(c->buf);
    for (size_t i = 0; i < 2 * L * layer; i++) p[i] = (uint8_t)(seed ? (i * 131u + seed) % 251u : 0);
    for (int l = 0; l < L; l++) {
        c->k[l] = p + (size_t)(2 * l) * layer;
        c->v[l] = p + (size_t)(2 * l + 1) * layer;
    }
}

static const uint8_t *row_at(void *base, int block, int row) { return (uint8_t *)base + ((size_t)block * BS + row) * ROW; }

PD_TEST(nccl_layer_gather_scatter_roundtrip) {
    pd_err err = {0};
    pd_backend *b = pd_backend_new("cpu", 0, &err);
    PD_REQUIRE(b);
    cache src, dst;
    cache_new(b, &src, 7);
    cache_new(b, &dst, 0);
    pd_kvconn *c = pd_calloc(1, sizeof *c);
    PD_REQUIRE(c);
    c->p.backend = b;
    c->p.cache = (pd_kvconn_cache){.n_layers = L, .n_blocks = NB, .block_size = BS, .row_bytes = ROW, .k = src.k, .v = src.v};
    // A request of 11 prompt tokens from position 0: 3 blocks, the last with 3 rows.
    int32_t srcb[3] = {5, 2, 7}, dstb[3] = {1, 6, 0}, rows[3] = {4, 4, 3}, idx[3] = {0, 1, 2};
    uint64_t sums[L] = {0};
    void *dk[L] = {0}, *dv[L] = {0};
    pd_kvconn_save s = {.peer_req_id = 42, .n_blocks = 3, .n_tokens = 11, .src = srcb, .dst = dstb, .rows = rows,
                        .sums = sums, .dk = dk, .dv = dv, .dst_slab = idx};
    uint64_t lb = kvc_nccl_layer_bytes(c, &s);
    PD_CHECK(lb == 2ull * 3 * BS * ROW);
    pd_buffer *stage = pd_buffer_alloc(b, (size_t)lb * L);
    PD_REQUIRE(stage);
    memset(pd_buffer_ptr(stage), 0xEE, (size_t)lb * L);
    for (int l = 0; l < L; l++) {
        pd_kvw_kv_nccl h;
        kvc_nccl_header(c, &s, l, &h);
        PD_CHECK(pd_kvw_kv_nccl_valid(&h));  // what the decoder accepts
        PD_CHECK_EQ(h.layer, l);
        PD_CHECK_EQ(h.n_layers, L);
        PD_CHECK_EQ(h.n_rows_last, 3);
        PD_CHECK(h.req_id == 42 && h.bytes == lb);
        char *slab = (char *)pd_buffer_ptr(stage) + (size_t)l * lb;
        kvc_nccl_gather(c, &s, l, slab);
        // the decode side's scatter of this layer (xfer.c land_nccl)
        void *sk[L] = {0}, *sv[L] = {0};
        pd_kvw_kv_nccl_split(&h, slab, &sk[l], &sv[l]);
        PD_CHECK((char *)sv[l] - (char *)sk[l] == (ptrdiff_t)(lb / 2));
        int32_t srows[3] = {4, 4, h.n_rows_last};
        pd_kv_copy_params kp = {.src_k = sk, .src_v = sv, .dst_k = dst.k, .dst_v = dst.v, .src_blocks = idx,
                                .dst_blocks = dstb, .n_rows = srows, .n_blocks = 3, .layer_begin = l, .layer_end = l + 1,
                                .block_size = BS, .row_bytes = ROW};
        pd_op_kv_copy(b, &kp);
    }
    pd_backend_xfer_sync(b);
    // Every transferred row landed in its destination block, in every layer, K and V; the padding
    // row of the last block and every other block stayed untouched.
    for (int l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++) {
            void *sb = kv ? src.v[l] : src.k[l], *db = kv ? dst.v[l] : dst.k[l];
            for (int i = 0; i < 3; i++)
                for (int r = 0; r < BS; r++) {
                    static const uint8_t zero[ROW];
                    const uint8_t *want = r < rows[i] ? row_at(sb, srcb[i], r) : zero;
                    if (memcmp(row_at(db, dstb[i], r), want, ROW))
                        PD_FAIL_("layer %d %c block %d row %d differs", l, kv ? 'V' : 'K', i, r);
                }
            for (int blk = 0; blk < NB; blk++) {
                if (blk == 1 || blk == 6 || blk == 0) continue;
                static const uint8_t zero[BS * ROW];
                PD_CHECK(!memcmp(row_at(db, blk, 0), zero, BS * ROW));
            }
        }
    // The per-layer checksums made with the gathers equal the decode side's over its own blocks
    // (pd_kvconn_load_verify), and differ from layer to layer.
    uint64_t got[L] = {0};
    pd_kv_checksum_params cp = {.k = dst.k, .v = dst.v, .blocks = dstb, .n_rows = rows, .n_blocks = 3, .layer_begin = 0,
                                .layer_end = L, .block_size = BS, .row_bytes = ROW, .sums = got};
    pd_op_kv_checksum(b, &cp);
    for (int l = 0; l < L; l++) PD_CHECK(sums[l] != 0 && sums[l] == got[l]);
    PD_CHECK(sums[0] != sums[1] && sums[1] != sums[2]);
    pd_buffer_free(stage);
    pd_buffer_free(src.buf);
    pd_buffer_free(dst.buf);
    pd_free(c);
    pd_backend_free(b);
}

PD_TEST(nccl_stage_pool_reuses_and_bounds) {
    pd_err err = {0};
    pd_backend *b = pd_backend_new("cpu", 0, &err);
    PD_REQUIRE(b);
    kvc_stage_pool pool = {0};
    size_t cap = 0;
    pd_buffer *a = kvc_stage_take(b, &pool, 1000, &cap);
    PD_CHECK(cap == 1000);
    pd_buffer *c2 = kvc_stage_take(b, &pool, 4000, &cap);
    PD_REQUIRE(a && c2 && a != c2);
    kvc_stage_give(&pool, a, 1000);
    kvc_stage_give(&pool, c2, 4000);
    PD_CHECK_EQ(pool.n_free, 2);
    // the smallest buffer that fits is reused (no allocation)
    PD_CHECK(kvc_stage_take(b, &pool, 900, &cap) == a);
    PD_CHECK(cap == 1000);  // its real size, given back with it
    PD_CHECK_EQ(pool.n_free, 1);
    PD_CHECK(kvc_stage_take(b, &pool, 3000, &cap) == c2);
    PD_CHECK(cap == 4000);
    PD_CHECK_EQ(pool.n_free, 0);
    kvc_stage_give(&pool, a, 1000);
    kvc_stage_give(&pool, c2, 4000);
    // too large for any: one free buffer is replaced by a fresh one of the size asked
    pd_buffer *big = kvc_stage_take(b, &pool, 10000, &cap);
    PD_REQUIRE(big);
    PD_CHECK(cap == 10000);
    PD_CHECK_EQ(pool.n_free, 1);
    memset(pd_buffer_ptr(big), 1, 10000);  // (ASan: really that large)
    kvc_stage_give(&pool, big, 10000);
    // a full pool keeps the largest buffers
    pd_buffer *x[KVC_STAGE_POOL_MAX + 1];
    size_t caps[KVC_STAGE_POOL_MAX + 1], smallest = SIZE_MAX;
    for (int i = 0; i <= KVC_STAGE_POOL_MAX; i++) {
        x[i] = kvc_stage_take(b, &pool, (size_t)(100 + i), &caps[i]);
        PD_REQUIRE(x[i] && caps[i] >= (size_t)(100 + i));
        smallest = PD_MIN(smallest, caps[i]);
    }
    PD_CHECK_EQ(pool.n_free, 0);
    for (int i = 0; i <= KVC_STAGE_POOL_MAX; i++) kvc_stage_give(&pool, x[i], caps[i]);
    PD_CHECK_EQ(pool.n_free, KVC_STAGE_POOL_MAX);
    for (int i = 0; i < pool.n_free; i++) PD_CHECK(pool.sizes[i] > smallest);  // the smallest was dropped
    kvc_stage_fini(&pool);
    PD_CHECK_EQ(pool.n_free, 0);
    pd_backend_free(b);
}
