"""Gemma 3n (text), read as transformers' modeling_gemma3n computes it: Gemma 4's attention (plain RMSNorm weights,
q/k norms, a weightless value norm, q·k unscaled, KV sharing over the last `num_kv_shared_layers` layers) and
per-layer embeddings, with Gemma 3's RoPE (local base `rope_local_base_freq`, global `rope_theta`), plus:

- AltUp (`altup_num_inputs` parallel residual streams, engine/altup.py): the layer runs on the active stream's
  prediction and corrects all of them; the per-layer input's gate goes to the other streams;
- the Laurel branch beside attention (`laurel_rank`), joining the residual scaled by 1/sqrt(2);
- per-layer MLP widths (`intermediate_size` may be a list) and activation sparsity on the MLP gate
  (`activation_sparsity_pattern`; default 0.95 on the first 10 layers of a model of more than 10).

The published checkpoints are multimodal (`gemma3n`, Gemma3nForConditionalGeneration): only the text model is
loaded (`text_config`, tensors under `model.language_model.`); the vision and audio towers are not.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from kobold_backend.engine.architectures.base import Features, positive_window, register
from kobold_backend.engine.architectures.gemma import Gemma3
from kobold_backend.engine.architectures.gemma4 import Gemma4, _kv_sources, language_model_names, multimodal_text_config
from kobold_backend.engine.config_types import ConfigData
from kobold_backend.errors import ModelFormatError


def _types(raw: Dict[str, Any], n: int, where: str) -> List[str]:
    types = list(raw.get("layer_types") or
                 ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(n)])
    if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ModelFormatError(f"{where}: layer_types must list 'sliding_attention' or 'full_attention' for each "
                               f"of the {n} layers.")
    return types


def _per_layer_floats(raw: Dict[str, Any], key: str, n: int, default: List[float], where: str) -> List[float]:
    value = raw.get(key)
    if value is None:
        return default
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise ModelFormatError(f"{where}: {key} must be a number or a list of {n} numbers, found {value!r:.60}.")
    return [float(v) for v in values]


class Gemma3n(Gemma4):
    model_types = ("gemma3n_text",)
    class_names = ("Gemma3nForCausalLM",)
    ple_default = 256

    def text_config(self, raw: Dict[str, Any], where: str) -> Dict[str, Any]:
        """A list `intermediate_size` (one per layer) becomes its largest entry, the list kept per layer."""
        sizes = raw.get("intermediate_size")
        if isinstance(sizes, list) and sizes and all(isinstance(s, int) for s in sizes):
            return dict(raw, intermediate_size=max(sizes), intermediate_size_per_layer=sizes)
        return raw

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ModelFormatError(f"{where}: hidden_activation {act!r} is not supported for Gemma 3n "
                                   "(supported: gelu_pytorch_tanh).")
        n = config.num_layers
        types = _types(raw, n, where)
        window = positive_window(raw.get("sliding_window"), where)
        local, global_ = Gemma3._ropes(raw, config, where)
        sizes = raw.get("intermediate_size_per_layer") or [config.intermediate_size] * n
        if len(sizes) != n:
            raise ModelFormatError(f"{where}: intermediate_size must list one size per layer ({n}).")
        sparse = 10 if n > 10 else 0
        sparsity = _per_layer_floats(raw, "activation_sparsity_pattern", n, [0.95] * sparse + [0.0] * (n - sparse),
                                     where)
        if any(not 0.0 <= s < 1.0 for s in sparsity):
            raise ModelFormatError(f"{where}: activation_sparsity_pattern entries must lie in [0, 1).")
        cap = raw.get("final_logit_softcapping", 30.0)
        return Features(
            qk_norm=True,
            attn_out_norm=True,
            mlp_out_norm=True,
            activation="gelu_tanh",
            embed_scale=config.hidden_size ** 0.5,
            attn_scale=1.0,
            final_softcap=None if cap is None else float(cap),
            windows=tuple(window if t == "sliding_attention" else None for t in types),
            ropes=tuple(local if t == "sliding_attention" else global_ for t in types),
            intermediate_sizes=tuple(int(s) for s in sizes),
            kv_sources=_kv_sources(dict(raw, num_kv_shared_layers=raw.get("num_kv_shared_layers", 15)), types,
                                   where),
            activation_sparsity=tuple(sparsity),
        )

    def layer_extras(self, loader: Any, config: ConfigData, index: int) -> Dict[str, Any]:
        from kobold_backend.engine.altup import AltUpLayer, Laurel
        from kobold_backend.engine.per_layer_input import PerLayerGate

        h, raw, eps = config.hidden_size, config.raw, config.rms_norm_eps
        n, rank, dim = int(raw.get("altup_num_inputs", 4)), int(raw.get("laurel_rank", 64)), self.ple_dim(config)
        extras: Dict[str, Any] = {}
        if config.layer_kv_source(index) is None:
            extras["v_norm"] = torch.ones(config.head_dim, device=loader.device, dtype=loader.dtype)
        extras["laurel"] = Laurel(loader.linear("laurel.linear_left", h, rank),
                                  loader.linear("laurel.linear_right", rank, h),
                                  loader.dense("laurel.post_laurel_norm.weight", (h,)), eps)
        gate = PerLayerGate(loader.linear("per_layer_input_gate", h, dim),
                            loader.linear("per_layer_projection", dim, h),
                            loader.dense("post_per_layer_input_norm.weight", (h,)), eps)
        scale = loader.dense("altup.correct_output_scale", (h,)) if raw.get("altup_correct_scale", True) else None
        extras["wrap"] = AltUpLayer(
            loader.linear("altup.modality_router", h, n), loader.dense("altup.router_norm.weight", (h,)),
            loader.dense("altup.prediction_coefs.weight", (n * n, n)),
            loader.dense("altup.correction_coefs.weight", (n, n)), scale, gate,
            int(raw.get("altup_active_idx", 0)), eps)
        return extras

    def model_tensors(self, config: ConfigData) -> Dict[str, Tuple[int, ...]]:
        h, n = config.hidden_size, int(config.raw.get("altup_num_inputs", 4))
        own = dict(super().model_tensors(config))
        for i in range(n - 1):
            own[f"model.altup_projections.{i}.weight"] = (h, h)
            own[f"model.altup_unembed_projections.{i}.weight"] = (h, h)
        return own

    def own_tensors(self, config: ConfigData, index: int) -> Dict[str, Tuple[int, ...]]:
        h, raw = config.hidden_size, config.raw
        n, rank = int(raw.get("altup_num_inputs", 4)), int(raw.get("laurel_rank", 64))
        own = {k: v for k, v in super().own_tensors(config, index).items() if k != "layer_scalar"}
        own.update({"laurel.linear_left.weight": (rank, h), "laurel.linear_right.weight": (h, rank),
                    "laurel.post_laurel_norm.weight": (h,), "altup.correct_output_scale": (h,),
                    "altup.correction_coefs.weight": (n, n), "altup.prediction_coefs.weight": (n * n, n),
                    "altup.modality_router.weight": (n, h), "altup.router_norm.weight": (h,)})
        return own

    def residual_streams(self, loader: Any, config: ConfigData) -> Optional[Any]:
        from kobold_backend.engine.altup import AltUpStreams

        h, n = config.hidden_size, int(config.raw.get("altup_num_inputs", 4))
        return AltUpStreams([loader.linear(f"altup_projections.{i}", h, h) for i in range(n - 1)],
                            [loader.linear(f"altup_unembed_projections.{i}", h, h) for i in range(n - 1)],
                            loader.device, loader.dtype)


class Gemma3nMultimodal(Gemma3n):
    """The text model of Gemma3nForConditionalGeneration (Gemma 3n E2B, E4B as published)."""

    model_types = ("gemma3n",)
    class_names = ("Gemma3nForConditionalGeneration",)

    def text_config(self, raw: Dict[str, Any], where: str) -> Dict[str, Any]:
        return super().text_config(multimodal_text_config(raw, where), where)

    def stored_names(self, names: List[str]) -> Dict[str, str]:
        return language_model_names(names)


register(Gemma3n())
register(Gemma3nMultimodal())
