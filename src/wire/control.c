// control.c — JSON encode/decode of the router ↔ worker control messages (see control.h for the
// message shapes and docs/WIRE.md for the protocol), plus the worker's numbered KV event log.
//
// Decoding is strict about what it needs (types, ranges, hex) and lenient about what it does not
// know (extra fields are ignored), so a newer worker within the same version keeps working with an
// older router. All allocation goes through pd_malloc; jansson's own allocations are its business.
#include "wire/control.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

static const char *const ROLE_NAMES[] = {"both", "prefill", "decode"};

const char *pd_wire_role_str(pd_wire_role r) {
    return (unsigned)r < PD_ARRAY_LEN(ROLE_NAMES) ? ROLE_NAMES[r] : "both";
}

pd_status pd_wire_role_parse(const char *s, pd_wire_role *out) {
    for (size_t i = 0; s && i < PD_ARRAY_LEN(ROLE_NAMES); i++)
        if (!strcmp(s, ROLE_NAMES[i])) {
            *out = (pd_wire_role)i;
            return PD_OK;
        }
    return PD_ERR_INVALID;
}

void pd_wire_hash_to_hex(pd_hash128 h, char out[PD_WIRE_HASH_HEX_LEN + 1]) {
    snprintf(out, PD_WIRE_HASH_HEX_LEN + 1, "%016" PRIx64 "%016" PRIx64, h.hi, h.lo);
}

