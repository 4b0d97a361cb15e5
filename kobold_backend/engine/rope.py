"""Rotary position embedding tables: inverse frequencies with linear, llama3, LongRoPE, YaRN, proportional (partial)
and NTK-alpha scaling.

A model may use several tables (Gemma 3's local and global layers); each layer's `RopeSpec` says which.
LongRoPE (Phi-3) picks its short or long factors once per table, by the table's length: transformers switches
per forward call (long once a call reaches past `original_max_position_embeddings`), which would leave keys
rotated two ways in one cache; here every cached key uses the same table, as llama.cpp does by context size.

Partial rotary embeddings (`RopeSpec.dim` < head_dim: GLM) and layers without any (`None`: Cohere 2's global
layers) use tables of the full head size whose pass-through columns have frequency 0 (cos 1, sin 0), and
`model.head_permutation` orders each head of q and k so that the rotated pairs, interleaved (2i, 2i + 1) or split
(i, i + dim / 2) in the checkpoint, sit at (i, i + head_dim / 2) where the rotate-half kernels expect them; the
permutation is applied to q and k alike, so q·k is unchanged. DeepSeek's latent attention rotates a separate
`qk_rope_head_dim` part of its query and key (`RopeSpec.dim` too): its table is only that wide (`width`).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from kobold_backend.engine.architectures import RopeSpec
from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.config_types import RopeScaling


def inverse_frequencies(
    config: ModelConfig, rope_alpha: float = 1.0, rope: Optional[RopeSpec] = None, max_seq_len: int = 0
) -> torch.Tensor:
    """Per-pair inverse frequencies (fp64 on CPU) after NTK alpha, llama3, LongRoPE and YaRN scaling."""
    rope = rope or RopeSpec(config.rope_theta, config.rope_scaling)
    d = rope.dim or config.head_dim
    base = rope.theta
    if rope_alpha != 1.0:
        base = base * rope_alpha ** (d / (d - 2))
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = rope.scaling
    if scaling is not None and scaling.rope_type == "longrope":
        long = max_seq_len > scaling.original_max_position_embeddings
        inv = inv / torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float64)
    if scaling is not None and scaling.rope_type == "llama3":
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        mid = (1 - smooth) * inv / scaling.factor + smooth * inv
        inv = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, inv)
    if scaling is not None and scaling.rope_type == "yarn":
        inv = _yarn(inv, base, d, scaling)
    if scaling is not None and scaling.rope_type == "proportional":
        # the pairs past the rotated share get frequency 0: cos 1, sin 0, the identity
        inv[int(scaling.partial_rotary_factor * d // 2):] = 0.0
        inv = inv / scaling.factor
    return inv


def _yarn(inv: torch.Tensor, base: float, d: int, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: frequencies rotating more than `beta_fast` times over the original context keep their value, those
    rotating fewer than `beta_slow` times are divided by the factor, with a linear ramp between (over pair
    indices, bounds floored/ceiled unless `truncate` is false), as transformers computes it."""
    def pair_index(rotations: float) -> float:
        return d * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index(scaling.beta_fast), pair_index(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv / scaling.factor * ramp + inv * (1 - ramp)


def cos_sin_tables(
    config: ModelConfig,
    max_seq_len: int,
    device: torch.device | str,
    dtype: torch.dtype,
    rope_alpha: float = 1.0,
    compress_pos_emb: float = 1.0,
    rope: Optional[RopeSpec] = None,
    width: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_seq_len, width] in the rotate-half layout, the rotated columns times the RoPE
    attention factor; columns a partial RoPE passes through, and every column of a layer without RoPE
    (`rope=None`), hold cos 1 and sin 0.

    `rope` selects the table (default: the config's rope_theta and rope_scaling); `width` is the q/k head size
    (0: head_dim; GLM's partial rotary included; a layer's own size where layers differ, Gemma 4), or `rope.dim`
    for an attention that keeps its rotated part apart (DeepSeek's latent attention), whose table then has no
    pass-through columns."""
    half = (width or config.head_dim) // 2
    if rope is None:
        ones = torch.ones(max_seq_len, 2 * half, device=device, dtype=dtype)
        return ones, torch.zeros_like(ones)
    inv = inverse_frequencies(config, rope_alpha, rope, max_seq_len)
    scale = compress_pos_emb
    if rope.scaling is not None and rope.scaling.rope_type == "linear":
        scale *= rope.scaling.factor
    t = torch.arange(max_seq_len, dtype=torch.float64) / scale
    freqs = torch.outer(t, inv)
    cos, sin = freqs.cos() * rope.attention_factor, freqs.sin() * rope.attention_factor
    rotated = inv.shape[0]
    if rotated < half:
        cos = torch.cat((cos, torch.ones(max_seq_len, half - rotated, dtype=cos.dtype)), dim=-1)
        sin = torch.cat((sin, torch.zeros(max_seq_len, half - rotated, dtype=sin.dtype)), dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

