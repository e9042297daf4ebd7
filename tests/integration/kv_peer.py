#!/usr/bin/env python3
"""kv_peer.py — a hostile or misbehaving peer on a prefill worker's KV port (docs/kv-wire-format.md,
version 4), for tests/integration/test_kv_faults.sh. Each subcommand runs one attack or fault and
prints one line; it exits 1 when the worker behaved wrongly (answered something it must not, or
accepted what it must refuse).

  kv_peer.py ATTACK HOST PORT [TOKEN_FILE] [args]
"""
import hashlib
import hmac
import os
import socket
import struct
import sys
import time

MAGIC, VERSION = 0x564B4450, 4
HELLO, HELLO_ACK, PREFILL_REQ, KV_SLAB, DONE, FAIL, PING, PONG, CANCEL, KV_NCCL = range(1, 11)
CHALLENGE, PROOF, AUTH_OK = 11, 12, 13
PROBE, PROBE_DATA = 14, 15
TCP, SHM = 1, 2
M32 = 0xFFFFFFFF


def xxh32(data, seed=0):
    p1, p2, p3, p4, p5 = 2654435761, 2246822519, 3266489917, 668265263, 374761393
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & M32
    n, i = len(data), 0
    if n >= 16:
        v = [(seed + p1 + p2) & M32, (seed + p2) & M32, seed & M32, (seed - p1) & M32]
        while i + 16 <= n:
            for k in range(4):
                w = struct.unpack_from("<I", data, i + 4 * k)[0]
                v[k] = (rotl((v[k] + w * p2) & M32, 13) * p1) & M32
            i += 16
        h = (rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18)) & M32
    else:
        h = (seed + p5) & M32
    h = (h + n) & M32
    while i + 4 <= n:
        h = (rotl((h + struct.unpack_from("<I", data, i)[0] * p3) & M32, 17) * p4) & M32
        i += 4
    while i < n:
        h = (rotl((h + data[i] * p5) & M32, 11) * p1) & M32
        i += 1
    h ^= h >> 15
    h = (h * p2) & M32
    h ^= h >> 13
    h = (h * p3) & M32
    return h ^ (h >> 16)


assert xxh32(b"") == 0x02CC5D05 and xxh32(b"abc") == 0x32D153FF


def frame(typ, body=b"", payload_len=0, version=VERSION, crc=None, body_len=None):
    bl = len(body) if body_len is None else body_len
    c = xxh32(body) if crc is None else crc
    return struct.pack("<IHHIIQ", MAGIC, version, typ, bl, c, payload_len) + body


def recv_exact(s, n, timeout=5.0):
    s.settimeout(timeout)
    out = b""
    while len(out) < n:
        try:
            k = s.recv(n - len(out))
        except (ConnectionResetError, socket.timeout):
            return None
        if not k:
            return None
        out += k
    return out


def recv_frame(s, timeout=5.0):
    h = recv_exact(s, 24, timeout)
    if h is None:
        return None
    magic, ver, typ, bl, crc, pl = struct.unpack("<IHHIIQ", h)
    body = recv_exact(s, bl, timeout) if bl else b""
    if body is None:
        return None
    payload = recv_exact(s, pl, 30) if pl else b""
    return typ, body, payload


def closed_without_answer(s, timeout=8.0):
    """True when the peer closes without sending a single further byte."""
    s.settimeout(timeout)
    try:
        d = s.recv(1)
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    return d == b""


def dial(host, port, unix=False):
    if unix:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0pdserve-kv-%d" % port)
    else:
        s = socket.create_connection((host, port), timeout=5)
    return s


def secret(path):
    return open(path, "rb").read().rstrip(b" \t\r\n")


def authenticate(s, key):
    f = recv_frame(s)
    if not f or f[0] != CHALLENGE or len(f[1]) != 32:
        raise SystemExit("FAIL: no AUTH_CHALLENGE first")
    ns, nc = f[1], os.urandom(32)
    mac = hmac.new(key, b"pdkv3 client" + ns + nc, hashlib.sha256).digest()
    s.sendall(frame(PROOF, nc + mac))
    f = recv_frame(s)
    if not f or f[0] != AUTH_OK:
        raise SystemExit("FAIL: authentication refused with the right secret")
    want = hmac.new(key, b"pdkv3 server" + nc + ns, hashlib.sha256).digest()
    if not hmac.compare_digest(want, f[1]):
        raise SystemExit("FAIL: the worker's proof is wrong")


