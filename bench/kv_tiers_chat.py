#!/usr/bin/env python3
"""bench/kv_tiers_chat.py URL LABEL OUT.json [options] — a multi-turn chat workload for the KV tiers
(issue 14): N conversations x T turns, C conversations live at once (each sends its next turn when
the previous answer came). Every conversation shares one system prompt; turn t's prompt is the
system prompt, the whole history (each earlier user message and an assistant reply of fixed length)
and the new user message, so each prompt extends the previous one of its conversation (growing
shared histories: the earlier turns' KV is reusable, from the device pool or a tier). max_tokens 1:
the request's latency is its time to first token. Token ids are drawn at random from the
vocabulary (dummy weights: the text does not matter, the lengths and the reuse do).

Prints and writes TTFT p50 / p90 / p99 (all turns, and turns >= 2), the prompt tokens sent and
computed (the server's /metrics delta), the tokens loaded from tiers and the tier load wall time.
A deadline stops new conversations (the number finished is reported: compare like with like)."""
import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse
import urllib.request
import http.client


def metrics(url):
    txt = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for line in txt.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{")[0].split(" ")[0]
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            pass
    return out


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = max(0, min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1)))))
    return xs[k]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("label")
    ap.add_argument("out")
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--system", type=int, default=256, help="shared system prompt tokens")
    ap.add_argument("--user", type=int, default=96, help="tokens of each user message")
    ap.add_argument("--assistant", type=int, default=32, help="tokens of each assistant reply kept in the history")
    ap.add_argument("--vocab", type=int, default=128000)
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds: no new conversation after this")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--keepalive", action="store_true",
                    help="each client thread keeps one HTTP/1.1 connection open (as vLLM's benchmark_serving does "
                         "with aiohttp) instead of a new connection per request")
    a = ap.parse_args()

    rng = random.Random(a.seed)
    system = [rng.randrange(10, a.vocab) for _ in range(a.system)]
    m0 = metrics(a.url)
    lock = threading.Lock()
    nxt = [0]
    results = []  # (conversation, turn, prompt_len, ttft_ms)
    parts = []  # (turn, queue_ms, prefill_ms, first_decode_ms, cached_tokens, ttft_ms): the server's TTFT breakdown
    errors = []
    outputs = {}  # "conversation.turn" -> the greedy token's text (compared across configurations)
    t_start = time.perf_counter()

    u = urllib.parse.urlsplit(a.url)
    local = threading.local()

    def post(body):
        if not a.keepalive:
            return urllib.request.urlopen(urllib.request.Request(a.url + "/v1/completions", data=body,
                                          headers={"Content-Type": "application/json"}), timeout=300).read()
        for attempt in (0, 1):  # one reconnect: the server may close an idle kept-alive connection
            c = getattr(local, "conn", None)
            if c is None:
                c = local.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
            try:
                c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
                resp = c.getresponse()
                data = resp.read()
                if resp.status != 200:
                    raise RuntimeError("HTTP %d: %s" % (resp.status, data[:200]))
                if resp.getheader("Connection", "").lower() == "close":
                    c.close()
                    local.conn = None
                return data
            except (http.client.HTTPException, ConnectionError, OSError):
                c.close()
                local.conn = None
                if attempt:
                    raise

    def conversation(cid):
        r = random.Random(a.seed * 1000003 + cid)
        hist = list(system)
        for t in range(a.turns):
            prompt = hist + [r.randrange(10, a.vocab) for _ in range(a.user)]
            body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0, "timings": True}).encode()
            t0 = time.perf_counter()
            try:
                resp = json.loads(post(body))
            except Exception as e:  # counted, reported
                with lock:
                    errors.append(str(e))
                return
            ms = (time.perf_counter() - t0) * 1000
            with lock:
                results.append((cid, t, len(prompt), ms))
                outputs["%d.%d" % (cid, t)] = resp["choices"][0]["text"]
                us = resp.get("usage") or {}
                b = us.get("ttft_breakdown") or {}
                if b:
                    parts.append((t, b.get("queue_ms", 0.0), b.get("prefill_ms", 0.0), b.get("first_decode_ms", 0.0),
                                  (us.get("prompt_tokens_details") or {}).get("cached_tokens", 0), b.get("ttft_ms", 0.0)))
            hist = prompt + [r.randrange(10, a.vocab) for _ in range(a.assistant)]

    def worker():
        while True:
            with lock:
                cid = nxt[0]
                if cid >= a.conversations or time.perf_counter() - t_start > a.deadline:
                    return
                nxt[0] += 1
            conversation(cid)

    th = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    wall = time.perf_counter() - t_start
    m1 = metrics(a.url)
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
    done_conv = len({c for c, t, _, _ in results if t == a.turns - 1})
    all_ms = [r[3] for r in results]
    later = [r[3] for r in results if r[1] >= 1]
    hit = d.get("pdserve_kv_tier_hit_tokens_total", 0.0)
    wall_load = d.get("pdserve_kv_tier_load_wall_seconds_total", 0.0)
    steps = d.get("pdserve_engine_steps_total", 0.0)
    def part(i, sel):
        xs = [p[i] for p in parts if sel(p)]
        return {"p50": pct(xs, 50), "p90": pct(xs, 90), "mean": statistics.mean(xs) if xs else float("nan")}
    breakdown = {name: part(i, lambda p: p[0] >= 1) for i, name in ((1, "queue_ms"), (2, "prefill_ms"), (3, "first_decode_ms"))}
    server_ttft = part(5, lambda p: True)  # the server's own TTFT (arrival -> first token handed to HTTP), all turns
    rep = {
        "label": a.label, "conversations_started": nxt[0], "conversations_finished": done_conv,
        "requests": len(results), "errors": len(errors), "wall_s": round(wall, 1),
        "ttft_ms": {"p50": pct(all_ms, 50), "p90": pct(all_ms, 90), "p99": pct(all_ms, 99),
                    "mean": statistics.mean(all_ms) if all_ms else float("nan")},
        "ttft_ms_turns_ge2": {"p50": pct(later, 50), "p99": pct(later, 99)},
        "prompt_tokens": d.get("pdserve_prompt_tokens_total", 0.0),
        "prompt_tokens_computed": d.get("pdserve_prefill_tokens_computed_total", 0.0),
        "tier_hit_tokens": hit,
        "engine_steps": steps, "ms_per_step": wall * 1000 / steps if steps else float("nan"),
        "ttft_breakdown_turns_ge2": breakdown,
        "server_ttft_ms": server_ttft,
        "tier_load_wall_s": wall_load,
        "tier_hits": {k: v for k, v in d.items() if k.startswith("pdserve_kv_tier_hits_total")},
        "tier_bytes_out": d.get("pdserve_kv_tier_bytes_out_total", 0.0),
        "tier_offloads": d.get("pdserve_kv_tier_offloads_total", 0.0),
        "tier_offloads_dropped": d.get("pdserve_kv_tier_offloads_dropped_total", 0.0),
        "config": vars(a),
        "requests_ms": [[c, t, n, round(ms, 2)] for c, t, n, ms in results],  # (conversation, turn, prompt tokens, TTFT)
        "outputs": outputs,
    }
    if errors:
        rep["first_error"] = errors[0]
    json.dump(rep, open(a.out, "w"), indent=1)
    print("%-14s conv %3d/%3d req %4d err %d wall %6.1fs | TTFT p50 %8.1f p90 %8.1f p99 %8.1f ms (turn>=2 p50 %8.1f) | "
          "prompt %9.0f computed %9.0f tier-hit %9.0f load-wall %.2fs" %
          (a.label, done_conv, a.conversations, len(results), len(errors), wall, rep["ttft_ms"]["p50"],
           rep["ttft_ms"]["p90"], rep["ttft_ms"]["p99"], rep["ttft_ms_turns_ge2"]["p50"], rep["prompt_tokens"],
           rep["prompt_tokens_computed"], hit, wall_load))
    print("%-14s turns>=2 breakdown p50/p90/mean ms: queue %.1f/%.1f/%.1f prefill %.1f/%.1f/%.1f first-decode %.1f/%.1f/%.1f | "
          "%d steps, %.1f ms a step" % ((a.label,) + tuple(breakdown[k][q] for k in ("queue_ms", "prefill_ms", "first_decode_ms")
                                                          for q in ("p50", "p90", "mean")) + (steps, rep["ms_per_step"])))
    print("%-14s server-side TTFT (arrival -> first token handed to the HTTP loop) p50 %.1f p90 %.1f mean %.1f ms%s" %
          (a.label, server_ttft["p50"], server_ttft["p90"], server_ttft["mean"], " (keep-alive client)" if a.keepalive else ""))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
