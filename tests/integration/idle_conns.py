#!/usr/bin/env python3
"""idle_conns.py HOST PORT N SECONDS — holds up to N idle TCP connections to HOST:PORT, then times
GET /health on fresh connections while they are held.

Raises this process's RLIMIT_NOFILE soft limit to the hard one (N is capped below it), opens the
connections non-blocking (connect storms are paced by the kernel's backlog; every wait is bounded
by SECONDS), and prints one JSON line:
  {"opened": k, "established": e, "health": [{"status": 200, "ms": 3.1}, ...], "closed_by_server": c}
"opened" counts sockets whose connect() was started, "established" those that completed, and
"closed_by_server" those the server had closed (EOF or reset) when the probes ran (the server sheds
the longest-idle connections at its limit, like nginx). Exit status 0 unless the script itself fails.
"""
import errno
import json
import resource
import selectors
import socket
import sys
import time


def health(host, port, timeout):
    t0 = time.monotonic()
    s = socket.create_connection((host, port), timeout=timeout)
    try:
        s.settimeout(max(0.05, timeout - (time.monotonic() - t0)))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    ms = (time.monotonic() - t0) * 1000
    line = data.split(b"\r\n", 1)[0].split()
    return {"status": int(line[1]) if len(line) > 1 else 0, "ms": round(ms, 2)}


def main():
    host, port, n, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    n = min(n, soft - 64)
    deadline = time.monotonic() + secs
    sel = selectors.EpollSelector()
    socks = []
    pending = 0
    for _ in range(n):
        if time.monotonic() > deadline:
            break
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            break
        s.setblocking(False)
        rc = s.connect_ex((host, port))
        if rc not in (0, errno.EINPROGRESS):
            s.close()
            continue
        socks.append(s)
        sel.register(s, selectors.EVENT_WRITE)
        pending += 1
    established = 0
    while pending and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            s = key.fileobj
            sel.unregister(s)
            pending -= 1
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                established += 1
    for s in socks:  # those still connecting stay open as they are
        try:
            sel.unregister(s)
        except (KeyError, ValueError):
            pass
    time.sleep(0.5)  # let the server finish accepting
    probes = []
    for _ in range(3):
        try:
            probes.append(health(host, port, 5.0))
        except OSError as e:
            probes.append({"status": 0, "ms": None, "error": str(e)})
        time.sleep(0.2)
    closed = 0
    time.sleep(float(__import__("os").environ.get("IDLE_SETTLE", "0")))
    for s in socks:
        try:
            if s.recv(1, socket.MSG_PEEK) == b"":
                closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    for s in socks:
        s.close()
    print(json.dumps({"opened": len(socks), "established": established, "health": probes,
                      "closed_by_server": closed}))


if __name__ == "__main__":
    main()
