"""Phi-3 / Phi-3.5 (and Phi-4-mini's layout): q/k/v stored as one `qkv_proj` and gate/up as one `gate_up_proj`
(gate first), kept fused at load; LongRoPE ("longrope" / "su") scaling is read by config.py and rope.py;
`sliding_window` applies to every layer. Partial rotary embeddings (`partial_rotary_factor` < 1) are refused."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict

from kobold_backend.engine.architectures.base import Architecture, Features, register, uniform_windows
from kobold_backend.engine.config_types import ConfigData, rope_settings
from kobold_backend.errors import ModelFormatError


class Phi3(Architecture):
    model_types = ("phi3",)
    class_names = ("Phi3ForCausalLM",)
    fused = {"qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj"}

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        partial = (rope_settings(raw) or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ModelFormatError(f"{where}: partial_rotary_factor {partial} is not supported (RoPE over the "
                                   "whole head only).")
        return replace(super().features(raw, config, where), windows=uniform_windows(raw, config, where))


register(Phi3())
