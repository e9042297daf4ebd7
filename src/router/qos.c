// qos.c — QoS classes: parsing --qos-config, choosing a request's class, reserved-capacity
// admission and per-key token buckets. Pure: no I/O, time is passed in.
//
// A class has a priority (forwarded to the worker, whose scheduler runs higher priorities first),
// a reserved share of the pool's capacity, SLOs and a per-API-key rate limit. Capacity is counted
// in concurrent requests (capacity_per_worker × healthy workers): when the pool is near capacity,
// lower classes are refused first because the admission rule keeps the unused reservations of every
// higher class free (see pd_router_qos_admit).
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "router/core_impl.h"

static void set_class(pd_router_class *c, const char *name, int prio, double reserved,
                      double ttft, double tpot) {
    memset(c, 0, sizeof *c);
    snprintf(c->name, sizeof c->name, "%s", name);
    c->priority = prio;
    c->reserved_frac = reserved;
    c->slo_ttft_ms = ttft;
    c->slo_tpot_ms = tpot;
}

void pd_router_qos_default(pd_router_qos *q, double slo_ttft_ms, double slo_tpot_ms) {
    memset(q, 0, sizeof *q);
    set_class(&q->classes[0], "premium", 2, 0.0, slo_ttft_ms, slo_tpot_ms);
    set_class(&q->classes[1], "standard", 1, 0.0, slo_ttft_ms, slo_tpot_ms);
    set_class(&q->classes[2], "free", 0, 0.0, slo_ttft_ms, slo_tpot_ms);
    q->n_classes = 3;
    q->default_class = 1;
    q->capacity_per_worker = 0;
}

int pd_router_qos_find(const pd_router_qos *q, const char *name) {
    for (int i = 0; name && i < q->n_classes; i++)
        if (!strcmp(q->classes[i].name, name)) return i;
    return -1;
}

static double num(json_t *o, const char *key, double dflt) {
    json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : dflt;
}

static pd_status parse_class(json_t *c, int idx, pd_router_class *out, double ttft, double tpot,
                             pd_err *err) {
    const char *name = json_string_value(json_object_get(c, "name"));
    if (!json_is_object(c) || !name || !*name || strlen(name) >= sizeof out->name)
        return pd_err_set(err, PD_ERR_INVALID, "qos: class %d needs a name (< 32 chars)", idx);
    double reserved = num(c, "reserved_fraction", 0);
    if (reserved < 0 || reserved > 1)
        return pd_err_set(err, PD_ERR_INVALID, "qos: class %s: reserved_fraction not in [0,1]", name);
    set_class(out, name, (int)num(c, "priority", 0), reserved, num(c, "slo_ttft_ms", ttft),
              num(c, "slo_tpot_ms", tpot));
    out->rate_limit_rps = num(c, "rate_limit_rps", 0);
    out->rate_burst = num(c, "rate_burst", 0);
    if (out->rate_burst <= 0) out->rate_burst = PD_MAX(1.0, out->rate_limit_rps);
    if (out->slo_ttft_ms < 0 || out->slo_tpot_ms < 0 || out->rate_limit_rps < 0)
        return pd_err_set(err, PD_ERR_INVALID, "qos: class %s: negative SLO or rate", name);
    return PD_OK;
}

static pd_status parse_keys(pd_router_qos *q, json_t *keys, pd_err *err) {
    const char *k;
    json_t *v;
    if (!keys) return PD_OK;
    if (!json_is_object(keys)) return pd_err_set(err, PD_ERR_INVALID, "qos: api_keys must be an object");
    json_object_foreach(keys, k, v) {
        const char *cls = json_is_string(v) ? json_string_value(v)
                                            : json_string_value(json_object_get(v, "class"));
        int ci = pd_router_qos_find(q, cls);
        if (ci < 0) return pd_err_set(err, PD_ERR_INVALID, "qos: key maps to unknown class");
        if (q->n_keys >= PD_ROUTER_MAX_KEYS || strlen(k) >= sizeof q->keys[0].key)
            return pd_err_set(err, PD_ERR_INVALID, "qos: too many or too long api keys");
        snprintf(q->keys[q->n_keys].key, sizeof q->keys[0].key, "%s", k);
        q->keys[q->n_keys++].class_idx = ci;
    }
    return PD_OK;
}

