// status.c — GET /status: one self-contained HTML page (inline CSS, inline JS, inline SVG; no
// external asset) giving a live view of the disaggregated system, and GET /status.json, which the
// page polls every second.
//
// What it shows: the workers by role (decode-capable ones with running / waiting / capacity / KV
// and the KV handoffs they received, prefill ones with the KV exports they served), totals of
// rejections by class and reason and of handoff fallbacks by reason, and charts over the last
// RT_HISTORY_S seconds (one slot per unix second): TTFT per class, the TTFT breakdown (router,
// queue, prefill, transfer, first decode; mean per second, stacked), handoffs/s and GB/s, queue
// depths, rejections/s by class and fallbacks/s by reason. Every chart has a title, labelled axes
// with units and tick values.
//
// The tables and the charts' axes are rendered on the server too, so the page is useful (and
// testable with a DOM dump) before its script runs; the script then redraws everything from
// /status.json.
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "base/buf.h"
#include "router/router_impl.h"

static rt_sample *sample_now(pd_router *r) {
    int64_t now = (int64_t)time(NULL);
    rt_sample *s = &r->history[now % RT_HISTORY_S];
    if (s->t_s != now) {
        memset(s, 0, sizeof *s);
        s->t_s = now;
    }
    return s;
}

void rt_history_note(pd_router *r, int c, double ttft_ms, double e2e_ms, bool is_rejected) {
    rt_sample *s = sample_now(r);
    if (is_rejected) {
        s->n_rejected++;
        s->n_rejected_class[c]++;
        return;
    }
    s->n[c]++;
    s->ttft_ms_sum[c] += ttft_ms;
    s->e2e_ms_sum[c] += e2e_ms;
    if (ttft_ms > s->ttft_ms_max[c]) s->ttft_ms_max[c] = ttft_ms;
}

void rt_ttft_note(pd_router *r, int part, double ms) {
    if (part < 0 || part >= RT_N_TTFT_PARTS) return;
    rt_sample *s = sample_now(r);
    s->n_ttft_part[part]++;
    s->ttft_part_ms_sum[part] += ms;
}

void rt_history_queue(pd_router *r, int router_inflight, int running, int waiting) {
    rt_sample *s = sample_now(r);
    s->router_inflight = PD_MAX(s->router_inflight, router_inflight);
    s->running = PD_MAX(s->running, running);
    s->waiting = PD_MAX(s->waiting, waiting);
}

static int64_t delta(int64_t now, int64_t prev) { return now > prev ? now - prev : 0; }

void rt_history_disagg(pd_router *r, const pd_wire_load *now, const pd_wire_load *prev) {
    rt_sample *s = sample_now(r);
    s->n_handoffs += delta(now->n_kv_handoffs, prev->n_kv_handoffs);
    s->handoff_bytes += delta(now->n_kv_handoff_bytes, prev->n_kv_handoff_bytes);
    for (int i = 0; i < PD_WIRE_N_FALLBACKS; i++) s->n_fallbacks[i] += delta(now->n_kv_fallbacks[i], prev->n_kv_fallbacks[i]);
}

static const char *worker_state(const rt_worker *w) {
    if (!w->is_healthy) return "down";
    return w->has_state ? "up" : "up (no state)";
}

static int64_t sum_fallbacks(const pd_wire_load *l) {
    int64_t n = 0;
    for (int i = 0; i < PD_WIRE_N_FALLBACKS; i++) n += l->n_kv_fallbacks[i];
    return n;
}