FP = struct.Struct("<9IQ")  # arch n_layers n_heads n_kv_heads head_dim hidden vocab kv_dtype block_size weights_hash


def hello(fp, transport=TCP, n_blocks=64, handle=b""):
    return frame(HELLO, fp + struct.pack("<III", transport, n_blocks, len(handle)) + handle)


def learn_fp(host, port, key):
    """An authenticated peer learns the worker's fingerprint from a refused HELLO_ACK."""
    s = dial(host, port)
    authenticate(s, key)
    s.sendall(hello(b"\0" * FP.size))
    f = recv_frame(s)
    s.close()
    if not f or f[0] != HELLO_ACK:
        raise SystemExit("FAIL: no HELLO_ACK to an authenticated peer")
    ok = struct.unpack_from("<I", f[1])[0]
    if ok:
        raise SystemExit("FAIL: a zero fingerprint was accepted")
    return f[1][4:4 + FP.size]


def geometry(fp):
    v = FP.unpack(fp)
    return {"n_layers": v[1], "n_kv_heads": v[3], "head_dim": v[4], "vocab": v[6], "block_size": v[8]}


def prefill_req(req_id, tokens, blocks, start=0):
    b = struct.pack("<QiiffffffiiQI", req_id, start, len(tokens), 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0, 0, 0, 0)
    b += struct.pack("<%di" % len(tokens), *tokens) + struct.pack("<i", len(blocks)) + struct.pack("<%di" % len(blocks), *blocks)
    b += struct.pack("<I", 0)  # traceparent: empty
    return frame(PREFILL_REQ, b)


def check(cond, msg):
    if not cond:
        print("FAIL: " + msg)
        sys.exit(1)


# ---- attacks --------------------------------------------------------------------------------------
def a_unauth_hello(host, port, _key, _args):
    """HELLO with a zero fingerprint, no authentication: the worker must close, telling nothing."""
    s = dial(host, port)
    f = recv_frame(s)
    check(f and f[0] == CHALLENGE and len(f[1]) == 32, "the first frame is not a bare 32-byte challenge")
    s.sendall(hello(b"\0" * FP.size))
    check(closed_without_answer(s), "an unauthenticated HELLO got an answer")
    print("unauth_hello: closed, nothing learned")


def a_bad_proof(host, port, key, _args):
    s = dial(host, port)
    f = recv_frame(s)
    nc = os.urandom(32)
    s.sendall(frame(PROOF, nc + hmac.new(b"wrong-secret-123456", b"pdkv3 client" + f[1] + nc, hashlib.sha256).digest()))
    check(closed_without_answer(s), "a wrong proof got an answer")
    # a replayed proof (right secret, another connection's nonce) fails too
    s1 = dial(host, port)
    ns1 = recv_frame(s1)[1]
    s2 = dial(host, port)
    recv_frame(s2)
    nc = os.urandom(32)
    s2.sendall(frame(PROOF, nc + hmac.new(key, b"pdkv3 client" + ns1 + nc, hashlib.sha256).digest()))
    check(closed_without_answer(s2), "a proof for another challenge was accepted")
    s1.close()
    print("bad_proof: wrong and replayed proofs refused")


