"""GGUF tensor names <-> Hugging Face names, per architecture, and undoing llama.cpp's Q/K row permutation.

llama.cpp names a tensor by its role (`blk.N.attn_q.weight`, `blk.N.ffn_norm.weight`); which Hugging Face tensor a
role came from depends on the family: `ffn_norm` is Llama's `post_attention_layernorm` but Gemma's
`pre_feedforward_layernorm` (Gemma's `post_attention_layernorm` is `post_attention_norm`); Phi-3's fused projections
are `attn_qkv` and `ffn_up` (gate rows first). Routed experts are stacked on a leading axis in one tensor
(`blk.N.ffn_gate_exps.weight` [E, n, k]); files converted before April 2024 hold one tensor per expert
(`blk.N.ffn_gate.E.weight`). Either way a Hugging Face expert name maps to (GGUF tensor, expert index or None).
A few Hugging Face tensors have no `.weight` / `.bias` suffix (gpt-oss's `self_attn.sinks`, DeepSeek-V3's and
GLM-4.5's router bias `mlp.gate.e_score_correction_bias`); they map to `attn_sinks.weight` and `exp_probs_b.bias`.
Shared experts (DeepSeek, GLM-4.5) are `ffn_*_shexp`. GLM-4's fused gate/up is `ffn_up` (gate rows first) and its
norms after attention and after the MLP are `post_attention_norm` / `post_ffw_norm`.

llama.cpp's converter reorders the rows of each Q and K head for its interleaved RoPE: within a head of size D,
Hugging Face row `j * D/2 + i` (half j, pair i) is stored at row `2 i + j`. This engine rotates halves, so the
loader moves every row back; rows are whole quantization blocks, so the stored bytes are only reordered.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Tuple

import torch

_GLOBAL: Dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_ATTENTION: Dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_DENSE_MLP: Dict[str, str] = {
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA: Dict[str, str] = dict(_DENSE_MLP, post_attention_norm="post_attention_layernorm",
                              ffn_norm="pre_feedforward_layernorm", post_ffw_norm="post_feedforward_layernorm")
_PHI3: Dict[str, str] = {"attn_qkv": "self_attn.qkv_proj", "ffn_norm": "post_attention_layernorm",
                         "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}
# gpt-oss: the norm before the MLP is `post_attention_norm`; the router `ffn_gate_inp` (with a bias) is `mlp.router`
_GPT_OSS: Dict[str, str] = {"post_attention_norm": "post_attention_layernorm"}
_SHARED_EXPERTS: Dict[str, str] = {"ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                                   "ffn_up_shexp": "mlp.shared_experts.up_proj",
                                   "ffn_down_shexp": "mlp.shared_experts.down_proj"}
# DeepSeek-V2/V3: latent attention (kv_b_proj split by the converter into attn_k_b [H, rank, nope] and attn_v_b
# [H, v, rank]) and shared experts
_DEEPSEEK: Dict[str, str] = dict(_DENSE_MLP, attn_q_a="self_attn.q_a_proj", attn_q_b="self_attn.q_b_proj",
                                 attn_q_a_norm="self_attn.q_a_layernorm", attn_kv_a_mqa="self_attn.kv_a_proj_with_mqa",
                                 attn_kv_a_norm="self_attn.kv_a_layernorm", attn_kv_b="self_attn.kv_b_proj",
                                 attn_k_b="self_attn.k_b_proj", attn_v_b="self_attn.v_b_proj", **_SHARED_EXPERTS)
_GLM4: Dict[str, str] = {"post_attention_norm": "post_self_attn_layernorm", "ffn_norm": "post_attention_layernorm",
                         "post_ffw_norm": "post_mlp_layernorm", "ffn_up": "mlp.gate_up_proj",
                         "ffn_down": "mlp.down_proj"}
_GLM4_MOE: Dict[str, str] = dict(_DENSE_MLP, post_attention_norm="post_attention_layernorm", **_SHARED_EXPERTS)
# Hugging Face model_type -> (block tensors besides attention, router prefix, expert prefix and its gate/up/down)
_BLOCKS: Dict[str, Dict[str, str]] = {
    "llama": _DENSE_MLP, "mistral": _DENSE_MLP, "qwen2": _DENSE_MLP, "qwen3": _DENSE_MLP, "qwen3_moe": _DENSE_MLP,
    "mixtral": {"ffn_norm": "post_attention_layernorm"},
    "gemma2": _GEMMA, "gemma3_text": _GEMMA, "phi3": _PHI3,
    "gpt_oss": _GPT_OSS, "deepseek_v2": _DEEPSEEK, "deepseek_v3": _DEEPSEEK,
    "cohere": _DENSE_MLP, "cohere2": _DENSE_MLP, "glm4": _GLM4, "glm4_moe": _GLM4_MOE,
}
# Qwen3.5: linear attention's projections, conv and gated norm; the norm after attention is `post_attention_norm`
_QWEN35: Dict[str, str] = {
    "post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z", "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
}
_BLOCKS.update({
    "qwen3_5_text": dict(_QWEN35, ffn_gate="mlp.gate_proj", ffn_up="mlp.up_proj", ffn_down="mlp.down_proj"),
    "qwen3_5_moe_text": dict(_QWEN35, ffn_gate_inp_shexp="mlp.shared_expert_gate",
                             ffn_gate_shexp="mlp.shared_expert.gate_proj", ffn_up_shexp="mlp.shared_expert.up_proj",
                             ffn_down_shexp="mlp.shared_expert.down_proj"),
})
_EXPERTS: Dict[str, Tuple[str, Tuple[str, str, str]]] = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    # gpt-oss's checkpoints stack gate/up interleaved; its converter splits them into ffn_gate/up_exps (with
    # biases), read here under per-expert names as for Qwen3-MoE
    "gpt_oss": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v2": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "glm4_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_5_moe_text": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
_ROUTERS: Dict[str, str] = {"gpt_oss": "mlp.router"}
# Hugging Face tensors without a .weight/.bias suffix -> the GGUF tensor under `blk.N.` (Qwen3.5's converter stores
# -exp(A_log) as ssm_a, itself without a suffix; weights.py takes the log back)
_BARE: Dict[str, str] = {
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
}
_GGUF_BARE = {gg: hf for hf, gg in _BARE.items()}
_EXPERT_ROLES = ("ffn_gate", "ffn_up", "ffn_down")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_BLK = re.compile(r"blk\.(\d+)\.([a-z_]+)(?:\.(\d+))?\.(weight|bias)$")
_BARE_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
_BLK_BARE = re.compile(r"blk\.(\d+)\.(.+)$")


class TensorNames:
    """The name map of one Hugging Face model_type (a GGUF file's architecture as engine/gguf/config.py reads it)."""

    def __init__(self, model_type: str) -> None:
        block = dict(_ATTENTION, **_BLOCKS[model_type])
        self._experts: Optional[Tuple[str, Tuple[str, str, str]]] = _EXPERTS.get(model_type)
        if self._experts is not None:
            block["ffn_gate_inp"] = _ROUTERS.get(model_type, f"{self._experts[0]}.gate")
        self._block = block
        self._hf_block = {hf: gg for gg, hf in block.items()}
        self._hf_global = {hf: gg for gg, hf in _GLOBAL.items()}

    def gguf(self, hf_name: str, present: Iterable[str] = ()) -> Optional[Tuple[str, Optional[int]]]:
        """(GGUF tensor, expert index or None) holding a Hugging Face tensor, or None when GGUF has no such tensor.
        An expert resolves to the stacked `*_exps` tensor unless `present` holds the per-expert one instead."""
        bare = _BARE_LAYER.match(hf_name)
        if bare is not None and bare.group(2) in _BARE:
            return f"blk.{bare.group(1)}.{_BARE[bare.group(2)]}", None
        m = _LAYER.match(hf_name)
        if m is None:
            stem, _, suffix = hf_name.rpartition(".")
            base = self._hf_global.get(stem)
            return None if base is None else (f"{base}.{suffix}", None)
        layer, stem, suffix = m.groups()
        if stem in self._hf_block:
            return f"blk.{layer}.{self._hf_block[stem]}.{suffix}", None
        expert = self._expert(stem)
        if expert is None:
            return None
        role, index = expert
        single = f"blk.{layer}.{role}.{index}.{suffix}"
        if single in present:
            return single, None
        return f"blk.{layer}.{role}_exps.{suffix}", index

    def hf(self, gguf_tensor: str, num_experts: int = 0) -> List[str]:
        """The Hugging Face names a GGUF tensor holds (one per expert for a stacked tensor; none if unread)."""
        if gguf_tensor.count(".") == 1:
            stem, _, suffix = gguf_tensor.partition(".")
            return [f"{_GLOBAL[stem]}.{suffix}"] if stem in _GLOBAL else []
        bare = _BLK_BARE.match(gguf_tensor)
        if bare is not None and bare.group(2) in _GGUF_BARE:
            return [f"model.layers.{bare.group(1)}.{_GGUF_BARE[bare.group(2)]}"]
        m = _BLK.match(gguf_tensor)
        if m is None:
            return []
        layer, role, index, suffix = m.groups()
        prefix = f"model.layers.{layer}"
        if index is None and role in self._block:
            return [f"{prefix}.{self._block[role]}.{suffix}"]
        if self._experts is None:
            return []
        block, names = self._experts
        if index is not None and role in _EXPERT_ROLES:
            return [f"{prefix}.{block}.experts.{index}.{names[_EXPERT_ROLES.index(role)]}.{suffix}"]
        if role.endswith("_exps") and role[:-5] in _EXPERT_ROLES:
            name = names[_EXPERT_ROLES.index(role[:-5])]
            return [f"{prefix}.{block}.experts.{e}.{name}.{suffix}" for e in range(num_experts)]
        return []

    def _expert(self, stem: str) -> Optional[Tuple[str, int]]:
        if self._experts is None:
            return None
        block, names = self._experts
        parts = stem.split(".")
        if len(parts) != 4 or f"{parts[0]}" != block or parts[1] != "experts" or not parts[2].isdigit() \
                or parts[3] not in names:
            return None
        return _EXPERT_ROLES[names.index(parts[3])], int(parts[2])


def unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows [num_heads * D, ...] in llama.cpp's interleaved order -> Hugging Face's rotate-half order."""
    d = rows.shape[0] // num_heads
    return rows.reshape(num_heads, d // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)