static json_t *workers_json(const pd_router *r) {
    _Static_assert(PD_ROUTER_MAX_WORKERS <= 64, "a worker slot is a prefix-index bit");
    int64_t counts[64][4];  // per worker slot: blocks the prefix index lists (device, dram, disk, redis)
    if (r->prefix) pd_router_prefix_count(r->prefix, counts);
    else memset(counts, 0, sizeof counts);
    json_t *a = json_array();
    for (int i = 0; a && i < PD_ROUTER_MAX_WORKERS; i++) {
        const rt_worker *w = &r->workers[i];
        if (!w->is_used) continue;
        const pd_wire_load *l = &w->load;
        double hit = l->n_prefix_query_tokens > 0 ? (double)l->n_prefix_hit_tokens / (double)l->n_prefix_query_tokens : 0;
        double pred = w->n_pred_query_tokens > 0 ? (double)w->n_pred_hit_tokens / (double)w->n_pred_query_tokens : 0;
        json_t *o = json_pack("{s:s, s:s, s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:f, s:f, s:I, s:I, s:f, s:f}",
                         "url", w->url, "role", pd_wire_role_str(w->role), "state", worker_state(w),
                         "model", w->model, "running", (int)l->n_running, "waiting", (int)l->n_waiting,
                         "inflight", w->n_inflight, "kv_blocks_used", (int)l->n_kv_blocks_used,
                         "kv_blocks_total", (int)l->n_kv_blocks_total, "prefix_hit_rate", hit,
                         "predicted_hit_rate", pred, "routed", (json_int_t)w->n_routed, "failed",
                         (json_int_t)w->n_failed, "prefill_tokens_per_s", l->prefill_tokens_per_s,
                         "decode_step_ms", l->decode_step_ms);
        if (!o) continue;
        json_object_set_new(o, "observed_step_ms", json_real(w->obs_step_ms));
        json_object_set_new(o, "observed_ttft_ms_per_inflight", json_real(w->obs_ttft_per_inflight));
        json_object_set_new(o, "capacity", json_integer(w->role == PD_WIRE_ROLE_PREFILL ? 0 : rt_worker_capacity(r, w)));
        json_object_set_new(o, "max_seqs", json_integer(l->n_max_seqs));
        json_object_set_new(o, "handoffs", json_integer(l->n_kv_handoffs));
        json_object_set_new(o, "handoff_bytes", json_integer(l->n_kv_handoff_bytes));
        json_object_set_new(o, "local_short", json_integer(l->n_kv_local_short));
        json_object_set_new(o, "exports", json_integer(l->n_kv_exports));
        json_object_set_new(o, "export_bytes", json_integer(l->n_kv_export_bytes));
        json_object_set_new(o, "fallbacks", json_integer(sum_fallbacks(l)));
        if (l->n_tiers > 0) {  // KV tiers below the worker's device pool
            json_t *t = json_array();
            for (int k = 0; t && k < l->n_tiers; k++)
                json_array_append_new(t, json_pack("{s:s, s:I, s:I}", "name", l->tier_names[k], "hits",
                                                   (json_int_t)l->tier_hits[k], "misses", (json_int_t)l->tier_misses[k]));
            if (t) json_object_set_new(o, "kv_tiers", t);
            json_object_set_new(o, "tier_hit_tokens", json_integer(l->n_tier_hit_tokens));
            // What the router's prefix index lists for this worker, per place (KV events, incl. the
            // removals Redis's keyspace notifications report).
            const int64_t *nb = counts[i];
            json_object_set_new(o, "prefix_blocks", json_pack("{s:I, s:I, s:I, s:I}", "device", (json_int_t)nb[0], "dram",
                                                              (json_int_t)nb[1], "disk", (json_int_t)nb[2], "redis",
                                                              (json_int_t)nb[3]));
            json_object_set_new(o, "tier_load_us_per_token",
                                l->n_tier_hit_tokens > 0 ? json_real((double)l->tier_load_us / (double)l->n_tier_hit_tokens)
                                                         : json_null());
        }
        json_object_set_new(o, "via", json_string(w->is_nats ? "nats" : "http"));
        if (w->has_model) {  // the decode worker's link-aware model, as its last state said (wire/link.h)
            json_t *dm = pd_disagg_model_to_json(&w->model_dm, 1 << 15);  // (flip points searched up to 32k tokens)
            if (dm) json_object_set_new(o, "disagg_model", dm);
        }
        json_array_append_new(a, o);
    }
    return a;
}

static json_t *num_or_null(bool has, double v) { return has ? json_real(v) : json_null(); }

