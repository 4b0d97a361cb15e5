"""The decoder-only transformer: Model.forward(ids, cache) -> logits, reading top to bottom.

One generic layer serves every architecture: what differs between families (biases, q/k/v norms, extra norms,
RMSNorm or LayerNorm, a parallel attention/MLP block, activation, scales, soft-capping, sliding windows, RoPE
tables and sizes per layer, interleaved or partial RoPE, layers reading an earlier layer's KV cache, a routed MLP,
per-layer embeddings) is read from `config.features` and from the tensors the loader placed in each `Layer`, as
described in engine/architectures.
Each layer calls `kobold_backend.ops`, which runs the native kernels where they are loaded.
A `passthrough` (ForwardHooks, see engine/passthrough/base.py) may observe or change the residual stream
after each layer and add low-rank deltas to the projections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from kobold_backend import ops
from kobold_backend.engine.cache import KVCache
from kobold_backend.engine.config_types import ConfigData
from kobold_backend.engine.fuse import concat_outputs
from kobold_backend.ops.exl2_weight import EXL2Weight
from kobold_backend.ops.ggml import GGMLWeight
from kobold_backend.ops.gptq_weight import GPTQWeight
from kobold_backend.ops.reference import rotate_half, row_positions

if TYPE_CHECKING:
    from kobold_backend.engine.passthrough.base import ForwardHooks

Weight = Union[torch.Tensor, GPTQWeight, GGMLWeight, EXL2Weight]

ACTIVATIONS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": ops.silu_mul,
    "gelu_tanh": ops.gelu_tanh_mul,
}


def project(x: torch.Tensor, w: Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ w (+ bias) -> [..., N] for a dense weight [N, K], a GPTQ, GGML block or EXL2 layer (those hold
    their own bias)."""
    if isinstance(w, GPTQWeight):
        shape = x.shape
        y = ops.gptq_matmul(x.reshape(-1, shape[-1]), w)
        return y.view(*shape[:-1], w.out_features)
    if isinstance(w, GGMLWeight):
        shape = x.shape
        return ops.ggml_matmul(x.reshape(-1, shape[-1]), w).view(*shape[:-1], w.out_features)
    if isinstance(w, EXL2Weight):
        shape = x.shape
        return ops.exl2_matmul(x.reshape(-1, shape[-1]), w).view(*shape[:-1], w.out_features)
    return ops.linear(x, w, bias)


def head_permutation(head_dim: int, rope_dim: int, interleaved: bool) -> Optional[torch.Tensor]:
    """The order of a head's dimensions that puts the checkpoint's rotated pair i at (i, i + head_dim / 2): entry
    p is the checkpoint dimension stored at p. Pairs are (2i, 2i + 1) when `interleaved`, else (i, i + rope_dim / 2),
    for i < rope_dim / 2; dimensions from rope_dim on pass through. None when the order is already that one."""
    rope_dim = rope_dim or head_dim
    pairs = rope_dim // 2
    first = [2 * i for i in range(pairs)] if interleaved else list(range(pairs))
    second = [2 * i + 1 for i in range(pairs)] if interleaved else [pairs + i for i in range(pairs)]
    rest = list(range(rope_dim, head_dim))
    split = len(rest) // 2
    order = first + rest[:split] + second + rest[split:]
    if order == list(range(head_dim)):
        return None
    return torch.tensor(order, dtype=torch.long)
def rope_rows(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: Union[int, torch.Tensor]) -> torch.Tensor:
    """RoPE on q [B, T, H, D] at positions pos..pos+T-1 (`pos` an int or a device tensor), writing no cache: the
    queries of a layer that attends over an earlier layer's keys."""
    t = q.shape[1]
    if isinstance(pos, torch.Tensor):
        at = row_positions(pos, t)
        c, s = cos.index_select(0, at), sin.index_select(0, at)
    else:
        c, s = cos[pos : pos + t], sin[pos : pos + t]
    c, s = c.view(1, t, 1, -1).float(), s.view(1, t, 1, -1).float()
    qf = q.float()
    return (qf * c + rotate_half(qf) * s).to(q.dtype)


