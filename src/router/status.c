// status.c — GET /status: one self-contained HTML page (inline CSS, inline JS, inline SVG; no
// external asset) showing the workers and live latency charts, and GET /status.json, which the
// page polls every second.
//
// The worker table is rendered on the server too, so the page is useful (and testable with a DOM
// dump) before its script runs; the script then replaces it and draws the charts from the
// per-second history (RT_HISTORY_S seconds, one slot per unix second, mean TTFT / E2E per class
// and rejections).
#include <stdio.h>
#include <string.h>
#include <time.h>

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

static json_t *workers_json(const pd_router *r) {
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
        json_object_set_new(o, "observed_step_ms", json_real(w->obs_step_ms));
        json_object_set_new(o, "observed_ttft_ms_per_inflight", json_real(w->obs_ttft_per_inflight));
        json_array_append_new(a, o);
    }
    return a;
}

static json_t *history_json(const pd_router *r) {
    json_t *a = json_array();
    int64_t now = (int64_t)time(NULL);
    for (int64_t t = now - RT_HISTORY_S + 1; a && t <= now; t++) {
        const rt_sample *s = &r->history[t % RT_HISTORY_S];
        json_t *ttft = json_array(), *e2e = json_array();
        for (int c = 0; c < r->qos.n_classes; c++) {
            bool has = s->t_s == t && s->n[c] > 0;
            json_array_append_new(ttft, has ? json_real(s->ttft_ms_sum[c] / s->n[c]) : json_null());
            json_array_append_new(e2e, has ? json_real(s->e2e_ms_sum[c] / s->n[c]) : json_null());
        }
        json_array_append_new(a, json_pack("{s:I, s:o, s:o, s:i}", "t", (json_int_t)t, "ttft_ms", ttft,
                                           "e2e_ms", e2e, "rejected", s->t_s == t ? s->n_rejected : 0));
    }
    return a;
}

