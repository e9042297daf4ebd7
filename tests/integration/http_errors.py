#!/usr/bin/env python3
"""http_errors.py — raw-socket checks of the HTTP layer's error replies (used by test_http_errors.sh).

  http_errors.py raw URL                 malformed / oversized / unsupported requests over a raw
                                         socket: each must get its status with an OpenAI-shaped JSON
                                         error body ({"error":{"message","type","param","code"}})
  http_errors.py upload URL PID MB BOUND a chunked upload of MB MiB to /v1/completions, sent as
                                         fast as the server reads it, while sampling the server's
                                         RSS (/proc/PID/status) every 20 ms: must get a JSON 413, and
                                         the RSS must not grow by more than BOUND MiB

Every socket has a timeout; every loop is bounded. Prints one line per check; exit 1 on failure.
"""
import json
import socket
import sys
import threading
import time
from urllib.parse import urlparse


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


def connect(url, timeout=20):
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=timeout)
    return s


def read_response(s, deadline_s=20):
    """Reads one response (the connection is closed by the server after an error). Returns
    (status, headers dict lowercased, body bytes)."""
    data = b""
    end = time.time() + deadline_s
    s.settimeout(2)
    while time.time() < end:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            chunk = None
        except ConnectionResetError:
            break
        if chunk == b"":
            break
        if chunk:
            data += chunk
        if b"\r\n\r\n" in data:
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            if lines[0].split(" ")[1:2] == ["100"]:  # interim 100 Continue
                data = body
                continue
            hdrs = {}
            for ln in lines[1:]:
                if ":" not in ln:  # e.g. a second status line: libevent's reply was not replaced
                    fail("malformed response head: %r" % head[:400])
                k, _, v = ln.partition(":")
                hdrs[k.strip().lower()] = v.strip()
            n = int(hdrs.get("content-length", "-1"))
            if n >= 0 and len(body) >= n:
                return int(lines[0].split(" ")[1]), hdrs, body[:n]
    if b"\r\n\r\n" not in data:
        fail("no complete response (got %r)" % data[:200])
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split(" ")[1]), hdrs, body


def check_json_error(what, status, hdrs, body, want_status, want_code=None):
    if status != want_status:
        fail("%s: status %d, want %d: %r" % (what, status, want_status, body[:300]))
    if not hdrs.get("content-type", "").startswith("application/json"):
        fail("%s: content-type %r, want application/json: %r" % (what, hdrs.get("content-type"), body[:300]))
    try:
        e = json.loads(body)["error"]
    except Exception as x:  # noqa: BLE001 — any parse failure is the finding
        fail("%s: not an OpenAI error body (%s): %r" % (what, x, body[:300]))
    for k in ("message", "type", "param", "code"):
        if k not in e:
            fail("%s: error object lacks %r: %r" % (what, k, body))
    if not e["message"] or not e["type"]:
        fail("%s: empty message or type: %r" % (what, body))
    if want_code is not None and e["code"] != want_code:
        fail("%s: code %r, want %r" % (what, e["code"], want_code))
    print("ok   %-58s %d %s" % (what, status, json.dumps(e["message"])[:70]))