def std_multiplier(sparsity: float) -> float:
    """Phi^-1(sparsity): how many standard deviations above the mean Gemma 3n's sparse gate cuts (0 when dense)."""
    if sparsity <= 0.0:
        return 0.0
    return float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(sparsity, dtype=torch.float32)))


def gaussian_top(gate: torch.Tensor, multiplier: float) -> torch.Tensor:
    """Gemma 3n's activation sparsity: keep what lies above mean + std * multiplier of each row (the part a normal
    distribution puts in its top 1 - sparsity), shifted down by that cutoff, zero elsewhere. `multiplier` is a host
    float (std_multiplier), so a CUDA graph captures no host-to-device copy."""
    mean = gate.mean(-1, keepdim=True)
    std = gate.std(-1, keepdim=True, unbiased=False)
    return torch.relu(gate - (mean + std * multiplier))


QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def _out_features(w: Weight) -> int:
    return w.out_features if isinstance(w, (GPTQWeight, GGMLWeight, EXL2Weight)) else int(w.shape[0])


def _size(w: Any) -> int:
    if isinstance(w, (GPTQWeight, GGMLWeight, EXL2Weight)):
        return w.nbytes
    return w.numel() * w.element_size()


@dataclass
class Layer:
    """Weights of one decoder block, all on `device`.

    `post_norm` is the norm in front of the MLP (None in a parallel block, whose MLP reads `input_norm`'s
    output). The optional tensors are set only by architectures that use them: `q_norm`/`k_norm` (norm weights
    applied to every head [head_dim], or per head [heads, head_dim] as Cohere's), `attn_out_norm`/`mlp_out_norm`
    (norms on the attention and MLP outputs before the residual add), `biases` (dense projections' biases by
    projection name; GPTQ layers keep theirs), `sinks` (per-head attention-sink logits [num_heads], gpt-oss),
    `attn`, an attention object (engine/mla.py) called instead of q/k/v, and `mlp`, a routed MLP object called as
    `mlp(x, index, passthrough)` instead of gate/up/down.
    Gemma 4 adds `v_norm` (a weightless RMSNorm over each value head, stored as ones), `per_layer_gate` (called as
    `per_layer_gate(h, per_layer_input)` after the MLP's residual add, engine/per_layer_input.py) and `out_scale`
    (the layer's output is multiplied by it). A layer without v_proj (and no fused qkv) uses k's projection as v.
    Gemma 3n adds `laurel` (called on the normed input; joins the residual after attention, engine/altup.py) and
    `wrap` (AltUp: called as `wrap(streams, run_layer, per_layer_input)`).
    `mixer` replaces the whole attention block including o_proj (q/k/v/o stay None): `mixer(x, cache, index, pos)`
    maps the normed hidden state to the block's output and keeps a recurrent state of its own in the cache
    (`cache.states[index]`, engine/linear_attention.py); the layer then has no K/V buffers.
    `mlp_perm` is set when an act-order down_proj's input permutation was folded into gate/up's outputs
    (engine/mlp_fold.py): the intermediate is stored in that order, feature j being the checkpoint's mlp_perm[j].
    """

    input_norm: torch.Tensor
    q_proj: Optional[Weight]
    k_proj: Optional[Weight]
    v_proj: Optional[Weight]
    o_proj: Optional[Weight]
    post_norm: Optional[torch.Tensor]
    gate_proj: Optional[Weight]
    up_proj: Optional[Weight]
    down_proj: Optional[Weight]
    device: torch.device
    qkv_proj: Optional[Weight] = None
    gate_up_proj: Optional[Weight] = None
    out_features: Dict[str, int] = field(default_factory=dict)
    q_norm: Optional[torch.Tensor] = None
    k_norm: Optional[torch.Tensor] = None
    attn_out_norm: Optional[torch.Tensor] = None
    mlp_out_norm: Optional[torch.Tensor] = None
    biases: Dict[str, torch.Tensor] = field(default_factory=dict)
    mlp: Optional[Any] = None
    mlp_perm: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None
    attn: Optional[Any] = None
    laurel: Optional[Any] = None
    wrap: Optional[Any] = None
    v_norm: Optional[torch.Tensor] = None
    per_layer_gate: Optional[Any] = None
    out_scale: Optional[torch.Tensor] = None
    mixer: Optional[Any] = None

    PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "qkv_proj", "gate_up_proj")
    NORMS = ("input_norm", "post_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm", "sinks", "v_norm",
             "out_scale")

    def weight(self, name: str) -> Weight:
        """The weight of one projection (a copy of its columns of the fused weight when it was fused), as
        stored: with `mlp_perm` set, gate/up outputs and down inputs are in that order."""
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
                              end - start, None if fused.bias is None else fused.bias[cols].contiguous(),
                              fused.bits)
        if isinstance(fused, GGMLWeight):
            return GGMLWeight(fused.data[start:end], fused.type_name, fused.in_features, end - start,
                              None if fused.bias is None else fused.bias[start:end])
        return fused[start:end]

    def fuse(self) -> None:
        """Replace q/k/v and gate/up by one wide weight each where they can fuse (see engine/fuse.py).

        Projections the checkpoint already stores fused (Phi-3) stay as they are."""
        for fused_name, names in (("qkv_proj", QKV), ("gate_up_proj", GATE_UP)):
            parts = [getattr(self, n) for n in names]
            if any(p is None for p in parts):
                continue
            self.out_features.update({n: _out_features(p) for n, p in zip(names, parts)})
            biases = [self.biases.get(n) for n in names]
            if any(b is not None for b in biases) and not all(b is not None for b in biases):
                continue
            wide = concat_outputs(parts)
            if wide is None:
                continue
            setattr(self, fused_name, wide)
            for n in names:
                setattr(self, n, None)
            if biases[0] is not None:
                self.biases[fused_name] = torch.cat(biases)  # type: ignore[arg-type]
                for n in names:
                    del self.biases[n]

    def tensors(self) -> Iterator[Any]:
        """Every weight this layer holds (projections, norms, biases, the routed MLP's own `tensors()`)."""
        for name in self.PROJECTIONS + self.NORMS:
            if getattr(self, name) is not None:
                yield getattr(self, name)
        yield from self.biases.values()
        if self.mlp_perm is not None:
            yield self.mlp_perm
        if self.mlp is not None:
            yield from self.mlp.tensors()
        for part in (self.attn, self.mixer, self.per_layer_gate, self.laurel, self.wrap):
            if part is not None:
                yield from part.tensors()


