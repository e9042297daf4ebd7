#!/usr/bin/env python3
"""Diagnostic for the random-Llama-3.2-1B bf16 check (hf_random_check.py): where does pdserve's bf16
error come from? For models truncated to 1, 2, 4, 8 and 16 layers (same seeded weights) it prints
the relative L2 error of the last-position logits of pdserve CUDA bf16, pdserve CPU fp32 and
transformers bf16 against transformers fp32 (same bf16 weights, upcast).

usage (GPU machine): python3 tools/gpu/hf_random_depth.py PDSERVE_BIN OUT_DIR [default|wide]
"""
import json
import os
import shutil
import subprocess
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

bin_path, out_dir = sys.argv[1], sys.argv[2]
init = sys.argv[3] if len(sys.argv) > 3 else "default"
here = os.path.dirname(os.path.abspath(__file__))
cfg = json.load(open(os.path.join(here, "../../bench/configs/llama-3.2-1b/config.json")))
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 4000, (1, 96), generator=g)
rel = lambda a, b: float((a - b).norm() / b.norm())
rows = []
for n_layers in (1, 2, 4, 8, 16):
    c = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    c["num_hidden_layers"] = n_layers
    config = LlamaConfig(**c)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    if init == "wide":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_((1 + 0.2 * torch.randn_like(p.float())).to(p.dtype))
                else:
                    p.copy_((torch.randn_like(p.float()) / (p.shape[-1] ** 0.5)).to(p.dtype))
    d = "/tmp/pd_depth_%d" % n_layers
    model.save_pretrained(d, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(here, "../../models/kjv-llama-6m", f), d)
    del model
    refs = {}
    for dt in (torch.bfloat16, torch.float32):
        # from_pretrained, as users load models: casting the built model with .to(bfloat16) would
        # also round the RoPE buffer inv_freq (see hf_random_check.py)
        m = LlamaForCausalLM.from_pretrained(d, torch_dtype=dt).cuda().eval()
        with torch.no_grad():
            refs[dt] = m(ids.cuda()).logits[0, -1].float().cpu()
        del m
    r16, r32 = refs[torch.bfloat16], refs[torch.float32]
    got = {}
    for dev in ("cuda", "cpu"):
        out = os.path.join(out_dir, "l%d_%s.bin" % (n_layers, dev))
        subprocess.run([bin_path, "generate", "--model", d, "--device", dev, "--prompt-ids",
                        ",".join(str(int(x)) for x in ids[0]), "--max-tokens", "1", "--temperature", "0",
                        "--logits-out", out, "--output", "json"], check=True, stdout=subprocess.DEVNULL)
        got[dev] = torch.frombuffer(bytearray(open(out, "rb").read()), dtype=torch.float32)
    row = {"layers": n_layers, "pd_cuda_vs_fp32": rel(got["cuda"], r32), "hf_bf16_vs_fp32": rel(r16, r32),
           "pd_cuda_vs_hf_bf16": rel(got["cuda"], r16), "pd_cpu_vs_fp32": rel(got["cpu"], r32),
           "logit_rms": float(r32.norm() / r32.numel() ** 0.5)}
    print(json.dumps(row), flush=True)
    rows.append(row)
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(out_dir, "depth_%s.json" % init), "w"), indent=1)
