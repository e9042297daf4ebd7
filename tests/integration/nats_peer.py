#!/usr/bin/env python3
"""A hostile NATS publisher for test_nats_faults.sh (stdlib only: the NATS text protocol over a
socket, headers included). It authenticates to nats-server with the token, so nats-server lets it
publish anywhere; some messages it also signs with the shared secret (a Pd-Mac header, as pdserve
does: hex HMAC-SHA256(secret, "pdctl1" NUL subject NUL payload)), to reach the parsers behind the
signature check.

usage: nats_peer.py PHASE --port P --token-file F [--router URL] [--dec-inst HEX] [--pre-inst HEX]
                   [--dec-url URL] [--max-payload N] [--dead-port N]
PHASE: garbage | presence | flood | replay | resync | claim | jobs | auth
Prints one line per case; exits non-zero (naming the case) when an answer is not what pdserve must
answer. Every wait has a deadline.
"""
import argparse
import hashlib
import hmac
import json
import os
import socket
import sys
import time


class Nats:
    def __init__(self, port, token, deadline_s=10):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=deadline_s)
        self.buf = b""
        info = self._line()
        if not info.startswith(b"INFO "):
            raise SystemExit("no INFO from nats-server: %r" % info[:80])
        self.info = json.loads(info[5:])
        opts = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True, "protocol": 1,
                "lang": "python-test", "version": "0"}
        if token is not None:
            opts["auth_token"] = token
        self.s.sendall(b"CONNECT " + json.dumps(opts).encode() + b"\r\nPING\r\n")
        self.error = None
        while True:
            ln = self._line()
            if ln == b"PONG":
                break
            if ln.startswith(b"-ERR"):
                self.error = ln.decode(errors="replace")
                return
        self.sid = 0
        self.pending = []

    def _fill(self):
        d = self.s.recv(1 << 20)
        if not d:
            raise EOFError("nats-server closed the connection")
        self.buf += d

    def _line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        ln, self.buf = self.buf.split(b"\r\n", 1)
        return ln

    def _exact(self, n):
        while len(self.buf) < n + 2:
            self._fill()
        d, self.buf = self.buf[:n], self.buf[n + 2:]
        return d

    def pub(self, subject, payload, reply=None, headers=None):
        if isinstance(payload, str):
            payload = payload.encode()
        r = (" " + reply) if reply else ""
        if headers:
            h = b"NATS/1.0\r\n" + b"".join(k.encode() + b": " + v.encode() + b"\r\n" for k, v in headers.items()) + b"\r\n"
            self.s.sendall(b"HPUB %s%s %d %d\r\n" % (subject.encode(), r.encode(), len(h), len(h) + len(payload)) + h +
                           payload + b"\r\n")
        else:
            self.s.sendall(b"PUB %s%s %d\r\n" % (subject.encode(), r.encode(), len(payload)) + payload + b"\r\n")

    def sub(self, subject):
        self.sid += 1
        self.s.sendall(b"SUB %s %d\r\n" % (subject.encode(), self.sid))
        return self.sid

    def flush(self, timeout=10):
        """PING/PONG: everything sent before was processed by the server. Messages seen meanwhile are kept."""
        self.s.sendall(b"PING\r\n")
        end = time.time() + timeout
        while time.time() < end:
            m = self.next_msg(end - time.time(), want_pong=True)
            if m == "PONG":
                return
            if m:
                self.pending.append(m)
        raise SystemExit("no PONG from nats-server")

    def next_msg(self, timeout, want_pong=False):
        """(subject, reply, headers, payload) or None on timeout."""
        if self.pending and not want_pong:
            return self.pending.pop(0)
        self.s.settimeout(max(0.01, timeout))
        try:
            while True:
                ln = self._line()
                if ln == b"PING":
                    self.s.sendall(b"PONG\r\n")
                elif ln == b"PONG":
                    if want_pong:
                        return "PONG"
                elif ln.startswith(b"MSG "):
                    p = ln.split()
                    subj, reply, n = p[1].decode(), (p[3].decode() if len(p) == 5 else None), int(p[-1])
                    return subj, reply, {}, self._exact(n)
                elif ln.startswith(b"HMSG "):
                    p = ln.split()
                    subj, reply = p[1].decode(), (p[3].decode() if len(p) == 6 else None)
                    hl, tl = int(p[-2]), int(p[-1])
                    d = self._exact(tl)
                    hdr = {}
                    for h in d[:hl].split(b"\r\n")[1:]:
                        if b":" in h:
                            k, v = h.split(b":", 1)
                            hdr[k.decode().strip()] = v.decode().strip()
                    return subj, reply, hdr, d[hl:]
                elif ln.startswith(b"-ERR"):
                    raise SystemExit("nats-server: " + ln.decode(errors="replace"))
        except socket.timeout:
            return None
        finally:
            self.s.settimeout(10)

    def request(self, subject, payload, headers=None, timeout=2.0):
        inbox = "_INBOX.pdtest.%d" % (self.sid + 1)
        self.sub(inbox)
        self.pub(subject, payload, reply=inbox, headers=headers)
        end = time.time() + timeout
        while time.time() < end:
            m = self.next_msg(end - time.time())
            if m and m[0] == inbox:
                return m
        return None


