#!/usr/bin/env python3
"""Diagnostic for the random-Llama-3.2-1B bf16 check (hf_random_check.py): where does pdserve's bf16
error come from? For models truncated to 1, 2, 4, 8 and 16 layers (same seeded weights) it prints
the relative L2 error of the last-position logits of pdserve CUDA bf16, pdserve CPU fp32 and
transformers bf16 against transformers fp32 (same bf16 weights, upcast).

usage (GPU machine): python3 tools/gpu/hf_random_depth.py PDSERVE_BIN OUT_DIR [default|wide]
"""
import json
import os
import sys

import torch

from hf_random_model import build, hf_logits, pd_logits, prompt_ids, rel

bin_path, out_dir = sys.argv[1], sys.argv[2]
init = sys.argv[3] if len(sys.argv) > 3 else "default"
ids = prompt_ids()
rows = []
for n_layers in (1, 2, 4, 8, 16):
    d = "/tmp/pd_depth_%d" % n_layers
    build(d, init, n_layers)
    refs, _ = hf_logits(d, ids)
    r16, r32 = refs[torch.bfloat16], refs[torch.float32]
    got = {dev: pd_logits(bin_path, d, ids, dev, os.path.join(out_dir, "l%d_%s.bin" % (n_layers, dev)))
           for dev in ("cuda", "cpu")}
    row = {"layers": n_layers, "pd_cuda_vs_fp32": rel(got["cuda"], r32), "hf_bf16_vs_fp32": rel(r16, r32),
           "pd_cuda_vs_hf_bf16": rel(got["cuda"], r16), "pd_cpu_vs_fp32": rel(got["cpu"], r32),
           "logit_rms": float(r32.norm() / r32.numel() ** 0.5)}
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump(rows, open(os.path.join(out_dir, "depth_%s.json" % init), "w"), indent=1)