static json_t *history_json(const pd_router *r) {
    json_t *a = json_array();
    int64_t now = (int64_t)time(NULL);
    for (int64_t t = now - RT_HISTORY_S + 1; a && t <= now; t++) {
        const rt_sample *s = &r->history[t % RT_HISTORY_S];
        bool cur = s->t_s == t;
        json_t *ttft = json_array(), *e2e = json_array(), *rej = json_array(), *parts = json_array(),
               *fb = json_array();
        for (int c = 0; c < r->qos.n_classes; c++) {
            bool has = cur && s->n[c] > 0;
            json_array_append_new(ttft, num_or_null(has, has ? s->ttft_ms_sum[c] / s->n[c] : 0));
            json_array_append_new(e2e, num_or_null(has, has ? s->e2e_ms_sum[c] / s->n[c] : 0));
            json_array_append_new(rej, json_integer(cur ? s->n_rejected_class[c] : 0));
        }
        for (int p = 0; p < RT_N_TTFT_PARTS; p++) {
            bool has = cur && s->n_ttft_part[p] > 0;
            json_array_append_new(parts, num_or_null(has, has ? s->ttft_part_ms_sum[p] / s->n_ttft_part[p] : 0));
        }
        for (int i = 0; i < PD_WIRE_N_FALLBACKS; i++) json_array_append_new(fb, json_integer(cur ? s->n_fallbacks[i] : 0));
        json_t *o = json_pack("{s:I, s:o, s:o, s:i, s:o, s:o, s:I, s:f, s:o, s:i, s:i, s:i}", "t", (json_int_t)t, "ttft_ms",
                              ttft, "e2e_ms", e2e, "rejected", cur ? s->n_rejected : 0, "rejected_by_class", rej,
                              "ttft_parts_ms", parts, "handoffs", (json_int_t)(cur ? s->n_handoffs : 0), "handoff_gb",
                              cur ? (double)s->handoff_bytes / 1e9 : 0.0, "fallbacks", fb, "router_inflight",
                              cur ? s->router_inflight : 0, "running", cur ? s->running : 0, "waiting",
                              cur ? s->waiting : 0);
        if (o) json_array_append_new(a, o);
    }
    return a;
}

static json_t *rejections_json(const pd_router *r) {
    json_t *a = json_array();
    for (int c = 0; a && c < r->qos.n_classes; c++) {
        const rt_class_metrics *m = &r->cm[c];
        json_t *o = json_pack("{s:s, s:I, s:I, s:I, s:I}", "class", r->qos.classes[c].name, "requests",
                              (json_int_t)pd_metric_value(m->requests), "capacity",
                              (json_int_t)pd_metric_value(m->rejected_capacity), "slo",
                              (json_int_t)pd_metric_value(m->rejected_slo), "rate_limit",
                              (json_int_t)pd_metric_value(m->rejected_rate));
        if (o) json_array_append_new(a, o);
    }
    return a;
}

static json_t *fallbacks_json(const pd_router *r) {
    json_t *o = json_object();
    for (int i = 0; o && i < PD_WIRE_N_FALLBACKS; i++) {
        int64_t n = 0;
        for (int w = 0; w < PD_ROUTER_MAX_WORKERS; w++)
            if (r->workers[w].is_used) n += r->workers[w].load.n_kv_fallbacks[i];
        json_object_set_new(o, pd_wire_fallback_names[i], json_integer(n));
    }
    return o;
}

