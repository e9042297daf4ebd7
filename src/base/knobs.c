// knobs.c — the registry of environment knobs (knobs.h) and the start-up check.
#include "base/knobs.h"

#include <stdlib.h>
#include <string.h>

#define SW(n, w) {n, PD_KNOB_SWITCH, 0, 1, NULL, w}
#define INT(n, lo, hi, w) {n, PD_KNOB_INT, lo, hi, NULL, w}
#define CHOICE(n, c, w) {n, PD_KNOB_CHOICE, 0, 0, c, w}

// Sorted by name (strcmp order; test_knobs checks it). Ranges are those the reading code accepts.
static const pd_knob KNOBS[] = {
    SW("PDSERVE_KV_TIER_HOT", "KV tiers: keep hot pages on the device (default 1)"),
    SW("PDSERVE_KV_TIER_JIT", "KV tiers: just-in-time layer-wise load commits (default 0; measured no gain)"),
    INT("PDSERVE_KV_TIER_LAYERWISE", 0, 4096, "KV tiers: layers per same-step load copy (default 1; 0: one copy, one fence)"),
    SW("PDSERVE_KV_TIER_SAMESTEP", "KV tiers: a load may end in the step that needs it (default 1; 0: a later step)"),
    SW("PDSERVE_KV_TIER_STAGING", "KV tiers: the staged copy path on the cpu backend too (test hook; default 0)"),
    CHOICE("PDSERVE_LOG", "debug|info|warn", "log level (default info)"),
    {"PDSERVE_MODEL", PD_KNOB_TEXT, 0, 0, NULL, "model folder when --model is not given (default: the bundled kjv-llama-6m)"},
    SW("PDSERVE_SCHED_BACKFILL", "scheduler: admit later requests that fit past a blocked head (default 0)"),
    SW("PDSERVE_TIER_RESERVE", "scheduler: a tier load reserves the blocks of the tokens it computes (default 1)"),
    SW("PD_CUDA_ATTN_BT", "decode attention: the bf16 streaming kernel (default 1; 0: k_attn_decode_tc)"),
    SW("PD_CUDA_ATTN_EARLY", "decode attention: graph steps load K/V rows they do not write before the PDL wait (default 1)"),
    SW("PD_CUDA_ATTN_F8S", "decode attention: the fp8 streaming kernel (default 1; 0: k_attn_decode_tc_f8)"),
    INT("PD_CUDA_ATTN_F8TILES", 1, 2, "decode attention: fp8 tiles in flight (default 2)"),
    SW("PD_CUDA_ATTN_FOLD", "decode attention: split partials merged in place (default 1; 0: combine kernel)"),
    SW("PD_CUDA_ATTN_ONEWAVE", "decode attention: one wave of 8-warp blocks for small grids (default 1)"),
    SW("PD_CUDA_ATTN_PIPE", "decode attention: next step's K/V loaded during this one (default 1)"),
    SW("PD_CUDA_ATTN_PREFILL", "prefill attention: the sm_90a FA3-class kernel (default 1; 0: mma.sync kernel)"),
    SW("PD_CUDA_ATTN_TC", "decode attention: tensor-core kernels for head_dim 64/128 (default 1)"),
    INT("PD_CUDA_ATTN_WAVES", 1, 64, "decode attention: waves of blocks for the split sizing (default 1)"),
    INT("PD_CUDA_BGEMM", 0, 1, "batched-decode GEMM kernel instead of cuBLASLt (default 0; measured slower)"),
    INT("PD_CUDA_BGEMM_PER_SM", 1, 2, "batched-decode GEMM: split-K sizing (measurements)"),
    INT("PD_CUDA_BGEMM_STAGES", 4, 8, "batched-decode GEMM: ring depth, 4 or 8 (measurements)"),
    SW("PD_CUDA_EARLY_LOADS", "rmsnorm / rope_kv: loads before the PDL wait (default 1)"),
    SW("PD_CUDA_FA3_ARV", "prefill attention: copies arrive on the full barrier as they land (default: on at head_dim 128)"),
    CHOICE("PD_CUDA_FA3_DIAG", "noload|nomath|nosync", "prefill attention diagnostics (op_bench_diag builds only; wrong results)"),
    SW("PD_CUDA_FA3_DSC", "prefill attention with OVL: wgmma descriptors as 32-bit words built before the handshake (default 0; measured level)"),
    SW("PD_CUDA_FA3_KVS", "prefill attention with OVL: K and V on separate barriers (default: on at head_dim 64, off at 128)"),
    SW("PD_CUDA_FA3_LKF", "prefill attention: page lookups one per lane, rows by shuffle (default: on at head_dim 128)"),
    SW("PD_CUDA_FA3_MB", "prefill attention: the causal mask only on tiles crossing the diagonal (default 1)"),
    SW("PD_CUDA_FA3_OVL", "prefill attention: intra-warpgroup overlap (default 1; 0: session 11's default kernel)"),
    SW("PD_CUDA_FA3_PERS", "prefill attention: persistent blocks, one per SM (default 0; measured slower)"),
    SW("PD_CUDA_FA3_PP", "prefill attention: consumer ping-pong (default: on at head_dim 128, off at 64)"),
    SW("PD_CUDA_FA3_ROWP", "prefill attention: the first producer variant (measurements)"),
    SW("PD_CUDA_FA3_RSC", "prefill attention with OVL: O rescaled only when a row's max changed (default 1)"),
    SW("PD_CUDA_FA3_RSE", "prefill attention with OVL: O rescaled at the end of a turn, off the ping-pong (default 1)"),
    INT("PD_CUDA_FA3_TMA", 0, 2, "prefill attention: 1 whole pages by TMA, 2 tiles of consecutive pages by TMA (measurements)"),
    SW("PD_CUDA_FA3_VN64", "prefill attention: P.V of head_dim 128 as two n64 wgmmas (measurements)"),
    SW("PD_CUDA_FUSE_GLU", "skinny GEMM: SwiGLU fused into gate_up (default 1)"),
    INT("PD_CUDA_FUSE_MMA_FORMS", 0, 15, "fused tensor-core GEMM forms, a bit mask (default 7)"),
    INT("PD_CUDA_FUSE_MMA_MIN_M", 0, 16, "fused tensor-core GEMMs from this M (default 0: never)"),
    SW("PD_CUDA_FUSE_NORM", "skinny GEMM: rmsnorm fused into the next GEMM (default 1)"),
    INT("PD_CUDA_FUSE_NORM_MAX_M", 0, 8, "skinny GEMM: fused rmsnorm up to this M (default 2)"),
    SW("PD_CUDA_FUSE_ROPE", "skinny GEMM: RoPE + KV write fused into qkv (default 1)"),
    INT("PD_CUDA_GEMM_PF_PICK", -1, 31, "cuBLASLt: prefill plans take the heuristic's candidate k, printed (measurements)"),
    INT("PD_CUDA_GEMM_TUNE", 0, 1, "cuBLASLt candidate tuning for decode shapes (default: 32 <= M <= 128)"),
    INT("PD_CUDA_GEMM_TUNE_ALGOS", 1, 32, "cuBLASLt tuning: candidates timed (default 32)"),
    INT("PD_CUDA_GEMM_TUNE_MAX_M", 1, 65536, "cuBLASLt tuning: largest M tuned (default 128)"),
    INT("PD_CUDA_GEMM_TUNE_PF", 0, 1 << 30, "cuBLASLt prefill tuning from this M (default 0: off)"),
    INT("PD_CUDA_GEMM_TUNE_PF_ALGOS", 1, 32, "cuBLASLt prefill tuning: candidates (default 8)"),
    INT("PD_CUDA_GEMV_MAX_M", 0, 16, "stream-K GEMV kernel up to this M (default 0: off)"),
    SW("PD_CUDA_GEMV_TMA", "stream-K GEMV: TMA loads (default 1; 0: cp.async)"),
    SW("PD_CUDA_GRAPHS", "CUDA graphs for decode and verify steps (default 1)"),
    SW("PD_CUDA_GRAPH_DUMP", "print every captured CUDA graph's nodes and edges to stderr (default 0)"),
    SW("PD_CUDA_HF_ROUNDING", "bf16 roundings where transformers rounds (default 1)"),
    INT("PD_CUDA_KV_COPY_CTAS", 0, 65535, "KV copy kernel CTA cap with host memory on one side (default 16; 0: none)"),
    INT("PD_CUDA_KV_DMA", 0, 2, "KV copies by the copy engines: 1 host<->device, 2 every copy (default 0)"),
    SW("PD_CUDA_PDL", "programmatic dependent launch (default 1)"),
    SW("PD_CUDA_PROF", "bench-engine: one profiled step per prefill length, a table of its ops (default 0)"),
    INT("PD_CUDA_RMS_THREADS", 0, 1024, "rmsnorm threads per block for large M (default 0: automatic)"),
    SW("PD_CUDA_ROPE_SPLIT", "rope_kv: a token's heads split over blocks (default 1)"),
    INT("PD_CUDA_ROPE_VEC_MIN", 0, 1 << 30, "rope_kv: 16-byte kernel from this many tokens (default 256; 0: never)"),
    CHOICE("PD_CUDA_SAMPLE_CLUSTER", "0|1|2|4|8|16", "sampler: cluster size per row (default 0: sized to the batch)"),
    SW("PD_CUDA_SAMPLE_DIRECT", "sampler: rows inline, results to mapped host memory (default 1)"),
    SW("PD_CUDA_SAMPLE_FAST", "sampler: the fast paths (default 1; 0: radix passes only)"),
    SW("PD_CUDA_SAMPLE_GATHER", "sampler: gathered cluster histograms (default 1)"),
    SW("PD_CUDA_SAMPLE_POLL", "sampler: poll mapped results (default 1; 0: stream synchronize)"),
    SW("PD_CUDA_SAMPLE_TOPP2", "sampler: one-read top-p path (default 1)"),
    INT("PD_CUDA_SAMPLE_TOPP_MIN_CL", 1, 32, "sampler: top-p candidate path from this cluster size (default 1)"),
    INT("PD_CUDA_SKINNY", 0, 2, "skinny GEMM kernels: 0 off, 1 the measured rule (default), 2 every call"),
    INT("PD_CUDA_SKINNY_ASYNC", 0, 1, "skinny GEMM: weights through shared memory by cp.async (default 0)"),
    INT("PD_CUDA_SKINNY_FUSE", 0, 1, "skinny GEMM: fused decode layers (default 1)"),
    INT("PD_CUDA_SKINNY_FUSE_MAX_M", 1, 16, "skinny GEMM: fused layers up to this M (default 4)"),
    INT("PD_CUDA_SKINNY_MMA", 0, 3, "skinny tensor-core GEMM rule: 0 off, 1 measured (default), 2 every M <= 16, 3 per shape"),
    INT("PD_CUDA_SKINNY_MMA_LOADS", 16, 32, "skinny tensor-core GEMM: loads in flight per thread, 16 or 32 (default 16)"),
    INT("PD_CUDA_SKINNY_MMA_PIPE", -1, 1, "skinny tensor-core GEMM: double-buffered loads (default -1: automatic)"),
    INT("PD_CUDA_SKINNY_MMA_ROWS", 16, 32, "skinny tensor-core GEMM: rows per block, 16 or 32 (default 16)"),
    INT("PD_CUDA_SKINNY_NORM_PF", 0, 2, "skinny GEMM: fused norm weight prefetched before the PDL wait, 0 off, 1 L1 (default), 2 L2"),
    INT("PD_CUDA_SKINNY_OCC4", 0, 1, "skinny GEMM: the 128-register build at M = 5 (default 0)"),
    INT("PD_CUDA_SKINNY_PREWAIT", -1, 16, "skinny GEMM: weight-load batches before the PDL wait (default -1: all)"),
    INT("PD_CUDA_SKINNY_ROWS", 2, 4, "skinny GEMM: weight rows per block (default 4)"),
    INT("PD_CUDA_SKINNY_RULE_MAX_M", 1, 8, "skinny GEMM: the CUDA-core kernel up to this M (default 5)"),
    SW("PD_DEVICE_SAMPLING", "sample on the device where the backend can (default 1)"),
    SW("PD_KV_OVERLAP", "disaggregated handoff: ship KV layer by layer during prefill (default 1)"),
    SW("PD_MODEL_FUSE", "fused decode layers: 0 never, 1 always (default: where the backend fuses)"),
    INT("PD_MODEL_RESID_GEMM", 0, 1 << 30, "residual adds in the o/down GEMMs from this many tokens (default 0: off)"),
    SW("PD_MODEL_ROWS_DIRECT", "one-token lm_head reads x without a gather (default 1)"),
    SW("PD_SPEC_CALIB", "speculation: scale predicted gains by the realized / predicted gain per batch (default 1)"),
    SW("PD_SPEC_CALIB_TOK", "speculation: a draining batch's acceptance times its emitted / expected tokens (default 0)"),
    SW("PD_SPEC_CATCHUP_PAD", "speculation: draft catch-ups padded to warmed sizes (default 1)"),
    SW("PD_SPEC_DRAIN", "speculation: a draining batch drafts only where its finish time gains (default 1)"),
    {"PD_SPEC_DRAIN_GAIN", PD_KNOB_FLOAT, 0, 0.5, NULL, "speculation: the finish-time gain a draining batch must promise (default 0.025)"},
    INT("PD_SPEC_DRAIN_HOLD", 0, 1 << 20, "speculation: steps a drain refusal holds before it is judged again (default 8; 0: until the batch changes)"),
    {"PD_SPEC_DRAIN_Z", PD_KNOB_FLOAT, 0, 4, NULL, "speculation: a draining batch drafts only if the acceptance's lower bound (mean - z sd) pays too (default 1)"},
    SW("PD_SPEC_EVIDENCE", "speculation: session 15's evidence rules (bound, exploring at k = 1, shape prices confirmed; default 1; 0: session 14's policy)"),
    INT("PD_SPEC_EXPLORE_N", 0, 1 << 20, "speculation: drafting steps an uninformed request drafts at most 1 token at batch > 1 (default 8; 0: off)"),
    SW("PD_SPEC_IDLE_FAST", "speculation: the draft method skips steps whose choice stands (default 1)"),
    {"PD_SPEC_MIN_GAIN", PD_KNOB_FLOAT, 0, 0.5, NULL, "speculation: the gain a step must promise to draft (default 0.05)"},
    SW("PD_SPEC_POP_REQ", "speculation: a new request's prior is finished requests' acceptance (default 1; 0: recent steps')"),
    {"PD_SPEC_PRIOR_EVIDENCE", PD_KNOB_FLOAT, 0, 64, NULL, "speculation: observations a finished-requests prior counts for in the drain model's bound (default 4)"},
    SW("PD_SPEC_PROBE_GROUP", "speculation: a probe step lets every idle sequence draft (default 1; 0: one)"),
    {"PD_SPEC_PROBE_SHARE", PD_KNOB_FLOAT, 0, 0.1, NULL, "speculation: share of step time for probes (default 0.0025)"},
    SW("PD_SPEC_STATS", "speculation: log the policy's counters at engine stop (default 0)"),
    SW("PD_SPEC_WARM_TIMINGS", "speculation: time verify/draft shapes at warm-up (default 1)"),
    CHOICE("PD_UCX_DEBUG_LENGTH", "short|long", "UCX: send a wrong block length (fault-injection tests only)"),
    SW("PD_UCX_DEVICE_RMA", "UCX: allow one-sided puts into device memory (untested; default 0)"),
    SW("PD_UCX_FORCE_GATHER", "UCX: gather blocks into one buffer before sending (tests; default 0)"),
    CHOICE("PD_UCX_PATH", "tag|put", "UCX data path (default: tag for device pools, put for host pools)"),
};

