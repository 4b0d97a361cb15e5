"""Gemma 4 (text), read as transformers' modeling_gemma4 computes it: Gemma 3's layer (norms after attention and
after the MLP, per-head q/k norms, GELU-tanh gate, sqrt(hidden) embedding scale, local and global layers) with:

- plain RMSNorm weights (no `1 + weight`), q·k unscaled (scale 1), and a weightless RMSNorm over each value head;
- global layers with their own head size (`global_head_dim`) and, with `attention_k_eq_v`, their own KV head count
  and no v_proj (the values are k's projection before its norm); transformers 5 writes both as `per_layer_config`;
- global layers rotate only a `partial_rotary_factor` of the frequencies ("proportional" RoPE);
- KV sharing: the last `num_kv_shared_layers` layers compute no keys or values and attend over the cache of the
  last earlier layer of their type; with `use_double_wide_mlp` their MLP is twice as wide;
- per-layer embeddings (`hidden_size_per_layer_input`, engine/per_layer_input.py) and a per-layer output scale
  (`layer_scalar`); final logits soft-capped by `final_logit_softcapping`.

The released checkpoints are multimodal (`gemma4`, Gemma4ForConditionalGeneration): the decoder's settings are
under `text_config` and its tensors under `model.language_model.`; only the text model is loaded (no vision or
audio tower), so image and audio inputs are refused by the server as for any text model.

- the mixture-of-experts block (`enable_moe_block`, 26B-A4B: engine/gemma4_moe.py) beside the dense MLP.

Refused: bidirectional attention.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from kobold_backend.engine.architectures.base import (
    Architecture,
    Features,
    LayerLayout,
    Linear,
    RopeSpec,
    positive_window,
    register,
)
from kobold_backend.engine.config_types import ConfigData, parse_rope_scaling
from kobold_backend.errors import ModelFormatError

_TYPES = ("sliding_attention", "full_attention")


def _layer_types(raw: Dict[str, Any], n: int, where: str) -> List[str]:
    """config.json's `layer_types` (default: 5 local to 1 global); the last layer is always global."""
    types = list(raw.get("layer_types") or
                 ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    if len(types) != n or any(t not in _TYPES for t in types):
        raise ModelFormatError(f"{where}: layer_types must list 'sliding_attention' or 'full_attention' for each "
                               f"of the {n} layers.")
    types[-1] = "full_attention"
    return types


def _per_layer_sizes(raw: Dict[str, Any], config: ConfigData, types: List[str],
                     where: str) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(head size, KV heads) of every layer: `per_layer_config` when config.json has it, else the global layers'
    `global_head_dim` (default 512) and, with `attention_k_eq_v`, `num_global_key_value_heads`."""
    per_layer = raw.get("per_layer_config")
    if isinstance(per_layer, dict):
        overrides = [per_layer.get(str(i)) or per_layer.get(i) or {} for i in range(config.num_layers)]  # type: ignore
    else:
        full: Dict[str, Any] = {"head_dim": raw.get("global_head_dim", 512)}
        if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = raw["num_global_key_value_heads"]
        overrides = [full if t == "full_attention" else {} for t in types]
    try:
        dims = tuple(int(o.get("head_dim", config.head_dim)) for o in overrides)
        heads = tuple(int(o.get("num_key_value_heads", config.num_kv_heads)) for o in overrides)
    except (TypeError, ValueError, AttributeError):
        raise ModelFormatError(f"{where}: per_layer_config / global_head_dim hold a size that is not a whole "
                               "number.") from None
    for d, kv in zip(dims, heads):
        if d < 2 or d % 2 or kv < 1 or config.num_heads % kv:
            raise ModelFormatError(f"{where}: a layer's head_dim {d} / num_key_value_heads {kv} does not fit "
                                   f"{config.num_heads} attention heads with RoPE.")
    return dims, heads


def _kv_sources(raw: Dict[str, Any], types: List[str], where: str) -> Tuple[Optional[int], ...]:
    """For each layer, None or the layer whose cache it reads: the last `num_kv_shared_layers` layers read the last
    earlier layer of their own type."""
    n = len(types)
    shared = raw.get("num_kv_shared_layers") or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < n:
        raise ModelFormatError(f"{where}: num_kv_shared_layers must be a whole number below the {n} layers, "
                               f"found {shared!r}.")
    first = n - shared
    sources: List[Optional[int]] = [None] * n
    for i in range(first, n):
        own = [j for j in range(first) if types[j] == types[i]]
        if not own:
            raise ModelFormatError(f"{where}: layer {i} shares the KV cache of a {types[i]} layer but none of the "
                                   f"first {first} layers is one.")
        sources[i] = own[-1]
    return tuple(sources)


class Gemma4(Architecture):
    model_types = ("gemma4_text",)
    class_names = ("Gemma4ForCausalLM",)
    #: `hidden_size_per_layer_input` when config.json leaves it out (0: no per-layer embeddings)
    ple_default = 0

    def ple_dim(self, config: ConfigData) -> int:
        value = config.raw.get("hidden_size_per_layer_input", self.ple_default)
        return int(value or 0)

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        if raw.get("enable_moe_block"):
            for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
                value = raw.get(key)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ModelFormatError(f"{where}: enable_moe_block needs a positive whole {key}, found "
                                           f"{value!r}.")
        if raw.get("use_bidirectional_attention") == "all":
            raise ModelFormatError(f"{where}: use_bidirectional_attention 'all' is not supported; this engine "
                                   "decodes causally.")
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ModelFormatError(f"{where}: hidden_activation {act!r} is not supported for Gemma 4 "
                                   "(supported: gelu_pytorch_tanh).")
        n = config.num_layers
        types = _layer_types(raw, n, where)
        window = positive_window(raw.get("sliding_window"), where)
        dims, kv_heads = _per_layer_sizes(raw, config, types, where)
        sources = _kv_sources(raw, types, where)
        wide = 2 if raw.get("use_double_wide_mlp") else 1
        cap = raw.get("final_logit_softcapping")
        biases = ("q_proj", "k_proj", "v_proj", "o_proj") if raw.get("attention_bias") else ()
        return Features(
            biases=biases,
            qk_norm=True,
            attn_out_norm=True,
            mlp_out_norm=True,
            activation="gelu_tanh",
            embed_scale=config.hidden_size ** 0.5,
            attn_scale=1.0,
            final_softcap=None if cap is None else float(cap),
            windows=tuple(window if t == "sliding_attention" else None for t in types),
            ropes=tuple(self._rope(raw, t, d, config, where) for t, d in zip(types, dims)),
            head_dims=dims,
            kv_heads=kv_heads,
            intermediate_sizes=tuple(config.intermediate_size * (wide if s is not None else 1) for s in sources),
            kv_sources=sources,
        )

    @staticmethod
    def _rope(raw: Dict[str, Any], layer_type: str, head_dim: int, config: ConfigData, where: str) -> RopeSpec:
        params = raw.get("rope_parameters") or {}
        own = params.get(layer_type) if isinstance(params, dict) else None
        if not isinstance(own, dict):
            own = ({"rope_type": "default", "rope_theta": 10_000.0} if layer_type == "sliding_attention" else
                   {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0})
        theta = float(own.get("rope_theta") or config.rope_theta)
        return RopeSpec(theta, parse_rope_scaling(raw, own, head_dim, where), head_dim)

    def layout(self, config: ConfigData, index: int) -> LayerLayout:
        h, hd = config.hidden_size, config.layer_head_dim(index)
        qd, kvd, inter = config.num_heads * hd, config.layer_kv_heads(index) * hd, config.layer_intermediate(index)
        linears = {"q_proj": Linear("self_attn.q_proj", h, qd)}
        norms = {"input_norm": ("input_layernorm", h), "attn_out_norm": ("post_attention_layernorm", h),
                 "post_norm": ("pre_feedforward_layernorm", h), "mlp_out_norm": ("post_feedforward_layernorm", h),
                 "q_norm": ("self_attn.q_norm", hd)}
        if config.layer_kv_source(index) is None:
            linears["k_proj"] = Linear("self_attn.k_proj", h, kvd)
            if not self._k_eq_v(config, index):
                linears["v_proj"] = Linear("self_attn.v_proj", h, kvd)
            norms["k_norm"] = ("self_attn.k_norm", hd)
        linears["o_proj"] = Linear("self_attn.o_proj", qd, h)
        dense = {"gate_proj": Linear("mlp.gate_proj", h, inter), "up_proj": Linear("mlp.up_proj", h, inter),
                 "down_proj": Linear("mlp.down_proj", inter, h)}
        if not config.raw.get("enable_moe_block"):
            linears.update(dense)
            return LayerLayout(linears, norms, config.features.biases, tensors=self.own_tensors(config, index))
        # the MoE block loads the dense MLP and its norms itself (build_mlp); the layer norms without a weight
        del norms["post_norm"]
        e = int(config.raw["num_experts"])
        dense["router"] = Linear("router.proj", h, e, quantized=False)
        return LayerLayout(linears, norms, config.features.biases, mlp_linears=dense,
                           tensors=self.own_tensors(config, index))

    def build_mlp(self, loader: Any, config: ConfigData, index: int) -> Optional[Any]:
        if not config.raw.get("enable_moe_block"):
            return None
        from kobold_backend.engine.gemma4_moe import Gemma4MoE

        h, inter, raw = config.hidden_size, config.layer_intermediate(index), config.raw
        e, moe = int(raw["num_experts"]), int(raw["moe_intermediate_size"])
        return Gemma4MoE(
            loader.linear("mlp.gate_proj", h, inter), loader.linear("mlp.up_proj", h, inter),
            loader.linear("mlp.down_proj", inter, h), loader.dense("pre_feedforward_layernorm.weight", (h,)),
            loader.dense("post_feedforward_layernorm_1.weight", (h,)), loader.dense("router.proj.weight", (e, h)),
            loader.dense("router.scale", (h,)), loader.dense("router.per_expert_scale", (e,)),
            loader.dense("pre_feedforward_layernorm_2.weight", (h,)),
            loader.dense("post_feedforward_layernorm_2.weight", (h,)),
            loader.dense("experts.gate_up_proj", (e, 2 * moe, h)), loader.dense("experts.down_proj", (e, h, moe)),
            int(raw["top_k_experts"]), config.rms_norm_eps)

    @staticmethod
    def _k_eq_v(config: ConfigData, index: int) -> bool:
        return bool(config.raw.get("attention_k_eq_v")) and config.layer_window(index) is None

    def layer_extras(self, loader: Any, config: ConfigData, index: int) -> Dict[str, Any]:
        from kobold_backend.engine.per_layer_input import PerLayerGate

        h, hd = config.hidden_size, config.layer_head_dim(index)
        extras: Dict[str, Any] = {}
        if config.layer_kv_source(index) is None:
            extras["v_norm"] = torch.ones(hd, device=loader.device, dtype=loader.dtype)
        if config.raw.get("enable_moe_block"):  # the MoE block applies each branch's norm weight itself
            extras["post_norm"] = torch.ones(h, device=loader.device, dtype=loader.dtype)
        if loader.has("layer_scalar"):
            extras["out_scale"] = loader.dense("layer_scalar", (1,))
        dim = self.ple_dim(config)
        if dim:
            extras["per_layer_gate"] = PerLayerGate(
                loader.linear("per_layer_input_gate", h, dim), loader.linear("per_layer_projection", dim, h),
                loader.dense("post_per_layer_input_norm.weight", (h,)), config.rms_norm_eps)
        return extras

    def model_tensors(self, config: ConfigData) -> Dict[str, Tuple[int, ...]]:
        dim, n, h = self.ple_dim(config), config.num_layers, config.hidden_size
        if not dim:
            return {}
        vocab = int(config.raw.get("vocab_size_per_layer_input") or config.vocab_size)
        return {"model.embed_tokens_per_layer.weight": (vocab, n * dim),
                "model.per_layer_model_projection.weight": (n * dim, h),
                "model.per_layer_projection_norm.weight": (dim,)}

    def own_tensors(self, config: ConfigData, index: int) -> Dict[str, Tuple[int, ...]]:
        """The layout's `tensors`: what `layer_extras` and the MoE block read beyond its linears and norms."""
        dim, h, raw = self.ple_dim(config), config.hidden_size, config.raw
        own: Dict[str, Tuple[int, ...]] = {"layer_scalar": (1,)}
        if raw.get("enable_moe_block"):
            e, moe = int(raw["num_experts"]), int(raw["moe_intermediate_size"])
            own.update({"pre_feedforward_layernorm.weight": (h,), "router.scale": (h,),
                        "router.per_expert_scale": (e,), "experts.gate_up_proj": (e, 2 * moe, h),
                        "experts.down_proj": (e, h, moe), "post_feedforward_layernorm_1.weight": (h,),
                        "post_feedforward_layernorm_2.weight": (h,), "pre_feedforward_layernorm_2.weight": (h,)})
        if dim:
            own.update({"per_layer_input_gate.weight": (dim, h), "per_layer_projection.weight": (h, dim),
                        "post_per_layer_input_norm.weight": (h,)})
        return own

    def per_layer_embedding(self, loader: Any, config: ConfigData) -> Optional[Any]:
        from kobold_backend.engine.per_layer_input import PerLayerEmbedding

        dim = self.ple_dim(config)
        if not dim:
            return None
        n, vocab = config.num_layers, int(config.raw.get("vocab_size_per_layer_input") or config.vocab_size)
        embed = loader.dense("embed_tokens_per_layer.weight", (vocab, n * dim))
        return PerLayerEmbedding(
            embed, float(torch.tensor(dim ** 0.5, dtype=embed.dtype)),
            loader.linear("per_layer_model_projection", config.hidden_size, n * dim),
            loader.dense("per_layer_projection_norm.weight", (dim,)), n, dim, config.rms_norm_eps)


class Gemma4Multimodal(Gemma4):
    """The text model of Gemma4ForConditionalGeneration (Gemma 4 E2B, E4B, 31B as published)."""

    model_types = ("gemma4",)
    class_names = ("Gemma4ForConditionalGeneration",)

    def text_config(self, raw: Dict[str, Any], where: str) -> Dict[str, Any]:
        return multimodal_text_config(raw, where)

    def stored_names(self, names: List[str]) -> Dict[str, str]:
        return language_model_names(names)


def multimodal_text_config(raw: Dict[str, Any], where: str) -> Dict[str, Any]:
    """The decoder's settings of a Gemma multimodal config.json: `text_config` with the outer dtype, tying and
    quantization."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelFormatError(f"{where}: a {raw.get('model_type')} config.json must hold the text model's settings "
                               "in text_config.")
    merged = dict(text, model_type=raw["model_type"], architectures=raw.get("architectures") or [])
    for key in ("tie_word_embeddings", "quantization_config", "torch_dtype", "dtype"):
        if raw.get(key) is not None:
            merged[key] = raw[key]
    return merged


def language_model_names(names: List[str]) -> Dict[str, str]:
    """Engine names of the text model's tensors stored under `model.language_model.` (towers are left out)."""
    stored = "model.language_model."
    return {"model." + name[len(stored):]: name for name in names if name.startswith(stored)}


register(Gemma4())
register(Gemma4Multimodal())
