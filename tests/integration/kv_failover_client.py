#!/usr/bin/env python3
"""One greedy streaming completion through a router, whose worker is SIGKILLed mid-stream (stdlib only).

usage: kv_failover_client.py ROUTER_URL PROMPT_JSON OUT_JSON --max-tokens N --kill-after K
                             --worker URL=PID [--worker URL=PID ...] [--chat] [--wait-puts N]
PROMPT_JSON: a JSON list of token ids (completions), or with --chat a list of chat messages. The request asks for return_token_ids, ignore_eos and
temperature 0. Once K generated token ids have arrived, the worker now running the request (the
one whose pdserve_num_requests_running is 1) is killed with SIGKILL and the stream read on: the
router continues it on another worker. --wait-puts N: before the kill, wait (up to 60 s) until that
worker has written N pages to Redis since the request started (write-back is asynchronous: on a
loaded machine it may trail generation by several blocks; the stream goes on meanwhile).
OUT_JSON: {"text", "token_ids", "done", "errors", "killed": URL, "ids_at_kill": n}
Every read has a deadline (120 s); the script always ends by itself.
"""
import http.client
import json
import os
import signal
import sys
import time
import urllib.parse
import urllib.request


def arg(name, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def metric(url, name):
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def running(url):
    return metric(url, "pdserve_num_requests_running")


def puts(url):
    return metric(url, 'pdserve_kv_tier_puts_total{tier="redis"}')


def main():
    url, prompt_path, out_path = sys.argv[1:4]
    max_tokens, kill_after = int(arg("--max-tokens")), int(arg("--kill-after"))
    workers = [w.split("=", 1) for i, w in enumerate(sys.argv) if i > 0 and sys.argv[i - 1] == "--worker"]
    prompt = json.load(open(prompt_path))
    wait_puts = int(arg("--wait-puts", "0"))
    puts0 = {w_url: puts(w_url) for w_url, _ in workers}
    u = urllib.parse.urlparse(url)
    chat = "--chat" in sys.argv
    req = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    req["messages" if chat else "prompt"] = prompt
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    c.request("POST", "/v1/chat/completions" if chat else "/v1/completions", json.dumps(req),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    out = {"text": "", "token_ids": [], "done": False, "errors": [], "killed": None, "ids_at_kill": 0}
    if r.status != 200:
        out["errors"].append("status %d: %s" % (r.status, r.read()[:500]))
    deadline = time.time() + 120
    while r.status == 200 and time.time() < deadline:
        line = r.readline()
        if not line:
            break
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            out["done"] = True
            break
        j = json.loads(data)
        if "error" in j:
            out["errors"].append(j["error"])
            continue
        for ch in j.get("choices", []):
            out["text"] += ch.get("text", "") or (ch.get("delta") or {}).get("content", "") or ""
            out["token_ids"] += ch.get("token_ids", [])
        if out["killed"] is None and len(out["token_ids"]) >= kill_after:
            for w_url, pid in workers:
                if running(w_url) >= 1:
                    t_end = time.time() + 60
                    while puts(w_url) - puts0[w_url] < wait_puts and time.time() < t_end:
                        time.sleep(0.005)
                    out["puts_at_kill"] = puts(w_url) - puts0[w_url]
                    os.kill(int(pid), signal.SIGKILL)
                    out["killed"], out["ids_at_kill"] = w_url, len(out["token_ids"])
                    break
            if out["killed"] is None:
                out["errors"].append("no worker was running the request at %d ids" % len(out["token_ids"]))
                break
    json.dump(out, open(out_path, "w"))


if __name__ == "__main__":
    main()