static int hex_val(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

pd_status pd_wire_hash_from_hex(const char *s, pd_hash128 *out) {
    if (!s || strlen(s) != PD_WIRE_HASH_HEX_LEN) return PD_ERR_PROTO;
    uint64_t w[2] = {0, 0};
    for (int i = 0; i < PD_WIRE_HASH_HEX_LEN; i++) {
        int v = hex_val(s[i]);
        if (v < 0) return PD_ERR_PROTO;
        w[i / 16] = (w[i / 16] << 4) | (uint64_t)v;
    }
    out->hi = w[0];
    out->lo = w[1];
    return PD_OK;
}

// ---- common decode plumbing -------------------------------------------------------------------------
// Parses buf, checks it is an object with an acceptable "v" and (if type != NULL) that "type"
// matches. Returns the new reference or NULL with err set.
static json_t *parse_msg(const char *buf, size_t len, const char *type, pd_status *st, pd_err *err) {
    json_error_t je;
    json_t *root = json_loadb(buf, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        *st = pd_err_set(err, PD_ERR_PROTO, "control: invalid JSON: %s", je.text);
        return NULL;
    }
    if (!json_is_object(root)) {
        *st = pd_err_set(err, PD_ERR_PROTO, "control: message is not a JSON object");
        goto fail;
    }
    json_t *v = json_object_get(root, "v");
    if (!json_is_integer(v) || json_integer_value(v) < 1) {
        *st = pd_err_set(err, PD_ERR_PROTO, "control: missing or bad \"v\"");
        goto fail;
    }
    if (json_integer_value(v) > PD_WIRE_CONTROL_VERSION) {
        *st = pd_err_set(err, PD_ERR_UNSUPPORTED, "control: version %" JSON_INTEGER_FORMAT
                         " is newer than %d", json_integer_value(v), PD_WIRE_CONTROL_VERSION);
        goto fail;
    }
    if (type) {
        const char *t = json_string_value(json_object_get(root, "type"));
        if (!t || strcmp(t, type)) {
            *st = pd_err_set(err, PD_ERR_PROTO, "control: expected type \"%s\"", type);
            goto fail;
        }
    }
    *st = PD_OK;
    return root;
fail:
    json_decref(root);
    return NULL;
}

// Copies a string field into out[cap]; false if missing (when required), not a string or too long.
static bool get_str(json_t *o, const char *key, char *out, size_t cap, bool required) {
    json_t *x = json_object_get(o, key);
    if (!x) {
        out[0] = 0;
        return !required;
    }
    const char *s = json_string_value(x);
    if (!s || strlen(s) >= cap) return false;
    memcpy(out, s, strlen(s) + 1);
    return true;
}

static int64_t get_int(json_t *o, const char *key, int64_t dflt) {
    json_t *x = json_object_get(o, key);
    if (json_is_integer(x)) return (int64_t)json_integer_value(x);
    if (json_is_real(x)) {  // (a double outside int64 is undefined to cast: clamp first)
        double d = json_real_value(x);
        return d != d ? dflt : d >= 9.2e18 ? INT64_MAX : d <= -9.2e18 ? INT64_MIN : (int64_t)d;
    }
    return dflt;
}

// Counters and sizes a worker reports: never negative (a hostile or broken report of -5 running
// requests must not make a worker look emptier than empty).
static int64_t get_count(json_t *o, const char *key) { return PD_MAX(0, get_int(o, key, 0)); }

static double get_num(json_t *o, const char *key, double dflt) {
    json_t *x = json_object_get(o, key);
    return json_is_number(x) ? json_number_value(x) : dflt;
}

static int32_t clamp_i32(int64_t v) {
    return v < INT32_MIN ? INT32_MIN : v > INT32_MAX ? INT32_MAX : (int32_t)v;
}

// ---- REGISTER / DEREGISTER ------------------------------------------------------------------------
json_t *pd_wire_register_to_json(const pd_wire_register *m) {
    return json_pack("{s:i, s:s, s:s, s:s, s:s, s:i}", "v", PD_WIRE_CONTROL_VERSION, "type",
                     "register", "url", m->url, "role", pd_wire_role_str(m->role), "model",
                     m->model, "block_size", (int)m->block_size);
}

pd_status pd_wire_register_decode(const char *buf, size_t len, pd_wire_register *out, pd_err *err) {
    pd_status st;
    memset(out, 0, sizeof *out);
    json_t *root = parse_msg(buf, len, NULL, &st, err);
    if (!root) return st;
    const char *t = json_string_value(json_object_get(root, "type"));
    if (t && strcmp(t, "register")) {
        st = pd_err_set(err, PD_ERR_PROTO, "register: wrong type \"%s\"", t);
        goto out;
    }
    if (!get_str(root, "url", out->url, sizeof out->url, true) || !out->url[0]) {
        st = pd_err_set(err, PD_ERR_PROTO, "register: missing or oversized \"url\"");
        goto out;
    }
    size_t n = strlen(out->url);
    while (n > 0 && out->url[n - 1] == '/') out->url[--n] = 0;
    if (strncmp(out->url, "http://", 7) != 0 || n <= 7) {
        st = pd_err_set(err, PD_ERR_PROTO, "register: \"url\" must be http://host:port");
        goto out;
    }
    char role[16];
    if (!get_str(root, "role", role, sizeof role, false)) {
        st = pd_err_set(err, PD_ERR_PROTO, "register: bad \"role\"");
        goto out;
    }
    out->role = PD_WIRE_ROLE_BOTH;
    if (role[0] && pd_wire_role_parse(role, &out->role) != PD_OK) {
        st = pd_err_set(err, PD_ERR_PROTO, "register: unknown role \"%s\"", role);
        goto out;
    }
    if (!get_str(root, "model", out->model, sizeof out->model, false)) {
        st = pd_err_set(err, PD_ERR_PROTO, "register: bad \"model\"");
        goto out;
    }
    int64_t bs = get_int(root, "block_size", 16);
    if (bs <= 0 || bs > 1 << 20) {
        st = pd_err_set(err, PD_ERR_PROTO, "register: bad \"block_size\"");
        goto out;
    }
    out->block_size = (int32_t)bs;
    st = PD_OK;
out:
    json_decref(root);
    return st;
}

json_t *pd_wire_deregister_to_json(const char *url) {
    return json_pack("{s:i, s:s, s:s}", "v", PD_WIRE_CONTROL_VERSION, "type", "deregister", "url",
                     url);
}

pd_status pd_wire_deregister_decode(const char *buf, size_t len, char *out_url, pd_err *err) {
    pd_status st;
    out_url[0] = 0;
    json_t *root = parse_msg(buf, len, NULL, &st, err);
    if (!root) return st;
    st = PD_OK;
    if (!get_str(root, "url", out_url, PD_WIRE_URL_MAX, true) || !out_url[0]) {
        st = pd_err_set(err, PD_ERR_PROTO, "deregister: missing or oversized \"url\"");
    } else {
        size_t n = strlen(out_url);
        while (n > 0 && out_url[n - 1] == '/') out_url[--n] = 0;
    }
    json_decref(root);
    return st;
}

// ---- LOAD and STATE -----------------------------------------------------------------------------------
pd_wire_load pd_wire_load_default(void) {
    pd_wire_load l;
    memset(&l, 0, sizeof l);
    l.prefill_tokens_per_s = -1;
    l.decode_step_ms = -1;
    return l;
}

const char *const pd_wire_fallback_names[PD_WIRE_N_FALLBACKS] = {"unavailable", "timeout", "worker_died",
                                                                "checksum", "error"};
const char *const pd_wire_ttft_part_names[PD_WIRE_N_TTFT_PARTS] = {"queue", "prefill", "transfer", "first_decode"};

const char *const pd_wire_tier_names[PD_WIRE_N_TIERS] = {"device", "dram", "disk", "redis"};

pd_wire_tier pd_wire_tier_parse(const char *s) {
    if (!s) return PD_WIRE_TIER_DEVICE;
    for (int i = 1; i < PD_WIRE_N_TIERS; i++)
        if (!strcmp(s, pd_wire_tier_names[i])) return (pd_wire_tier)i;
    return PD_WIRE_N_TIERS;
}

static json_t *tiers_to_json(const pd_wire_load *l) {
    json_t *list = json_array();
    for (int i = 0; list && i < l->n_tiers && i < PD_WIRE_MAX_TIERS; i++)
        json_array_append_new(list, json_pack("{s:s, s:I, s:I}", "name", l->tier_names[i], "hits", (json_int_t)l->tier_hits[i],
                                              "misses", (json_int_t)l->tier_misses[i]));
    return list ? json_pack("{s:o, s:I, s:I}", "list", list, "hit_tokens", (json_int_t)l->n_tier_hit_tokens, "load_us",
                            (json_int_t)l->tier_load_us)
                : NULL;
}

static json_t *load_extra_to_json(const pd_wire_load *l, json_t *o) {
    json_t *fb = json_object();
    for (int i = 0; fb && i < PD_WIRE_N_FALLBACKS; i++)
        json_object_set_new(fb, pd_wire_fallback_names[i], json_integer(l->n_kv_fallbacks[i]));
    json_t *d = fb ? json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:o}", "handoffs", (json_int_t)l->n_kv_handoffs,
                               "handoff_bytes", (json_int_t)l->n_kv_handoff_bytes, "handoff_us",
                               (json_int_t)l->kv_handoff_us, "local_short", (json_int_t)l->n_kv_local_short,
                               "exports", (json_int_t)l->n_kv_exports, "export_bytes",
                               (json_int_t)l->n_kv_export_bytes, "fallbacks", fb)
                   : NULL;
    json_t *t = json_pack("{s:I}", "n", (json_int_t)l->n_ttft);
    for (int i = 0; t && i < PD_WIRE_N_TTFT_PARTS; i++) {
        char k[32];
        snprintf(k, sizeof k, "%s_ms", pd_wire_ttft_part_names[i]);
        json_object_set_new(t, k, json_real(l->ttft_ms_sum[i]));
    }
    if (!o || !d || !t || json_object_set_new(o, "max_seqs", json_integer(l->n_max_seqs)) ||
        json_object_set_new(o, "max_waiting", json_integer(l->n_max_waiting)) || json_object_set_new(o, "disagg", d) ||
        json_object_set_new(o, "ttft", t)) {
        json_decref(o);
        return NULL;  // set_new stole d and t
    }
    if (l->n_tiers > 0 && json_object_set_new(o, "tiers", tiers_to_json(l))) {
        json_decref(o);
        return NULL;
    }
    return o;
}

