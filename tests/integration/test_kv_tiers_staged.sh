#!/bin/sh
# test_kv_tiers.sh again with the device-cache path on the cpu backend (PDSERVE_KV_TIER_STAGING=1):
# the DRAM tier whose pages are the staged rows (kvconn/tier.c "hot"), the disk fed by its victims,
# Redis by every block; the same checks (greedy outputs identical to tiers off, hits from DRAM,
# disk and Redis, restart, corrupted disk pages, Redis killed, the pool shared by two workers).
PDSERVE_KV_TIER_STAGING=1 exec sh "$(dirname "$0")/test_kv_tiers.sh"
