"""A PyTorch EAGLE-3 draft head written from the official semantics (the parity reference).

Written from reading SafeAILab/EAGLE `eagle/model/cnets.py` (inference `Model` +
`LlamaDecoderLayeremb`) and SpecForge `llama3_eagle.py` (`LlamaForCausalLMEagle3`); not copied.
What it reproduces, step for step:
  - fc is applied only when the feature is not D wide (the official run-time width test);
  - residual = the feature BEFORE hidden_norm; x = cat(input_layernorm(emb), hidden_norm(h));
  - q/k/v from the 2D-wide x, RoPE (rotate-half, cos/sin of position * inv_freq) on q and k,
    past K/V concatenated in front, GQA by repeating kv heads, additive finfo.min mask, softmax
    upcast to fp32, o_proj, residual; then post_attention_layernorm -> SwiGLU MLP -> residual;
  - logits = lm_head(norm(h)); the returned hidden is the pre-norm h.
State-dict names are the official checkpoint names (fc, midlayer.*, norm, lm_head, embed_tokens,
d2t, t2d), so `state_dict()` saved with safetensors is an official-format head.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, d, nh, nkv, hd, theta):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(2 * d, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, d, bias=False)
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x, position_ids, add_mask, past_kv=None):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        freqs = position_ids.float()[..., None] * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, hd]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)
            v = torch.cat([past_kv[1], v], dim=2)
        present = (k, v)
        rep = self.nh // self.nkv
        kr = k.repeat_interleave(rep, dim=1)
        vr = v.repeat_interleave(rep, dim=1)
        scores = q @ kr.transpose(2, 3) / math.sqrt(self.hd) + add_mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (probs @ vr).transpose(1, 2).reshape(b, t, self.nh * self.hd)
        return self.o_proj(out), present


class MLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Midlayer(nn.Module):
    def __init__(self, d, f, nh, nkv, hd, eps, theta):
        super().__init__()
        self.self_attn = Attention(d, nh, nkv, hd, theta)
        self.mlp = MLP(d, f)
        self.hidden_norm = RMSNorm(d, eps)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)

    def forward(self, emb, h, position_ids, add_mask, past_kv=None):
        residual = h
        x = torch.cat((self.input_layernorm(emb), self.hidden_norm(h)), dim=-1)
        a, present = self.self_attn(x, position_ids, add_mask, past_kv)
        h = residual + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, present


class Eagle3Draft(nn.Module):
    def __init__(self, d, f, nh, nkv, hd, v, vd, ht, n_aux=3, eps=1e-5, theta=10000.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(v, d)
        self.fc = nn.Linear(n_aux * ht, d, bias=False)
        self.midlayer = Midlayer(d, f, nh, nkv, hd, eps, theta)
        self.norm = RMSNorm(d, eps)
        self.lm_head = nn.Linear(d, vd, bias=False)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(v, dtype=torch.bool))

    def forward(self, feat, input_ids, position_ids, mask_BTS, past_kv=None):
        """feat [B,T,n_aux*Ht] or [B,T,D]; mask_BTS bool over past+new keys -> (h, logits, kv)."""
        emb = self.embed_tokens(input_ids).to(feat.dtype)
        h = self.fc(feat) if feat.shape[-1] != emb.shape[-1] else feat
        add_mask = torch.zeros(mask_BTS.shape, dtype=torch.float32)
        add_mask = add_mask.masked_fill(~mask_BTS, torch.finfo(torch.float32).min)[:, None]
        h, present = self.midlayer(emb, h, position_ids, add_mask, past_kv)
        return h, self.lm_head(self.norm(h)), present