def a_garbage(host, port, key, args):
    """Garbage and crafted frames before and after authentication: each connection just closes."""
    n = int(args[0]) if args else 50
    rnd = os.urandom
    cases = [lambda: rnd(64), lambda: rnd(4096),
             lambda: frame(PROOF, rnd(64), version=2),                     # old version
             lambda: frame(PROOF, rnd(64), version=3),                     # the previous version
             lambda: frame(PROOF, b"", body_len=16 << 20),                 # a 16 MiB body announced
             lambda: frame(PROOF, rnd(64), payload_len=1 << 34),           # a 16 GiB payload announced
             lambda: frame(PROOF, rnd(64), crc=1),                         # bad checksum
             lambda: frame(99, rnd(8)),                                    # unknown type
             lambda: hello(b"\0" * FP.size)]                               # HELLO before auth
    for i in range(n):
        s = dial(host, port)
        recv_frame(s)
        s.sendall(cases[i % len(cases)]())
        check(closed_without_answer(s), "pre-auth case %d got an answer" % (i % len(cases)))
        s.close()
    # authenticated, then crafted frames: the connection ends; the worker lives on
    post = [frame(KV_SLAB, rnd(28), payload_len=1 << 34), frame(PREFILL_REQ, rnd(100)), frame(DONE, rnd(40)),
            frame(HELLO, rnd(10)), frame(PREFILL_REQ, b"", body_len=(16 << 20) + 1), hello(b"\0" * FP.size, transport=77)]
    for i, p in enumerate(post):
        s = dial(host, port)
        authenticate(s, key)
        s.sendall(p)
        f = recv_frame(s, 8)
        check(f is None or (f[0] == HELLO_ACK and struct.unpack_from("<I", f[1])[0] == 0),
              "post-auth case %d was accepted" % i)
        s.close()
    print("garbage: %d pre-auth and %d post-auth crafted connections closed" % (n, len(post)))


def a_big_pool(host, port, key, _args):
    """shm: a HELLO announcing a 1,000,000-block pool backed by a 4 KB memfd, then a PREFILL_REQ
    naming block 999,999. The worker must refuse the pool and fail the request, not write."""
    fp = learn_fp(host, port, key)
    g = geometry(fp)
    fd = os.memfd_create("attacker", 0)
    os.ftruncate(fd, 4096)
    row = g["n_kv_heads"] * g["head_dim"] * 4
    for announced in (2 * g["n_layers"] * 1000000 * g["block_size"] * row, 4096):
        s = dial(host, port, unix=True)
        authenticate(s, key)
        handle = b"memfd".ljust(8, b"\0") + b"\0" * 128 + struct.pack("<QiiiI", announced, 0, os.getpid(), -1, 0)
        body = fp + struct.pack("<III", SHM, 1000000, len(handle)) + handle
        socket.send_fds(s, [frame(HELLO, body)], [fd])
        f = recv_frame(s)
        check(f and f[0] == HELLO_ACK, "no HELLO_ACK")
        toks = [1] * g["block_size"]
        s.sendall(prefill_req(7, toks, [999999]))
        f = recv_frame(s, 10)
        while f and f[0] == PONG:
            f = recv_frame(s, 10)
        check(f and f[0] == FAIL, "block 999,999 of an unmapped pool was not refused (%r)" % (f[0] if f else None))
        code = struct.unpack_from("<I", f[1], 8)[0]  # req_id u64, code u32, reason (u32 length + bytes)
        reason = f[1][16:].decode(errors="replace")
        check(code == 1, "a refused pool's failure does not say so (code %d)" % code)
        check("pool refused" in reason, "unexpected reason " + reason)
        s.close()
    os.close(fd)
    print("big_pool: both announcements refused; block 999,999 failed with '%s'" % reason)


def a_block_range(host, port, key, _args):
    """tcp: destination blocks outside the pool the peer announced are refused."""
    fp = learn_fp(host, port, key)
    g = geometry(fp)
    s = dial(host, port)
    authenticate(s, key)
    s.sendall(hello(fp, TCP, 8))
    f = recv_frame(s)
    check(f and f[0] == HELLO_ACK and struct.unpack_from("<I", f[1])[0] == 1, "tcp HELLO refused")
    for blk in (8, -1, 1 << 30):
        s.sendall(prefill_req(9, [1] * g["block_size"], [blk]))
        f = recv_frame(s, 10)
        check(f and f[0] == FAIL, "block %d not refused" % blk)
    s.sendall(prefill_req(10, [g["vocab"] + 5] * 4, [0]))
    f = recv_frame(s, 10)
    check(f and f[0] == FAIL, "a token id out of the vocabulary was not refused")
    print("block_range: out-of-pool blocks and bad token ids refused")


