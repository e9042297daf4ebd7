// tiers.c — the engine's half of the KV tiers below the device pool (host DRAM, local disk, a Redis
// pool shared by every worker). It talks to the tier connector (kvconn/kvconn.h, "KV tiers") only.
//
//   offload   every block that becomes full and cached in the device pool (a STORED event of
//             kv/, drained right after the step or command that cached it, before anything can
//             reallocate the block) is offered to the tiers: the connector copies its rows into a
//             job and returns; encoding and writes run on the tier thread. The step loop never
//             waits on a tier.
//   lookup    at submit (and when a prefill worker takes a request from a decode worker), the
//             prompt's chained block hashes are probed without waiting (no Redis round trip here);
//             the scheduler loads the blocks beyond the device prefix hit (LOADING_TIER).
//   load      plan->tier_loads ─► pd_kvconn_tiers_start_load (decodes into the reserved blocks on
//             the tier thread; a device cache: into pinned staging, uploaded on the transfer stream
//             by pd_kvconn_tiers_loaded, ordered before the next step's compute) ─► TIER_LOADED
//             event ─► pd_sched_tier_loaded(n): the request runs
//             on from what arrived (a tier that lost a block, or a corrupted page, loads less and
//             the rest is computed). Other requests keep stepping meanwhile.
//   same step when the hot DRAM tier (a device cache) holds every block of a load, it ends inside
//             the step that admitted it: pd_kvconn_tiers_load_now enqueues the one copy with a
//             fence this step's compute waits on, and pd_sched_tier_loaded_now puts the request
//             into the step's plan from the loaded position on, like a device prefix-cache hit
//             (no extra step in LOADING_TIER; PDSERVE_KV_TIER_SAMESTEP=0: off). A load that
//             found nothing to load is computed in that step too. The step's copies go out
//             together at pd_tiers_step_begin, layer by layer: the compute of layer l waits (on
//             the device, pd_batch.before_layer) for layer l's copy only, so the copy of later
//             layers overlaps the compute of earlier ones (PDSERVE_KV_TIER_LAYERWISE=0: one copy
//             and a fence per load, enqueued at the schedule).
#include <stdlib.h>
#include <string.h>

#include "engine/engine_impl.h"

static void on_tier_event(void *ud, pd_kvconn_event *ev) {
    pd_engine *e = ud;
    pd_cmd *c = NULL;
    for (int i = 0; i < 100 && !c; i++) c = pd_calloc(1, sizeof *c);  // the blocks wait for this event
    PD_ASSERT(c);
    c->kind = PD_CMD_XFER;
    c->kev = ev;
    pd_queue_push_cmd(&e->q, c);
}

pd_status pd_tiers_init(pd_engine *e, pd_kvw_fingerprint fp, pd_err *err) {
    const pd_engine_params *p = &e->params;
    if (!p->kv_offload_dram_bytes && !p->kv_offload_disk_dir && !p->kv_remote_url) return PD_OK;
    if (!p->enable_prefix_caching)
        return pd_err_set(err, PD_ERR_INVALID, "the KV tiers (--kv-offload-*, --kv-remote) need prefix caching");
    const pd_model_config *c = pd_model_get_config(e->model);
    pd_kvconn_tier_params tp = {.dram_bytes = p->kv_offload_dram_bytes, .disk_dir = p->kv_offload_disk_dir,
                                .disk_bytes = p->kv_offload_disk_bytes, .remote_url = p->kv_remote_url, .secret = p->kv_secret,
                                .dtype = p->kv_offload_dtype, .fp = fp, .backend = e->backend,
                                .on_event = on_tier_event, .ud = e};
    tp.cache = (pd_kvconn_cache){.n_layers = c->n_layers, .n_blocks = pd_model_cache_n_blocks(e->cache),
                                 .block_size = p->block_size, .row_bytes = pd_model_kv_row_bytes(e->model),
                                 .k = e->layer_k, .v = e->layer_v, .buffer = pd_model_cache_buffer(e->cache)};
    e->tiers = pd_kvconn_tiers_new(&tp, err);
    if (!e->tiers) return err ? err->status : PD_ERR_INVALID;
    const char *ss = getenv("PDSERVE_KV_TIER_SAMESTEP");  // "0": every load ends in a later step
    e->tier_same_step = !(ss && !strcmp(ss, "0"));
    pd_kvconn_tiers_stats ts;
    pd_kvconn_tiers_stats_get(e->tiers, &ts);
    char names[64] = "";
    for (int i = 0; i < ts.n_tiers; i++) {
        size_t n = strlen(names);
        snprintf(names + n, sizeof names - n, "%s%s", i ? " > " : "", ts.tier[i].name);
    }
    PD_LOG_I("engine: KV tiers %s (DRAM pages in %s host memory; disk/remote pages %s; %s)", names,
             ts.dram_pinned ? "pinned" : "plain", ts.dtype,
             ts.staging_slots ? "device cache: staged through pinned slots on the transfer stream" : "host cache: direct");
    if (ts.staging_slots) PD_LOG_I("engine: KV tier staging: %d block slots", ts.staging_slots);
    return PD_OK;
}

