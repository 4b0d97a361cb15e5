"""gpt-oss: Llama-shaped attention with biases, per-head attention sinks and alternating sliding windows, and a
routed MLP with biases and a clamped SwiGLU, read as transformers' modeling_gpt_oss computes it.

- Attention: q/k/v/o carry biases; `self_attn.sinks` [num_heads] is a learned logit per head that joins the softmax's
  denominator; `layer_types` alternates "sliding_attention" (window `sliding_window`) and "full_attention" (default:
  layer 0 sliding); RoPE is YaRN (`rope_scaling` / `rope_parameters`).
- MLP, every layer routed: `mlp.router.weight` [E, H] and `mlp.router.bias` [E]; the k largest biased logits are
  softmaxed among themselves. The experts are stacked tensors, either dense (`mlp.experts.gate_up_proj` [E, H, 2I],
  gate and up interleaved along the last axis, `down_proj` [E, I, H], i.e. [in, out]) or MXFP4 as the published
  checkpoints store them (`gate_up_proj_blocks` / `_scales` [E, 2I, ...], `down_proj_blocks` / `_scales`
  [E, H, ...], [out, in]; engine/mxfp4.py), which are dequantized here at load; `gate_up_proj_bias` [E, 2I] and
  `down_proj_bias` [E, H]. The unit is (clamp(up, ±limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
- GGUF (llama.cpp's converter): gate and up split into `ffn_gate_exps` / `ffn_up_exps` with their biases,
  `ffn_down_exps`, read per expert as stored (MXFP4 blocks included, ops/ggml.py), under the names
  engine/gguf/names.py gives them (`mlp.experts.E.gate_proj`).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

import torch

from kobold_backend import ops
from kobold_backend.engine.architectures.base import (
    Architecture,
    Features,
    LayerLayout,
    Linear,
    layer_type_windows,
    positive_window,
    register,
)
from kobold_backend.engine.config_types import ConfigData
from kobold_backend.engine.moe import ExpertBiases, ExpertStack, RoutedExperts, Routing, stack_expert_mlps
from kobold_backend.engine.mxfp4 import dequantize_mxfp4
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.ggml import GGMLWeight

_EXPERTS = "mlp.experts"


def _positive_int(raw: Dict[str, Any], key: str, where: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelFormatError(f"{where}: {key} must be a positive integer, found {value!r}.")
    return value


class GptOss(Architecture):
    model_types = ("gpt_oss",)
    class_names = ("GptOssForCausalLM",)

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        experts = _positive_int(raw, "num_local_experts", where)
        if _positive_int(raw, _top_k_key(raw), where) > experts:
            raise ModelFormatError(f"{where}: num_experts_per_tok exceeds the {experts} experts.")
        default = tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(config.num_layers))
        windows = layer_type_windows(raw, config, positive_window(raw.get("sliding_window"), where), default, where)
        biases = ("q_proj", "k_proj", "v_proj", "o_proj") if raw.get("attention_bias", True) else ()
        return Features(biases=biases, windows=windows)

    def layout(self, config: ConfigData, index: int) -> LayerLayout:
        h, qd = config.hidden_size, config.num_heads * config.head_dim
        kvd = config.num_kv_heads * config.head_dim
        linears = {"q_proj": Linear("self_attn.q_proj", h, qd), "k_proj": Linear("self_attn.k_proj", h, kvd),
                   "v_proj": Linear("self_attn.v_proj", h, kvd), "o_proj": Linear("self_attn.o_proj", qd, h)}
        experts, inter = int(config.raw["num_local_experts"]), config.intermediate_size
        mlp = {"router": Linear("mlp.router", h, experts, quantized=False)}
        mlp.update({f"{e}.gate_up": Linear(f"{_EXPERTS}.{e}.gate_up", h, 2 * inter) for e in range(experts)})
        mlp.update({f"{e}.down": Linear(f"{_EXPERTS}.{e}.down", inter, h) for e in range(experts)})
        norms = {"input_norm": ("input_layernorm", h), "post_norm": ("post_attention_layernorm", h)}
        return LayerLayout(linears, norms, config.features.biases, mlp,
                           extras={"sinks": ("self_attn.sinks", (config.num_heads,))})

    def build_mlp(self, loader: Any, config: ConfigData, index: int) -> Optional[RoutedExperts]:
        raw = config.raw
        h, inter, e = config.hidden_size, config.intermediate_size, int(raw["num_local_experts"])
        if loader.has(f"{_EXPERTS}.0.gate_proj.weight"):
            gate_up, up, down, biases = _per_expert(loader, e, h, inter)
        else:
            gate_up, up, down, biases = _stacked(loader, e, h, inter)
        act = functools.partial(ops.clamped_swiglu_mul, alpha=float(raw.get("swiglu_alpha", 1.702)),
                                limit=float(raw.get("swiglu_limit", 7.0)))
        return RoutedExperts(
            router=loader.dense("mlp.router.weight", (e, h)),
            gate_up=gate_up,
            up=up,
            down=down,
            top_k=int(raw[_top_k_key(raw)]),
            renormalize=False,
            act=act,
            routing=Routing("topk_softmax"),
            router_bias=loader.dense("mlp.router.bias", (e,)),
            biases=biases,
        )


def _top_k_key(raw: Dict[str, Any]) -> str:
    """The released config.json also spells it `experts_per_token`."""
    return "num_experts_per_tok" if "num_experts_per_tok" in raw else "experts_per_token"


Stacks = Tuple[ExpertStack, Optional[ExpertStack], ExpertStack, ExpertBiases]


def _stacked(loader: Any, e: int, h: int, inter: int) -> Stacks:
    """The checkpoint's stacked experts (dense or MXFP4), gate/up reordered to [gate; up] for the fused path."""
    gate_up = _experts(loader, "gate_up_proj", e, 2 * inter, h)
    down = _experts(loader, "down_proj", e, h, inter)
    gu_bias = loader.dense(f"{_EXPERTS}.gate_up_proj_bias", (e, 2 * inter))
    order = torch.cat([torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)]).to(gate_up.device)
    biases = ExpertBiases(gu_bias.index_select(1, order).contiguous(), None,
                          loader.dense(f"{_EXPERTS}.down_proj_bias", (e, h)))
    return (ExpertStack(h, 2 * inter, weight=gate_up.index_select(1, order).contiguous()), None,
            ExpertStack(inter, h, weight=down), biases)