void rt_handle_status_json(pd_http_req *req, void *ud) {
    pd_router *r = ud;
    json_t *classes = json_array(), *parts = json_array(), *fbn = json_array();
    for (int c = 0; c < r->qos.n_classes; c++) json_array_append_new(classes, json_string(r->qos.classes[c].name));
    json_array_append_new(parts, json_string("router"));
    for (int p = 0; p < PD_WIRE_N_TTFT_PARTS; p++) json_array_append_new(parts, json_string(pd_wire_ttft_part_names[p]));
    for (int i = 0; i < PD_WIRE_N_FALLBACKS; i++) json_array_append_new(fbn, json_string(pd_wire_fallback_names[i]));
    int inflight = 0;
    for (int c = 0; c < r->qos.n_classes; c++) inflight += r->inflight_by_class[c];
    json_t *o = json_pack("{s:s, s:i, s:i, s:I, s:i, s:i, s:I, s:o, s:o, s:o, s:o, s:o, s:o, s:o}", "routing",
                          pd_router_routing_str(r->routing), "workers_healthy", rt_n_healthy(r), "decode_workers_healthy",
                          rt_n_decode_healthy(r), "capacity", (json_int_t)rt_pool_capacity(r), "inflight", inflight,
                          "connections", pd_http_server_n_connections(r->http), "prefix_index_entries",
                          (json_int_t)pd_router_prefix_n_entries(r->prefix), "classes", classes, "ttft_parts", parts,
                          "fallback_reasons", fbn, "workers", workers_json(r), "rejections", rejections_json(r),
                          "fallbacks", fallbacks_json(r), "history", history_json(r));
    if (!o) return pd_http_reply_error(req, 500, "server_error", "out of memory", NULL, NULL);
    rt_nats_info ni;
    rt_nats_info_get(r, &ni);
    json_t *nj = json_pack("{s:b, s:b, s:I, s:I, s:I, s:I, s:I}", "on", ni.is_on, "connected", ni.is_connected, "disconnects",
                           (json_int_t)ni.disconnects, "reconnects", (json_int_t)ni.reconnects, "presences",
                           (json_int_t)ni.presences, "resyncs", (json_int_t)ni.resyncs, "expired", (json_int_t)ni.expired);
    json_t *rj = nj ? json_object() : NULL;
    for (int i = 0; rj && i < RT_NATS_N_REJECTS; i++) json_object_set_new(rj, rt_nats_reject_names[i], json_integer(ni.rejected[i]));
    if (rj) {
        json_object_set_new(nj, "rejected", rj);
        json_object_set_new(nj, "bad_mac", json_integer(ni.bad_mac));
        json_object_set_new(nj, "inbox_full", json_integer(ni.inbox_full));
        json_object_set_new(nj, "verified", json_integer(ni.verified));
    }
    if (nj) json_object_set_new(o, "control", nj);
    pd_http_reply_json(req, 200, o);
    json_decref(o);
}

// ---- the page ------------------------------------------------------------------------------------------
// The server-side render's string: a pd_buf with a sticky OOM flag.
typedef struct sbuf {
    pd_buf s;
    bool is_oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    if (b->is_oom) return;
    va_list ap;
    va_start(ap, fmt);
    b->is_oom = pd_buf_vprintf(&b->s, fmt, ap) != PD_OK;
    va_end(ap);
}

// HTML-escapes s into out (bounded).
static void esc(char *out, size_t cap, const char *s) {
    size_t n = 0;
    for (; *s && n + 7 < cap; s++) {
        const char *e = *s == '<' ? "&lt;" : *s == '>' ? "&gt;" : *s == '&' ? "&amp;" : *s == '"' ? "&quot;" : NULL;
        if (e) n += (size_t)snprintf(out + n, cap - n, "%s", e);
        else out[n++] = *s;
    }
    out[n] = 0;
}

// The charts: id, title, y-axis label (with unit). The x axis is always "time (s)".
static const struct {
    const char *id, *title, *ylabel;
} CHARTS[] = {
    {"c_ttft", "Time to first token, mean per class", "TTFT (ms)"},
    {"c_parts", "TTFT breakdown, mean per part (stacked)", "time (ms)"},
    {"c_handoffs", "KV handoffs", "handoffs/s"},
    {"c_gbps", "KV handoff throughput", "GB/s"},
    {"c_queue", "Queue depths (max per second)", "requests"},
    {"c_rejects", "Rejections per class", "rejections/s"},
    {"c_fallbacks", "Handoff fallbacks per reason", "fallbacks/s"},
    {"c_e2e", "End-to-end latency, mean per class", "latency (ms)"},
};

#define CHART_W 420
#define CHART_H 200
#define STR_(x) #x
#define STR(x) STR_(x)

