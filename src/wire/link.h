// wire/link — the disaggregation cost model that the decode worker decides with and the router
// routes with (docs/design.md, "Link-aware disaggregation"). Pure: numbers in, predictions out
// (no I/O, no clock); plus its JSON form (PRESENCE "disagg", /status, /internal/state).
//
// Local prefill (the decode worker's own step-time model, fitted over its measured steps):
//   steps(n)   = ceil((n + local_queue_tokens) / chunk_tokens)
//   local(n)   = steps(n) × local_a_us + (n + local_queue_tokens) × local_b_us
// Remote prefill over link i (the prefill worker's measured compute model, the link's measured
// latency and bandwidth, the work this decode worker has queued there):
//   remote(n)  = queue_us + ceil(n / remote_chunk) × remote_a_us + n × remote_b_us + rtt_us
//                + f × n × bytes_per_token / bw
// bw and rtt come from the probe at connect (three sizes: latency and bandwidth) and the pings; f
// from the real transfers (the part of the link time not hidden behind the prefill worker's compute
// by layer-wise shipping; 1 until measured); the remote step-time model is the prefill worker's own
// (it sends it with every probe answer), else its compute per prompt token in the real transfers.
// The decode worker hands a prompt off when min_i remote_i(n) < local(n) (and it is at least
// --disagg-min-tokens long). flip_tokens(i) is the smallest n for which remote_i wins (-1: none up
// to max_tokens). Unknown numbers (< 0) make a prediction unknown (-1); the remote compute model
// falls back to the local one (same model, same kind of machine) until the link has measured one.
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

// Exponentially weighted least squares y = a + b·x (alpha: weight of the newest sample).
typedef struct pd_link_fit {
    double w, sx, sy, sxx, sxy;
    int64_t n;
} pd_link_fit;
void pd_link_fit_add(pd_link_fit *f, double x, double y, double alpha);
// false with fewer than 2 samples. With a single x value seen, a = 0 and b = mean y / x (exact at
// that x: a worker whose steps all carry the same number of tokens). a >= 0, b >= 0.
bool pd_link_fit_get(const pd_link_fit *f, double *a, double *b);

#define PD_LINK_MAX 16
#define PD_LINK_PEER_MAX 64

typedef struct pd_link_stats {     // one decode ↔ prefill pair, as the decode worker measured it
    char peer[PD_LINK_PEER_MAX];   // the prefill worker's KV address
    bool is_healthy;
    double rtt_us;                 // EMA of ping round trips (probe at connect + heartbeats); < 0 unknown
    double bw_bytes_per_s;         // EMA: probe at connect, then real transfers; < 0 unknown
    double remote_a_us, remote_b_us;  // the prefill worker's step-time model (< 0 unknown)
    int32_t remote_chunk;          // its prefill budget per step (0: unknown, one step)
    double queue_us;               // our prefill work queued there now, predicted
    double xfer_factor;            // measured share of the link time left after compute (layer-wise
                                   // overlap; EMA over real transfers); < 0 unknown (1 is used)
    int64_t n_probes, n_transfers; // samples behind the numbers
} pd_link_stats;

typedef struct pd_disagg_model {
    double local_a_us, local_b_us;  // per step, per token (< 0 unknown)
    int32_t chunk_tokens;           // the local step's prefill budget (max_num_batched_tokens)
    int64_t local_queue_tokens;     // prefill tokens ahead of a new request locally
    double bytes_per_token;         // KV bytes a token moves
    int32_t min_tokens;             // --disagg-min-tokens
    int n_links;
    pd_link_stats links[PD_LINK_MAX];
} pd_disagg_model;

// Predicted microseconds, or -1 when unknown.
double pd_disagg_local_us(const pd_disagg_model *m, int64_t n);
double pd_disagg_remote_us(const pd_disagg_model *m, int link, int64_t n);
// The healthy link with the lowest remote(n) (-1: none known). out_us (may be NULL): its time.
int pd_disagg_best_link(const pd_disagg_model *m, int64_t n, double *out_us);
// Smallest n in [max(1, min_tokens), max_tokens] where remote over link beats local; -1 if none.
int64_t pd_disagg_flip_tokens(const pd_disagg_model *m, int link, int64_t max_tokens);
// Predicted prefill time of n uncached tokens as the worker would do it (min of local and the best
// link; local alone without links). -1 unknown.
double pd_disagg_predict_us(const pd_disagg_model *m, int64_t n, bool *out_remote);

// {"local_a_us":..,"local_b_us":..,"chunk_tokens":..,"local_queue_tokens":..,"bytes_per_token":..,
//  "min_tokens":..,"links":[{"peer":..,"healthy":..,"rtt_us":..,"bw_bytes_per_s":..,"remote_a_us":..,
//  "remote_b_us":..,"queue_us":..,"probes":..,"transfers":..,"flip_tokens":..}]}
// (flip_tokens up to max_tokens is informative; decoders ignore it). NULL on OOM.
json_t *pd_disagg_model_to_json(const pd_disagg_model *m, int64_t max_tokens);
// PD_OK or PD_ERR_PROTO. Missing numbers read as -1 (unknown).
pd_status pd_disagg_model_from_json(const json_t *o, pd_disagg_model *out);

#ifdef __cplusplus
}
#endif
