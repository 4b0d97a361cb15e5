"""Output-gated attention with partial RoPE (the full-attention layers of Qwen3.5 / Qwen3-Next).

q_proj yields, per head, the query and a gate of head_dim each (stored interleaved by head); q and k get a per-head
RMSNorm, RoPE turns only the first `rotary_dim` values of each head (rotate-half within them), and the attention
output is multiplied by sigmoid(gate) before o_proj. Keys and values go to the layer's K/V buffers of the cache
(plain or quantized), attention runs through `kobold_backend.ops`.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from kobold_backend import ops
from kobold_backend.engine.model import Weight, project
from kobold_backend.ops.reference import rotate_half


class GatedAttention:
    """One full-attention token mixer: `mixer(x, cache, index, pos)` maps the normed hidden state [B, T, H] to the
    layer's mixer output [B, T, H], writing positions pos..pos+T-1 of the layer's K/V buffers."""

    uses_kv = True

    def __init__(self, q_proj: Weight, k_proj: Weight, v_proj: Weight, o_proj: Weight, q_norm: torch.Tensor,
                 k_norm: torch.Tensor, heads: int, kv_heads: int, head_dim: int, rotary_dim: int, theta: float,
                 eps: float) -> None:
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rotary_dim = rotary_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.eps = eps
        self.scale = head_dim ** -0.5

    def tensors(self) -> Iterator[Any]:
        yield from (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.q_norm, self.k_norm)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        rot = x[..., :r]
        return torch.cat([(rot * cos + rotate_half(rot) * sin).to(x.dtype), x[..., r:]], dim=-1)

    def __call__(self, x: torch.Tensor, cache: Any, index: int, pos: int) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        qg = project(x, self.q_proj).view(b, t, self.heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(b, t, self.heads * d)
        k = project(x, self.k_proj).view(b, t, self.kv_heads, d)
        v = project(x, self.v_proj).view(b, t, self.kv_heads, d)
        q = ops.rms_norm(q.contiguous(), self.q_norm, self.eps)
        k = ops.rms_norm(k, self.k_norm, self.eps)
        positions = torch.arange(pos, pos + t, dtype=torch.float32, device=x.device)
        freqs = positions[:, None] * self.inv_freq.to(x.device)[None, :]
        angles = torch.cat([freqs, freqs], dim=-1).view(1, t, 1, self.rotary_dim)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        k_cache, v_cache = cache.k[index], cache.v[index]
        k_cache[:, :, pos : pos + t].copy_(k.transpose(1, 2))
        v_cache[:, :, pos : pos + t].copy_(v.transpose(1, 2))
        if t == 1:
            a = ops.decode_attention(q[:, 0], k_cache, v_cache, pos + 1, self.scale)
        else:
            a = ops.attention(q, k_cache, v_cache, pos, self.scale)
        a = a.reshape(b, t, self.heads * d) * torch.sigmoid(gate)
        return project(a, self.o_proj)