static const char PAGE_HEAD[] =
    "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width\">"
    "<title>pdserve router</title><style>"
    "body{font-family:system-ui,sans-serif;margin:12px 16px;color:#222;background:#fafafa;font-size:13px}"
    "h1{font-size:20px;margin:4px 0}h2{font-size:15px;margin:12px 0 6px}"
    "table{border-collapse:collapse;margin-bottom:8px}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
    "th{background:#eee}td.l,th.l{text-align:left}.up{color:#080}.down{color:#c00;font-weight:bold}"
    ".charts{display:flex;flex-wrap:wrap;gap:8px}svg{background:#fff;border:1px solid #ccc}"
    ".row{display:flex;flex-wrap:wrap;gap:24px}.legend{font-size:11px}"
    "</style></head><body><h1>pdserve router</h1><p id=\"summary\">%s</p>";

// The page script: polls /status.json each second and redraws tables and charts.
static const char PAGE_SCRIPT[] =
    "<script>\n"
    "const COLORS=['#1f77b4','#ff7f0e','#2ca02c','#d62728','#9467bd','#8c564b','#e377c2','#7f7f7f'];\n"
    "const W=" STR(CHART_W) ",H=" STR(CHART_H) ",L=52,R=10,T=30,B=34;\n"
    "function esc(s){return String(s).replace(/[&<>\"]/g,c=>({'&':'&amp;','<':'&lt;','>':'&gt;','\"':'&quot;'}[c]));}\n"
    "function nice(v){if(v<=0)return 1;const p=Math.pow(10,Math.floor(Math.log10(v)));for(const m of [1,2,2.5,5,10])if(m*p>=v)return m*p;return 10*p;}\n"
    "function fmt(v){return Number.isInteger(v)?String(v):v>=100?v.toFixed(0):v>=10?v.toFixed(1):v>=1?v.toFixed(2):v.toFixed(3);}\n"
    "// series: [{name,values:[number|null]}]; stacked: draw cumulative areas\n"
    "function chart(id,title,ylabel,series,stacked){const el=document.getElementById(id);if(!el)return;\n"
    " const n=series.length?series[0].values.length:0;let max=0;\n"
    " for(let i=0;i<n;i++){let acc=0;series.forEach(s=>{const v=s.values[i];if(v!==null){acc=stacked?acc+v:Math.max(acc,v);}});max=Math.max(max,acc);}\n"
    " max=nice(max);const x=i=>L+i*(W-L-R)/Math.max(1,n-1),y=v=>H-B-(v/max)*(H-B-T);\n"
    " let s=`<text x=\"${L}\" y=\"14\" font-size=\"12\" font-weight=\"bold\">${esc(title)}</text>`;\n"
    " s+=`<line x1=\"${L}\" y1=\"${H-B}\" x2=\"${W-R}\" y2=\"${H-B}\" stroke=\"#666\"/><line x1=\"${L}\" y1=\"${T}\" x2=\"${L}\" y2=\"${H-B}\" stroke=\"#666\"/>`;\n"
    " for(const f of [0,0.5,1]){const v=max*f,yy=y(v);s+=`<line x1=\"${L-4}\" y1=\"${yy}\" x2=\"${W-R}\" y2=\"${yy}\" stroke=\"#eee\"/><text class=\"tick\" x=\"${L-6}\" y=\"${yy+4}\" font-size=\"10\" text-anchor=\"end\">${fmt(v)}</text>`;}\n"
    " for(const k of [120,90,60,30,0]){const i=Math.max(0,n-1-k),xx=x(i);s+=`<text class=\"tick\" x=\"${xx}\" y=\"${H-B+13}\" font-size=\"10\" text-anchor=\"middle\">${k?'-'+k:'0'}</text>`;}\n"
    " s+=`<text class=\"axis-label\" x=\"${(L+W-R)/2}\" y=\"${H-4}\" font-size=\"11\" text-anchor=\"middle\">time (s, 0 = now)</text>`;\n"
    " s+=`<text class=\"axis-label\" transform=\"translate(12,${(T+H-B)/2}) rotate(-90)\" font-size=\"11\" text-anchor=\"middle\">${esc(ylabel)}</text>`;\n"
    " const base=new Array(n).fill(0);\n"
    " series.forEach((se,si)=>{const c=COLORS[si%8];let pts=[];\n"
    "  if(stacked){let top=[];for(let i=0;i<n;i++){const v=se.values[i]||0;top.push(base[i]+v);}\n"
    "   const up=top.map((v,i)=>x(i).toFixed(1)+','+y(v).toFixed(1)),down=base.map((v,i)=>x(i).toFixed(1)+','+y(v).toFixed(1)).reverse();\n"
    "   s+=`<polygon fill=\"${c}\" fill-opacity=\"0.55\" stroke=\"${c}\" points=\"${up.concat(down).join(' ')}\"/>`;for(let i=0;i<n;i++)base[i]=top[i];}\n"
    "  else{for(let i=0;i<n;i++){const v=se.values[i];if(v!==null)pts.push(x(i).toFixed(1)+','+y(v).toFixed(1));}\n"
    "   if(pts.length)s+=`<polyline fill=\"none\" stroke=\"${c}\" stroke-width=\"1.5\" points=\"${pts.join(' ')}\"/>`;}});\n"
    " let lx=L+4;series.forEach((se,si)=>{s+=`<text class=\"legend\" x=\"${lx}\" y=\"${T-4}\" font-size=\"10\" fill=\"${COLORS[si%8]}\">&#9632; ${esc(se.name)}</text>`;lx+=24+6.5*se.name.length;});\n"
    " el.innerHTML=s;}\n"
    "function col(h,f){return h.map(f);}\n"
    "async function tick(){try{const r=await fetch('/status.json');const d=await r.json();const h=d.history;\n"
    " document.getElementById('summary').textContent=`routing ${d.routing} | workers up ${d.workers_healthy} (decode-capable ${d.decode_workers_healthy}) | capacity ${d.capacity||'unknown'} requests | in flight ${d.inflight} | client connections ${d.connections} | prefix index ${d.prefix_index_entries} blocks`;\n"
    " const dec=d.workers.filter(w=>w.role!=='prefill'),pre=d.workers.filter(w=>w.role==='prefill');\n"
    " document.querySelector('#decode tbody').innerHTML=dec.map(w=>`<tr><td class=\"l\">${esc(w.url)}</td><td class=\"l\">${w.role}</td><td class=\"l ${w.state==='down'?'down':'up'}\">${w.state}</td><td>${w.running}</td><td>${w.waiting}</td><td>${w.inflight}</td><td>${w.capacity||'?'}</td><td>${w.kv_blocks_used}/${w.kv_blocks_total}</td><td>${(100*w.prefix_hit_rate).toFixed(1)}%</td><td>${w.routed}</td><td>${w.handoffs}</td><td>${w.local_short}</td><td>${w.fallbacks}</td></tr>`).join('');\n"
    " document.querySelector('#prefill tbody').innerHTML=pre.map(w=>`<tr><td class=\"l\">${esc(w.url)}</td><td class=\"l ${w.state==='down'?'down':'up'}\">${w.state}</td><td>${w.running}</td><td>${w.waiting}</td><td>${w.exports}</td><td>${(w.export_bytes/1e9).toFixed(3)}</td><td>${w.prefill_tokens_per_s>0?w.prefill_tokens_per_s.toFixed(0):'-'}</td></tr>`).join('');\n"
    " document.querySelector('#rejections tbody').innerHTML=d.rejections.map(c=>`<tr><td class=\"l\">${esc(c.class)}</td><td>${c.requests}</td><td>${c.capacity}</td><td>${c.slo}</td><td>${c.rate_limit}</td></tr>`).join('');\n"
    " document.querySelector('#fallbacks tbody').innerHTML=d.fallback_reasons.map(k=>`<tr><td class=\"l\">${k}</td><td>${d.fallbacks[k]}</td></tr>`).join('');\n"
    " const per=(key,names)=>names.map((nm,i)=>({name:nm,values:col(h,x=>x[key][i])}));\n"
    " chart('c_ttft','Time to first token, mean per class','TTFT (ms)',per('ttft_ms',d.classes));\n"
    " chart('c_parts','TTFT breakdown, mean per part (stacked)','time (ms)',per('ttft_parts_ms',d.ttft_parts),true);\n"
    " chart('c_handoffs','KV handoffs','handoffs/s',[{name:'handoffs',values:col(h,x=>x.handoffs)}]);\n"
    " chart('c_gbps','KV handoff throughput','GB/s',[{name:'GB/s',values:col(h,x=>x.handoff_gb)}]);\n"
    " chart('c_queue','Queue depths (max per second)','requests',[{name:'router in flight',values:col(h,x=>x.router_inflight)},{name:'workers running',values:col(h,x=>x.running)},{name:'workers waiting',values:col(h,x=>x.waiting)}]);\n"
    " chart('c_rejects','Rejections per class','rejections/s',per('rejected_by_class',d.classes));\n"
    " chart('c_fallbacks','Handoff fallbacks per reason','fallbacks/s',per('fallbacks',d.fallback_reasons));\n"
    " chart('c_e2e','End-to-end latency, mean per class','latency (ms)',per('e2e_ms',d.classes));\n"
    "}catch(e){document.getElementById('summary').textContent='status.json unavailable: '+e;}}\n"
    "tick();setInterval(tick,1000);\n"
    "</script></body></html>\n";

