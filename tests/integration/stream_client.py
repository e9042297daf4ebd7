#!/usr/bin/env python3
"""Many concurrent greedy *streaming* completions against a pdserve URL (stdlib only).

usage: stream_client.py URL PROMPTS_JSON OUT_JSON [--max-tokens N] [--ready FILE] [--ready-after K]
PROMPTS_JSON: a JSON list of token-id lists; one stream per prompt, all started at once.
--ready FILE: written once K streams (default: all) have received their first text chunk, so a
test can act (signal, kill) while streams are running.
OUT_JSON: {"texts": [...], "finish": [...], "done": [...], "errors": [...], "n_ok": n}
  texts[i]   the streamed text; finish[i] the finish_reason of the last chunk (or null);
  done[i]    whether "data: [DONE]" arrived; errors[i] an error event's / exception's text or null.
A stream counts as ok when it ended with [DONE], finish_reason "length" and no error.
Every request has a deadline (300 s); the script always ends by itself.
"""
import http.client
import json
import sys
import threading
import urllib.parse


def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main():
    url, prompts_path, out_path = sys.argv[1:4]
    max_tokens = int(arg("--max-tokens", "64"))
    ready_path = arg("--ready", None)
    prompts = json.load(open(prompts_path))
    n = len(prompts)
    ready_after = int(arg("--ready-after", str(n)))
    u = urllib.parse.urlparse(url)
    texts, finish, done, errors = [""] * n, [None] * n, [False] * n, [None] * n
    lock = threading.Lock()
    started = [0]

    def note_started():
        with lock:
            started[0] += 1
            if started[0] == ready_after and ready_path:
                open(ready_path, "w").write("ready\n")

    def one(i):
        first = True
        try:
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
            body = json.dumps({"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                               "ignore_eos": True, "stream": True})
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                errors[i] = "HTTP %d: %s" % (r.status, r.read()[:200].decode(errors="replace"))
                return
            for raw in r:
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done[i] = True
                    continue
                o = json.loads(data)
                if "error" in o:
                    errors[i] = o["error"].get("message", "error")
                    continue
                ch = o.get("choices") or []
                if not ch:
                    continue
                texts[i] += ch[0].get("text") or ""
                if ch[0].get("finish_reason"):
                    finish[i] = ch[0]["finish_reason"]
                if first and texts[i]:
                    first = False
                    note_started()
        except Exception as e:  # noqa: BLE001 - any failure is reported
            errors[i] = "%s: %s" % (type(e).__name__, e)
        finally:
            if first:
                note_started()  # never block the ready signal on a failed stream

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=320)
    n_ok = sum(1 for i in range(n) if done[i] and finish[i] == "length" and errors[i] is None)
    json.dump({"texts": texts, "finish": finish, "done": done, "errors": errors, "n_ok": n_ok},
              open(out_path, "w"))


if __name__ == "__main__":
    main()
