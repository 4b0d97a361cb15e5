"""DeepSeek's multi-head latent attention (MLA) with its compressed KV cache.

Per token the cache keeps one vector of `kv_lora_rank + qk_rope_head_dim` values, shared by every head: the
normalised latent c (`kv_a_layernorm(kv_a_proj_with_mqa(x)[:rank])`) and the rotated decoupled key k_pe. `kv_b_proj`
is never applied to the cache; it is split at load into W_uk [H, nope, rank] and W_uv [H, v, rank] and absorbed:
- scores: q_nope · (W_uk c) + q_pe · k_pe = [q_nope W_uk, q_pe] · [c, k_pe], i.e. multi-query attention of
  head size rank + rope over the one cached vector per token;
- values: Σ p (W_uv c) = W_uv (Σ p c), so attention reads c itself as the value (a view of the cached key's first
  `rank` values) and W_uv is applied to each head's output afterwards.
This is exactly transformers' expanded computation, reordered. The cache is a `KVCache` with one "head" of key size
rank + rope and empty values; RoPE rotates the last `qk_rope_head_dim` values of the key (what
`Model.shift_cache` re-rotates). The checkpoint's rotary dimensions come in interleaved pairs (DeepSeek-V2, V3
with `rope_interleave`); their rows are permuted at load into the rotate-half layout the tables use, which leaves
every q_pe · k_pe unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from kobold_backend import ops
from kobold_backend.ops.reference import rotate_half, row_positions


@dataclass
class LatentAttention:
    """One layer's MLA weights (before o_proj). `q_proj` [H*(nope+rope), hidden], or `q_a_proj` [q_rank, hidden],
    `q_a_norm` [q_rank] and `q_b_proj` [H*(nope+rope), q_rank] (V3's q LoRA); `kv_a_proj` [rank+rope, hidden];
    `w_uk` [H, nope, rank] and `w_uv` [H, v, rank] from kv_b_proj."""

    kv_a_proj: Any
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    num_heads: int
    nope: int
    rope: int
    eps: float
    q_proj: Optional[Any] = None
    q_a_proj: Optional[Any] = None
    q_a_norm: Optional[torch.Tensor] = None
    q_b_proj: Optional[Any] = None
    q_a_bias: Optional[torch.Tensor] = None
    kv_a_bias: Optional[torch.Tensor] = None

    @property
    def rank(self) -> int:
        return int(self.w_uk.shape[-1])

    def tensors(self) -> Iterator[Any]:
        for t in (self.kv_a_proj, self.kv_a_norm, self.w_uk, self.w_uv, self.q_proj, self.q_a_proj, self.q_a_norm,
                  self.q_b_proj, self.q_a_bias, self.kv_a_bias):
            if t is not None:
                yield t

    def __call__(self, x: torch.Tensor, k_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int,
                 scale: float, pos_t: Optional[torch.Tensor] = None, length: int = 0) -> torch.Tensor:
        """Attention output [B, T, H * v] for normed x [B, T, hidden] at positions pos.. (or the device position
        `pos_t` of a graph step's first token over `length` cache positions); writes the tokens' cache entries."""
        from kobold_backend.engine.model import project

        b, t, _ = x.shape
        h, rank = self.num_heads, self.rank
        if self.q_proj is not None:
            q = project(x, self.q_proj)
        else:
            q = project(ops.rms_norm(project(x, self.q_a_proj, self.q_a_bias), self.q_a_norm, self.eps),
                        self.q_b_proj)
        q_nope, q_pe = q.view(b, t, h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = project(x, self.kv_a_proj, self.kv_a_bias).split([rank, self.rope], dim=-1)
        latent = ops.rms_norm(latent, self.kv_a_norm, self.eps)
        at = None if pos_t is None else row_positions(pos_t, t)
        if at is not None:
            c, s = cos.index_select(0, at).view(1, t, 1, -1), sin.index_select(0, at).view(1, t, 1, -1)
        else:
            c, s = cos[pos : pos + t].view(1, t, 1, -1), sin[pos : pos + t].view(1, t, 1, -1)
        q_pe = (q_pe.float() * c + rotate_half(q_pe.float()) * s).to(q.dtype)
        k_pe = (k_pe.unsqueeze(2).float() * c + rotate_half(k_pe.unsqueeze(2).float()) * s).to(q.dtype)
        entry = torch.cat([latent.unsqueeze(2), k_pe], dim=-1).transpose(1, 2)  # [B, 1, T, rank + rope]
        q_lat = torch.einsum("bthn,hnr->bthr", q_nope, self.w_uk)
        query = torch.cat([q_lat, q_pe], dim=-1)
        values = k_cache[..., :rank]
        if at is not None:
            k_cache.index_copy_(2, at, entry)
            out = ops.decode_attention_rows(query, k_cache, values, pos_t, length, scale)
        else:
            k_cache[:, :, pos : pos + t].copy_(entry)
            if t == 1:
                out = ops.decode_attention(query[:, 0], k_cache, values, pos + 1, scale).unsqueeze(1)
            else:
                out = ops.attention(query, k_cache, values, pos, scale)
        return torch.einsum("bthr,hvr->bthv", out, self.w_uv).reshape(b, t, -1)