static json_t *load_to_json(const pd_wire_load *l) {
    return load_extra_to_json(l, json_pack("{s:i, s:i, s:I, s:i, s:i, s:i, s:i, s:f, s:f, s:I, s:I, s:I}",
                     "running", (int)l->n_running, "waiting", (int)l->n_waiting,
                     "waiting_prefill_tokens", (json_int_t)l->n_waiting_prefill_tokens,
                     "kv_blocks_total", (int)l->n_kv_blocks_total, "kv_blocks_free",
                     (int)l->n_kv_blocks_free, "kv_blocks_used", (int)l->n_kv_blocks_used,
                     "kv_blocks_cached", (int)l->n_kv_blocks_cached, "prefill_tokens_per_s",
                     l->prefill_tokens_per_s, "decode_step_ms", l->decode_step_ms,
                     "prefix_query_tokens", (json_int_t)l->n_prefix_query_tokens,
                     "prefix_hit_tokens", (json_int_t)l->n_prefix_hit_tokens, "requests_finished",
                     (json_int_t)l->n_requests_finished));
}

static void load_from_json(json_t *o, pd_wire_load *l) {
    *l = pd_wire_load_default();
    if (!json_is_object(o)) return;
    l->n_running = clamp_i32(get_count(o, "running"));
    l->n_waiting = clamp_i32(get_count(o, "waiting"));
    l->n_waiting_prefill_tokens = get_count(o, "waiting_prefill_tokens");
    l->n_kv_blocks_total = clamp_i32(get_count(o, "kv_blocks_total"));
    l->n_kv_blocks_free = clamp_i32(get_count(o, "kv_blocks_free"));
    l->n_kv_blocks_used = clamp_i32(get_count(o, "kv_blocks_used"));
    l->n_kv_blocks_cached = clamp_i32(get_count(o, "kv_blocks_cached"));
    l->prefill_tokens_per_s = get_num(o, "prefill_tokens_per_s", -1);
    l->decode_step_ms = get_num(o, "decode_step_ms", -1);
    if (!(l->prefill_tokens_per_s >= 0 && l->prefill_tokens_per_s < 1e12)) l->prefill_tokens_per_s = -1;  // unknown
    if (!(l->decode_step_ms >= 0 && l->decode_step_ms < 1e9)) l->decode_step_ms = -1;
    l->n_prefix_query_tokens = get_count(o, "prefix_query_tokens");
    l->n_prefix_hit_tokens = get_count(o, "prefix_hit_tokens");
    l->n_requests_finished = get_count(o, "requests_finished");
    l->n_max_seqs = clamp_i32(get_count(o, "max_seqs"));
    l->n_max_waiting = clamp_i32(get_count(o, "max_waiting"));
    if (l->n_max_seqs < 0) l->n_max_seqs = 0;
    if (l->n_max_waiting < 0) l->n_max_waiting = 0;
    json_t *d = json_object_get(o, "disagg");
    if (json_is_object(d)) {
        l->n_kv_handoffs = get_count(d, "handoffs");
        l->n_kv_handoff_bytes = get_count(d, "handoff_bytes");
        l->kv_handoff_us = get_count(d, "handoff_us");
        l->n_kv_local_short = get_count(d, "local_short");
        l->n_kv_exports = get_count(d, "exports");
        l->n_kv_export_bytes = get_count(d, "export_bytes");
        json_t *fb = json_object_get(d, "fallbacks");
        for (int i = 0; i < PD_WIRE_N_FALLBACKS; i++) l->n_kv_fallbacks[i] = get_count(fb, pd_wire_fallback_names[i]);
    }
    json_t *tr = json_object_get(o, "tiers");
    if (json_is_object(tr)) {
        json_t *list = json_object_get(tr, "list");
        for (size_t i = 0; json_is_array(list) && i < json_array_size(list) && i < PD_WIRE_MAX_TIERS; i++) {
            json_t *x = json_array_get(list, i);
            const char *nm = json_string_value(json_object_get(x, "name"));
            snprintf(l->tier_names[i], sizeof l->tier_names[i], "%s", nm ? nm : "?");
            l->tier_hits[i] = get_count(x, "hits");
            l->tier_misses[i] = get_count(x, "misses");
            l->n_tiers = (int32_t)i + 1;
        }
        l->n_tier_hit_tokens = get_count(tr, "hit_tokens");
        l->tier_load_us = get_count(tr, "load_us");
    }
    json_t *t = json_object_get(o, "ttft");
    if (json_is_object(t)) {
        l->n_ttft = get_count(t, "n");
        for (int i = 0; i < PD_WIRE_N_TTFT_PARTS; i++) {
            char k[32];
            snprintf(k, sizeof k, "%s_ms", pd_wire_ttft_part_names[i]);
            l->ttft_ms_sum[i] = get_num(t, k, 0);
        }
    }
}