def a_cycles(host, port, key, args):
    """Many connect/close cycles (port probes, aborted handshakes, full HELLOs)."""
    n = int(args[0]) if args else 10000
    fp = learn_fp(host, port, key)
    for i in range(n):
        s = dial(host, port)
        if i % 100 == 0:
            authenticate(s, key)
            s.sendall(hello(fp, TCP, 8))
            recv_frame(s)
        s.close()
    print("cycles: %d connect/close cycles" % n)


def a_slow_reader(host, port, key, args):
    """Authenticated tcp peer that asks for many prefills and never reads (the worker's writer
    stalls, its queue fills). Holds the connection for args[0] seconds."""
    hold = float(args[0]) if args else 15
    fp = learn_fp(host, port, key)
    g = geometry(fp)
    s = dial(host, port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    authenticate(s, key)
    s.sendall(hello(fp, TCP, 4096))
    recv_frame(s)
    n_tok = 20 * g["block_size"]
    for i in range(24):
        s.sendall(prefill_req(100 + i, [(7 * i + j) % 1000 + 10 for j in range(n_tok)], list(range(20 * i, 20 * i + 20))))
    print("slow_reader: 24 requests sent, not reading", flush=True)
    time.sleep(hold)
    s.close()


def a_probe(host, port, key, _args):
    """Link probes (wire v4, PROBE / PROBE_DATA): no answer before authentication, nor before
    HELLO; after HELLO a size over 4 MiB or not a multiple of 4 closes the connection without a
    PROBE_DATA; a good probe is answered with its nonce and exactly the bytes asked for."""
    body = lambda nonce, n: struct.pack("<QI", nonce, n)
    s = dial(host, port)
    recv_frame(s)
    s.sendall(frame(PROBE, body(1, 4096)))
    check(closed_without_answer(s), "a PROBE before authentication got an answer")
    s.close()
    s = dial(host, port)
    authenticate(s, key)
    s.sendall(frame(PROBE, body(2, 4096)))
    f = recv_frame(s, 8)
    check(f is None or f[0] != PROBE_DATA, "a PROBE before HELLO was answered")
    s.close()
    fp = learn_fp(host, port, key)
    for n in [(4 << 20) + 4, 4094, 0xFFFFFFFC]:
        s = dial(host, port)
        authenticate(s, key)
        s.sendall(hello(fp, TCP, 64))
        f = recv_frame(s)
        check(f is not None and f[0] == HELLO_ACK, "HELLO refused")
        s.sendall(frame(PROBE, body(3, n)))
        for _ in range(50):  # whatever comes (a PONG), never a PROBE_DATA, then the close
            f = recv_frame(s, 8)
            if f is None:
                break
            check(f[0] != PROBE_DATA, "a PROBE of %d bytes was answered" % n)
        check(f is None, "the connection stayed open after a PROBE of %d bytes" % n)
        s.close()
    s = dial(host, port)
    authenticate(s, key)
    s.sendall(hello(fp, TCP, 64))
    recv_frame(s)
    s.sendall(frame(PROBE, body(4, 65536)))
    f = recv_frame(s, 8)
    while f is not None and f[0] != PROBE_DATA:
        f = recv_frame(s, 8)
    check(f is not None and struct.unpack_from("<QI", f[1]) == (4, 65536) and len(f[1]) + len(f[2]) == 24 + 65536,
          "a good PROBE was not answered with its nonce and 65536 bytes")
    s.close()
    print("probe: refused before auth and HELLO, bad sizes close the connection, a good probe answered")


ATTACKS = {"unauth_hello": a_unauth_hello, "bad_proof": a_bad_proof, "garbage": a_garbage, "big_pool": a_big_pool,
           "block_range": a_block_range, "cycles": a_cycles, "slow_reader": a_slow_reader,
           "probe": a_probe}

if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] not in ATTACKS:
        sys.exit(__doc__)
    key = secret(sys.argv[4]) if len(sys.argv) > 4 else b""
    ATTACKS[sys.argv[1]](sys.argv[2], int(sys.argv[3]), key, sys.argv[5:])
