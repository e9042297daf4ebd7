#!/usr/bin/env python3
"""fake_openai.py — a tiny OpenAI-compatible streaming server for testing `pdserve bench` itself.

Python standard library only. It answers:
  GET  /v1/models                       {"data": [{"id": MODEL}]}
  GET  /health                          200
  GET  /stats                           {"completions": requests answered on the two POST routes}
  POST /v1/completions                  SSE: max_tokens chunks {"choices":[{"text": "tok"}]}, a finish
  POST /v1/chat/completions             chunk, a usage chunk (stream_options.include_usage), [DONE];
                                        chat sends a role-only delta first, as OpenAI does
Timing is known, so the harness's measurements can be checked: the first token comes after
--ttft-ms, then one every --itl-ms. --fail-every N answers every Nth completion request with a
500 (OpenAI-shaped error) so failure accounting can be checked too; with --api-key KEY every route
but /health and /stats wants "Authorization: Bearer KEY" (else 401). Responses use HTTP/1.1
chunked encoding and keep-alive, like a real server.

Usage: fake_openai.py [--port 0] [--ttft-ms 20] [--itl-ms 5] [--fail-every 0] [--model NAME] [--api-key KEY]
Prints "port N" on stdout once listening (port 0 picks a free one).
"""
import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    counter = 0
    lock = threading.Lock()

    def log_message(self, fmt, *args):  # quiet
        pass

    def _json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _chunk(self, data):
        raw = data.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(raw), raw))
        self.wfile.flush()

    def _authorized(self):
        key = self.server.opts.api_key
        if not key or self.headers.get("Authorization") == "Bearer " + key:
            return True
        self._json(401, {"error": {"message": "bad api key", "type": "invalid_request_error"}})
        return False

    def do_GET(self):
        if self.path == "/stats":
            with Handler.lock:
                return self._json(200, {"completions": Handler.counter})
        if self.path != "/health" and not self._authorized():
            return
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.server.opts.model, "object": "model"}]})
        elif self.path == "/health":
            self._json(200, {"status": "ok"})
        else:
            self._json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(n)
        if not self._authorized():
            return
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            return self._json(400, {"error": {"message": "bad json", "type": "invalid_request_error"}})
        chat = self.path == "/v1/chat/completions"
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self._json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})
        opts = self.server.opts
        with Handler.lock:
            Handler.counter += 1
            idx = Handler.counter
        if opts.fail_every and idx % opts.fail_every == 0:
            return self._json(500, {"error": {"message": "injected failure", "type": "server_error"}})
        prompt = req.get("messages") if chat else req.get("prompt")
        if isinstance(prompt, list) and not chat and not all(isinstance(t, int) for t in prompt):
            return self._json(400, {"error": {"message": "prompt ids must be ints", "type": "invalid_request_error"}})
        n_prompt = len(prompt) if isinstance(prompt, list) and not chat else len(str(prompt).split())
        max_tokens = int(req.get("max_tokens", 16))
        usage = (req.get("stream_options") or {}).get("include_usage", False)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def choice(text, finish=None):
            if chat:
                return {"index": 0, "delta": {"content": text} if text is not None else {"role": "assistant"},
                        "finish_reason": finish}
            return {"index": 0, "text": text or "", "finish_reason": finish}

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        ev = lambda o: self._chunk("data: " + json.dumps(o) + "\n\n")
        if chat:
            ev({"object": obj, "choices": [choice(None)]})
        time.sleep(opts.ttft_ms / 1000.0)
        for i in range(max_tokens):
            if i:
                time.sleep(opts.itl_ms / 1000.0)
            ev({"object": obj, "choices": [choice(" tok%d" % i)]})
        ev({"object": obj, "choices": [choice("", "length")]})
        if usage:
            ev({"object": obj, "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": max_tokens,
                                                       "total_tokens": n_prompt + max_tokens}})
        self._chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ttft-ms", type=float, default=20)
    ap.add_argument("--itl-ms", type=float, default=5)
    ap.add_argument("--fail-every", type=int, default=0)
    ap.add_argument("--model", default="fake-model")
    ap.add_argument("--api-key", default="")
    opts = ap.parse_args()
    srv = ThreadingHTTPServer(("127.0.0.1", opts.port), Handler)
    srv.daemon_threads = True
    srv.opts = opts
    print("port %d" % srv.server_address[1], flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
