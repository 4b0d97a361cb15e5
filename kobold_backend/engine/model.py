"""The Llama-family transformer: Model.forward(ids, cache) -> logits, reading top to bottom.

Each layer calls `kobold_backend.ops`, which runs the native kernels where they are loaded.
A `passthrough` object (see engine/passthrough.py) may observe or change the residual stream
after each layer and add low-rank deltas to the projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Union

import torch

from kobold_backend import ops
from kobold_backend.engine.cache import KVCache
from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.gptq import GPTQWeight

Weight = Union[torch.Tensor, GPTQWeight]


def project(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [..., K] @ w -> [..., N] for a dense weight [N, K] or a GPTQ layer."""
    if isinstance(w, GPTQWeight):
        shape = x.shape
        y = ops.gptq_matmul(x.reshape(-1, shape[-1]), w)
        return y.view(*shape[:-1], w.out_features)
    return ops.linear(x, w)


@dataclass
class Layer:
    """Weights of one decoder block, all on `device`."""

    input_norm: torch.Tensor
    q_proj: Weight
    k_proj: Weight
    v_proj: Weight
    o_proj: Weight
    post_norm: torch.Tensor
    gate_proj: Weight
    up_proj: Weight
    down_proj: Weight
    device: torch.device

    PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Model:
    """A loaded Llama-family model. Build it with `kobold_backend.engine.loader.load_model`."""

    def __init__(
        self,
        config: ModelConfig,
        embed_tokens: torch.Tensor,
        layers: List[Layer],
        norm: torch.Tensor,
        lm_head: Weight,
        cos: List[torch.Tensor],
        sin: List[torch.Tensor],
        dtype: torch.dtype,
        max_seq_len: int,
    ) -> None:
        self.config = config
        self.embed_tokens = embed_tokens
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.cos = cos
        self.sin = sin
        self.dtype = dtype
        self.max_seq_len = max_seq_len
        self.device = norm.device
        self.scale = config.head_dim ** -0.5

    def new_cache(self, max_seq_len: Optional[int] = None, batch_size: int = 1) -> KVCache:
        n = max_seq_len or self.max_seq_len
        if n > self.max_seq_len:
            raise ValueError(f"a cache of {n} positions exceeds the RoPE tables of {self.max_seq_len}")
        return KVCache(
            num_layers=self.config.num_layers,
            batch_size=batch_size,
            num_kv_heads=self.config.num_kv_heads,
            max_seq_len=n,
            head_dim=self.config.head_dim,
            dtypes=[layer.input_norm.dtype for layer in self.layers],
            devices=[layer.device for layer in self.layers],
        )

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        cache: KVCache,
        *,
        passthrough: Optional[Any] = None,
        last_only: bool = True,
    ) -> torch.Tensor:
        """Run ids [B, T] at positions cache.seq_len.. and return float32 logits [B, 1 or T, V]."""
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        t = ids.shape[1]
        pos = cache.reserve(t)
        h = self.embed_tokens[ids.to(self.embed_tokens.device)]
        for index, layer in enumerate(self.layers):
            h = h.to(device=layer.device, dtype=layer.input_norm.dtype)
            h = self._layer(index, layer, h, cache, pos, passthrough)
            if passthrough is not None:
                h = passthrough.after_layer(index, h, pos)
        cache.seq_len = pos + t
        if last_only:
            h = h[:, -1:]
        return self._logits(h)

    @torch.inference_mode()
    def decode_step(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, length: int) -> torch.Tensor:
        """One token [B, 1] at the device-tensor position `pos`, attending over the first `length` cache
        positions; no host-side state changes, so a CUDA graph can capture it. The caller advances
        `cache.seq_len`."""
        h = self.embed_tokens[ids.to(self.embed_tokens.device)]
        for index, layer in enumerate(self.layers):
            h = h.to(device=layer.device, dtype=layer.input_norm.dtype)
            h = self._layer(index, layer, h, cache, 0, None, pos, length)
        return self._logits(h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = h.to(device=self.device, dtype=self.dtype)
        return project(ops.rms_norm(h, self.norm, self.config.rms_norm_eps), self.lm_head).float()

    def _layer(
        self,
        index: int,
        layer: Layer,
        h: torch.Tensor,
        cache: KVCache,
        pos: int,
        passthrough: Optional[Any],
        pos_t: Optional[torch.Tensor] = None,
        length: int = 0,
    ) -> torch.Tensor:
        cfg = self.config
        b, t, _ = h.shape
        x = ops.rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
        q = self._proj(index, layer, "q_proj", x, passthrough).view(b, t, cfg.num_heads, cfg.head_dim)
        k = self._proj(index, layer, "k_proj", x, passthrough).view(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self._proj(index, layer, "v_proj", x, passthrough).view(b, t, cfg.num_kv_heads, cfg.head_dim)
        k_cache, v_cache = cache.k[index], cache.v[index]
        if pos_t is not None:
            q = ops.rope_cache_write_at(q, k, v, self.cos[index], self.sin[index], pos_t, k_cache, v_cache)
            a = ops.decode_attention_at(q[:, 0], k_cache, v_cache, pos_t, length, self.scale)
        elif t == 1:
            q = ops.rope_cache_write(q, k, v, self.cos[index], self.sin[index], pos, k_cache, v_cache)
            a = ops.decode_attention(q[:, 0], k_cache, v_cache, pos + 1, self.scale)
        else:
            q = ops.rope_cache_write(q, k, v, self.cos[index], self.sin[index], pos, k_cache, v_cache)
            a = ops.attention(q, k_cache, v_cache, pos, self.scale)
        a = self._proj(index, layer, "o_proj", a.reshape(b, t, cfg.num_heads * cfg.head_dim), passthrough)
        x, h = ops.add_rms_norm(a, h, layer.post_norm, cfg.rms_norm_eps)
        gate = self._proj(index, layer, "gate_proj", x, passthrough)
        up = self._proj(index, layer, "up_proj", x, passthrough)
        down = self._proj(index, layer, "down_proj", ops.silu_mul(gate, up), passthrough)
        return h + down

    @staticmethod
    def _proj(index: int, layer: Layer, name: str, x: torch.Tensor, passthrough: Optional[Any]) -> torch.Tensor:
        y = project(x, getattr(layer, name))
        if passthrough is not None:
            delta = passthrough.linear_delta(index, name, x)
            if delta is not None:
                y = y + delta.to(y.dtype)
        return y

    @property
    def nbytes(self) -> int:
        def size(w: Any) -> int:
            if isinstance(w, GPTQWeight):
                return w.nbytes
            return w.numel() * w.element_size()

        total = size(self.embed_tokens) + size(self.norm)
        if self.lm_head is not self.embed_tokens:
            total += size(self.lm_head)
        for layer in self.layers:
            total += sum(size(getattr(layer, n)) for n in Layer.PROJECTIONS)
            total += size(layer.input_norm) + size(layer.post_norm)
        return total