static const char *const EVENT_NAMES[] = {NULL, "stored", "removed", "all_cleared"};

static json_t *event_to_json(const pd_wire_kv_event *e) {
    char h[PD_WIRE_HASH_HEX_LEN + 1], p[PD_WIRE_HASH_HEX_LEN + 1];
    const char *name = (unsigned)e->type < PD_ARRAY_LEN(EVENT_NAMES) ? EVENT_NAMES[e->type] : NULL;
    if (!name) name = "all_cleared";  // unknown type: the safe interpretation for a consumer
    pd_wire_hash_to_hex(e->hash, h);
    pd_wire_hash_to_hex(e->parent_hash, p);
    json_t *o;
    switch (e->type) {
        case PD_WIRE_KV_STORED:
            o = json_pack("{s:I, s:s, s:s, s:s, s:i}", "seq", (json_int_t)e->seq, "type", name, "hash", h, "parent", p,
                          "n_tokens", (int)e->n_tokens);
            break;
        case PD_WIRE_KV_REMOVED:
            o = json_pack("{s:I, s:s, s:s}", "seq", (json_int_t)e->seq, "type", name, "hash", h);
            break;
        default:
            return json_pack("{s:I, s:s}", "seq", (json_int_t)e->seq, "type", name);
    }
    // A block in a tier below the device pool says which (absent: the device pool itself).
    if (o && e->tier > PD_WIRE_TIER_DEVICE && e->tier < PD_WIRE_N_TIERS &&
        json_object_set_new(o, "tier", json_string(pd_wire_tier_names[e->tier]))) {
        json_decref(o);
        return NULL;
    }
    return o;
}

