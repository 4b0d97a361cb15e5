"""Rotary position embedding tables: inverse frequencies with linear, llama3 and NTK-alpha scaling."""

from __future__ import annotations

import math
from typing import Tuple

import torch

from kobold_backend.engine.config import ModelConfig


def inverse_frequencies(config: ModelConfig, rope_alpha: float = 1.0) -> torch.Tensor:
    """Per-pair inverse frequencies (fp64 on CPU) after NTK alpha and llama3 scaling."""
    d = config.head_dim
    base = config.rope_theta
    if rope_alpha != 1.0:
        base = base * rope_alpha ** (d / (d - 2))
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = config.rope_scaling
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
    return inv


def cos_sin_tables(
    config: ModelConfig,
    max_seq_len: int,
    device: torch.device | str,
    dtype: torch.dtype,
    rope_alpha: float = 1.0,
    compress_pos_emb: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_seq_len, head_dim] in the rotate-half layout."""
    inv = inverse_frequencies(config, rope_alpha)
    scale = compress_pos_emb
    if config.rope_scaling is not None and config.rope_scaling.rope_type == "linear":
        scale *= config.rope_scaling.factor
    t = torch.arange(max_seq_len, dtype=torch.float64) / scale
    freqs = torch.outer(t, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)
