"""The Llama-family transformer: Model.forward(ids, cache) -> logits, reading top to bottom.

Each layer calls `kobold_backend.ops`, which runs the native kernels where they are loaded.
A `passthrough` (ForwardHooks, see engine/passthrough/base.py) may observe or change the residual stream
after each layer and add low-rank deltas to the projections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import torch

from kobold_backend import ops
from kobold_backend.engine.cache import KVCache
from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.fuse import concat_outputs
from kobold_backend.ops.gptq_weight import GPTQWeight
from kobold_backend.ops.reference import rotate_half

if TYPE_CHECKING:
    from kobold_backend.engine.passthrough.base import ForwardHooks

Weight = Union[torch.Tensor, GPTQWeight]


def project(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [..., K] @ w -> [..., N] for a dense weight [N, K] or a GPTQ layer."""
    if isinstance(w, GPTQWeight):
        shape = x.shape
        y = ops.gptq_matmul(x.reshape(-1, shape[-1]), w)
        return y.view(*shape[:-1], w.out_features)
    return ops.linear(x, w)


QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def _out_features(w: Weight) -> int:
    return w.out_features if isinstance(w, GPTQWeight) else int(w.shape[0])


@dataclass
class Layer:
    """Weights of one decoder block, all on `device`."""

    input_norm: torch.Tensor
    q_proj: Optional[Weight]
    k_proj: Optional[Weight]
    v_proj: Optional[Weight]
    o_proj: Weight
    post_norm: torch.Tensor
    gate_proj: Optional[Weight]
    up_proj: Optional[Weight]
    down_proj: Weight
    device: torch.device
    qkv_proj: Optional[Weight] = None
    gate_up_proj: Optional[Weight] = None
    out_features: Dict[str, int] = field(default_factory=dict)

    PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "qkv_proj", "gate_up_proj")

    def weight(self, name: str) -> Weight:
        """The weight of one projection (a copy of its columns of the fused weight when it was fused)."""
        own = getattr(self, name)
        if own is not None:
            return own
        fused_name, names = ("qkv_proj", QKV) if name in QKV else ("gate_up_proj", GATE_UP)
        fused = getattr(self, fused_name)
        sizes = [self.out_features[n] for n in names]
        start = sum(sizes[: names.index(name)])
        end = start + sizes[names.index(name)]
        if isinstance(fused, GPTQWeight):
            cols = slice(start, end)
            return GPTQWeight(fused.qweight[:, cols].contiguous(), fused.scales[:, cols].contiguous(),
                              fused.zeros[:, cols].contiguous(), fused.perm, fused.group_size, fused.in_features,
                              end - start, None if fused.bias is None else fused.bias[cols].contiguous())
        return fused[start:end]

    def fuse(self) -> None:
        """Replace q/k/v and gate/up by one wide weight each where they can fuse (see engine/fuse.py)."""
        self.out_features = {n: _out_features(getattr(self, n)) for n in QKV + GATE_UP}
        qkv = concat_outputs([self.q_proj, self.k_proj, self.v_proj])  # type: ignore[list-item]
        if qkv is not None:
            self.qkv_proj, self.q_proj, self.k_proj, self.v_proj = qkv, None, None, None
        gate_up = concat_outputs([self.gate_proj, self.up_proj])  # type: ignore[list-item]
        if gate_up is not None:
            self.gate_up_proj, self.gate_proj, self.up_proj = gate_up, None, None


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
            num_layers=len(self.layers),
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
        passthrough: Optional[ForwardHooks] = None,
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
    def shift_cache(self, cache: KVCache, start: int, drop: int) -> None:
        """Remove positions [start, start+drop) from the cache in place: later positions move left by `drop`
        and their keys are re-rotated by -drop positions, so they read as if computed at their new place."""
        end = cache.seq_len
        if drop <= 0 or not 0 <= start < start + drop <= end:
            raise ValueError(f"cannot drop {drop} positions at {start} from a cache of {end}")
        moved = end - start - drop
        for index in range(len(self.layers)):
            k, v = cache.k[index], cache.v[index]
            cos = self.cos[index][drop].float()
            sin = self.sin[index][drop].float()
            src = k[:, :, start + drop : end].float()
            k[:, :, start : start + moved].copy_(src * cos - rotate_half(src) * sin)
            v[:, :, start : start + moved].copy_(v[:, :, start + drop : end].clone())
        cache.seq_len = start + moved
        del cache.tokens[start : start + drop]

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
        passthrough: Optional[ForwardHooks],
        pos_t: Optional[torch.Tensor] = None,
        length: int = 0,
    ) -> torch.Tensor:
        cfg = self.config
        b, t, _ = h.shape
        x = ops.rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
        qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = self._projs(index, layer, "qkv_proj", ("q_proj", "k_proj", "v_proj"), (qd, kvd, kvd), x,
                              passthrough)
        q = q.view(b, t, cfg.num_heads, cfg.head_dim)
        k = k.view(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim)
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
        gate, up = self._projs(index, layer, "gate_up_proj", ("gate_proj", "up_proj"),
                               (cfg.intermediate_size, cfg.intermediate_size), x, passthrough)
        down = self._proj(index, layer, "down_proj", ops.silu_mul(gate, up), passthrough)
        return h + down

    @staticmethod
    def _proj(index: int, layer: Layer, name: str, x: torch.Tensor,
              passthrough: Optional[ForwardHooks]) -> torch.Tensor:
        y = project(x, getattr(layer, name))
        if passthrough is not None:
            delta = passthrough.linear_delta(index, name, x)
            if delta is not None:
                y = y + delta.to(y.dtype)
        return y

    def _projs(
        self,
        index: int,
        layer: Layer,
        fused: str,
        names: Tuple[str, ...],
        sizes: Tuple[int, ...],
        x: torch.Tensor,
        passthrough: Optional[ForwardHooks],
    ) -> List[torch.Tensor]:
        """The outputs of projections that share the input x, through their fused weight when there is one."""
        weight = getattr(layer, fused)
        if weight is None:
            return [self._proj(index, layer, name, x, passthrough) for name in names]
        outs = list(project(x, weight).split(list(sizes), dim=-1))
        if passthrough is not None:
            for i, name in enumerate(names):
                delta = passthrough.linear_delta(index, name, x)
                if delta is not None:
                    outs[i] = outs[i] + delta.to(outs[i].dtype)
        return outs

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
            total += sum(size(getattr(layer, n)) for n in Layer.PROJECTIONS if getattr(layer, n) is not None)
            total += size(layer.input_norm) + size(layer.post_norm)
        return total