json_t *pd_wire_state_to_json(const pd_wire_state *s) {
    char inst[17];
    snprintf(inst, sizeof inst, "%016" PRIx64, s->instance);
    json_t *list = json_array();
    json_t *root = NULL;
    if (!list) return NULL;
    for (int32_t i = 0; i < s->n_events; i++)
        if (json_array_append_new(list, event_to_json(&s->events[i]))) goto fail;
    root = json_pack("{s:i, s:s, s:s, s:s, s:s, s:i, s:o, s:{s:b, s:I, s:o}}", "v",
                     PD_WIRE_CONTROL_VERSION, "type", "state", "instance", inst, "model", s->model,
                     "role", pd_wire_role_str(s->role), "block_size", (int)s->block_size, "load",
                     load_to_json(&s->load), "events", "reset", (int)s->is_reset, "seq_next",
                     (json_int_t)s->seq_next, "list", list);
    return root;  // json_pack's "o" stole list (and the load object), even on failure
fail:
    json_decref(list);
    return NULL;
}

pd_status pd_wire_state_encode(const pd_wire_state *s, char **out, size_t *out_len) {
    json_t *j = pd_wire_state_to_json(s);
    if (!j) return PD_ERR_NOMEM;
    char *txt = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (!txt) return PD_ERR_NOMEM;
    *out = pd_strdup(txt);
    free(txt);  // jansson's default allocator
    if (!*out) return PD_ERR_NOMEM;
    if (out_len) *out_len = strlen(*out);
    return PD_OK;
}