void pd_tiers_fini(pd_engine *e) {
    if (e->tiers)
        PD_LOG_I("engine: KV tier loads: %lld done, %lld of them inside the admitting step (hot DRAM), %lld tokens",
                 (long long)e->n_tier_loads_done, (long long)e->n_tier_loads_now, (long long)e->n_tier_hit_tokens);
    pd_kvconn_tiers_free(e->tiers);  // loads still queued write into the cache: before it goes
    e->tiers = NULL;
}

void pd_tiers_req_fini(ereq *q) {
    pd_free(q->tier_hashes);
    q->tier_hashes = NULL;
    q->n_tier_hashes = 0;
}

int32_t pd_tiers_req_init(pd_engine *e, ereq *q, const int32_t *prompt, int n_prompt) {
    if (!e->tiers) return 0;
    int bs = e->params.block_size, nb = n_prompt / bs;
    if (nb <= 0) return 0;
    pd_tiers_req_fini(q);
    q->tier_hashes = pd_malloc(sizeof(pd_hash128) * (size_t)nb);
    if (!q->tier_hashes) return 0;  // no tier lookup: computed like any prompt
    pd_hash128 h = {0};
    for (int b = 0; b < nb; b++) {  // the chain kv/ computes (cache key 0: the plain model)
        h = pd_hash_block(b ? &h : NULL, prompt + (size_t)b * (size_t)bs, bs);
        q->tier_hashes[b] = h;
    }
    q->n_tier_hashes = nb;
    return pd_kvconn_tiers_match(e->tiers, q->tier_hashes, nb, NULL, NULL) * bs;
}

void pd_tiers_start_loads(pd_engine *e, pd_step_plan *plan) {
    int bs = e->params.block_size;
    for (int i = 0; i < plan->n_tier_loads; i++) {
        const pd_step_kv_load *l = &plan->tier_loads[i];
        uint64_t id = l->req_id;
        ereq *q = pd_engine_req_find(e, id);
        int first = l->n_tokens_local / bs, nb = l->n_tokens / bs - first;
        pd_status st = PD_ERR_INVALID;
        bool ok = q && q->tier_hashes && l->n_tokens / bs <= q->n_tier_hashes && nb > 0;
        int64_t t0 = pd_time_us();
        // The hot DRAM tier holds it all: one copy enqueued now, before this step's compute (the
        // fence), and the request computes its remaining tokens in this very step.
        if (ok && e->tier_same_step &&
            pd_kvconn_tiers_load_now(e->tiers, q->tier_hashes + first, l->block_ids + first, nb) == nb) {
            PD_ASSERT(pd_sched_tier_loaded_now(e->sched, plan, id, nb * bs) == PD_OK);  // (l may be stale now)
            if (!q->t_sched_us) q->t_sched_us = t0;
            e->n_tier_loads_done++;
            e->n_tier_loads_now++;
            e->n_tier_hit_tokens += (int64_t)nb * bs;
            e->tier_load_us += pd_time_us() - t0;
            q->n_tier_loaded += nb * bs;
            continue;
        }
        if (ok) st = pd_kvconn_tiers_start_load(e->tiers, id, q->tier_hashes + first, l->block_ids + first, nb);
        if (st == PD_OK) {
            q->is_tier_loading = true;
            q->tier_t0_us = t0;
            if (!q->t_sched_us) q->t_sched_us = q->tier_t0_us;
            continue;
        }
        // Nothing to load after all: computed instead (in this step where the hot path is on).
        if (e->tier_same_step) PD_ASSERT(pd_sched_tier_loaded_now(e->sched, plan, id, 0) == PD_OK);
        else PD_ASSERT(pd_sched_tier_loaded(e->sched, id, 0) == PD_OK);
    }
}

static void before_layer(void *ud, int layer) {
    pd_engine *e = ud;
    pd_kvconn_tiers_layer_wait(e->tiers, layer);
}

void pd_tiers_step_begin(pd_engine *e, pd_batch *batch) {
    if (!e->tiers) return;
    if (pd_kvconn_tiers_load_now_commit(e->tiers, batch != NULL) > 0) {
        batch->before_layer = before_layer;
        batch->before_layer_ud = e;
    }
}

void pd_tiers_step_end(pd_engine *e) {
    if (e->tiers) pd_kvconn_tiers_step_end(e->tiers);
}

