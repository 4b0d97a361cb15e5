"""Qwen3.5 dense and MoE text models (`qwen3_5_text`, `qwen3_5_moe_text`): hybrid stacks of Gated DeltaNet linear
attention (engine/linear_attention.py, a layer mixer) and, every `full_attention_interval`-th layer (or as
`layer_types` says), the generic attention with q/k norm, partial RoPE (`RopeSpec.dim`, default a quarter of each
head) and an output gate (`Features.attn_output_gate`: q_proj yields each head's query and then its gate).

Checkpoint names under `model.layers.N.`:
- linear layers: `linear_attn.{in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj}.weight`, `conv1d.weight`
  [channels, 1, kernel], `dt_bias`, `A_log`, `norm.weight` (the gated RMSNorm, a plain weight);
- full layers: `self_attn.{q_proj (query and gate per head), k_proj, v_proj, o_proj}`, `self_attn.{q,k}_norm`;
- MLP: `mlp.{gate,up,down}_proj` (dense) or `mlp.gate` (router), `mlp.experts.E.{gate,up,down}_proj`,
  `mlp.shared_expert.{gate,up,down}_proj`, `mlp.shared_expert_gate` (MoE: every layer routed, top-k renormalised).
Every RMSNorm except the gated one is zero-centred, `(1 + weight)`: `norm_offset` 1.

The released checkpoints are multimodal (`qwen3_5` / `qwen3_5_moe`, *ForConditionalGeneration): the decoder's
settings are under `text_config` and its tensors under `model.language_model.` (`lm_head` at the top); the vision
tower (`model.visual.`) and the multi-token-prediction head (`mtp.`) are not loaded: this engine runs text only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from kobold_backend.engine.architectures.base import (
    Architecture,
    Features,
    LayerLayout,
    Linear,
    activation,
    partial_ropes,
    register,
)
from kobold_backend.engine.architectures.moe import MoeSpec, RoutedArchitecture
from kobold_backend.engine.config_types import ConfigData
from kobold_backend.engine.moe import DenseMLP, RoutedExperts
from kobold_backend.errors import ModelFormatError


@dataclass(frozen=True)
class LinearSpec:
    """The sizes of a Gated DeltaNet layer."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    kernel: int

    @property
    def channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def _positive(raw: Dict[str, Any], key: str, where: str, default: Optional[int] = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelFormatError(f"{where}: {key} must be a positive integer, found {value!r}.")
    return value


def layer_kinds(raw: Dict[str, Any], layers: int, where: str) -> Tuple[str, ...]:
    """"linear_attention" or "full_attention" per layer, from `layer_types` or `full_attention_interval`."""
    types = raw.get("layer_types")
    if types is None:
        interval = _positive(raw, "full_attention_interval", where, 4)
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))
    if not isinstance(types, list) or len(types) != layers or \
            any(t not in ("linear_attention", "full_attention") for t in types):
        raise ModelFormatError(f"{where}: layer_types must list 'linear_attention' or 'full_attention' for each of "
                               f"the {layers} layers.")
    return tuple(types)


