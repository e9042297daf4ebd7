// link.c — the disaggregation cost model (see link.h).
#include "wire/link.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

void pd_link_fit_add(pd_link_fit *f, double x, double y, double alpha) {
    double k = 1.0 - alpha;
    f->w = f->w * k + 1.0;
    f->sx = f->sx * k + x;
    f->sy = f->sy * k + y;
    f->sxx = f->sxx * k + x * x;
    f->sxy = f->sxy * k + x * y;
    f->n++;
}

bool pd_link_fit_get(const pd_link_fit *f, double *a, double *b) {
    if (f->n < 2 || f->w <= 0) return false;
    double mx = f->sx / f->w, my = f->sy / f->w;
    double var = f->sxx / f->w - mx * mx, cov = f->sxy / f->w - mx * my;
    if (!(var > 1e-9 * (1.0 + mx * mx))) {  // one x only: a and b are not separable; proportional
        if (!(mx > 0) || my < 0) return false;  // (exact at that x, which is where a chunked worker runs)
        *a = 0;
        *b = my / mx;
        return true;
    }
    double bb = cov / var, aa = my - bb * mx;
    if (bb < 0) bb = 0, aa = my;       // noise: time never falls with more tokens
    if (aa < 0) aa = 0, bb = mx > 0 ? my / mx : 0;
    *a = aa;
    *b = bb;
    return true;
}

double pd_disagg_local_us(const pd_disagg_model *m, int64_t n) {
    if (m->local_a_us < 0 || m->local_b_us < 0 || n < 0) return -1;
    int64_t tok = n + (m->local_queue_tokens > 0 ? m->local_queue_tokens : 0);
    int64_t chunk = m->chunk_tokens > 0 ? m->chunk_tokens : tok;
    int64_t steps = chunk > 0 ? (tok + chunk - 1) / chunk : 1;
    return (double)steps * m->local_a_us + (double)tok * m->local_b_us;
}

double pd_disagg_remote_us(const pd_disagg_model *m, int link, int64_t n) {
    if (link < 0 || link >= m->n_links || n < 0) return -1;
    const pd_link_stats *l = &m->links[link];
    double ra = l->remote_a_us, rb = l->remote_b_us;
    if (ra < 0 || rb < 0) ra = m->local_a_us, rb = m->local_b_us;  // not measured yet: same model
    int64_t steps = l->remote_chunk > 0 ? (n + l->remote_chunk - 1) / l->remote_chunk : 1;
    if (ra < 0 || rb < 0 || l->rtt_us < 0 || !(l->bw_bytes_per_s > 0)) return -1;
    double f = l->xfer_factor >= 0 ? l->xfer_factor : 1.0;
    return (l->queue_us > 0 ? l->queue_us : 0) + (double)(steps > 0 ? steps : 1) * ra + (double)n * rb + l->rtt_us +
           f * (double)n * m->bytes_per_token / l->bw_bytes_per_s * 1e6;
}

int pd_disagg_best_link(const pd_disagg_model *m, int64_t n, double *out_us) {
    int best = -1;
    double best_us = 0;
    for (int i = 0; i < m->n_links; i++) {
        if (!m->links[i].is_healthy) continue;
        double t = pd_disagg_remote_us(m, i, n);
        if (t >= 0 && (best < 0 || t < best_us)) best = i, best_us = t;
    }
    if (out_us) *out_us = best < 0 ? -1 : best_us;
    return best;
}

int64_t pd_disagg_flip_tokens(const pd_disagg_model *m, int link, int64_t max_tokens) {
    int64_t lo = m->min_tokens > 1 ? m->min_tokens : 1;
    if (pd_disagg_remote_us(m, link, lo) < 0 || pd_disagg_local_us(m, lo) < 0) return -1;
    // local - remote is not monotone in n (the step count is a staircase): scan. Cheap: the
    // caller's max_tokens is a context length (≤ a few 100k), evaluated only for /status.
    for (int64_t n = lo; n <= max_tokens; n++)
        if (pd_disagg_remote_us(m, link, n) < pd_disagg_local_us(m, n)) return n;
    return -1;
}

double pd_disagg_predict_us(const pd_disagg_model *m, int64_t n, bool *out_remote) {
    double local = pd_disagg_local_us(m, n), remote = -1;
    bool rem = false;
    if (n >= m->min_tokens && pd_disagg_best_link(m, n, &remote) >= 0 && (local < 0 || remote < local)) rem = true;
    if (out_remote) *out_remote = rem;
    return rem ? remote : local;
}