def mac(secret, subject, payload):
    if isinstance(payload, str):
        payload = payload.encode()
    return hmac.new(secret.encode(), b"pdctl1\0" + subject.encode() + b"\0" + payload, hashlib.sha256).hexdigest()


def signed(secret, subject, payload):
    return {"Pd-Mac": mac(secret, subject, payload)}


def garbage_payloads(max_payload):
    """Bodies no pdserve message is: non-JSON, truncated, wrong types, deep nesting, huge."""
    big = max_payload - 256  # (headers count towards max_payload)
    return [
        ("empty", b""),
        ("not JSON", b"hello \x00\xff world"),
        ("truncated JSON", b'{"v":1,"type":"state","url":"http://127.0.0.1:1'),
        ("JSON array", b"[1,2,3]"),
        ("JSON null", b"null"),
        ("JSON string", b'"since=0"'),
        ("deep nesting", b"[" * 20000 + b"]" * 20000),
        ("wrong types", json.dumps({"v": "1", "type": 5, "url": 7, "role": ["decode"], "instance": {"a": 1},
                                    "since": "0", "pseq": "1", "leaving": "yes", "load": [1],
                                    "events": {"list": {"x": 1}}}).encode()),
        ("numbers out of range", json.dumps({"v": 1, "type": "state", "instance": "ffffffffffffffff", "since": -1,
                                             "pseq": 1e308, "load": {"running": -5, "waiting": 1e300,
                                                                      "kv_blocks_total": -2**63,
                                                                      "prefill_tokens_per_s": -1e308}}).encode()),
        ("duplicate keys", b'{"v":1,"url":"http://127.0.0.1:1","url":"http://127.0.0.1:2"}'),
        ("huge (max_payload)", b'{"v":1,"pad":"' + b"a" * big + b'"}'),
    ]


