"""Command-R (`cohere`) and Command-R7B / Command-A (`cohere2`), read as transformers' modeling_cohere /
modeling_cohere2 compute them.

Both: every norm is a LayerNorm without bias (`layer_norm_eps`); a parallel block (attention and MLP both read
`input_layernorm`'s output and are added to the residual together, no second norm); RoPE on interleaved pairs of
head dimensions; logits multiplied by `logit_scale`; embeddings tied to the head unless config.json says otherwise.
- Command-R: optional per-head q/k LayerNorms (`use_qk_norm`, weights [heads, head_dim]: Command-R+).
- Cohere 2: sliding-window layers (`layer_types`, else 3 of every `sliding_window_pattern` = 4, the fourth
  global) carry RoPE; the global layers have no positional embedding at all.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict

from kobold_backend.engine.architectures.base import (
    Architecture,
    Features,
    LayerLayout,
    RopeSpec,
    layer_type_windows,
    positive_window,
    register,
)
from kobold_backend.engine.config_types import ConfigData
from kobold_backend.errors import ModelFormatError

# what transformers assumes when config.json leaves these keys out
_DEFAULTS = {"tie_word_embeddings": True, "layer_norm_eps": 1e-5, "logit_scale": 0.0625}


class Cohere(Architecture):
    model_types = ("cohere",)
    class_names = ("CohereForCausalLM",)

    def text_config(self, raw: Dict[str, Any], where: str) -> Dict[str, Any]:
        return dict(_DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k not in _DEFAULTS})

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        scale = raw["logit_scale"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ModelFormatError(f"{where}: logit_scale must be a number, found {scale!r}.")
        return replace(super().features(raw, config, where), norm="layer", parallel_block=True,
                       logit_scale=float(scale), rope_interleaved=True, qk_norm=bool(raw.get("use_qk_norm")))

    def layout(self, config: ConfigData, index: int) -> LayerLayout:
        layout = super().layout(config, index)
        norms = {k: v for k, v in layout.norms.items() if k != "post_norm"}
        if config.features.qk_norm:
            norms["q_norm"] = ("self_attn.q_norm", (config.num_heads, config.head_dim))
            norms["k_norm"] = ("self_attn.k_norm", (config.num_kv_heads, config.head_dim))
        return replace(layout, norms=norms)


class Cohere2(Cohere):
    model_types = ("cohere2",)
    class_names = ("Cohere2ForCausalLM",)

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        pattern = raw.get("sliding_window_pattern", 4)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ModelFormatError(f"{where}: sliding_window_pattern must be a positive integer, found {pattern!r}.")
        default = tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                        for i in range(config.num_layers))
        windows = layer_type_windows(raw, config, positive_window(raw.get("sliding_window"), where), default, where)
        types = raw.get("layer_types") or default
        rope = RopeSpec(config.rope_theta, config.rope_scaling)
        ropes = tuple(rope if t == "sliding_attention" else None for t in types)
        return replace(super().features(raw, config, where), qk_norm=False, windows=windows, ropes=ropes)


register(Cohere())
register(Cohere2())
