#!/usr/bin/env python3
"""Greedy completions against a pdserve URL, many at once (stdlib only).

usage: disagg_client.py URL PROMPTS_JSON OUT_JSON [--concurrency N] [--max-tokens N]
PROMPTS_JSON: a JSON list of token-id lists. OUT_JSON: {"texts": [...], "errors": n}.
Every request has a deadline; the script ends by itself.
"""
import json
import sys
import threading
import urllib.request


def complete(url, ids, max_tokens):
    body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    return out["choices"][0]["text"], out["choices"][0]["finish_reason"]


def main():
    url, prompts_path, out_path = sys.argv[1:4]
    conc = int(sys.argv[sys.argv.index("--concurrency") + 1]) if "--concurrency" in sys.argv else 8
    max_tokens = int(sys.argv[sys.argv.index("--max-tokens") + 1]) if "--max-tokens" in sys.argv else 32
    prompts = json.load(open(prompts_path))
    texts = [None] * len(prompts)
    errors = []
    sem = threading.Semaphore(conc)

    def one(i):
        with sem:
            try:
                text, reason = complete(url, prompts[i], max_tokens)
                texts[i] = text if reason == "length" else "<finish %s>" % reason
            except Exception as e:  # noqa: BLE001 - report any failure
                errors.append("%d: %s" % (i, e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    json.dump({"texts": texts, "errors": len(errors), "error_list": errors[:5]}, open(out_path, "w"))


if __name__ == "__main__":
    main()