def must(cond, what):
    if not cond:
        raise SystemExit("FAIL nats_peer: " + what)
    print("ok   " + what)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("phase")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--dec-inst", default="")
    ap.add_argument("--pre-inst", default="")
    ap.add_argument("--dec-url", default="")
    ap.add_argument("--max-payload", type=int, default=1 << 20)
    ap.add_argument("--dead-port", type=int, default=1)
    ap.add_argument("--n", type=int, default=2000)
    a = ap.parse_args()
    secret = open(a.token_file).read().strip()
    nc = Nats(a.port, secret)
    if nc.error:
        raise SystemExit("FAIL nats_peer: the token was refused: " + nc.error)
    mp = int(nc.info.get("max_payload", a.max_payload))
    dec, pre = a.dec_inst, a.pre_inst

    if a.phase == "auth":  # no token / a wrong token: refused by nats-server itself
        bad = Nats(a.port, None)
        must(bad.error is not None and "Authorization" in bad.error, "a client without the token is refused (%s)" % bad.error)
        bad = Nats(a.port, "x" * 64)
        must(bad.error is not None and "Authorization" in bad.error, "a client with a wrong token is refused")
        return

    if a.phase == "garbage":  # every subject, every bad body, unsigned then signed
        subjects = ["pdserve.presence.decode." + dec, "pdserve.presence.prefill." + pre, "pdserve.presence.both.0123456789abcdef",
                    "pdserve.presence.king." + dec, "pdserve.presence.decode.xyz", "pdserve.presence.decode." + dec + ".extra",
                    "pdserve.presence", "pdserve.resync." + dec, "pdserve.resync." + pre, "pdserve.claim." + dec,
                    "pdserve.prefill.jobs", "pdserve.router.0000000000000000"]
        n = 0
        for subj in subjects:
            for name, body in garbage_payloads(mp):
                for sign in (False, True):
                    nc.pub(subj, body, reply="_INBOX.pdtest.void" if "resync" in subj or "claim" in subj else None,
                           headers=signed(secret, subj, body) if sign else {"Pd-Mac": "00" * 32} if n % 3 == 0 else None)
                    n += 1
            nc.flush()
        print("ok   %d garbage messages published on %d subjects (unsigned, forged and signed)" % (n, len(subjects)))
        return

    if a.phase == "presence":  # crafted presences: every field wrong once, spoofed ids, addresses that are not
        base = {"v": 1, "type": "state", "instance": "5eed5eed5eed5eed", "role": "decode", "model": "kjv",
                "block_size": 16, "load": {}, "events": {"reset": True, "seq_next": 0, "list": []},
                "url": "http://127.0.0.1:%d" % a.dead_port, "since": 0, "pseq": 1}
        cases = []
        for url in ["http://", "http://a b:80", "ftp://127.0.0.1:80", "http://127.0.0.1:0", "http://127.0.0.1:99999",
                    "http://[::1:80", "http://user@127.0.0.1:80", "http://127.0.0.1:80/path?q", "http://127.0.0.1:80\r\nX: y",
                    "http://" + "a" * 600 + ":80", "javascript:alert(1)", 5, None]:
            cases.append(("url %r" % (url if not isinstance(url, str) or len(url) < 40 else url[:40] + "..."), "decode",
                          "5eed5eed5eed5eed", dict(base, url=url)))
        cases += [
            ("role unknown", "king", "5eed5eed5eed5eed", dict(base, role="king")),
            ("role differs from the subject", "prefill", "5eed5eed5eed5eed", base),
            ("instance differs from the subject", "decode", "5eed5eed5eed5eee", base),
            ("instance not hex", "decode", "5eed5eed5eed5eeX", dict(base, instance="5eed5eed5eed5eeX")),
            ("since negative", "decode", "5eed5eed5eed5eed", dict(base, since=-1)),
            ("since huge", "decode", "5eed5eed5eed5eed", dict(base, since=2**64 - 1)),
            ("pseq 0", "decode", "5eed5eed5eed5eed", dict(base, pseq=0)),
            ("pseq a string", "decode", "5eed5eed5eed5eed", dict(base, pseq="1")),
            ("leaving not a boolean", "decode", "5eed5eed5eed5eed", dict(base, leaving="yes")),
            # well-formed, but the address is no pdserve worker (nothing listens there)
            ("a fake worker at a dead address", "decode", "5eed5eed5eed5eed", base),
            # a spoofed worker id: the real decode worker's url with another instance
            ("a fake instance at the real decode worker's url", "decode", "5eed5eed5eed5eef",
             dict(base, instance="5eed5eed5eed5eef", url=a.dec_url)),
            # the real decode worker's instance at another url, and with "leaving"
            ("the real decode worker's instance at another url", "decode", dec,
             dict(base, instance=dec, url="http://127.0.0.1:%d" % a.dead_port, pseq=2**62)),
            ("the real decode worker's instance, another url, leaving", "decode", dec,
             dict(base, instance=dec, url="http://127.0.0.1:%d" % a.dead_port, pseq=2**62, leaving=True)),
            ("the real decode worker's instance as a prefill worker", "prefill", dec,
             dict(base, instance=dec, role="prefill", url=a.dec_url, pseq=2**62)),
            ("a negative load for a fake worker", "decode", "5eed5eed5eed5ee1",
             dict(base, instance="5eed5eed5eed5ee1", load={"running": -1000000, "waiting": -5, "max_seqs": -1,
                                                           "prefill_tokens_per_s": 1e308, "decode_step_ms": -1e308})),
        ]
        for name, role, inst, body in cases:
            subj = "pdserve.presence.%s.%s" % (role, inst)
            data = json.dumps(body).encode()
            nc.pub(subj, data, headers=signed(secret, subj, data))
        nc.flush()
        print("ok   %d crafted (signed) presences published" % len(cases))
        return

    if a.phase == "flood":  # thousands of distinct fake workers, signed and unsigned
        for i in range(a.n):
            inst = "%016x" % (0xfa4e000000000000 + i)
            body = json.dumps({"v": 1, "type": "state", "instance": inst, "role": "decode", "load": {},
                               "events": {"reset": True, "seq_next": 0, "list": []},
                               "url": "http://127.0.0.1:%d" % a.dead_port, "since": 0, "pseq": 1}).encode()
            subj = "pdserve.presence.decode." + inst
            nc.pub(subj, body, headers=signed(secret, subj, body) if i % 2 else None)
            if i % 500 == 499:
                nc.flush()
        nc.flush()
        print("ok   %d fake workers announced (half of them signed)" % a.n)
        return

    if a.phase == "replay":  # a real presence, captured and published again (twice), and a "leaving"
        nc.sub("pdserve.presence.decode." + dec)
        nc.flush()
        m = None
        end = time.time() + 10
        while time.time() < end and not m:
            m = nc.next_msg(end - time.time())
        must(m is not None and "Pd-Mac" in m[2], "captured a signed presence of the real decode worker")
        for _ in range(3):
            nc.pub(m[0], m[3], headers=m[2])
        body = json.loads(m[3])
        body["leaving"] = True  # a tampered copy: the MAC no longer matches
        nc.pub(m[0], json.dumps(body).encode(), headers=m[2])
        nc.flush()
        print("ok   the captured presence replayed 3 times, then tampered into a \"leaving\"")
        # Signed and next in line (pseq + 1, since = where the router is): hostile KV events and
        # load for the real decode worker. Applied — a secret holder can do that — but bounded:
        # counts clamp at 0, and the real worker's next presence no longer continues from the
        # router's event number, so the router resyncs and the worker's full state replaces it.
        body = json.loads(m[3])
        nxt = body["events"]["seq_next"]
        evs = [{"seq": nxt + i, "type": "stored", "hash": "%032x" % (0xbad0000 + i), "parent": "0" * 32, "n_tokens": -7}
               for i in range(3000)]
        evs += [{"seq": nxt + 3000, "type": "stored", "hash": "%032x" % 1, "parent": "0" * 32, "tier": "tape"},
                {"seq": nxt + 3001, "type": "from_the_future"}]
        body.update({"pseq": body["pseq"] + 1, "since": nxt, "events": {"reset": False, "seq_next": nxt + 3002, "list": evs}})
        body["load"].update({"running": -1000000, "waiting": -5, "max_seqs": -1, "kv_blocks_free": 2**62,
                             "prefill_tokens_per_s": 1e308, "decode_step_ms": -1e308})
        body["disagg_model"] = {"local_a_us": 1e308, "local_b_us": -1, "chunk_tokens": 1e300,
                                "links": [{"peer": "x" * 500, "probes": 1e300, "transfers": -1e300, "bw_bytes_per_s": 0}] * 100}
        data = json.dumps(body).encode()
        nc.pub(m[0], data, headers=signed(secret, m[0], data))
        nc.flush()
        print("ok   a signed presence with 3002 hostile KV events and out-of-range load / link model published")
        return

    if a.phase == "resync":
        subj = "pdserve.resync." + dec
        r = nc.request(subj, "since=0")
        must(r is None, "an unsigned resync request gets no answer")
        r = nc.request(subj, "since=0", headers=signed(secret, subj, "since=0"))
        must(r is not None and json.loads(r[3]).get("instance") == dec and "Pd-Mac" in r[2],
             "a signed resync request is answered with a signed STATE of that instance")
        for bad in ["since=", "since=-1", "since=1x", "since=99999999999999999999999", "since= 1", "SINCE=1", "since=1\n"]:
            r = nc.request(subj, bad, headers=signed(secret, subj, bad), timeout=0.5)
            must(r is None, "malformed resync %r: no answer" % bad)
        # a burst over the rate limit: some are refused (answered at most 20 a second)
        inbox = "_INBOX.pdtest.burst"
        nc.sub(inbox)
        for _ in range(200):
            nc.pub(subj, "since=0", reply=inbox, headers=signed(secret, subj, "since=0"))
        nc.flush()
        got, end = 0, time.time() + 3
        while time.time() < end:
            m = nc.next_msg(end - time.time())
            if m and m[0] == inbox:
                got += 1
        must(0 < got < 200, "a burst of 200 resync requests: %d answered, the rest refused (rate limit)" % got)
        return

    if a.phase == "claim":
        subj = "pdserve.claim." + dec
        for body, want in [("req=1 kv=127.0.0.1:%d" % a.dead_port, "refused"), ("req=1 kv=10.255.255.1:9", "refused"),
                           ("req=1 kv=", "bad"), ("req=-1 kv=127.0.0.1:1", "bad"), ("kv=127.0.0.1:1 req=1", "bad"),
                           ("req=1 kv=127.0.0.1:1 trailing", "bad"), ("req=99999999999999999999999 kv=a:1", "bad"),
                           ("req=1 kv=" + "a" * 400, "bad")]:
            r = nc.request(subj, body, headers=signed(secret, subj, body))
            must(r is not None and r[3].decode() == want and "Pd-Mac" in r[2], "claim %r: answered %r" % (body[:40], want))
        body = "req=1 kv=127.0.0.1:%d" % a.dead_port
        r = nc.request(subj, body, timeout=1.0)
        must(r is None, "an unsigned claim gets no answer")
        return

    if a.phase == "jobs":  # the JetStream work queue's subject: unsigned, malformed and signed-but-bogus jobs
        subj = "pdserve.prefill.jobs"
        bodies = [b"not json", b"{}", b'{"decode":"../../x","req":1}', b'{"decode":"pdserve.>","req":1}',
                  b'{"decode":"ABCDEF0123456789","req":1}', b'{"decode":"' + dec.encode() + b'","req":-5}',
                  b'{"decode":"' + dec.encode() + b'","req":"1"}', b'{"decode":"0000000000000bad","req":7}',
                  b'{"decode":"' + dec.encode() + b'","req":999999999}']
        n = 0
        for body in bodies:
            for sign in (False, True):
                r = nc.request(subj, body, headers=signed(secret, subj, body) if sign else None, timeout=3)
                must(r is not None and b'"stream"' in r[3], "job %r (%s) stored by JetStream" % (body[:30], "signed" if sign else "unsigned"))
                n += 1
        # duplicates: the same signed job 5 times
        body = b'{"decode":"' + dec.encode() + b'","req":424242}'
        for _ in range(5):
            nc.pub(subj, body, headers=signed(secret, subj, body))
        nc.flush()
        print("ok   %d hostile jobs and 5 duplicates queued" % n)
        return

    raise SystemExit("unknown phase " + a.phase)


if __name__ == "__main__":
    main()