// A load ended (engine thread).
void pd_tiers_handle(pd_engine *e, pd_kvconn_event *ev) {
    int bs = e->params.block_size;
    pd_kvconn_tiers_loaded(e->tiers, ev);  // a device cache: the upload is enqueued before any next step
    ereq *q = pd_engine_req_find(e, ev->req_id);
    pd_status st = pd_sched_tier_loaded(e->sched, ev->req_id, ev->n_blocks * bs);
    if (st == PD_ERR_INVALID) st = pd_sched_tier_loaded(e->sched, ev->req_id, 0);  // never more than asked
    e->n_tier_loads_done++;
    if (!q) return;
    q->is_tier_loading = false;
    if (st == PD_ERR_CLOSED || q->is_aborted) {
        pd_engine_req_remove(e, q->id);  // aborted while loading: its blocks are free now
        return;
    }
    if (st == PD_OK) {
        e->n_tier_hit_tokens += (int64_t)ev->n_blocks * bs;
        e->tier_load_us += pd_time_us() - q->tier_t0_us;
        q->n_tier_loaded += ev->n_blocks * bs;
    }
}

// Moves kv/'s pending events to the router's log, offering every newly cached block to the tiers
// first. Called right after anything that caches blocks (a step's update, commands), before the
// next schedule can reallocate them.
void pd_tiers_drain_kv_events(pd_engine *e) {
    pd_kv_event kev[256];
    int n_kev;
    while ((n_kev = pd_kv_events_drain(e->kv, kev, 256)) > 0) {
        if (e->tiers)
            for (int i = 0; i < n_kev; i++)
                if (kev[i].type == PD_KV_EVENT_STORED) pd_kvconn_tiers_save(e->tiers, kev[i].block_id, kev[i].hash, kev[i].parent_hash);
        if (e->tiers) pd_kvconn_tiers_poll(e->tiers);  // a device cache: one copy for the batch, before any reuse
        pthread_mutex_lock(&e->q.mu);
        for (int i = 0; i < n_kev; i++) {
            pd_wire_kv_event_type t = kev[i].type == PD_KV_EVENT_STORED    ? PD_WIRE_KV_STORED
                                      : kev[i].type == PD_KV_EVENT_REMOVED ? PD_WIRE_KV_REMOVED
                                                                           : PD_WIRE_KV_ALL_CLEARED;
            pd_wire_kv_log_push(e->kv_log, t, kev[i].hash, kev[i].parent_hash, kev[i].n_tokens);
        }
        pthread_mutex_unlock(&e->q.mu);
    }
    if (!e->tiers) return;
    pd_kvconn_tiers_poll(e->tiers);  // copies that finished go to the tier thread
    // The tiers' own changes (written, evicted), so a router can price a tier hit at its load time.
    pd_kvconn_tier_event tev[256];
    int bs = e->params.block_size;
    while ((n_kev = pd_kvconn_tiers_events_drain(e->tiers, tev, 256)) > 0) {
        pthread_mutex_lock(&e->q.mu);
        for (int i = 0; i < n_kev; i++) {
            pd_wire_tier t = tev[i].kind == PD_KVCONN_TIER_DRAM   ? PD_WIRE_TIER_DRAM
                             : tev[i].kind == PD_KVCONN_TIER_DISK ? PD_WIRE_TIER_DISK
                                                                  : PD_WIRE_TIER_REMOTE;
            pd_wire_kv_log_push_tier(e->kv_log, tev[i].is_stored ? PD_WIRE_KV_STORED : PD_WIRE_KV_REMOVED, t, tev[i].hash,
                                     tev[i].parent, bs);
        }
        pthread_mutex_unlock(&e->q.mu);
    }
}

void pd_tiers_stats(pd_engine *e, pd_engine_stats *o) {
    o->n_tier_hit_tokens = e->n_tier_hit_tokens;
    o->n_tier_loads_done = e->n_tier_loads_done;
    o->tier_load_us_total = e->tier_load_us;
    if (!e->tiers) return;
    pd_kvconn_tiers_stats ts;
    pd_kvconn_tiers_stats_get(e->tiers, &ts);
    o->n_tiers = PD_MIN(ts.n_tiers, PD_ENGINE_MAX_TIERS);
    for (int i = 0; i < o->n_tiers; i++) {
        const pd_kvconn_tier_stat *s = &ts.tier[i];
        pd_engine_tier_stats *d = &o->tiers[i];
        memcpy(d->name, s->name, sizeof d->name);
        d->hits = s->hits, d->misses = s->misses, d->puts = s->puts, d->put_failures = s->put_failures;
        d->evictions = s->evictions, d->bad_pages = s->bad_pages, d->bytes_in = s->bytes_in, d->bytes_out = s->bytes_out;
        d->bytes_used = s->bytes_used, d->capacity = s->capacity, d->n_items = s->n_items;
        memcpy(d->load_hist, s->load_hist, sizeof d->load_hist);
    }
    o->tier_offloads = ts.offloads_done;
    o->tier_offloads_dropped = ts.offloads_dropped;
    o->tier_loads = ts.loads;
    o->tier_load_blocks = ts.load_blocks;
    o->tier_promotions = ts.promotions;
    _Static_assert(sizeof o->tier_remote_notify == sizeof ts.remote_notify, "notify counters");
    memcpy(o->tier_remote_notify, ts.remote_notify, sizeof o->tier_remote_notify);
    memcpy(o->tier_dtype, ts.dtype, sizeof o->tier_dtype);
}
