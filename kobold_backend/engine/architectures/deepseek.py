"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (engine/mla.py, compressed cache) and routed experts with
shared experts, read as transformers' modeling_deepseek_v2 / modeling_deepseek_v3 compute them.

- Attention: `self_attn.q_proj` (V2-Lite, `q_lora_rank` null) or `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (V2,
  V3), each head's query being `qk_nope_head_dim` + `qk_rope_head_dim` values; `kv_a_proj_with_mqa` gives the
  `kv_lora_rank` latent (then `kv_a_layernorm`) and the decoupled rotary key shared by all heads; `kv_b_proj`
  expands the latent into each head's nope key and `v_head_dim` value; `o_proj`. RoPE (YaRN in the releases)
  rotates only the rope part; the softmax scale is qk_head_dim ** -0.5 times mscale(factor, mscale_all_dim) ** 2.
- MLP: the first `first_k_dense_replace` layers (and those off `moe_layer_freq`) are dense (`intermediate_size`);
  the others route to `n_routed_experts` experts `mlp.experts.E.{gate,up,down}_proj` (`moe_intermediate_size`)
  through `mlp.gate`, and add `mlp.shared_experts` (a dense MLP of n_shared_experts * moe_intermediate_size).
  V2 scores by softmax (top-k greedy, or within the `topk_group` best of `n_group` groups for
  "group_limited_greedy"), never renormalised; V3 by sigmoid with `mlp.gate.e_score_correction_bias` and groups,
  renormalised with `norm_topk_prob`; both multiply by `routed_scaling_factor`.
- GGUF (llama.cpp's `deepseek2`): the same tensors under engine/gguf/names.py's map, kv_b_proj split by the converter
  into `attn_k_b` [H, rank, nope] and `attn_v_b` [H, v, rank], the rotary rows left interleaved as in the checkpoint.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional

import torch

from kobold_backend import ops
from kobold_backend.engine.architectures.base import Features, LayerLayout, Linear, register
from kobold_backend.engine.architectures.moe import CORRECTION_BIAS, MoeSpec, RoutedArchitecture
from kobold_backend.engine.config_types import ConfigData, RopeSpec, rope_settings, yarn_softmax_scale
from kobold_backend.engine.mla import LatentAttention
from kobold_backend.engine.moe import DenseMLP, RoutedExperts, Routing
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.exl2_weight import EXL2Weight
from kobold_backend.ops.ggml import GGMLWeight, ggml_dequantize
from kobold_backend.ops.gptq_weight import GPTQWeight

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps, not rms_norm_eps
_LATENT_NORM_EPS = 1e-6
_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _dims(raw: Dict[str, Any], where: str) -> Dict[str, int]:
    dims = {}
    for key in _DIMS:
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelFormatError(f"{where}: {key} must be a positive integer, found {value!r}.")
        dims[key] = value
    if dims["qk_rope_head_dim"] % 2:
        raise ModelFormatError(f"{where}: qk_rope_head_dim {dims['qk_rope_head_dim']} is odd; RoPE needs pairs.")
    return dims


def _rope_order(rope: int) -> torch.Tensor:
    """Interleaved pairs (x0, x1), (x2, x3)... -> the rotate-half layout (x0, x2, ..., x1, x3, ...)."""
    return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])


def _permute_rows(w: Any, order: torch.Tensor, where: str) -> Any:
    """A projection with its output rows in `order` (dense or GGML rows; other formats are refused)."""
    if isinstance(w, GGMLWeight):
        bias = None if w.bias is None else w.bias[order.to(w.bias.device)]
        return GGMLWeight(w.data.index_select(0, order.to(w.data.device)), w.type_name, w.in_features,
                          w.out_features, bias)
    if isinstance(w, GPTQWeight):  # output features are qweight's, scales' and zeros' columns
        cols = order.to(w.qweight.device)
        pick = lambda t: t.index_select(1, cols).contiguous()  # noqa: E731
        return GPTQWeight(pick(w.qweight), pick(w.scales), pick(w.zeros), w.perm, w.group_size, w.in_features,
                          w.out_features, None if w.bias is None else w.bias[cols], w.bits)
    if isinstance(w, EXL2Weight):
        raise ModelFormatError(f"{where}: an EXL2 projection carrying DeepSeek's interleaved rotary dimensions is "
                               "not supported (its rows would need reordering); use a dense, GPTQ or GGUF checkpoint.")
    return w.index_select(0, order.to(w.device)).contiguous()


def _dense(w: Any) -> torch.Tensor:
    if isinstance(w, GGMLWeight):
        return ggml_dequantize(w)
    if isinstance(w, GPTQWeight):  # [K, N] with act-order rows sorted: row j is input feature perm[j]
        d = ops.gptq_dequantize(w)
        if w.perm is not None:
            d = torch.empty_like(d).index_copy_(0, w.perm, d)
        return d.t()
    if isinstance(w, EXL2Weight):
        raise ModelFormatError("an EXL2 kv_b_proj is not supported; DeepSeek's latent attention reads it dense.")
    return w


class DeepseekV2(RoutedArchitecture):
    model_types = ("deepseek_v2",)
    class_names = ("DeepseekV2ForCausalLM",)
    scoring = "softmax"

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        dims = _dims(raw, where)
        self.check(raw, config, where)
        qk_head = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
        scale = qk_head ** -0.5 * yarn_softmax_scale(rope_settings(raw))
        rope = RopeSpec(config.rope_theta, config.rope_scaling, dims["qk_rope_head_dim"])
        return Features(activation="silu", attn_scale=scale, ropes=(rope,) * config.num_layers,
                        cache_shape=(1, dims["kv_lora_rank"] + dims["qk_rope_head_dim"], 0))

    def moe(self, raw: Dict[str, Any], config: ConfigData, where: str) -> MoeSpec:
        from kobold_backend.engine.architectures.moe import _count

        return MoeSpec("mlp", ("gate_proj", "up_proj", "down_proj"), _count(raw, ("n_routed_experts",), where),
                       _count(raw, ("num_experts_per_tok",), where), _count(raw, ("moe_intermediate_size",), where),
                       self.renormalize(raw))

    def unused_layers(self, raw: Dict[str, Any]) -> int:
        return int(raw.get("num_nextn_predict_layers") or 0)  # V3's multi-token-prediction layers

    def renormalize(self, raw: Dict[str, Any]) -> bool:
        return False  # transformers' DeepSeek-V2 router never renormalises

    def routing(self, raw: Dict[str, Any]) -> Routing:
        grouped = raw.get("topk_method") == "group_limited_greedy"
        return Routing(str(raw.get("scoring_func") or self.scoring), float(raw.get("routed_scaling_factor") or 1.0),
                       int(raw.get("n_group") or 1) if grouped else 1, int(raw.get("topk_group") or 1), fp32=True)

    def routed(self, raw: Dict[str, Any], index: int) -> bool:
        freq = int(raw.get("moe_layer_freq") or 1)
        return bool(raw.get("n_routed_experts")) and index >= int(raw.get("first_k_dense_replace") or 0) \
            and index % freq == 0

    def layout(self, config: ConfigData, index: int) -> LayerLayout:
        """o_proj, the dense or routed MLP and the norms; the latent attention's own projections are listed in
        `mlp_linears` (loaded by `build_attention`) so planners count them."""
        base = super().layout(config, index)
        raw, h, heads = config.raw, config.hidden_size, config.num_heads
        dims = _dims(raw, config.model_type)
        qk_head = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
        linears = {k: v for k, v in base.linears.items() if k not in ("q_proj", "k_proj", "v_proj")}
        linears["o_proj"] = Linear("self_attn.o_proj", heads * dims["v_head_dim"], h)
        attn = {"kv_a_proj": Linear("self_attn.kv_a_proj_with_mqa", h, dims["kv_lora_rank"] + dims["qk_rope_head_dim"]),
                "kv_b_proj": Linear("self_attn.kv_b_proj", dims["kv_lora_rank"],
                                    heads * (dims["qk_nope_head_dim"] + dims["v_head_dim"]))}
        q_rank = raw.get("q_lora_rank")
        if q_rank:
            attn.update(q_a_proj=Linear("self_attn.q_a_proj", h, q_rank),
                        q_b_proj=Linear("self_attn.q_b_proj", q_rank, heads * qk_head))
        else:
            attn["q_proj"] = Linear("self_attn.q_proj", h, heads * qk_head)
        norms = {"input_norm": ("input_layernorm", h), "post_norm": ("post_attention_layernorm", h)}
        # V3's router bias, read by build_mlp (listed so the planner counts it)
        routed = self.scoring == "sigmoid" and self.routed(raw, index)
        tensors = {CORRECTION_BIAS: (self.moe(raw, config, config.model_type).num_experts,)} if routed else {}
        return LayerLayout(linears, norms, (), {**base.mlp_linears, **attn}, tensors=tensors)

    def interleaved(self, raw: Dict[str, Any]) -> bool:
        return True  # transformers' V2 rotates consecutive pairs (complex multiplication)

    def build_attention(self, loader: Any, config: ConfigData, index: int) -> LatentAttention:
        raw, heads = config.raw, config.num_heads
        dims = _dims(raw, config.model_type)
        rank, nope, rope, v = (dims[k] for k in _DIMS)
        lin = self.layout(config, index).mlp_linears
        where = loader.prefix

        def load(name: str) -> Any:
            return loader.linear(lin[name].prefix, lin[name].in_features, lin[name].out_features)

        order = _rope_order(rope) if self.interleaved(raw) else torch.arange(rope)
        q_order = torch.cat([torch.cat([torch.arange(nope), nope + order]) + hd * (nope + rope)
                             for hd in range(heads)])
        kv_order = torch.cat([torch.arange(rank), rank + order])
        bias = raw.get("attention_bias")
        attn = LatentAttention(
            kv_a_proj=_permute_rows(load("kv_a_proj"), kv_order, where),
            kv_a_norm=loader.dense("self_attn.kv_a_layernorm.weight", (rank,)),
            w_uk=torch.empty(0), w_uv=torch.empty(0), num_heads=heads, nope=nope, rope=rope,
            eps=_LATENT_NORM_EPS,
            kv_a_bias=loader.dense("self_attn.kv_a_proj_with_mqa.bias", (rank + rope,))[kv_order] if bias else None,
        )
        if loader.has("self_attn.k_b_proj.weight"):  # GGUF: the converter split kv_b_proj, k_b transposed
            attn.w_uk = loader.dense("self_attn.k_b_proj.weight", (heads, rank, nope)).transpose(1, 2).contiguous()
            attn.w_uv = loader.dense("self_attn.v_b_proj.weight", (heads, v, rank))
        else:
            kv_b = _dense(load("kv_b_proj")).to(loader.dtype).view(heads, nope + v, rank)
            attn.w_uk, attn.w_uv = kv_b[:, :nope].contiguous(), kv_b[:, nope:].contiguous()
        if "q_proj" in lin:
            attn.q_proj = _permute_rows(load("q_proj"), q_order, where)
        else:
            q_rank = lin["q_a_proj"].out_features
            attn.q_a_proj = load("q_a_proj")
            attn.q_a_norm = loader.dense("self_attn.q_a_layernorm.weight", (q_rank,))
            attn.q_b_proj = _permute_rows(load("q_b_proj"), q_order, where)
            attn.q_a_bias = loader.dense("self_attn.q_a_proj.bias", (q_rank,)) if bias else None
        return attn

    def build_mlp(self, loader: Any, config: ConfigData, index: int) -> Optional[RoutedExperts]:
        experts = super().build_mlp(loader, config, index)
        if experts is None:
            return None
        raw, h = config.raw, config.hidden_size
        inter = int(raw["moe_intermediate_size"]) * int(raw.get("n_shared_experts") or 0)
        shared = None
        if inter:
            shared = DenseMLP(*(loader.linear(f"mlp.shared_experts.{name}", i, o) for name, i, o in
                                (("gate_proj", h, inter), ("up_proj", h, inter), ("down_proj", inter, h))),
                              experts.act)
        correction = self.correction_bias(loader, experts.num_experts)
        return replace(experts, routing=self.routing(raw), correction_bias=correction, shared=shared)


class DeepseekV3(DeepseekV2):
    model_types = ("deepseek_v3",)
    class_names = ("DeepseekV3ForCausalLM",)
    scoring = "sigmoid"

    def renormalize(self, raw: Dict[str, Any]) -> bool:
        return bool(raw.get("norm_topk_prob", True))

    def routing(self, raw: Dict[str, Any]) -> Routing:
        # transformers' V3 router always limits the choice to the best groups (topk_method "noaux_tc")
        return Routing(str(raw.get("scoring_func") or self.scoring), float(raw.get("routed_scaling_factor") or 1.0),
                       int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1), fp32=True)

    def interleaved(self, raw: Dict[str, Any]) -> bool:
        return bool(raw.get("rope_interleave", True))


register(DeepseekV2())
register(DeepseekV3())
