#!/usr/bin/env python3
"""Issue check: a random Llama-3.2-1B-shaped model created with transformers (seeded) gives the same
last-position logits in pdserve (CUDA, bf16) as in transformers (bf16, CUDA).

usage (on the GPU machine): python3 tools/gpu/hf_random_check.py PDSERVE_BIN OUT_DIR [fp8]
For two initialisations (transformers' own init, std 0.02; and a wider one, N(0, 1/fan_in) with
norms 1 + 0.2 N(0,1), like the golden tiny-random models) it writes the relative L2 error of
pdserve vs transformers bf16, and both vs a transformers fp32 forward of the same (bf16) weights,
so bf16 rounding noise can be told apart from a real difference. Exit 1 if pdserve vs bf16 > 2e-2.
With `fp8` it also runs pdserve with `--kv-cache-dtype fp8` and records that run against
transformers bf16 and fp32 and against pdserve's bf16-cache run (reported, not judged).

The references are loaded with from_pretrained, as users load models; hf_random_model.py says why
(and tools/gpu/hf_random_depth.py is the per-depth diagnostic).
"""
import json
import os
import sys

import torch

from hf_random_model import build, hf_logits, pd_logits, prompt_ids, rel

bin_path, out_dir = sys.argv[1], sys.argv[2]
fp8 = len(sys.argv) > 3 and sys.argv[3] == "fp8"
ids = prompt_ids()
results = {}
ok = True
for init in ("default", "wide"):
    model_dir = "/tmp/pd_random_llama_1b_" + init
    build(model_dir, init)
    refs, inv_freq_dtype = hf_logits(model_dir, ids)
    ref16, ref32 = refs[torch.bfloat16], refs[torch.float32]
    got = pd_logits(bin_path, model_dir, ids, "cuda", os.path.join(out_dir, "pd_logits_%s.bin" % init))
    r = {"pdserve_vs_hf_bf16": rel(got, ref16), "pdserve_vs_hf_fp32": rel(got, ref32),
         "hf_bf16_vs_hf_fp32": rel(ref16, ref32), "top1_equal_bf16": int(got.argmax()) == int(ref16.argmax()),
         "hf_inv_freq_dtype": inv_freq_dtype}
    if fp8:
        g8 = pd_logits(bin_path, model_dir, ids, "cuda", os.path.join(out_dir, "pd_logits_fp8_%s.bin" % init),
                       ("--kv-cache-dtype", "fp8"))
        r.update({"fp8_vs_hf_bf16": rel(g8, ref16), "fp8_vs_hf_fp32": rel(g8, ref32),
                  "fp8_vs_pdserve_bf16_cache": rel(g8, got), "fp8_top1_equal_bf16": int(g8.argmax()) == int(ref16.argmax())})
    results[init] = r
    ok = ok and r["pdserve_vs_hf_bf16"] <= 2e-2
results["limit"] = 2e-2
json.dump(results, open(os.path.join(out_dir, "hf_random_check.json"), "w"), indent=1)
print(json.dumps(results, indent=1))
sys.exit(0 if ok else 1)