def _per_expert(loader: Any, e: int, h: int, inter: int) -> Stacks:
    """GGUF's split `ffn_{gate,up,down}_exps` (weights and biases), each expert's rows as stored."""
    def weights(name: str, k: int, n: int) -> List[Any]:
        out = []
        for i in range(e):
            w = loader.linear(f"{_EXPERTS}.{i}.{name}", k, n)
            out.append(GGMLWeight(w.data, w.type_name, k, n) if isinstance(w, GGMLWeight) else w)
        return out

    def bias(name: str, n: int) -> torch.Tensor:
        return torch.stack([loader.dense(f"{_EXPERTS}.{i}.{name}.bias", (n,)) for i in range(e)])

    try:
        gate_up, up, down = stack_expert_mlps(weights("gate_proj", h, inter), weights("up_proj", h, inter),
                                              weights("down_proj", inter, h))
    except ValueError as exc:
        raise ModelFormatError(f"{loader.prefix}: {exc}.") from None
    gate_b, up_b = bias("gate_proj", inter), bias("up_proj", inter)
    fused = up is None
    biases = ExpertBiases(torch.cat([gate_b, up_b], dim=-1) if fused else gate_b, None if fused else up_b,
                          bias("down_proj", h))
    return gate_up, up, down, biases


def _experts(loader: Any, name: str, experts: int, out_features: int, in_features: int) -> torch.Tensor:
    """One stacked expert projection as [E, out, in] in the layer's dtype, from the dense [E, in, out] tensor or
    the MXFP4 blocks and scales."""
    if loader.has(f"{_EXPERTS}.{name}_blocks"):
        if in_features % 32:
            raise ModelFormatError(f"{loader.prefix}: MXFP4 {name} needs an input size that is a multiple of 32, "
                                   f"not {in_features}.")
        groups = in_features // 32
        blocks = loader.reader.get(loader.name(f"{_EXPERTS}.{name}_blocks"), (experts, out_features, groups, 16))
        scales = loader.reader.get(loader.name(f"{_EXPERTS}.{name}_scales"), (experts, out_features, groups))
        w = dequantize_mxfp4(blocks.to(loader.device), scales.to(loader.device), loader.dtype)
        return w.contiguous()
    return loader.dense(f"{_EXPERTS}.{name}", (experts, in_features, out_features)).transpose(1, 2).contiguous()


register(GptOss())
