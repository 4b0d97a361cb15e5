"""Mixtral and Qwen3-MoE: Llama-style attention (Qwen3-MoE with Qwen3's per-head q/k norm) and a routed-experts MLP
(engine/moe.py) in place of the dense one.

Checkpoint names, dense or per-expert GPTQ (`.qweight`, `.qzeros`, `.scales`, `.g_idx` under each expert):
- Mixtral: `model.layers.N.block_sparse_moe.gate` (router [E, H], never quantized in GPTQ repos but read either
  way) and `block_sparse_moe.experts.E.{w1,w3,w2}` (gate, up, down). Every layer is routed; the k routing weights are
  always renormalised to sum 1.
- Qwen3-MoE: `mlp.gate` and `mlp.experts.E.{gate_proj,up_proj,down_proj}` (size `moe_intermediate_size`); layer i
  is routed unless it is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`, and then has the dense MLP of
  `intermediate_size`. The k weights are renormalised only with `norm_topk_prob`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple

import torch

from kobold_backend.engine.architectures.base import (
    Architecture,
    Features,
    LayerLayout,
    Linear,
    register,
    uniform_windows,
)
from kobold_backend.engine.config_types import ConfigData
from kobold_backend.engine.moe import RoutedExperts, stack_expert_mlps
from kobold_backend.errors import ModelFormatError

# the router bias of sigmoid routing (DeepSeek-V3, GLM-4.5): it biases the choice of experts, not their weights
CORRECTION_BIAS = "mlp.gate.e_score_correction_bias"

_DENSE_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MoeSpec:
    """Where a family keeps its experts and how it routes."""

    block: str  # "block_sparse_moe" | "mlp"
    names: Tuple[str, str, str]  # the gate, up and down projections of one expert
    num_experts: int
    top_k: int
    intermediate: int
    renormalize: bool


def _count(raw: Dict[str, Any], keys: Tuple[str, ...], where: str) -> int:
    for key in keys:
        value = raw.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelFormatError(f"{where}: {key} must be a positive integer, found {value!r}.")
            return value
    raise ModelFormatError(f"{where}: config.json lacks {keys[0]!r}, which a mixture-of-experts model needs.")


class RoutedArchitecture(Architecture):
    """Shared by the routed families: the dense MLP of routed layers leaves the layout; build_mlp loads experts."""

    def moe(self, raw: Dict[str, Any], config: ConfigData, where: str) -> MoeSpec:
        raise NotImplementedError

    def routed(self, raw: Dict[str, Any], index: int) -> bool:
        return True

    def check(self, raw: Dict[str, Any], config: ConfigData, where: str) -> None:
        """Refuse a config whose routing cannot work, before any weight is read."""
        spec = self.moe(raw, config, where)
        if spec.top_k > spec.num_experts:
            raise ModelFormatError(f"{where}: num_experts_per_tok {spec.top_k} exceeds the {spec.num_experts} "
                                   "experts.")

    def layout(self, config: ConfigData, index: int) -> LayerLayout:
        """The dense MLP leaves a routed layer; its router and experts are listed as `mlp_linears` (named
        `router` and `E.gate` / `E.up` / `E.down`), which `build_mlp` loads."""
        layout = super().layout(config, index)
        if not self.routed(config.raw, index):
            return layout
        spec = self.moe(config.raw, config, config.model_type)
        h, inter = config.hidden_size, spec.intermediate
        mlp = {"router": Linear(f"{spec.block}.gate", h, spec.num_experts, quantized=False)}
        for e in range(spec.num_experts):
            prefix = f"{spec.block}.experts.{e}"
            gate, up, down = spec.names
            mlp[f"{e}.gate"] = Linear(f"{prefix}.{gate}", h, inter)
            mlp[f"{e}.up"] = Linear(f"{prefix}.{up}", h, inter)
            mlp[f"{e}.down"] = Linear(f"{prefix}.{down}", inter, h)
        linears = {k: v for k, v in layout.linears.items() if k not in _DENSE_MLP}
        return replace(layout, linears=linears, mlp_linears=mlp)

    def build_mlp(self, loader: Any, config: ConfigData, index: int) -> Optional[RoutedExperts]:
        if not self.routed(config.raw, index):
            return None
        from kobold_backend.engine.model import ACTIVATIONS

        spec = self.moe(config.raw, config, config.model_type)
        mlp = self.layout(config, index).mlp_linears

        def load(name: str) -> Any:
            lin = mlp[name]
            return loader.linear(lin.prefix, lin.in_features, lin.out_features)

        experts = range(spec.num_experts)
        try:
            gate_up, up, down = stack_expert_mlps([load(f"{e}.gate") for e in experts],
                                                  [load(f"{e}.up") for e in experts],
                                                  [load(f"{e}.down") for e in experts])
        except ValueError as exc:
            raise ModelFormatError(f"{loader.prefix}: {exc}.") from None
        return RoutedExperts(load("router"), gate_up, up, down, spec.top_k, spec.renormalize,
                             ACTIVATIONS[config.features.activation])

    @staticmethod
    def correction_bias(loader: Any, num_experts: int) -> Optional[torch.Tensor]:
        """`mlp.gate.e_score_correction_bias` [E] (DeepSeek-V3, GLM-4.5) in float32 as stored, without a round trip
        through the layer dtype (transformers keeps it in float32), or None when the checkpoint has none."""
        if not loader.has(CORRECTION_BIAS):
            return None
        return loader.reader.get(loader.name(CORRECTION_BIAS), (num_experts,)).float().to(loader.device)


class Mixtral(RoutedArchitecture):
    model_types = ("mixtral",)
    class_names = ("MixtralForCausalLM",)

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        self.check(raw, config, where)
        return replace(super().features(raw, config, where), windows=uniform_windows(raw, config, where))

    def moe(self, raw: Dict[str, Any], config: ConfigData, where: str) -> MoeSpec:
        return MoeSpec("block_sparse_moe", ("w1", "w3", "w2"), _count(raw, ("num_local_experts",), where),
                       _count(raw, ("num_experts_per_tok",), where), config.intermediate_size, True)


class Qwen3Moe(RoutedArchitecture):
    model_types = ("qwen3_moe",)
    class_names = ("Qwen3MoeForCausalLM",)

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        self.check(raw, config, where)
        # transformers applies `sliding_window` to every layer when `use_sliding_window` is set (off in releases)
        windows = uniform_windows(raw, config, where) if raw.get("use_sliding_window") else ()
        return replace(super().features(raw, config, where), qk_norm=True, windows=windows)

    def moe(self, raw: Dict[str, Any], config: ConfigData, where: str) -> MoeSpec:
        # transformers 5 writes num_local_experts where the Hub's configs say num_experts
        return MoeSpec("mlp", ("gate_proj", "up_proj", "down_proj"),
                       _count(raw, ("num_experts", "num_local_experts"), where),
                       _count(raw, ("num_experts_per_tok",), where),
                       _count(raw, ("moe_intermediate_size",), where), bool(raw.get("norm_topk_prob", False)))

    def routed(self, raw: Dict[str, Any], index: int) -> bool:
        experts = raw.get("num_experts", raw.get("num_local_experts")) or 0
        step = int(raw.get("decoder_sparse_step") or 1)
        return index not in (raw.get("mlp_only_layers") or []) and experts > 0 and (index + 1) % step == 0


register(Mixtral())
register(Qwen3Moe())
