#!/usr/bin/env python3
"""tools/kv_tier_chain_sim.py — a trace simulation of bench/kv_tiers_chat.py's multi-turn chat (200
conversations x 8 turns, 16 live, a shared 16-block system prompt, 8 new blocks a turn) against a
device prefix cache (LRU of DEV blocks) and the hot DRAM tier (S3-FIFO as src/kvtier/policy.c, or
LRU), to count the prompt tokens that must be computed. A tier match walks the chain from the root
(kvconn/tier.c, hot_lead_locked), so a root block the device keeps serving, and DRAM never hears
of, ages out of S3-FIFO's small queue and takes every chain through it along. --touch-match makes
each match a reuse of the blocks it reports (what kvconn/tier.c does since branch tiersperf).

  python3 tools/kv_tier_chain_sim.py            # the table below (about 10 s)

With DEV=150 and a 16 GiB DRAM tier (8,192 blocks) it gives 392,192 computed tokens and 4,216
evictions without --touch-match, which is what the H100 measured (392,384 and 4,200, call
tiersperf-1), and 198,656 with it (the H100, call tiersperf-2: 198,656)."""
import argparse
import collections
import random


class Policy:
    def __init__(self, cap, lru=False):
        self.cap, self.lru, self.ev = cap, lru, 0
        self.small, self.main, self.ghost = collections.OrderedDict(), collections.OrderedDict(), collections.OrderedDict()

    def __contains__(self, k):
        return k in self.small or k in self.main

    def touch(self, k):
        if self.lru:
            if k in self.main:
                self.main.move_to_end(k)
                return True
            return False
        for q in (self.small, self.main):
            if k in q:
                q[k] = min(3, q[k] + 1)
                return True
        return False

    def evict(self):
        self.ev += 1
        if self.lru:
            self.main.popitem(last=False)
            return
        while True:
            if self.small and (len(self.small) > self.cap // 10 or not self.main):
                k, f = self.small.popitem(last=False)
                if f > 0:  # reused while probationary: to M with freq 0
                    self.main[k] = 0
                    continue
                self.ghost[k] = 1
                if len(self.ghost) > self.cap:
                    self.ghost.popitem(last=False)
                return
            k, f = self.main.popitem(last=False)
            if f > 0:
                self.main[k] = f - 1
                continue
            return

    def put(self, k):
        if self.touch(k):
            return
        while len(self.small) + len(self.main) >= self.cap:
            self.evict()
        if self.lru or k in self.ghost:
            self.ghost.pop(k, None)
            self.main[k] = 0
        else:
            self.small[k] = 0


def run(dram_blocks, dev, lru, touch_match, seed=1, conv=200, live=16, turns=8):
    d, devq, rng = Policy(dram_blocks, lru), collections.OrderedDict(), random.Random(seed)
    computed, pend = 0, []
    act, nxt, turn = list(range(live)), live, {c: 0 for c in range(live)}
    while act:
        c = rng.choice(act)
        nb = 22 + 8 * turn[c]  # 352 + 128 t tokens, 16-token blocks
        keys = [("sys", i) if i < 16 else (c, i) for i in range(nb)]
        h = next((i for i, k in enumerate(keys) if k not in devq), nb)
        m = next((i for i, k in enumerate(keys) if k not in d), nb)
        if touch_match:
            for k in keys[:m]:
                d.touch(k)
        end = min(max(h, m), nb - 1)  # never the last token's block
        for k in keys[h:end] if m > h else []:
            d.touch(k)  # loaded from DRAM
        computed += (nb - end) * 16
        for k in keys:  # the device prefix cache
            if k in devq:
                devq.move_to_end(k)
            else:
                devq[k] = 1
                if len(devq) > dev:
                    devq.popitem(last=False)
        for k in pend:  # saved after the step (offered: held ones are a reuse)
            d.put(k)
        pend = keys[h:]
        turn[c] += 1
        if turn[c] == turns:
            act.remove(c)
            if nxt < conv:
                act.append(nxt)
                turn[nxt] = 0
                nxt += 1
    return computed, d.ev


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dev", type=int, nargs="*", default=[50, 150], help="device blocks left for cached prefixes")
    ap.add_argument("--dram", type=int, nargs="*", default=[8192, 1024], help="DRAM tier blocks (2 MiB each)")
    a = ap.parse_args()
    for cap in a.dram:
        for dev in a.dev:
            for lru, tm in ((False, False), (False, True), (True, False), (True, True)):
                c, e = run(cap, dev, lru, tm)
                print("dram %5d blocks, device %3d: %-7s touch-match %d: computed %7d tokens, %5d evictions" %
                      (cap, dev, "lru" if lru else "s3fifo", tm, c, e))


if __name__ == "__main__":
    main()
