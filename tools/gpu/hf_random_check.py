#!/usr/bin/env python3
"""Issue check: a random Llama-3.2-1B-shaped model created with transformers (seeded) gives the same
last-position logits in pdserve (CUDA, bf16) as in transformers (bf16, CUDA).

usage (on the GPU machine): python3 tools/gpu/hf_random_check.py PDSERVE_BIN OUT_DIR
Writes OUT_DIR/hf_random_check.json with the relative L2 error and top-1 agreement.
"""
import json
import os
import subprocess
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

bin_path, out_dir = sys.argv[1], sys.argv[2]
cfg = json.load(open(os.path.join(os.path.dirname(__file__), "../../bench/configs/llama-3.2-1b/config.json")))
model_dir = "/tmp/pd_random_llama_1b"
torch.manual_seed(0)
config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")})
model = LlamaForCausalLM(config).to(torch.bfloat16)
# Default init gives tiny logits; widen the weights so the comparison is not trivially near zero.
with torch.no_grad():
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.2 * torch.randn_like(p.float()).to(p.dtype))
        else:
            p.copy_(torch.randn_like(p.float()).to(p.dtype) / (p.shape[-1] ** 0.5))
model.save_pretrained(model_dir, safe_serialization=True)
# A tokenizer folder is needed by `pdserve generate`: reuse the repo's bundled one (ids only matter).
import shutil
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(os.path.dirname(__file__), "../../models/kjv-llama-6m", f), model_dir)
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 4000, (1, 96), generator=g)
with torch.no_grad():
    ref = model.cuda()(ids.cuda()).logits[0, -1].float().cpu()
out = os.path.join(out_dir, "pd_logits.bin")
subprocess.run([bin_path, "generate", "--model", model_dir, "--device", "cuda", "--prompt-ids",
                ",".join(str(int(x)) for x in ids[0]), "--max-tokens", "1", "--temperature", "0",
                "--logits-out", out, "--output", "json"], check=True)
got = torch.frombuffer(bytearray(open(out, "rb").read()), dtype=torch.float32)
rel = float((got - ref).norm() / ref.norm())
res = {"rel_l2": rel, "top1_equal": int(got.argmax()) == int(ref.argmax()), "vocab": int(ref.numel()), "limit": 2e-2}
json.dump(res, open(os.path.join(out_dir, "hf_random_check.json"), "w"), indent=1)
print(json.dumps(res))
sys.exit(0 if rel <= 2e-2 else 1)