static pd_status event_from_json(json_t *o, pd_wire_kv_event *e, int32_t idx, pd_err *err) {
    memset(e, 0, sizeof *e);
    if (!json_is_object(o)) return pd_err_set(err, PD_ERR_PROTO, "state: event %d is not an object", idx);
    e->seq = (uint64_t)get_int(o, "seq", 0);
    const char *t = json_string_value(json_object_get(o, "type"));
    if (!t) return pd_err_set(err, PD_ERR_PROTO, "state: event %d has no type", idx);
    e->tier = pd_wire_tier_parse(json_string_value(json_object_get(o, "tier")));
    if (!strcmp(t, "stored")) {
        e->type = PD_WIRE_KV_STORED;
        e->n_tokens = clamp_i32(get_int(o, "n_tokens", 0));
        if (pd_wire_hash_from_hex(json_string_value(json_object_get(o, "hash")), &e->hash) ||
            pd_wire_hash_from_hex(json_string_value(json_object_get(o, "parent")), &e->parent_hash))
            return pd_err_set(err, PD_ERR_PROTO, "state: event %d: bad hash", idx);
    } else if (!strcmp(t, "removed")) {
        e->type = PD_WIRE_KV_REMOVED;
        if (pd_wire_hash_from_hex(json_string_value(json_object_get(o, "hash")), &e->hash))
            return pd_err_set(err, PD_ERR_PROTO, "state: event %d: bad hash", idx);
    } else {
        // "all_cleared" and any type from the future: forgetting is always safe
        e->type = PD_WIRE_KV_ALL_CLEARED;
    }
    return PD_OK;
}

pd_status pd_wire_state_decode(const char *buf, size_t len, pd_wire_state *out, pd_err *err) {
    pd_status st;
    memset(out, 0, sizeof *out);
    out->load = pd_wire_load_default();
    json_t *root = parse_msg(buf, len, "state", &st, err);
    if (!root) return st;
    const char *inst = json_string_value(json_object_get(root, "instance"));
    if (inst) out->instance = strtoull(inst, NULL, 16);
    char role[16];
    if (!get_str(root, "model", out->model, sizeof out->model, false) ||
        !get_str(root, "role", role, sizeof role, false)) {
        st = pd_err_set(err, PD_ERR_PROTO, "state: bad model or role");
        goto out;
    }
    out->role = PD_WIRE_ROLE_BOTH;
    if (role[0]) (void)pd_wire_role_parse(role, &out->role);
    out->block_size = clamp_i32(get_int(root, "block_size", 0));
    load_from_json(json_object_get(root, "load"), &out->load);
    json_t *ev = json_object_get(root, "events");
    if (json_is_object(ev)) {
        out->is_reset = json_is_true(json_object_get(ev, "reset"));
        out->seq_next = (uint64_t)get_int(ev, "seq_next", 0);
        json_t *list = json_object_get(ev, "list");
        size_t n = json_array_size(list);
        if (n > (size_t)INT32_MAX / 2) {
            st = pd_err_set(err, PD_ERR_PROTO, "state: too many events");
            goto out;
        }
        if (n > 0) {
            out->events = pd_calloc(n, sizeof *out->events);
            if (!out->events) {
                st = pd_err_set(err, PD_ERR_NOMEM, "state: out of memory");
                goto out;
            }
        }
        for (size_t i = 0; i < n; i++) {
            st = event_from_json(json_array_get(list, i), &out->events[i], (int32_t)i, err);
            if (st != PD_OK) goto out;
            out->n_events = (int32_t)i + 1;
        }
    }
    st = PD_OK;
out:
    json_decref(root);
    return st;
}

void pd_wire_state_fini(pd_wire_state *s) {
    if (!s) return;
    pd_free(s->events);
    memset(s, 0, sizeof *s);
}

// ---- worker event log -------------------------------------------------------------------------------
struct pd_wire_kv_log {
    pd_wire_kv_event *ring;  // (capacity)
    int32_t capacity;
    uint64_t seq_next;       // seq of the next event pushed; events [seq_next - n, seq_next) are held
    int32_t n;
};

