"""Gemma 2 and Gemma 3 (text): Llama's tensors plus norms after attention and after the MLP, read as transformers'
modeling_gemma2 / modeling_gemma3 compute them.

Both: every RMSNorm multiplies by (1 + weight); embeddings are multiplied by sqrt(hidden_size) rounded to the
compute dtype; q·k is scaled by `query_pre_attn_scalar ** -0.5`; the MLP gate is GELU (tanh approximation);
`input_layernorm` -> attention -> `post_attention_layernorm` -> residual add -> `pre_feedforward_layernorm` -> MLP ->
`post_feedforward_layernorm` -> residual add; the embeddings are tied to the head.
- Gemma 2: attention scores soft-capped by `attn_logit_softcapping`, final logits by `final_logit_softcapping`
  (`c * tanh(x / c)`); local (sliding-window) and global layers alternate, layer 0 local.
- Gemma 3: per-head q/k RMSNorm before RoPE; 5 local layers to 1 global (`sliding_window_pattern`, or
  `layer_types`); local layers rotate with base `rope_local_base_freq` and no scaling, global layers with
  `rope_theta` and `rope_scaling`. transformers 5 writes both as `rope_parameters[layer_type]`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

from kobold_backend.engine.architectures.base import (
    Architecture,
    Features,
    RopeSpec,
    positive_window,
    register,
)
from kobold_backend.engine.config_types import ConfigData, parse_rope_scaling
from kobold_backend.errors import ModelFormatError

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def _positive(raw: Dict[str, Any], key: str, where: str, default: Optional[float] = None) -> Optional[float]:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ModelFormatError(f"{where}: {key} must be a positive number or null, found {value!r}.")
    return float(value)


def _layer_windows(raw: Dict[str, Any], config: ConfigData, pattern: int, where: str) -> Tuple[Optional[int], ...]:
    """`sliding_window` on the layers `layer_types` marks "sliding_attention" (else: every layer whose
    (index + 1) is not a multiple of `pattern` is local)."""
    window = positive_window(raw.get("sliding_window"), where)
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(config.num_layers)]
    if not isinstance(types, list) or len(types) != config.num_layers or \
            any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ModelFormatError(f"{where}: layer_types must list 'sliding_attention' or 'full_attention' for each "
                               f"of the {config.num_layers} layers.")
    return tuple(window if t == "sliding_attention" else None for t in types)


class Gemma2(Architecture):
    model_types = ("gemma2",)
    class_names = ("Gemma2ForCausalLM",)
    #: local:global layer pattern when config.json has no layer_types
    pattern = 2

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GELU_TANH:
            raise ModelFormatError(f"{where}: hidden_activation {act!r} is not supported for Gemma "
                                   "(supported: gelu_pytorch_tanh).")
        scalar = _positive(raw, "query_pre_attn_scalar", where, config.head_dim)
        return Features(
            norm_offset=1.0,
            attn_out_norm=True,
            mlp_out_norm=True,
            activation="gelu_tanh",
            embed_scale=config.hidden_size ** 0.5,
            attn_scale=None if scalar is None else scalar ** -0.5,
            attn_softcap=_positive(raw, "attn_logit_softcapping", where),
            final_softcap=_positive(raw, "final_logit_softcapping", where),
            windows=_layer_windows(raw, config, self.pattern, where),
        )


class Gemma3(Gemma2):
    model_types = ("gemma3_text",)
    class_names = ("Gemma3ForCausalLM",)
    pattern = 6

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        pattern = raw.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ModelFormatError(f"{where}: sliding_window_pattern must be a positive integer, found {pattern!r}.")
        windows = _layer_windows(raw, config, pattern, where)
        local, global_ = self._ropes(raw, config, where)
        ropes = tuple(local if w is not None else global_ for w in windows)
        return replace(super().features(raw, config, where), qk_norm=True, windows=windows, ropes=ropes)

    @staticmethod
    def _ropes(raw: Dict[str, Any], config: ConfigData, where: str) -> Tuple[RopeSpec, RopeSpec]:
        """(local, global) RoPE tables from the Hub's keys or transformers 5's per-layer-type `rope_parameters`."""
        params = raw.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
            full, sliding = params["full_attention"], params.get("sliding_attention") or {}
            global_theta = float(full.get("rope_theta", 1_000_000.0))
            local_theta = float(sliding.get("rope_theta", 10_000.0))
            global_scaling = parse_rope_scaling(raw, full, config.head_dim, where)
            local_scaling = parse_rope_scaling(raw, sliding, config.head_dim, where)
        else:
            global_theta = float(raw.get("rope_theta") or 1_000_000.0)
            local_theta = float(raw.get("rope_local_base_freq") or 10_000.0)
            global_scaling, local_scaling = config.rope_scaling, None
        return RopeSpec(local_theta, local_scaling), RopeSpec(global_theta, global_scaling)


register(Gemma2())
register(Gemma3())
