"""A Llama-architecture decoder (the layers of transformers' LlamaForCausalLM: RMSNorm, grouped-query attention
with rotary embeddings, SwiGLU MLP) with a static KV cache, for the decode figure: every projection an
nn.Linear (q, k, v, o, gate, up, down), so `convert` / `to_sparse24` reach them. Built here with seeded
weights (no transformers, no download); `LLAMA3_8B` holds Llama-3-8B's widths.

Decoding: `step(tokens_embedded, position)` takes (batch, 1, hidden) and the position of that token, writes
its keys and values into the cache and attends over positions 0..position; `forward` runs a whole prompt
(batch, T, hidden) from position 0 the same way, so the two agree (tests/cpu/models/test_llama.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaShape:
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    layers: int = 2
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA3_8B = LlamaShape()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        s, hd = shape, shape.head_dim
        self.shape = shape
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.q_proj = nn.Linear(s.hidden, s.heads * hd, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(s.heads * hd, s.hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x, cos, sin, k_cache, v_cache, position: torch.Tensor):
        """x: (batch, T, hidden) at positions position..position+T-1 (position: a 0-d long tensor, so one
        CUDA graph serves every step); the caches (batch, kv_heads, max_len, head_dim) are written in place."""
        s, hd = self.shape, self.shape.head_dim
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, s.heads, hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, s.kv_heads, hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, s.kv_heads, hd).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        index = position + torch.arange(t, device=x.device)
        k_cache.index_copy_(2, index, k)
        v_cache.index_copy_(2, index, v)
        max_len = k_cache.shape[2]
        keys = k_cache.repeat_interleave(s.heads // s.kv_heads, dim=1)
        values = v_cache.repeat_interleave(s.heads // s.kv_heads, dim=1)
        # causal over the cache: query i (at position + i) sees cache positions <= position + i
        visible = torch.arange(max_len, device=x.device)[None, :] <= index[:, None]
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, s.hidden))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaDecoder(nn.Module):
    """The decoder layers with their rotary tables and static caches (the embedding and lm_head are left out:
    the decode figure times the decoder layers, the 1 GB lm_head apart)."""

    def __init__(self, shape: LlamaShape = LLAMA3_8B, max_len: int = 256):
        super().__init__()
        self.shape, self.max_len = shape, max_len
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.hidden, shape.eps)
        inv = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim))
        freqs = torch.outer(torch.arange(max_len).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)

    @property
    def caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(getattr(self, f"k_cache{i}"), getattr(self, f"v_cache{i}")) for i in range(len(self.layers))
                if hasattr(self, f"k_cache{i}")]

    def reset_cache(self, batch: int) -> None:
        """Static caches for `batch` sequences, on the model's device and dtype (zeros): buffers (not saved),
        so .to() / .half() / deepcopy move them with the weights."""
        p = next(self.parameters())
        shape = (batch, self.shape.kv_heads, self.max_len, self.shape.head_dim)
        for i in range(len(self.layers)):
            for kind in ("k", "v"):
                self.register_buffer(f"{kind}_cache{i}", torch.zeros(shape, device=p.device, dtype=p.dtype),
                                     persistent=False)

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """x: (batch, T, hidden) embedded tokens at positions position.. (a 0-d long tensor)."""
        caches = self.caches
        if len(caches) != len(self.layers) or caches[0][0].shape[0] != x.shape[0]:
            raise ValueError(f"the KV cache is not set up for a batch of {x.shape[0]}: call reset_cache({x.shape[0]}) "
                             "first")
        t = x.shape[1]
        index = position + torch.arange(t, device=x.device)
        cos = self.cos_table.index_select(0, index).to(x.dtype)[None, None]
        sin = self.sin_table.index_select(0, index).to(x.dtype)[None, None]
        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            x = layer(x, cos, sin, k_cache, v_cache, position)
        return self.norm(x)


def llama_decoder(shape: LlamaShape = LLAMA3_8B, max_len: int = 256, seed: int = 0) -> LlamaDecoder:
    """Seeded weights: projections ~ N(0, 0.02) as transformers' initializer_range, norms at 1."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaDecoder(shape, max_len)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
    return model

