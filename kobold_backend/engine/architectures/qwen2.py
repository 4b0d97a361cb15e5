"""Qwen2 / Qwen2.5 and Qwen3: Llama's layout with q/k/v biases (Qwen2) or per-head q/k RMSNorm and an
independent head_dim (Qwen3); both carry sliding-window fields that are off unless `use_sliding_window` is set,
and then apply to the layers from `max_window_layers` on (or as `layer_types` says)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

from kobold_backend.engine.architectures.base import (
    Architecture,
    Features,
    layer_type_windows,
    positive_window,
    register,
)
from kobold_backend.engine.config_types import ConfigData
from kobold_backend.errors import ModelFormatError


def qwen_windows(raw: Dict[str, Any], config: ConfigData, where: str) -> Tuple[Optional[int], ...]:
    window = positive_window(raw.get("sliding_window"), where) if raw.get("use_sliding_window") else None
    first = raw.get("max_window_layers", 28)
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ModelFormatError(f"{where}: max_window_layers must be a non-negative integer, found {first!r}.")
    default = tuple("sliding_attention" if window is not None and i >= first else "full_attention"
                    for i in range(config.num_layers))
    return layer_type_windows(raw, config, window, default, where)


class Qwen2(Architecture):
    model_types = ("qwen2",)
    class_names = ("Qwen2ForCausalLM",)

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        base = super().features(raw, config, where)
        return replace(base, biases=("q_proj", "k_proj", "v_proj"), windows=qwen_windows(raw, config, where))


class Qwen3(Architecture):
    model_types = ("qwen3",)
    class_names = ("Qwen3ForCausalLM",)

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        base = super().features(raw, config, where)  # attention_bias: q/k/v/o biases, off in released models
        return replace(base, qk_norm=True, windows=qwen_windows(raw, config, where))


register(Qwen2())
register(Qwen3())