const pd_knob *pd_knobs(size_t *n) {
    *n = PD_ARRAY_LEN(KNOBS);
    return KNOBS;
}

const pd_knob *pd_knob_find(const char *name) {
    size_t lo = 0, hi = PD_ARRAY_LEN(KNOBS);
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(name, KNOBS[mid].name);
        if (c == 0) return &KNOBS[mid];
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return NULL;
}

static bool choice_has(const char *choices, const char *v) {
    size_t n = strlen(v);
    for (const char *p = choices; *p;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && !strncmp(p, v, n)) return true;
        if (!bar) break;
        p = bar + 1;
    }
    return false;
}

pd_status pd_knob_check(const pd_knob *k, const char *v, pd_err *err) {
    if (!v || !*v) return PD_OK;
    switch (k->kind) {
    case PD_KNOB_SWITCH:
        if (!strcmp(v, "0") || !strcmp(v, "1")) return PD_OK;
        return pd_err_set(err, PD_ERR_INVALID, "%s=%s: want 0 or 1 -- %s", k->name, v, k->what);
    case PD_KNOB_INT: {
        long long x;
        if (pd_parse_int_in(v, (long long)k->lo, (long long)k->hi, &x)) return PD_OK;
        return pd_err_set(err, PD_ERR_INVALID, "%s=%s: want a whole number in [%.0f, %.0f] -- %s", k->name, v, k->lo, k->hi,
                          k->what);
    }
    case PD_KNOB_FLOAT: {
        double x;
        if (pd_parse_double_in(v, k->lo, k->hi, &x)) return PD_OK;
        return pd_err_set(err, PD_ERR_INVALID, "%s=%s: want a number in (%g, %g] -- %s", k->name, v, k->lo, k->hi, k->what);
    }
    case PD_KNOB_CHOICE:
        if (choice_has(k->choices, v)) return PD_OK;
        return pd_err_set(err, PD_ERR_INVALID, "%s=%s: want one of %s -- %s", k->name, v, k->choices, k->what);
    case PD_KNOB_TEXT:
        return PD_OK;
    }
    return pd_err_set(err, PD_ERR_INVALID, "%s: unknown knob kind", k->name);
}