void rt_handle_status_html(pd_http_req *req, void *ud) {
    pd_router *r = ud;
    sbuf b = {0};
    char summary[256];
    snprintf(summary, sizeof summary, "routing %s | workers up %d (decode-capable %d)", pd_router_routing_str(r->routing),
             rt_n_healthy(r), rt_n_decode_healthy(r));
    sb_printf(&b, PAGE_HEAD, summary);
    sb_printf(&b, "<div class=\"row\"><div><h2>Decode workers</h2><table id=\"decode\"><thead><tr><th class=\"l\">url</th>"
                  "<th class=\"l\">role</th><th class=\"l\">state</th><th>running</th><th>waiting</th><th>in flight</th>"
                  "<th>capacity</th><th>KV blocks used</th><th>prefix hits</th><th>routed</th><th>KV handoffs in</th>"
                  "<th>local (short)</th><th>fallbacks</th><th class=\"l\">KV tiers (hits/misses)</th></tr></thead><tbody>");
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1)
            sb_printf(&b, "</tbody></table></div><div><h2>Prefill workers</h2><table id=\"prefill\"><thead><tr>"
                          "<th class=\"l\">url</th><th class=\"l\">state</th><th>running</th><th>waiting</th>"
                          "<th>KV exports</th><th>exported (GB)</th><th>prefill tokens/s</th></tr></thead><tbody>");
        for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++) {
            const rt_worker *w = &r->workers[i];
            if (!w->is_used || (w->role == PD_WIRE_ROLE_PREFILL) != (pass == 1)) continue;
            char url[PD_WIRE_URL_MAX * 6];
            esc(url, sizeof url, w->url);
            const pd_wire_load *l = &w->load;
            double hit = l->n_prefix_query_tokens > 0 ? 100.0 * (double)l->n_prefix_hit_tokens / (double)l->n_prefix_query_tokens : 0;
            char tiers[160] = "none";
            for (int k = 0, at = 0; k < l->n_tiers && at < (int)sizeof tiers; k++)
                at += snprintf(tiers + at, sizeof tiers - (size_t)at, "%s%s %lld/%lld", k ? ", " : "", l->tier_names[k],
                               (long long)l->tier_hits[k], (long long)l->tier_misses[k]);
            char tiers_esc[sizeof tiers * 6];
            esc(tiers_esc, sizeof tiers_esc, tiers);
            if (pass == 0)
                sb_printf(&b, "<tr><td class=\"l\">%s</td><td class=\"l\">%s</td><td class=\"l %s\">%s</td><td>%d</td><td>%d</td>"
                              "<td>%d</td><td>%lld</td><td>%d/%d</td><td>%.1f%%</td><td>%lld</td><td>%lld</td><td>%lld</td>"
                              "<td>%lld</td><td class=\"l\">%s</td></tr>",
                          url, pd_wire_role_str(w->role), w->is_healthy ? "up" : "down", worker_state(w), (int)l->n_running,
                          (int)l->n_waiting, w->n_inflight, (long long)rt_worker_capacity(r, w), (int)l->n_kv_blocks_used,
                          (int)l->n_kv_blocks_total, hit, (long long)w->n_routed, (long long)l->n_kv_handoffs,
                          (long long)l->n_kv_local_short, (long long)sum_fallbacks(l), tiers_esc);
            else
                sb_printf(&b, "<tr><td class=\"l\">%s</td><td class=\"l %s\">%s</td><td>%d</td><td>%d</td><td>%lld</td>"
                              "<td>%.3f</td><td>%.0f</td></tr>",
                          url, w->is_healthy ? "up" : "down", worker_state(w), (int)l->n_running, (int)l->n_waiting,
                          (long long)l->n_kv_exports, (double)l->n_kv_export_bytes / 1e9, l->prefill_tokens_per_s);
        }
    }
    sb_printf(&b, "</tbody></table></div></div><div class=\"row\"><div><h2>Rejections by class</h2><table id=\"rejections\">"
                  "<thead><tr><th class=\"l\">class</th><th>requests</th><th>capacity</th><th>SLO</th><th>rate limit</th>"
                  "</tr></thead><tbody>");
    for (int c = 0; c < r->qos.n_classes; c++) {
        char name[200];
        esc(name, sizeof name, r->qos.classes[c].name);
        const rt_class_metrics *m = &r->cm[c];
        sb_printf(&b, "<tr><td class=\"l\">%s</td><td>%.0f</td><td>%.0f</td><td>%.0f</td><td>%.0f</td></tr>", name,
                  pd_metric_value(m->requests), pd_metric_value(m->rejected_capacity), pd_metric_value(m->rejected_slo),
                  pd_metric_value(m->rejected_rate));
    }
    sb_printf(&b, "</tbody></table></div><div><h2>Handoff fallbacks</h2><table id=\"fallbacks\"><thead><tr>"
                  "<th class=\"l\">reason</th><th>count</th></tr></thead><tbody>");
    for (int i = 0; i < PD_WIRE_N_FALLBACKS; i++) {
        int64_t n = 0;
        for (int w = 0; w < PD_ROUTER_MAX_WORKERS; w++)
            if (r->workers[w].is_used) n += r->workers[w].load.n_kv_fallbacks[i];
        sb_printf(&b, "<tr><td class=\"l\">%s</td><td>%lld</td></tr>", pd_wire_fallback_names[i], (long long)n);
    }
    sb_printf(&b, "</tbody></table></div></div><h2>Last %d seconds</h2><div class=\"charts\">", RT_HISTORY_S);
    for (size_t i = 0; i < PD_ARRAY_LEN(CHARTS); i++)  // axes and labels before the script draws the data
        sb_printf(&b, "<svg id=\"%s\" width=\"%d\" height=\"%d\"><text x=\"52\" y=\"14\" font-size=\"12\" font-weight=\"bold\">%s</text>"
                      "<text class=\"axis-label\" x=\"%d\" y=\"%d\" font-size=\"11\" text-anchor=\"middle\">time (s, 0 = now)</text>"
                      "<text class=\"axis-label\" transform=\"translate(12,%d) rotate(-90)\" font-size=\"11\" text-anchor=\"middle\">%s</text></svg>",
                  CHARTS[i].id, CHART_W, CHART_H, CHARTS[i].title, (52 + CHART_W - 10) / 2, CHART_H - 4, (30 + CHART_H - 34) / 2,
                  CHARTS[i].ylabel);
    sb_printf(&b, "</div>%s", PAGE_SCRIPT);
    if (b.is_oom) {
        pd_buf_free(&b.s);
        return pd_http_reply_error(req, 500, "server_error", "out of memory", NULL, NULL);
    }
    pd_http_reply(req, 200, "text/html; charset=utf-8", b.s.p, b.s.len);
    pd_buf_free(&b.s);
}