pd_wire_kv_log *pd_wire_kv_log_new(int32_t capacity) {
    if (capacity <= 0) return NULL;
    pd_wire_kv_log *l = pd_calloc(1, sizeof *l);
    if (!l) return NULL;
    l->ring = pd_calloc((size_t)capacity, sizeof *l->ring);
    if (!l->ring) {
        pd_free(l);
        return NULL;
    }
    l->capacity = capacity;
    return l;
}

void pd_wire_kv_log_free(pd_wire_kv_log *l) {
    if (!l) return;
    pd_free(l->ring);
    pd_free(l);
}

uint64_t pd_wire_kv_log_push(pd_wire_kv_log *l, pd_wire_kv_event_type type, pd_hash128 hash,
                             pd_hash128 parent_hash, int32_t n_tokens) {
    return pd_wire_kv_log_push_tier(l, type, PD_WIRE_TIER_DEVICE, hash, parent_hash, n_tokens);
}

uint64_t pd_wire_kv_log_push_tier(pd_wire_kv_log *l, pd_wire_kv_event_type type, pd_wire_tier tier, pd_hash128 hash,
                                  pd_hash128 parent_hash, int32_t n_tokens) {
    pd_wire_kv_event *e = &l->ring[l->seq_next % (uint64_t)l->capacity];
    e->seq = l->seq_next;
    e->type = type;
    e->tier = tier;
    e->hash = hash;
    e->parent_hash = parent_hash;
    e->n_tokens = n_tokens;
    if (l->n < l->capacity) l->n++;
    return l->seq_next++;
}

uint64_t pd_wire_kv_log_seq_next(const pd_wire_kv_log *l) { return l->seq_next; }

pd_status pd_wire_kv_log_read(const pd_wire_kv_log *l, uint64_t since, int32_t n_max,
                              pd_wire_state *s) {
    uint64_t oldest = l->seq_next - (uint64_t)l->n;
    s->is_reset = since < oldest || since > l->seq_next;
    uint64_t from = s->is_reset ? oldest : since;
    uint64_t n = l->seq_next - from;
    if (n_max >= 0 && n > (uint64_t)n_max) n = (uint64_t)n_max;
    pd_free(s->events);
    s->events = NULL;
    s->n_events = 0;
    if (n > 0) {
        s->events = pd_malloc((size_t)n * sizeof *s->events);
        if (!s->events) return PD_ERR_NOMEM;
    }
    for (uint64_t i = 0; i < n; i++) s->events[i] = l->ring[(from + i) % (uint64_t)l->capacity];
    s->n_events = (int32_t)n;
    s->seq_next = from + n;
    return PD_OK;
}

// ---- helpers ------------------------------------------------------------------------------------------
pd_status pd_wire_token_ids_decode(const char *buf, size_t len, int32_t **out, int32_t *out_n,
                                   pd_err *err) {
    *out = NULL;
    *out_n = 0;
    json_error_t je;
    json_t *root = json_loadb(buf, len, 0, &je);
    if (!root) return pd_err_set(err, PD_ERR_PROTO, "token_ids: invalid JSON: %s", je.text);
    pd_status st = PD_OK;
    json_t *arr = json_object_get(root, "token_ids");
    size_t n = json_array_size(arr);
    if (!json_is_array(arr) || n > (size_t)INT32_MAX / 8) {
        st = pd_err_set(err, PD_ERR_PROTO, "token_ids: missing array");
        goto done;
    }
    int32_t *ids = pd_malloc((n ? n : 1) * sizeof *ids);
    if (!ids) {
        st = pd_err_set(err, PD_ERR_NOMEM, "token_ids: out of memory");
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(arr, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT32_MAX) {
            pd_free(ids);
            st = pd_err_set(err, PD_ERR_PROTO, "token_ids: element %zu is not a token id", i);
            goto done;
        }
        ids[i] = (int32_t)json_integer_value(x);
    }
    *out = ids;
    *out_n = (int32_t)n;
done:
    json_decref(root);
    return st;
}