class Qwen3_5(Architecture):
    model_types = ("qwen3_5_text",)
    class_names = ("Qwen3_5ForCausalLM",)

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        layer_kinds(raw, config.num_layers, where)
        spec = self.linear_spec(raw, where)
        if spec.value_heads % spec.key_heads:
            raise ModelFormatError(f"{where}: linear_num_value_heads {spec.value_heads} is not a multiple of "
                                   f"linear_num_key_heads {spec.key_heads}.")
        if raw.get("attention_bias"):
            raise ModelFormatError(f"{where}: attention_bias is not supported for Qwen3.5.")
        return Features(qk_norm=True, norm_offset=1.0, activation=activation(raw, where), attn_output_gate=True,
                        ropes=partial_ropes(raw, config, where, 0.25))

    @staticmethod
    def linear_spec(raw: Dict[str, Any], where: str) -> LinearSpec:
        return LinearSpec(_positive(raw, "linear_num_key_heads", where, 16),
                          _positive(raw, "linear_num_value_heads", where, 32),
                          _positive(raw, "linear_key_head_dim", where, 128),
                          _positive(raw, "linear_value_head_dim", where, 128),
                          _positive(raw, "linear_conv_kernel_dim", where, 4))

    @staticmethod
    def is_linear(config: ConfigData, index: int) -> bool:
        """Whether layer `index` is a linear-attention layer (else the generic, gated full attention)."""
        return layer_kinds(config.raw, config.num_layers, config.model_type)[index] == "linear_attention"

    def mixer_linears(self, config: ConfigData, index: int) -> Dict[str, Linear]:
        """A linear-attention layer's projections (build_mixer loads them)."""
        h = config.hidden_size
        s = self.linear_spec(config.raw, config.model_type)
        vd = s.value_heads * s.value_dim
        return {"in_proj_qkv": Linear("linear_attn.in_proj_qkv", h, s.channels),
                "in_proj_z": Linear("linear_attn.in_proj_z", h, vd),
                # one value per head: GPTQ repos keep them dense (the loader reads either way)
                "in_proj_b": Linear("linear_attn.in_proj_b", h, s.value_heads, quantized=False),
                "in_proj_a": Linear("linear_attn.in_proj_a", h, s.value_heads, quantized=False),
                "out_proj": Linear("linear_attn.out_proj", vd, h)}

    def layout(self, config: ConfigData, index: int) -> LayerLayout:
        """Llama's layout (q_proj twice as wide: query and gate) for a full-attention layer; a linear-attention
        layer's mixer projections are listed as `mlp_linears` and its other tensors in `tensors` (build_mixer loads
        them), in place of q/k/v/o and the q/k norms."""
        base = super().layout(config, index)
        if not self.is_linear(config, index):
            return base
        linears = {k: v for k, v in base.linears.items() if k in ("gate_proj", "up_proj", "down_proj")}
        norms = {k: v for k, v in base.norms.items() if k in ("input_norm", "post_norm")}
        mixer = {f"mixer.{k}": v for k, v in self.mixer_linears(config, index).items()}
        return LayerLayout(linears, norms, (), {**base.mlp_linears, **mixer}, tensors=self.mixer_tensors(config, index))

    def mixer_tensors(self, config: ConfigData, index: int) -> Dict[str, Tuple[int, ...]]:
        """A linear-attention layer's tensors besides its linears (checkpoint name -> shape)."""
        s = self.linear_spec(config.raw, config.model_type)
        return {"linear_attn.conv1d.weight": (s.channels, 1, s.kernel), "linear_attn.dt_bias": (s.value_heads,),
                "linear_attn.A_log": (s.value_heads,), "linear_attn.norm.weight": (s.value_dim,)}

    def state_bytes(self, config: ConfigData, index: int, elem: int) -> Optional[int]:
        """A linear layer's conv state (kernel - 1 inputs, the layer's dtype) and float32 recurrent state."""
        if not self.is_linear(config, index):
            return None
        s = self.linear_spec(config.raw, config.model_type)
        return s.channels * (s.kernel - 1) * elem + s.value_heads * s.key_dim * s.value_dim * 4

    def build_mixer(self, loader: Any, config: ConfigData, index: int) -> Any:
        if not self.is_linear(config, index):
            return None
        from kobold_backend.engine.linear_attention import GatedDeltaNet

        lin = {k: loader.linear(v.prefix, v.in_features, v.out_features)
               for k, v in self.mixer_linears(config, index).items()}
        raw, where, eps = config.raw, config.model_type, config.rms_norm_eps
        s = self.linear_spec(raw, where)
        conv = loader.dense("linear_attn.conv1d.weight", (s.channels, 1, s.kernel)).squeeze(1).contiguous()
        return GatedDeltaNet(lin["in_proj_qkv"], lin["in_proj_z"], lin["in_proj_b"], lin["in_proj_a"], conv,
                             loader.dense("linear_attn.dt_bias", (s.value_heads,)),
                             loader.dense("linear_attn.A_log", (s.value_heads,)),
                             loader.dense("linear_attn.norm.weight", (s.value_dim,)), lin["out_proj"],
                             s.key_heads, s.value_heads, s.key_dim, s.value_dim, eps,
                             raw.get("linear_value_head_order") == "tiled")


class Qwen3_5Moe(Qwen3_5, RoutedArchitecture):
    """Every layer routed (top-k renormalised) with a sigmoid-gated shared expert: RoutedArchitecture's experts and
    RoutedExperts.shared, a DenseMLP with `out_gate`."""

    model_types = ("qwen3_5_moe_text",)
    class_names = ("Qwen3_5MoeForCausalLM",)

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        self.check(raw, config, where)
        _positive(raw, "shared_expert_intermediate_size", where)
        return super().features(raw, config, where)

    def moe(self, raw: Dict[str, Any], config: ConfigData, where: str) -> MoeSpec:
        return MoeSpec("mlp", ("gate_proj", "up_proj", "down_proj"), _positive(raw, "num_experts", where),
                       _positive(raw, "num_experts_per_tok", where), _positive(raw, "moe_intermediate_size", where),
                       self.renormalize(raw))

    def renormalize(self, raw: Dict[str, Any]) -> bool:
        """Whether the top-k routing weights are renormalised to sum 1 (always for Qwen3.5-MoE)."""
        return True

    def layout(self, config: ConfigData, index: int) -> LayerLayout:
        layout = super().layout(config, index)
        if not self.routed(config.raw, index):
            return layout
        h, shared = config.hidden_size, config.raw["shared_expert_intermediate_size"]
        mlp = dict(layout.mlp_linears, shared_gate=Linear("mlp.shared_expert_gate", h, 1, quantized=False))
        mlp.update({"shared.gate": Linear("mlp.shared_expert.gate_proj", h, shared),
                    "shared.up": Linear("mlp.shared_expert.up_proj", h, shared),
                    "shared.down": Linear("mlp.shared_expert.down_proj", shared, h)})
        return replace(layout, mlp_linears=mlp)

    def build_mlp(self, loader: Any, config: ConfigData, index: int) -> Optional[RoutedExperts]:
        experts = super().build_mlp(loader, config, index)
        if experts is None:
            return None
        mlp = self.layout(config, index).mlp_linears
        gate, up, down, out_gate = (loader.linear(mlp[n].prefix, mlp[n].in_features, mlp[n].out_features)
                                    for n in ("shared.gate", "shared.up", "shared.down", "shared_gate"))
        return replace(experts, shared=DenseMLP(gate, up, down, experts.act, out_gate))


