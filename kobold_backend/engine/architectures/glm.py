"""GLM-4 (`glm4`, GLM-4-0414) and GLM-4.5 / 4.6 (`glm4_moe`), read as transformers' modeling_glm4 /
modeling_glm4_moe compute them.

Both rotate only the first `partial_rotary_factor` (default 0.5) of each head; q/k/v carry biases with
`attention_bias` (o_proj never does).
- GLM-4: RoPE on interleaved pairs; gate and up stored as one `mlp.gate_up_proj` (gate first); the attention output
  is normed (`post_self_attn_layernorm`) before the residual add, the MLP input by `post_attention_layernorm` and
  the MLP output by `post_mlp_layernorm`.
- GLM-4.5: RoPE on split halves of the rotated part; optional per-head q/k RMSNorm (`use_qk_norm`); the first
  `first_k_dense_replace` layers keep a dense MLP, the others route to `n_routed_experts` experts (sigmoid scores
  with `e_score_correction_bias`, group-limited top-k over `n_group` / `topk_group`, `norm_topk_prob`,
  `routed_scaling_factor`: engine/moe.py's "sigmoid" routing, as DeepSeek-V3's) plus `n_shared_experts` shared
  ones (`mlp.shared_experts`, one dense MLP of n_shared_experts * moe_intermediate_size). The
  `num_nextn_predict_layers` layers stored after the decoder stack (multi-token prediction) are not run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional

from kobold_backend.engine.architectures.base import (
    Architecture,
    Features,
    LayerLayout,
    Linear,
    partial_ropes,
    register,
)
from kobold_backend.engine.architectures.moe import CORRECTION_BIAS, MoeSpec, RoutedArchitecture, _count
from kobold_backend.engine.config_types import ConfigData
from kobold_backend.engine.moe import DenseMLP, RoutedExperts, Routing
from kobold_backend.errors import ModelFormatError


def _qkv_biases(raw: Dict[str, Any]) -> Any:
    return ("q_proj", "k_proj", "v_proj") if raw.get("attention_bias") else ()


class Glm4(Architecture):
    model_types = ("glm4",)
    class_names = ("Glm4ForCausalLM",)
    fused = {"gate_up_proj": "mlp.gate_up_proj"}

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        return replace(super().features(raw, config, where), biases=_qkv_biases(raw), attn_out_norm=True,
                       mlp_out_norm=True, rope_interleaved=True, ropes=partial_ropes(raw, config, where, 0.5))

    def layout(self, config: ConfigData, index: int) -> LayerLayout:
        h = config.hidden_size
        norms = {"input_norm": ("input_layernorm", h), "attn_out_norm": ("post_self_attn_layernorm", h),
                 "post_norm": ("post_attention_layernorm", h), "mlp_out_norm": ("post_mlp_layernorm", h)}
        return replace(super().layout(config, index), norms=norms)


class Glm4Moe(RoutedArchitecture):
    model_types = ("glm4_moe",)
    class_names = ("Glm4MoeForCausalLM",)

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        self.check(raw, config, where)
        experts, groups = self.moe(raw, config, where).num_experts, self._groups(raw, where)
        if experts % groups[0] or experts // groups[0] < 2 or groups[1] > groups[0]:
            raise ModelFormatError(f"{where}: {experts} experts cannot form n_group {groups[0]} groups of at least "
                                   f"two with topk_group {groups[1]}.")
        return replace(super().features(raw, config, where), biases=_qkv_biases(raw),
                       qk_norm=bool(raw.get("use_qk_norm")), ropes=partial_ropes(raw, config, where, 0.5))

    def moe(self, raw: Dict[str, Any], config: ConfigData, where: str) -> MoeSpec:
        return MoeSpec("mlp", ("gate_proj", "up_proj", "down_proj"),
                       _count(raw, ("n_routed_experts", "num_local_experts"), where),
                       _count(raw, ("num_experts_per_tok",), where),
                       _count(raw, ("moe_intermediate_size",), where), bool(raw.get("norm_topk_prob", True)))

    def routed(self, raw: Dict[str, Any], index: int) -> bool:
        return index >= int(raw.get("first_k_dense_replace") or 0)

    def unused_layers(self, raw: Dict[str, Any]) -> int:
        return int(raw.get("num_nextn_predict_layers") or 0)

    @staticmethod
    def _groups(raw: Dict[str, Any], where: str) -> Any:
        return _count(raw, ("n_group",), where) if raw.get("n_group") else 1, \
            _count(raw, ("topk_group",), where) if raw.get("topk_group") else 1

    def _shared_size(self, raw: Dict[str, Any], where: str) -> int:
        return int(raw.get("n_shared_experts") or 0) * _count(raw, ("moe_intermediate_size",), where)

    def layout(self, config: ConfigData, index: int) -> LayerLayout:
        """A routed layer lists its router bias and shared experts besides the router and routed experts."""
        layout = super().layout(config, index)
        if not self.routed(config.raw, index):
            return layout
        h, mlp = config.hidden_size, dict(layout.mlp_linears)
        shared = self._shared_size(config.raw, config.model_type)
        if shared:
            mlp.update({"shared.gate": Linear("mlp.shared_experts.gate_proj", h, shared),
                        "shared.up": Linear("mlp.shared_experts.up_proj", h, shared),
                        "shared.down": Linear("mlp.shared_experts.down_proj", shared, h)})
        experts = self.moe(config.raw, config, config.model_type).num_experts
        return replace(layout, mlp_linears=mlp, tensors={CORRECTION_BIAS: (experts,)})

    def build_mlp(self, loader: Any, config: ConfigData, index: int) -> Optional[RoutedExperts]:
        experts = super().build_mlp(loader, config, index)
        if experts is None:
            return None
        raw, where = config.raw, config.model_type
        groups, topk_groups = self._groups(raw, where)
        mlp = self.layout(config, index).mlp_linears
        shared = None
        if "shared.gate" in mlp:
            shared = DenseMLP(*(loader.linear(mlp[f"shared.{p}"].prefix, mlp[f"shared.{p}"].in_features,
                                              mlp[f"shared.{p}"].out_features) for p in ("gate", "up", "down")),
                              experts.act)
        correction = self.correction_bias(loader, experts.num_experts)
        routing = Routing("sigmoid", float(raw.get("routed_scaling_factor") or 1.0), groups, topk_groups, fp32=True)
        return replace(experts, routing=routing, correction_bias=correction, shared=shared)

register(Glm4())
register(Glm4Moe())