class Model:
    """A loaded decoder-only model. Build it with `kobold_backend.engine.loader.load_model`."""

    def __init__(
        self,
        config: ConfigData,
        embed_tokens: torch.Tensor,
        layers: List[Layer],
        norm: torch.Tensor,
        lm_head: Weight,
        cos: List[torch.Tensor],
        sin: List[torch.Tensor],
        dtype: torch.dtype,
        max_seq_len: int,
        cache_dtype: str = "fp16",
        per_layer_embedding: Optional[Any] = None,
        streams: Optional[Any] = None,
    ) -> None:
        self.config = config
        # Gemma 4's per-layer inputs: `per_layer_embedding.inputs(ids, h)` -> [B, T, layers, D] (per_layer_input.py)
        self.per_layer_embedding = per_layer_embedding
        # Gemma 3n's AltUp: `streams.expand(h)` -> [n, B, T, H] before the layers, `collapse` back after them
        self.streams = streams
        self.cache_dtype = cache_dtype  # what new_cache allocates (engine/cache.py CACHE_DTYPES)
        self.features = config.features
        self.embed_tokens = embed_tokens
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.cos = cos
        self.sin = sin
        self.dtype = dtype
        self.max_seq_len = max_seq_len
        self.device = norm.device
        self.scale = self.features.attn_scale or config.head_dim ** -0.5
        self.windows = self.features.windows
        n = config.num_layers
        self.head_dims = [config.layer_head_dim(i) for i in range(n)]
        self.kv_heads = [config.layer_kv_heads(i) for i in range(n)]
        self.intermediates = [config.layer_intermediate(i) for i in range(n)]
        self.kv_sources = [config.layer_kv_source(i) for i in range(n)]
        self.sparsity = list(self.features.activation_sparsity) or [0.0] * n
        self.sparse_cut = [std_multiplier(s) for s in self.sparsity]
        self.rope_factors = [1.0 if rope is None else rope.attention_factor for rope in self.features.ropes]
        layer_norm = self.features.norm == "layer"
        self._norm = ops.layer_norm if layer_norm else ops.rms_norm
        self._add_norm = ops.add_layer_norm if layer_norm else ops.add_rms_norm
        # per layer: the order of each q/k head that puts the rotated pairs where the rotate-half kernels read them
        # (an attention object orders its own rotated part: DeepSeek's latent attention)
        self.rope_perms: List[Optional[torch.Tensor]] = []
        for rope, layer, hd in zip(self.features.ropes, layers, self.head_dims):
            perm = None if rope is None or layer.attn is not None else \
                head_permutation(hd, rope.dim, self.features.rope_interleaved)
            self.rope_perms.append(None if perm is None else perm.to(layer.device))
        self.activation = ACTIVATIONS[self.features.activation]
        scale = self.features.embed_scale
        # rounded to the embedding dtype once, as transformers' Gemma rounds its normalizer; a Python float then
        # multiplies inside CUDA graphs without a host tensor
        self.embed_scale = None if scale is None else float(torch.tensor(scale, dtype=embed_tokens.dtype))

    def new_cache(self, max_seq_len: Optional[int] = None, batch_size: int = 1,
                  cache_dtype: Optional[str] = None) -> KVCache:
        """A cache of `max_seq_len` positions (default: the model's), in `cache_dtype` (default: the model's)."""
        n = max_seq_len or self.max_seq_len
        if n > self.max_seq_len:
            raise ValueError(f"a cache of {n} positions exceeds the RoPE tables of {self.max_seq_len}")
        heads, key, value = self.features.cache_shape
        if not heads:
            heads, key, value = self.kv_heads, self.head_dims, None
        elif (cache_dtype or self.cache_dtype) != "fp16":
            raise ValueError("this model's latent attention cache is kept in the model's dtype only (cache dtype "
                             "fp16)")
        return KVCache(
            num_layers=len(self.layers),
            batch_size=batch_size,
            num_kv_heads=heads,
            max_seq_len=n,
            head_dim=key,
            dtypes=[layer.input_norm.dtype for layer in self.layers],
            devices=[layer.device for layer in self.layers],
            cache_dtype=cache_dtype or self.cache_dtype,
            value_dim=value,
            sources=self.kv_sources,
            kv_layers=[layer.mixer is None for layer in self.layers],
            states=[None if layer.mixer is None else layer.mixer.new_state(batch_size) for layer in self.layers],
        )

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state (linear attention): its cache cannot be shifted, rewound only
        to snapshots, and it cannot run `decode_step` (CUDA graphs, multi-row verification)."""
        return any(layer.mixer is not None for layer in self.layers)

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
        h = self._embed(ids)
        extra = self._per_layer_inputs(ids, h)
        h = h if self.streams is None else self.streams.expand(h)
        for index, layer in enumerate(self.layers):
            h = h.to(device=layer.device, dtype=layer.input_norm.dtype)
            h = self._block(index, layer, h, cache, pos, passthrough, per_layer=extra)
            if passthrough is not None:
                h = passthrough.after_layer(index, h, pos)
        h = h if self.streams is None else self.streams.collapse(h)
        cache.seq_len = pos + t
        if last_only:
            h = h[:, -1:]
        return self._logits(h)

    @torch.inference_mode()
    def shift_cache(self, cache: KVCache, start: int, drop: int) -> None:
        """Remove positions [start, start+drop) from the cache in place: later positions move left by `drop`
        and their keys are re-rotated by -drop positions, so they read as if computed at their new place (only the
        keys' last RoPE-table-width values where a table rotates part of the key: DeepSeek's latent cache).

        A quantized cache (ops/kv_quant.QuantizedKV) moves the values' bytes as they are and re-quantizes the
        re-rotated keys from their dequantized float32 values (`.float()` / `.copy_` of a float tensor)."""
        if cache.recurrent:
            raise ValueError("this model's linear-attention state holds every position; it cannot be shifted")
        end = cache.seq_len
        if drop <= 0 or not 0 <= start < start + drop <= end:
            raise ValueError(f"cannot drop {drop} positions at {start} from a cache of {end}")
        moved = end - start - drop
        for index in range(len(self.layers)):
            if self.kv_sources[index] is not None:
                continue  # its buffers are its source layer's, moved once
            k, v = cache.k[index], cache.v[index]
            # the tables carry the RoPE attention factor (LongRoPE); a pure rotation must not apply it again
            cos = self.cos[index][drop].float() / self.rope_factors[index]
            sin = self.sin[index][drop].float() / self.rope_factors[index]
            src = k[:, :, start + drop : end].float().clone()
            part = src[..., -cos.shape[-1]:]
            src[..., -cos.shape[-1]:] = part * cos - rotate_half(part) * sin
            k[:, :, start : start + moved].copy_(src)
            v[:, :, start : start + moved].copy_(v[:, :, start + drop : end].clone())
        cache.seq_len = start + moved
        del cache.tokens[start : start + drop]

    @torch.inference_mode()
    def decode_step(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, length: int) -> torch.Tensor:
        """Tokens [B, T] at the device-tensor positions pos..pos+T-1 (T = 1 for a decode step, k+1 for a
        speculative verification), each attending over the cache up to its own position within the first
        `length`; float32 logits [B, T, V]. No host-side state changes, so a CUDA graph can capture it. The caller
        advances `cache.seq_len`."""
        if self.recurrent:
            raise ValueError("this model's linear-attention layers run only at host positions (no CUDA graphs)")
        h = self._embed(ids)
        extra = self._per_layer_inputs(ids, h)
        h = h if self.streams is None else self.streams.expand(h)
        for index, layer in enumerate(self.layers):
            h = h.to(device=layer.device, dtype=layer.input_norm.dtype)
            h = self._block(index, layer, h, cache, 0, None, pos, length, extra)
        h = h if self.streams is None else self.streams.collapse(h)
        return self._logits(h)

    def _block(self, index: int, layer: Layer, h: torch.Tensor, cache: KVCache, pos: int,
               passthrough: Optional[ForwardHooks], pos_t: Optional[torch.Tensor] = None, length: int = 0,
               per_layer: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One decoder layer, through its residual wrapper when it has one (Gemma 3n's AltUp: `h` holds the
        model's parallel streams, the wrapper runs the layer on the active one)."""
        if layer.wrap is None:
            return self._layer(index, layer, h, cache, pos, passthrough, pos_t, length, per_layer)
        own = None if per_layer is None else per_layer[:, :, index].to(device=h.device, dtype=h.dtype)
        return layer.wrap(h, lambda x: self._layer(index, layer, x, cache, pos, passthrough, pos_t, length), own)

    def _per_layer_inputs(self, ids: torch.Tensor, h: torch.Tensor) -> Optional[torch.Tensor]:
        if self.per_layer_embedding is None:
            return None
        return self.per_layer_embedding.inputs(ids.to(h.device), h)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens[ids.to(self.embed_tokens.device)]
        return h if self.embed_scale is None else h * self.embed_scale

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = h.to(device=self.device, dtype=self.dtype)
        logits = project(self._norm(h, self.norm, self.config.rms_norm_eps), self.lm_head).float()
        if self.features.logit_scale is not None:
            logits = logits * self.features.logit_scale
        cap = self.features.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
        per_layer: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        cfg = self.config
        eps = cfg.rms_norm_eps
        x = self._norm(h, layer.input_norm, eps)
        laurel = None if layer.laurel is None else layer.laurel(x)
        if layer.mixer is not None:  # its output already includes the output projection
            a = layer.mixer(x, cache, index, pos)
        else:
            if layer.attn is not None:
                a = layer.attn(x, cache.k[index], self.cos[index], self.sin[index], pos, self.scale, pos_t, length)
            else:
                a = self._attention(index, layer, x, cache, pos, passthrough, pos_t, length)
            a = self._proj(index, layer, "o_proj", a, passthrough)
        if layer.attn_out_norm is not None:
            a = self._norm(a, layer.attn_out_norm, eps)
        if self.features.parallel_block:
            h = h + a + self._mlp(index, layer, x, passthrough)
        else:
            if laurel is None:
                x, h = self._add_norm(a, h, layer.post_norm, eps)
            else:  # Gemma 3n: the Laurel branch joins the residual, the sum scaled by 1/sqrt(2)
                h = (h + a + laurel) / 2 ** 0.5
                x = self._norm(h, layer.post_norm, eps)
            h = h + self._mlp(index, layer, x, passthrough)
        if layer.per_layer_gate is not None and per_layer is not None:
            h = layer.per_layer_gate(h, per_layer[:, :, index].to(device=h.device, dtype=h.dtype))
        return h if layer.out_scale is None else h * layer.out_scale

    def _mlp(self, index: int, layer: Layer, x: torch.Tensor, passthrough: Optional[ForwardHooks]) -> torch.Tensor:
        """The MLP's output for the normed input x (routed or dense, with Gemma 3n's sparse gate), with its output
        norm when it has one."""
        if layer.mlp is not None:
            out = layer.mlp(x, index, passthrough)
        else:
            inter = self.intermediates[index]
            gate, up = self._projs(index, layer, "gate_up_proj", GATE_UP, (inter, inter), x, passthrough)
            if self.sparsity[index] > 0.0:
                gate = gaussian_top(gate, self.sparse_cut[index])
            out = self._proj(index, layer, "down_proj", self.activation(gate, up), passthrough)
        if layer.mlp_out_norm is not None:
            out = self._norm(out, layer.mlp_out_norm, self.config.rms_norm_eps)
        return out

    def _attention(
        self,
        index: int,
        layer: Layer,
        x: torch.Tensor,
        cache: KVCache,
        pos: int,
        passthrough: Optional[ForwardHooks],
        pos_t: Optional[torch.Tensor],
        length: int,
    ) -> torch.Tensor:
        """q/k/v attention of normed x [B, T, hidden] -> [B, T, heads * head_dim], writing the cache (a KV-sharing
        layer only reads its source layer's)."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        b, t, _ = x.shape
        hd, kvh, shared = self.head_dims[index], self.kv_heads[index], self.kv_sources[index] is not None
        qd, kvd = cfg.num_heads * hd, kvh * hd
        gated = self.features.attn_output_gate
        # a KV-sharing layer projects only q; a layer without v_proj reuses k's projection as v
        names = QKV[:1] if shared else QKV if layer.v_proj is not None or layer.qkv_proj is not None else QKV[:2]
        outs = self._projs(index, layer, "qkv_proj", names, (2 * qd if gated else qd, kvd, kvd), x, passthrough)
        q, gate = outs[0], None
        if gated:  # per head: the query, then its output gate
            q, gate = q.view(b, t, cfg.num_heads, 2 * hd).chunk(2, dim=-1)
            q, gate = q.contiguous(), gate.reshape(b, t, qd)
        q = q.view(b, t, cfg.num_heads, hd)
        if layer.q_norm is not None:
            q = self._norm(q, layer.q_norm, eps)
        perm = self.rope_perms[index]
        if perm is not None:
            q = q.index_select(-1, perm)
        k_cache, v_cache = cache.k[index], cache.v[index]
        cos, sin = self.cos[index], self.sin[index]
        if shared:
            q = rope_rows(q, cos, sin, pos if pos_t is None else pos_t)
        else:
            k = outs[1].view(b, t, kvh, hd)
            v = outs[-1].view(b, t, kvh, hd)
            if layer.k_norm is not None:
                k = self._norm(k, layer.k_norm, eps)
            if layer.v_norm is not None:
                v = self._norm(v, layer.v_norm, eps)
            if perm is not None:
                k = k.index_select(-1, perm)
            if pos_t is not None:
                q = ops.rope_cache_write_at(q, k, v, cos, sin, pos_t, k_cache, v_cache)
            else:
                q = ops.rope_cache_write(q, k, v, cos, sin, pos, k_cache, v_cache)
        window, cap = self.windows[index], self.features.attn_softcap
        if pos_t is not None:
            a = ops.decode_attention_rows(q, k_cache, v_cache, pos_t, length, self.scale, window=window, softcap=cap,
                                          sinks=layer.sinks)
        elif t == 1:
            a = ops.decode_attention(q[:, 0], k_cache, v_cache, pos + 1, self.scale, window=window, softcap=cap,
                                     sinks=layer.sinks)
        else:
            a = ops.attention(q, k_cache, v_cache, pos, self.scale, window=window, softcap=cap, sinks=layer.sinks)
        a = a.reshape(b, t, qd)
        return a if gate is None else a * torch.sigmoid(gate)

    @staticmethod
    def _proj(index: int, layer: Layer, name: str, x: torch.Tensor,
              passthrough: Optional[ForwardHooks]) -> torch.Tensor:
        y = project(x, getattr(layer, name), layer.biases.get(name))
        if passthrough is not None:
            delta = Model._delta(index, layer, name, x, passthrough)
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
        outs = list(project(x, weight, layer.biases.get(fused)).split(list(sizes), dim=-1))
        if passthrough is not None:
            for i, name in enumerate(names):
                delta = Model._delta(index, layer, name, x, passthrough)
                if delta is not None:
                    outs[i] = outs[i] + delta.to(outs[i].dtype)
        return outs

    @staticmethod
    def _delta(index: int, layer: Layer, name: str, x: torch.Tensor,
               passthrough: ForwardHooks) -> Optional[torch.Tensor]:
        """A passthrough's delta for projection `name`; deltas address the MLP intermediate in checkpoint order,
        so with `layer.mlp_perm` down's input is put back in that order and gate/up's deltas are permuted."""
        perm = layer.mlp_perm
        if perm is None or name not in ("gate_proj", "up_proj", "down_proj"):
            return passthrough.linear_delta(index, name, x)
        if name == "down_proj":
            return passthrough.linear_delta(index, name, torch.empty_like(x).index_copy_(x.dim() - 1, perm, x))
        delta = passthrough.linear_delta(index, name, x)
        return None if delta is None else delta.index_select(-1, perm)

    @property
    def nbytes(self) -> int:
        total = _size(self.embed_tokens) + _size(self.norm)
        if self.lm_head is not self.embed_tokens:
            total += _size(self.lm_head)
        for layer in self.layers:
            total += sum(_size(w) for w in layer.tensors())
        for part in (self.per_layer_embedding, self.streams):
            if part is not None:
                total += sum(_size(w) for w in part.tensors())
        return total