pd_status pd_router_qos_parse(pd_router_qos *q, const char *json, double slo_ttft_ms,
                              double slo_tpot_ms, pd_err *err) {
    pd_router_qos_default(q, slo_ttft_ms, slo_tpot_ms);
    json_error_t je;
    json_t *root = json_loads(json, 0, &je);
    if (!root) return pd_err_set(err, PD_ERR_INVALID, "qos: invalid JSON: %s (line %d)", je.text, je.line);
    pd_status st = PD_OK;
    json_t *classes = json_object_get(root, "classes");
    if (classes) {
        size_t n = json_array_size(classes);
        if (!json_is_array(classes) || n == 0 || n > PD_ROUTER_MAX_CLASSES) {
            st = pd_err_set(err, PD_ERR_INVALID, "qos: classes must be an array of 1..%d", PD_ROUTER_MAX_CLASSES);
            goto out;
        }
        q->n_classes = 0;
        for (size_t i = 0; i < n; i++) {
            st = parse_class(json_array_get(classes, i), (int)i, &q->classes[i], slo_ttft_ms, slo_tpot_ms, err);
            if (st != PD_OK) goto out;
            if (pd_router_qos_find(q, q->classes[i].name) >= 0) {
                st = pd_err_set(err, PD_ERR_INVALID, "qos: duplicate class %s", q->classes[i].name);
                goto out;
            }
            q->n_classes = (int)i + 1;
        }
        q->default_class = pd_router_qos_find(q, "standard");
        if (q->default_class < 0) q->default_class = 0;
    }
    double reserved = 0;
    for (int i = 0; i < q->n_classes; i++) reserved += q->classes[i].reserved_frac;
    if (reserved > 1.0 + 1e-9) {
        st = pd_err_set(err, PD_ERR_INVALID, "qos: reserved fractions add up to more than 1");
        goto out;
    }
    json_t *dc = json_object_get(root, "default_class");
    if (dc) {
        q->default_class = pd_router_qos_find(q, json_string_value(dc));
        if (q->default_class < 0) {
            st = pd_err_set(err, PD_ERR_INVALID, "qos: unknown default_class");
            goto out;
        }
    }
    double cap = num(root, "capacity_per_worker", q->capacity_per_worker);
    if (json_object_get(root, "capacity_per_worker") && (cap < 1 || cap > 1e6)) {
        st = pd_err_set(err, PD_ERR_INVALID, "qos: capacity_per_worker must be >= 1 (omit it to use the workers' reports)");
        goto out;
    }
    q->capacity_per_worker = (int)cap;
    st = parse_keys(q, json_object_get(root, "api_keys"), err);
out:
    json_decref(root);
    return st;
}

int pd_router_qos_select(const pd_router_qos *q, const char *x_priority, const char *api_key) {
    int c = pd_router_qos_find(q, x_priority);
    if (c >= 0) return c;
    for (int i = 0; api_key && i < q->n_keys; i++)
        if (!strcmp(q->keys[i].key, api_key)) return q->keys[i].class_idx;
    return q->default_class;
}

bool pd_router_qos_admit(const pd_router_qos *q, int c, const int *inflight, int capacity) {
    double need = 1;
    for (int i = 0; i < q->n_classes; i++) {
        need += inflight[i];
        if (q->classes[i].priority > q->classes[c].priority)
            need += PD_MAX(0.0, q->classes[i].reserved_frac * capacity - inflight[i]);
    }
    return need <= (double)capacity + 1e-9;
}

bool pd_router_bucket_take(pd_router_bucket *b, double rate, double burst, int64_t now_us) {
    if (rate <= 0) return true;
    if (b->t_us == 0) {
        b->tokens = burst;
    } else if (now_us > b->t_us) {
        b->tokens = PD_MIN(burst, b->tokens + rate * (double)(now_us - b->t_us) / 1e6);
    }
    b->t_us = now_us;
    if (b->tokens >= 1.0) {
        b->tokens -= 1.0;
        return true;
    }
    return false;
}
