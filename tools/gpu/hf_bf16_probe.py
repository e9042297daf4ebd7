#!/usr/bin/env python3
"""Diagnostic for the random-model check (hf_random_check.py): how far transformers' own bf16
variants are from each other, and which one pdserve is closest to. Variants of the same model and
prompt: the default (sdpa), each sdpa backend forced (flash, efficient, math), eager attention, and
sdpa with the q/k/v and gate/up projections fused into one GEMM each (as pdserve runs them).
Also prints torch's version, to tell which sdpa backend its default is.

usage (GPU machine): python3 tools/gpu/hf_bf16_probe.py PDSERVE_BIN OUT_DIR
"""
import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaForCausalLM

from hf_random_model import build, pd_logits, prompt_ids, rel


class _Fused(torch.nn.Module):
    """The first projection of a group computes the fused GEMM; the others return their slice."""

    def __init__(self, group, i, state):
        super().__init__()
        self.group, self.i, self.state = group, i, state

    def forward(self, x):
        if self.i == 0:
            w = torch.cat([m.weight for m in self.group])
            y = torch.nn.functional.linear(x, w)
            self.state["parts"] = torch.split(y, [m.weight.shape[0] for m in self.group], dim=-1)
        return self.state["parts"][self.i]


def fuse(model):
    for layer in model.model.layers:
        a, f = layer.self_attn, layer.mlp
        for group, names, owner in (((a.q_proj, a.k_proj, a.v_proj), ("q_proj", "k_proj", "v_proj"), a),
                                    ((f.gate_proj, f.up_proj), ("gate_proj", "up_proj"), f)):
            state = {}
            for i, n in enumerate(names):
                setattr(owner, n, _Fused(group, i, state))


def run(model, ids, backend=None):
    with torch.no_grad():
        if backend is None:
            return model(ids.cuda()).logits[0, -1].float().cpu()
        with sdpa_kernel(backend):
            return model(ids.cuda()).logits[0, -1].float().cpu()


bin_path, out_dir = sys.argv[1], sys.argv[2]
os.makedirs(out_dir, exist_ok=True)
ids = prompt_ids()
report = {"torch": torch.__version__}
for init in ("default", "wide"):
    d = "/tmp/pd_probe_" + init
    build(d, init)
    got = pd_logits(bin_path, d, ids, "cuda", os.path.join(out_dir, "pd_%s.bin" % init))
    outs = {}
    m = LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32).cuda().eval()
    f32 = run(m, ids)
    del m
    m = LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.bfloat16).cuda().eval()
    outs["sdpa"] = run(m, ids)
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", getattr(SDPBackend, "CUDNN_ATTENTION", None)), ("math", SDPBackend.MATH)):
        if be is None:
            continue
        try:
            outs[name] = run(m, ids, be)
        except Exception as e:  # a backend that cannot take these inputs
            report.setdefault("errors", []).append("%s: %s" % (name, e))
    fuse(m)
    outs["sdpa_fused_proj"] = run(m, ids)
    del m
    m = LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
    outs["eager"] = run(m, ids)
    del m
    torch.cuda.empty_cache()
    report[init] = {k: {"vs_sdpa": rel(v, outs["sdpa"]), "pdserve_vs_it": rel(got, v), "it_vs_fp32": rel(v, f32)}
                    for k, v in outs.items()}
    report[init]["pdserve_vs_fp32"] = rel(got, f32)
json.dump(report, open(os.path.join(out_dir, "hf_bf16_probe.json"), "w"), indent=1)
print(json.dumps(report, indent=1))
