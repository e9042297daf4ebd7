"""Shared by hf_random_check.py and hf_random_depth.py: a seeded random Llama-3.2-1B-shaped model
built with transformers and saved as bf16 safetensors, its last-position logits from transformers
(loaded back with from_pretrained, as users load models) and from `pdserve generate`.

Why from_pretrained and not the built model: Module.to(bfloat16) also rounds the non-persistent
RoPE buffer inv_freq to bf16, which moves every rotary angle (0.19 rad at position 95 for the
fastest frequency), so the "fp32" reference would not be the model's fp32 forward.
"""
import json
import os
import shutil
import subprocess

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "../..")


def prompt_ids():
    """96 seeded random token ids below 4000, shape (1, 96)."""
    return torch.randint(0, 4000, (1, 96), generator=torch.Generator().manual_seed(1))


def build(model_dir, init="default", n_layers=None):
    """Saves the seeded model in model_dir (with a tokenizer pdserve can load). init: "default"
    (transformers' own, std 0.02) or "wide" (N(0, 1/fan_in), norms 1 + 0.2 N(0, 1))."""
    cfg = json.load(open(os.path.join(REPO, "bench/configs/llama-3.2-1b/config.json")))
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    if n_layers is not None:
        cfg["num_hidden_layers"] = n_layers
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)
    if init == "wide":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_((1 + 0.2 * torch.randn_like(p.float())).to(p.dtype))
                else:
                    p.copy_((torch.randn_like(p.float()) / (p.shape[-1] ** 0.5)).to(p.dtype))
    model.save_pretrained(model_dir, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(REPO, "models/kjv-llama-6m", f), model_dir)


def hf_logits(model_dir, ids):
    """{torch.bfloat16: logits, torch.float32: logits} of the last position (float32, CPU), and the
    dtype of the loaded model's inv_freq buffer."""
    refs, inv_freq_dtype = {}, None
    for dt in (torch.bfloat16, torch.float32):
        m = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=dt).cuda().eval()
        inv_freq_dtype = str(m.model.rotary_emb.inv_freq.dtype)
        with torch.no_grad():
            refs[dt] = m(ids.cuda()).logits[0, -1].float().cpu()
        del m
    torch.cuda.empty_cache()
    return refs, inv_freq_dtype


def pd_logits(bin_path, model_dir, ids, device, out_path, extra=()):
    """Last-position logits of `pdserve generate --device DEVICE --logits-out` (extra: more flags)."""
    subprocess.run([bin_path, "generate", "--model", model_dir, "--device", device, "--prompt-ids",
                    ",".join(str(int(x)) for x in ids[0]), "--max-tokens", "1", "--temperature", "0",
                    "--logits-out", out_path, "--output", "json", *extra], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return torch.frombuffer(bytearray(open(out_path, "rb").read()), dtype=torch.float32)


def rel(a, b):
    """Relative L2 error of a against b."""
    return float((a - b).norm() / b.norm())
