"""Rotary position embedding tables: inverse frequencies with linear, llama3, LongRoPE, proportional (partial) and
NTK-alpha scaling.

A model may use several tables (Gemma 3's local and global layers); each layer's `RopeSpec` says which.
LongRoPE (Phi-3) picks its short or long factors once per table, by the table's length: transformers switches
per forward call (long once a call reaches past `original_max_position_embeddings`), which would leave keys
rotated two ways in one cache; here every cached key uses the same table, as llama.cpp does by context size.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from kobold_backend.engine.architectures import RopeSpec
from kobold_backend.engine.config import ModelConfig


def inverse_frequencies(
    config: ModelConfig, rope_alpha: float = 1.0, rope: Optional[RopeSpec] = None, max_seq_len: int = 0
) -> torch.Tensor:
    """Per-pair inverse frequencies (fp64 on CPU) after NTK alpha, llama3 and LongRoPE scaling."""
    rope = rope or RopeSpec(config.rope_theta, config.rope_scaling)
    d = rope.head_dim or config.head_dim
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
    if scaling is not None and scaling.rope_type == "proportional":
        # the pairs past the rotated share get frequency 0: cos 1, sin 0, the identity
        inv[int(scaling.partial_rotary_factor * d // 2):] = 0.0
        inv = inv / scaling.factor
    return inv


def cos_sin_tables(
    config: ModelConfig,
    max_seq_len: int,
    device: torch.device | str,
    dtype: torch.dtype,
    rope_alpha: float = 1.0,
    compress_pos_emb: float = 1.0,
    rope: Optional[RopeSpec] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_seq_len, the spec's head_dim] in the rotate-half layout, times the RoPE attention factor.

    `rope` selects the table (default: the config's rope_theta and rope_scaling)."""
    rope = rope or RopeSpec(config.rope_theta, config.rope_scaling)
    inv = inverse_frequencies(config, rope_alpha, rope, max_seq_len)
    scale = compress_pos_emb
    if rope.scaling is not None and rope.scaling.rope_type == "linear":
        scale *= rope.scaling.factor
    t = torch.arange(max_seq_len, dtype=torch.float64) / scale
    freqs = torch.outer(t, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