static json_t *num(double v) { return json_real(isfinite(v) ? v : -1); }

json_t *pd_disagg_model_to_json(const pd_disagg_model *m, int64_t max_tokens) {
    json_t *links = json_array();
    for (int i = 0; links && i < m->n_links; i++) {
        const pd_link_stats *l = &m->links[i];
        json_t *o = json_object();
        if (!o) break;
        json_object_set_new(o, "peer", json_string(l->peer));
        json_object_set_new(o, "healthy", json_boolean(l->is_healthy));
        json_object_set_new(o, "rtt_us", num(l->rtt_us));
        json_object_set_new(o, "bw_bytes_per_s", num(l->bw_bytes_per_s));
        json_object_set_new(o, "remote_a_us", num(l->remote_a_us));
        json_object_set_new(o, "remote_b_us", num(l->remote_b_us));
        json_object_set_new(o, "remote_chunk", json_integer(l->remote_chunk));
        json_object_set_new(o, "queue_us", num(l->queue_us));
        json_object_set_new(o, "xfer_factor", num(l->xfer_factor));
        json_object_set_new(o, "probes", json_integer(l->n_probes));
        json_object_set_new(o, "transfers", json_integer(l->n_transfers));
        json_object_set_new(o, "flip_tokens", json_integer(pd_disagg_flip_tokens(m, i, max_tokens)));
        json_array_append_new(links, o);
    }
    json_t *o = links ? json_object() : NULL;
    if (!o) {
        json_decref(links);
        return NULL;
    }
    json_object_set_new(o, "local_a_us", num(m->local_a_us));
    json_object_set_new(o, "local_b_us", num(m->local_b_us));
    json_object_set_new(o, "chunk_tokens", json_integer(m->chunk_tokens));
    json_object_set_new(o, "local_queue_tokens", json_integer(m->local_queue_tokens));
    json_object_set_new(o, "bytes_per_token", num(m->bytes_per_token));
    json_object_set_new(o, "min_tokens", json_integer(m->min_tokens));
    json_object_set_new(o, "links", links);
    return o;
}

static double getnum(const json_t *o, const char *k) {
    const json_t *v = json_object_get(o, k);
    return json_is_number(v) ? json_number_value(v) : -1;
}

pd_status pd_disagg_model_from_json(const json_t *o, pd_disagg_model *out) {
    memset(out, 0, sizeof *out);
    if (!json_is_object(o)) return PD_ERR_PROTO;
    out->local_a_us = getnum(o, "local_a_us");
    out->local_b_us = getnum(o, "local_b_us");
    double ct = getnum(o, "chunk_tokens"), qt = getnum(o, "local_queue_tokens"), mt = getnum(o, "min_tokens");
    out->chunk_tokens = ct > 0 && ct < 1e9 ? (int32_t)ct : 0;
    out->local_queue_tokens = qt > 0 && qt < 1e15 ? (int64_t)qt : 0;
    out->min_tokens = mt > 0 && mt < 1e9 ? (int32_t)mt : 0;
    out->bytes_per_token = getnum(o, "bytes_per_token");
    const json_t *links = json_object_get(o, "links");
    if (links && !json_is_array(links)) return PD_ERR_PROTO;
    size_t i;
    const json_t *l;
    json_array_foreach(links, i, l) {
        if (out->n_links >= PD_LINK_MAX) break;
        if (!json_is_object(l)) return PD_ERR_PROTO;
        pd_link_stats *s = &out->links[out->n_links++];
        const char *peer = json_string_value(json_object_get(l, "peer"));
        snprintf(s->peer, sizeof s->peer, "%s", peer ? peer : "");
        s->is_healthy = json_is_true(json_object_get(l, "healthy"));
        s->rtt_us = getnum(l, "rtt_us");
        s->bw_bytes_per_s = getnum(l, "bw_bytes_per_s");
        s->remote_a_us = getnum(l, "remote_a_us");
        s->remote_b_us = getnum(l, "remote_b_us");
        double rc = getnum(l, "remote_chunk");
        s->remote_chunk = rc > 0 && rc < 1e9 ? (int32_t)rc : 0;
        s->queue_us = getnum(l, "queue_us");
        s->xfer_factor = getnum(l, "xfer_factor");
        double np = getnum(l, "probes"), nt = getnum(l, "transfers");
        s->n_probes = np > 0 && np < 1e15 ? (int64_t)np : 0;  // (a double beyond int64 is undefined to cast)
        s->n_transfers = nt > 0 && nt < 1e15 ? (int64_t)nt : 0;
    }
    return PD_OK;
}