class Qwen3Next(Qwen3_5Moe):
    """Qwen3-Next: Qwen3.5-MoE's stack with linear attention's projections fused per key head (`in_proj_qkvz`,
    `in_proj_ba`, see engine/linear_attention.py FusedGatedDeltaNet), routed layers as Qwen3-MoE chooses them
    (`mlp_only_layers`, `decoder_sparse_step`; dense MLP of `intermediate_size` elsewhere) and `norm_topk_prob`."""

    model_types = ("qwen3_next",)
    class_names = ("Qwen3NextForCausalLM",)

    def routed(self, raw: Dict[str, Any], index: int) -> bool:
        step = int(raw.get("decoder_sparse_step") or 1)
        return index not in (raw.get("mlp_only_layers") or []) and (index + 1) % step == 0

    def renormalize(self, raw: Dict[str, Any]) -> bool:
        return bool(raw.get("norm_topk_prob", True))

    def mixer_linears(self, config: ConfigData, index: int) -> Dict[str, Linear]:
        h, s = config.hidden_size, self.linear_spec(config.raw, config.model_type)
        vd = s.value_heads * s.value_dim
        return {"in_proj_qkvz": Linear("linear_attn.in_proj_qkvz", h, s.channels + vd),
                "in_proj_ba": Linear("linear_attn.in_proj_ba", h, 2 * s.value_heads, quantized=False),
                "out_proj": Linear("linear_attn.out_proj", vd, h)}

    def build_mixer(self, loader: Any, config: ConfigData, index: int) -> Any:
        if not self.is_linear(config, index):
            return None
        from kobold_backend.engine.linear_attention import FusedGatedDeltaNet

        lin = {k: loader.linear(v.prefix, v.in_features, v.out_features)
               for k, v in self.mixer_linears(config, index).items()}
        s = self.linear_spec(config.raw, config.model_type)
        conv = loader.dense("linear_attn.conv1d.weight", (s.channels, 1, s.kernel)).squeeze(1).contiguous()
        return FusedGatedDeltaNet(lin["in_proj_qkvz"], None, lin["in_proj_ba"], None, conv,
                                  loader.dense("linear_attn.dt_bias", (s.value_heads,)),
                                  loader.dense("linear_attn.A_log", (s.value_heads,)),
                                  loader.dense("linear_attn.norm.weight", (s.value_dim,)), lin["out_proj"],
                                  s.key_heads, s.value_heads, s.key_dim, s.value_dim, config.rms_norm_eps)


_TEXT_PREFIX = "model.language_model."


class _Multimodal:
    """The text model of a multimodal checkpoint: `text_config` and the `model.language_model.` tensors."""

    def text_config(self, raw: Dict[str, Any], where: str) -> Dict[str, Any]:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelFormatError(f"{where}: a {raw.get('model_type')} config.json must hold the text model's "
                                   "settings in text_config.")
        merged = dict(text, model_type=raw["model_type"], architectures=raw.get("architectures") or [])
        for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "quantization_config", "torch_dtype",
                    "dtype"):
            if raw.get(key) is not None:
                merged[key] = raw[key]
        return merged

    def stored_names(self, names: List[str]) -> Dict[str, str]:
        return {"model." + name[len(_TEXT_PREFIX):]: name for name in names if name.startswith(_TEXT_PREFIX)}


class Qwen3_5Multimodal(_Multimodal, Qwen3_5):
    model_types = ("qwen3_5",)
    class_names = ("Qwen3_5ForConditionalGeneration",)


class Qwen3_5MoeMultimodal(_Multimodal, Qwen3_5Moe):
    model_types = ("qwen3_5_moe",)
    class_names = ("Qwen3_5MoeForConditionalGeneration",)


register(Qwen3_5())
register(Qwen3_5Moe())
register(Qwen3_5Multimodal())
register(Qwen3_5MoeMultimodal())
register(Qwen3Next())
