#!/usr/bin/env python3
# fake_worker.py — a stand-in pdserve worker for router tests (python3 stdlib only).
#
# It speaks just enough of the worker API for the router: POST /v1/completions and
# /v1/chat/completions (streaming or not, "return_token_ids" adds "token_ids" to each chunk's
# choice; "usage" like a worker's: in the body, or as a last chunk with stream_options.include_usage), POST /internal/tokenize ({"token_ids": [...]}), GET /internal/state (a v1 STATE with a
# load report and no KV events), GET /health. Generation is a deterministic function of the whole
# token sequence (next = f(last id, length)), so a continuation sent as prompt + generated ids
# produces exactly the tokens an uninterrupted run would have: that is what lets a test check a
# failed-over stream for gaps and duplicates. Text of token t is "<t>" so the ids are readable.
#
# usage: fake_worker.py PORT [--token-delay-ms N]   (prints "listening on http://127.0.0.1:PORT")
import json
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DELAY = 0.0
INSTANCE = "%016x" % random.getrandbits(64)
LOCK = threading.Lock()
RUNNING = [0]


def tokenize(body):
    if "messages" in body:
        text = "".join("[%s]%s" % (m.get("role", ""), m.get("content") or "") for m in body["messages"]) + "[assistant]"
        return [ord(c) % 1000 + 3 for c in text]
    p = body.get("prompt", "")
    if isinstance(p, list):
        return [int(x) for x in p]
    return [ord(c) % 1000 + 3 for c in p]


def next_token(seq):
    return (seq[-1] * 31 + len(seq)) % 997 + 3


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, code, obj):
        b = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def do_GET(self):
        if self.path.startswith("/internal/state"):
            since = int(self.path.split("since=")[1]) if "since=" in self.path else 0
            with LOCK:
                running = RUNNING[0]
            self.reply(200, {"v": 1, "type": "state", "instance": INSTANCE, "model": "fake", "role": "both",
                             "block_size": 16,
                             "load": {"running": running, "waiting": 0, "kv_blocks_total": 100, "kv_blocks_free": 100,
                                      "kv_blocks_used": 0, "prefill_tokens_per_s": 100000.0,
                                      "decode_step_ms": max(1.0, DELAY * 1000)},
                             "events": {"reset": False, "seq_next": since, "list": []}})
        elif self.path == "/health":
            self.reply(200, {"status": "ok"})
        else:
            self.reply(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(n) or b"{}")
        if self.path == "/internal/tokenize":
            return self.reply(200, {"token_ids": tokenize(body)})
        chat = self.path == "/v1/chat/completions"
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self.reply(404, {"error": {"message": "not found", "type": "invalid_request_error"}})
        seq = tokenize(body)
        n_prompt = len(seq)
        usage = lambda n_out: {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
        max_tokens = int(body.get("max_completion_tokens", body.get("max_tokens", 16)))
        ids = body.get("return_token_ids", False)
        obj = "chat.completion.chunk" if chat else "text_completion"
        with LOCK:
            RUNNING[0] += 1
        try:
            if not body.get("stream"):
                out = []
                for _ in range(max_tokens):
                    seq.append(next_token(seq))
                    out.append(seq[-1])
                text = "".join("<%d>" % t for t in out)
                choice = {"index": 0, "finish_reason": "length"}
                choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
                return self.reply(200, {"id": "x", "object": obj.replace(".chunk", ""), "choices": [choice],
                                        "usage": usage(len(out))})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def send(data):
                b = ("data: %s\n\n" % data).encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
                self.wfile.flush()

            for i in range(max_tokens):
                time.sleep(DELAY)
                seq.append(next_token(seq))
                fin = "length" if i == max_tokens - 1 else None
                c = {"index": 0, "finish_reason": None}
                c.update({"delta": {"content": "<%d>" % seq[-1]}} if chat else {"text": "<%d>" % seq[-1]})
                if ids:
                    c["token_ids"] = [seq[-1]]
                send(json.dumps({"id": "fake-%s" % INSTANCE, "object": obj, "created": 1, "choices": [c]}))
                if fin:
                    c = {"index": 0, "finish_reason": fin}
                    c.update({"delta": {}} if chat else {"text": ""})
                    send(json.dumps({"id": "fake-%s" % INSTANCE, "object": obj, "created": 1, "choices": [c]}))
            if (body.get("stream_options") or {}).get("include_usage"):
                send(json.dumps({"id": "fake-%s" % INSTANCE, "object": obj, "created": 1, "choices": [],
                                 "usage": usage(max_tokens)}))
            send("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with LOCK:
                RUNNING[0] -= 1


def main():
    global DELAY
    port = int(sys.argv[1])
    if "--token-delay-ms" in sys.argv:
        DELAY = float(sys.argv[sys.argv.index("--token-delay-ms") + 1]) / 1000.0
    srv = ThreadingHTTPServer(("127.0.0.1", port), H)
    srv.daemon_threads = True
    print("listening on http://127.0.0.1:%d" % srv.server_address[1], flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