void rt_handle_status_json(pd_http_req *req, void *ud) {
    pd_router *r = ud;
    json_t *classes = json_array();
    for (int c = 0; c < r->qos.n_classes; c++) json_array_append_new(classes, json_string(r->qos.classes[c].name));
    json_t *o = json_pack("{s:s, s:i, s:I, s:o, s:o, s:o}", "routing", pd_router_routing_str(r->routing),
                          "workers_healthy", rt_n_healthy(r), "prefix_index_entries",
                          (json_int_t)pd_router_prefix_n_entries(r->prefix), "classes", classes, "workers",
                          workers_json(r), "history", history_json(r));
    if (!o) return pd_http_reply_error(req, 500, "server_error", "out of memory", NULL, NULL);
    pd_http_reply_json(req, 200, o);
    json_decref(o);
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

static const char PAGE_HEAD[] =
    "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>pdserve router</title><style>"
    "body{font-family:system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}"
    "table{border-collapse:collapse;margin-bottom:20px}td,th{border:1px solid #ccc;padding:4px 10px;"
    "font-size:14px;text-align:right}th{background:#eee}td.l{text-align:left}.up{color:#080}"
    ".down{color:#c00;font-weight:bold}svg{background:#fff;border:1px solid #ccc;margin-right:16px}"
    ".legend span{margin-right:14px}</style></head><body><h1>pdserve router</h1>"
    "<p id=\"summary\"></p><h2>Workers</h2><table id=\"workers\"><thead><tr><th>url</th><th>role</th>"
    "<th>state</th><th>running</th><th>waiting</th><th>in flight</th><th>KV used</th>"
    "<th>prefix hit rate</th><th>routed</th></tr></thead><tbody>";

static const char PAGE_TAIL[] =
    "</tbody></table><h2>Latency (mean per second, last 2 minutes)</h2><div class=\"legend\" id=\"legend\">"
    "</div><svg id=\"ttft\" width=\"560\" height=\"220\"></svg><svg id=\"e2e\" width=\"560\" height=\"220\"></svg>"
    "<script>\n"
    "const COLORS=['#1f77b4','#ff7f0e','#2ca02c','#d62728','#9467bd','#8c564b','#e377c2','#7f7f7f'];\n"
    "function esc(s){return String(s).replace(/[&<>\"]/g,c=>({'&':'&amp;','<':'&lt;','>':'&gt;','\"':'&quot;'}[c]));}\n"
    "function chart(id,title,hist,key,classes){const W=560,H=220,P=40;let max=1;\n"
    " hist.forEach(h=>h[key].forEach(v=>{if(v!==null&&v>max)max=v;}));\n"
    " let s=`<text x=\"${P}\" y=\"16\" font-size=\"13\">${title} (ms, max ${max.toFixed(1)})</text>`;\n"
    " s+=`<line x1=\"${P}\" y1=\"${H-P}\" x2=\"${W-10}\" y2=\"${H-P}\" stroke=\"#999\"/>`;\n"
    " s+=`<line x1=\"${P}\" y1=\"24\" x2=\"${P}\" y2=\"${H-P}\" stroke=\"#999\"/>`;\n"
    " classes.forEach((c,ci)=>{let pts=[];hist.forEach((h,i)=>{const v=h[key][ci];if(v!==null){\n"
    "  const x=P+i*(W-P-10)/Math.max(1,hist.length-1),y=H-P-(v/max)*(H-P-24);pts.push(x.toFixed(1)+','+y.toFixed(1));}});\n"
    "  if(pts.length)s+=`<polyline fill=\"none\" stroke=\"${COLORS[ci%8]}\" stroke-width=\"2\" points=\"${pts.join(' ')}\"/>`;});\n"
    " document.getElementById(id).innerHTML=s;}\n"
    "async function tick(){try{const r=await fetch('/status.json');const d=await r.json();\n"
    " document.getElementById('summary').textContent=`routing: ${d.routing} | healthy workers: ${d.workers_healthy} | prefix index entries: ${d.prefix_index_entries}`;\n"
    " document.querySelector('#workers tbody').innerHTML=d.workers.map(w=>`<tr><td class=\"l\">${esc(w.url)}</td>"
    "<td class=\"l\">${w.role}</td><td class=\"l ${w.state==='down'?'down':'up'}\">${w.state}</td><td>${w.running}</td>"
    "<td>${w.waiting}</td><td>${w.inflight}</td><td>${w.kv_blocks_used}/${w.kv_blocks_total}</td>"
    "<td>${(100*w.prefix_hit_rate).toFixed(1)}%</td><td>${w.routed}</td></tr>`).join('');\n"
    " document.getElementById('legend').innerHTML=d.classes.map((c,i)=>`<span style=\"color:${COLORS[i%8]}\">&#9632; ${esc(c)}</span>`).join('');\n"
    " chart('ttft','TTFT',d.history,'ttft_ms',d.classes);chart('e2e','E2E latency',d.history,'e2e_ms',d.classes);\n"
    "}catch(e){document.getElementById('summary').textContent='status.json unavailable: '+e;}}\n"
    "tick();setInterval(tick,1000);\n"
    "</script></body></html>\n";

void rt_handle_status_html(pd_http_req *req, void *ud) {
    pd_router *r = ud;
    size_t cap = sizeof PAGE_HEAD + sizeof PAGE_TAIL + (size_t)PD_ROUTER_MAX_WORKERS * 1024;
    char *page = pd_malloc(cap);
    if (!page) return pd_http_reply_error(req, 500, "server_error", "out of memory", NULL, NULL);
    size_t n = (size_t)snprintf(page, cap, "%s", PAGE_HEAD);
    for (int i = 0; i < PD_ROUTER_MAX_WORKERS; i++) {
        const rt_worker *w = &r->workers[i];
        if (!w->is_used) continue;
        char url[PD_WIRE_URL_MAX * 6];
        esc(url, sizeof url, w->url);
        const pd_wire_load *l = &w->load;
        double hit = l->n_prefix_query_tokens > 0 ? 100.0 * (double)l->n_prefix_hit_tokens / (double)l->n_prefix_query_tokens : 0;
        n += (size_t)snprintf(page + n, cap - n,
                              "<tr><td class=\"l\">%s</td><td class=\"l\">%s</td><td class=\"l %s\">%s</td>"
                              "<td>%d</td><td>%d</td><td>%d</td><td>%d/%d</td><td>%.1f%%</td><td>%lld</td></tr>",
                              url, pd_wire_role_str(w->role), w->is_healthy ? "up" : "down", worker_state(w),
                              (int)l->n_running, (int)l->n_waiting, w->n_inflight, (int)l->n_kv_blocks_used,
                              (int)l->n_kv_blocks_total, hit, (long long)w->n_routed);
        if (n >= cap) break;
    }
    if (n < cap) n += (size_t)snprintf(page + n, cap - n, "%s", PAGE_TAIL);
    if (n >= cap) n = cap - 1;
    pd_http_reply(req, 200, "text/html; charset=utf-8", page, n);
    pd_free(page);
}