bool pd_knob_family(const char *name) {
    static const char *const FAM[] = {"PD_CUDA_", "PD_SPEC_", "PD_MODEL_", "PD_UCX_", "PDSERVE_"};
    for (size_t i = 0; i < PD_ARRAY_LEN(FAM); i++)
        if (!strncmp(name, FAM[i], strlen(FAM[i]))) return true;
    return false;
}

// Levenshtein distance, bounded: returns cap + 1 once it is certain to exceed cap.
static int edit_distance(const char *a, const char *b, int cap) {
    size_t na = strlen(a), nb = strlen(b);
    if (na > 64 || nb > 64) return cap + 1;
    if ((na > nb ? na - nb : nb - na) > (size_t)cap) return cap + 1;
    int row[65];
    for (size_t j = 0; j <= nb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= na; i++) {
        int diag = row[0], best = row[0] = (int)i;
        for (size_t j = 1; j <= nb; j++) {
            int up = row[j];
            int v = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < v) v = up + 1;
            if (row[j - 1] + 1 < v) v = row[j - 1] + 1;
            row[j] = v;
            diag = up;
            if (v < best) best = v;
        }
        if (best > cap) return cap + 1;
    }
    return row[nb];
}

const pd_knob *pd_knob_nearest(const char *name) {
    const pd_knob *best = NULL;
    int best_d = 4;
    for (size_t i = 0; i < PD_ARRAY_LEN(KNOBS); i++) {
        int d = edit_distance(name, KNOBS[i].name, best_d - 1);
        if (d < best_d) best_d = d, best = &KNOBS[i];
    }
    return best;
}

pd_status pd_knobs_check_env(char *const *env, int *n_unknown, void (*warn)(const char *name, const pd_knob *nearest),
                             pd_err *err) {
    if (n_unknown) *n_unknown = 0;
    for (char *const *e = env; e && *e; e++) {
        const char *eq = strchr(*e, '=');
        if (!eq || eq == *e) continue;
        size_t n = (size_t)(eq - *e);
        if (n >= 128 || strncmp(*e, "PD", 2)) continue;
        char name[128];
        memcpy(name, *e, n);
        name[n] = 0;
        const pd_knob *k = pd_knob_find(name);
        if (k) {
            if (pd_knob_check(k, eq + 1, err)) return err ? err->status : PD_ERR_INVALID;
        } else if (pd_knob_family(name)) {
            if (n_unknown) (*n_unknown)++;
            if (warn) warn(name, pd_knob_nearest(name));
        }
    }
    return PD_OK;
}