def raw(url):
    u = urlparse(url)
    host = "%s:%d" % (u.hostname, u.port)
    cases = [
        ("malformed request line", b"GARBAGE\r\n\r\n", 400, "bad_request"),
        ("bad HTTP version", b"GET /health HTTP/x.y\r\nHost: %s\r\n\r\n" % host.encode(), 400, "bad_request"),
        ("header line without a colon", b"GET /health HTTP/1.1\r\nHost: h\r\nno colon here\r\n\r\n", 400, "bad_request"),
        ("request line over 64 KiB", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: h\r\n\r\n", 400, "bad_request"),
        ("headers over 64 KiB", b"GET /health HTTP/1.1\r\nHost: h\r\n" + b"".join(
            b"X-Pad-%d: %s\r\n" % (i, b"v" * 1000) for i in range(80)) + b"\r\n", 400, "bad_request"),
        ("bad Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 12abc\r\n\r\n", 400,
         "bad_request"),
        ("negative Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: -5\r\n\r\n", 400,
         "bad_request"),
        ("malformed chunk size", b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"zz\r\nabc\r\n0\r\n\r\n", 413, "request_too_large"),
        ("unsupported Expect", b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nExpect: teapot\r\nContent-Length: 2\r\n"
         b"\r\n{}", 417, "expectation_failed"),
        ("unknown method FOO", b"FOO /health HTTP/1.1\r\nHost: h\r\n\r\n", 501, "method_not_implemented"),
        ("TRACE", b"TRACE /health HTTP/1.1\r\nHost: h\r\n\r\n", 501, "method_not_implemented"),
        ("unknown path", b"GET /nope HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n", 404, None),
        ("wrong method on a known path", b"DELETE /v1/completions HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
         405, None),
    ]
    for what, req, want, code in cases:
        s = connect(url)
        try:
            s.sendall(req)
        except OSError:
            pass  # the server may refuse before reading all of it; the reply must still come
        st, h, b = read_response(s)
        s.close()
        check_json_error(what, st, h, b, want, code)
    # CONNECT (not allowed): 501, and the connection is closed although libevent keeps CONNECT
    # connections alive.
    s = connect(url)
    s.sendall(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    st, h, b = read_response(s)
    check_json_error("CONNECT", st, h, b, 501, "method_not_implemented")
    s.settimeout(5)
    try:
        rest = s.recv(1024)
    except socket.timeout:
        fail("CONNECT: the connection stayed open after the 501")
    except ConnectionResetError:
        rest = b""
    if rest:
        fail("CONNECT: bytes after the 501: %r" % rest[:200])
    s.close()
    print("ok   CONNECT: the connection is closed after the reply")
    # Content-Length over the limit with Expect: 100-continue: refused before the body is sent.
    s = connect(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
              b"Expect: 100-continue\r\nContent-Length: 1000000000\r\n\r\n")
    st, h, b = read_response(s)
    s.close()
    check_json_error("1 GB Content-Length with Expect: 100-continue", st, h, b, 413, "request_too_large")
    # Keep-alive still works after all of this: a good request on a fresh connection.
    s = connect(url)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    st, h, b = read_response(s)
    s.close()
    if st != 200:
        fail("/health after the error cases: %d %r" % (st, b[:200]))
    print("ok   /health still 200 after the error cases")


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        for ln in f:
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1])
    return 0


def upload(url, pid, mb, bound):
    pid, mb, bound = int(pid), int(mb), float(bound)
    base = rss_kib(pid)
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], rss_kib(pid))
            except OSError:
                return
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    s = connect(url, timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"a" * 65536
    frame = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    sent = 0
    refused_early = False
    t0 = time.time()
    s.settimeout(10)
    try:
        while sent < mb << 20 and time.time() - t0 < 120:
            s.sendall(frame)
            sent += len(chunk)
        s.sendall(b"0\r\n\r\n")
    except OSError:
        refused_early = True  # the server closed after its reply: read the reply
    st, h, b = read_response(s)
    s.close()
    stop.set()
    t.join(1)
    grow_mib = (peak[0] - base) / 1024.0
    check_json_error("chunked upload of %d MiB (%.0f MiB sent)" % (mb, sent / 1048576.0), st, h, b, 413,
                     "request_too_large")
    print("ok   RSS during the upload: %.1f MiB before, peak +%.1f MiB (bound %.0f MiB)%s"
          % (base / 1024.0, grow_mib, bound, "; the server closed while we were sending" if refused_early else ""))
    if grow_mib > bound:
        fail("server RSS grew by %.1f MiB while refusing a %d MiB chunked body (bound %.0f)" % (grow_mib, mb, bound))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "raw":
        raw(sys.argv[2])
    elif len(sys.argv) == 6 and sys.argv[1] == "upload":
        upload(*sys.argv[2:])
    else:
        fail("usage: http_errors.py raw URL | upload URL PID MB BOUND_MIB")
