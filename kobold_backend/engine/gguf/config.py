"""GGUF metadata -> the Hugging Face config dict the file was converted from (what `config.json` would hold).

Keys are llama.cpp's (`{arch}.embedding_length`, `{arch}.attention.head_count`, ...); each architecture this
engine reads from GGUF is one row of `ARCHITECTURES`: its Hugging Face `model_type`, whether llama.cpp's converter
permuted the rows of Q and K for its interleaved RoPE (undone at load, see names.py) and what it added to the norm
weights (Gemma's converter stores `1 + weight`). What llama.cpp fixes in code rather than in the file is restated
here as llama.cpp's loader assumes it: Gemma 2 alternates local and global layers (layer 0 local), Gemma 3 has 5
local layers per global one (none without `attention.sliding_window`) with local RoPE base 10000 and no scaling
there, and both scale q·k by head_dim ** -0.5 except the 27B models (46 / 62 layers), which use
(hidden / heads) ** -0.5; Cohere 2 has a window on 3 of every 4 layers. A `llama` file with experts is Mixtral
(Mistral 3's converter writes the text model alone, as `llama` or `mistral3` in llama's layout). GLM's
`rope.dimension_count` below the head size is its partial rotary factor; GLM-4.5's `block_count` includes its
next-token-prediction layers.

RoPE frequency tables stored as tensors are read as per-frequency divisors: `rope_freqs.weight` (Llama 3.1's
frequency-dependent scaling, precomputed by the converter) and Phi-3's `rope_factors_short` / `rope_factors_long`
(LongRoPE) both become a `longrope` scaling (inverse frequency / factor, short below the original context, long
above it), which is what llama.cpp's RoPE does with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from kobold_backend.errors import ModelFormatError


@dataclass(frozen=True)
class GGUFArchitecture:
    model_type: str
    hf_architecture: str
    permuted_qk: bool
    norm_shift: float = 0.0  # added to every norm weight read (Gemma: the converter stored 1 + weight)


ARCHITECTURES: Dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", permuted_qk=True),  # also Mistral's files
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM", permuted_qk=False),
    "qwen3": GGUFArchitecture("qwen3", "Qwen3ForCausalLM", permuted_qk=False),
    "qwen3moe": GGUFArchitecture("qwen3_moe", "Qwen3MoeForCausalLM", permuted_qk=False),
    "gemma2": GGUFArchitecture("gemma2", "Gemma2ForCausalLM", permuted_qk=False, norm_shift=-1.0),
    "gemma3": GGUFArchitecture("gemma3_text", "Gemma3ForCausalLM", permuted_qk=False, norm_shift=-1.0),
    "phi3": GGUFArchitecture("phi3", "Phi3ForCausalLM", permuted_qk=False),
    "gpt-oss": GGUFArchitecture("gpt_oss", "GptOssForCausalLM", permuted_qk=False),
    "deepseek2": GGUFArchitecture("deepseek_v2", "DeepseekV2ForCausalLM", permuted_qk=False),  # V3 too (_deepseek)
    "command-r": GGUFArchitecture("cohere", "CohereForCausalLM", permuted_qk=False),
    "cohere2": GGUFArchitecture("cohere2", "Cohere2ForCausalLM", permuted_qk=False),
    "glm4": GGUFArchitecture("glm4", "Glm4ForCausalLM", permuted_qk=False),
    "glm4moe": GGUFArchitecture("glm4_moe", "Glm4MoeForCausalLM", permuted_qk=False),
    # Mistral Small 3.x: the converter writes the text model alone, in llama's layout
    "mistral3": GGUFArchitecture("mistral", "MistralForCausalLM", permuted_qk=True),
    # the converter stores the zero-centred norms as 1 + weight (not linear attention's gated norm, see weights.py)
    "qwen35": GGUFArchitecture("qwen3_5_text", "Qwen3_5ForCausalLM", permuted_qk=False, norm_shift=-1.0),
    "qwen35moe": GGUFArchitecture("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", permuted_qk=False, norm_shift=-1.0),
}
# families whose partial rotary embedding (rope.dimension_count < head size) is read as partial_rotary_factor
_PARTIAL_ROPE = ("glm4", "glm4_moe", "qwen3_5_text", "qwen3_5_moe_text")
MIXTRAL = GGUFArchitecture("mixtral", "MixtralForCausalLM", permuted_qk=True)
# Layer counts of the Gemma 27B models, whose q·k scale llama.cpp takes from hidden / heads.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

Reader = Callable[[str], List[float]]


def architecture(arch: str, where: str, experts: int = 0) -> GGUFArchitecture:
    if arch not in ARCHITECTURES:
        raise ModelFormatError(
            f"{where}: GGUF architecture {arch!r} is not supported yet (supported: {', '.join(ARCHITECTURES)})."
        )
    return MIXTRAL if arch == "llama" and experts > 0 else ARCHITECTURES[arch]


def hf_config(meta: Dict[str, Any], tensor_names: List[str], where: str,
              read: Optional[Reader] = None) -> Dict[str, Any]:
    """The config.json equivalent of a GGUF file's metadata; `read` gives a 1-D float tensor of the file (RoPE
    factor tables)."""
    arch = str(meta.get("general.architecture"))
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    desc = architecture(arch, where, experts)

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ModelFormatError(f"{where}: GGUF metadata lacks {arch}.{name}.")
        return value

    hidden = int(key("embedding_length", required=True))
    ffn = key("feed_forward_length")
    if ffn is None and desc.model_type in ("qwen3_moe", "qwen3_5_moe_text"):  # all routed: the expert size
        ffn = key("expert_feed_forward_length")
    if ffn is None:
        raise ModelFormatError(f"{where}: GGUF metadata lacks {arch}.feed_forward_length.")
    heads = int(key("attention.head_count", required=True))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ModelFormatError(f"{where}: per-layer KV head counts are not supported.")
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    # DeepSeek's MLA rotates a separate part by design; GLM rotates the leading rope.dimension_count of each head
    if rope_dim != head_dim and key("attention.kv_lora_rank") is None and desc.model_type not in _PARTIAL_ROPE:
        raise ModelFormatError(
            f"{where}: partial rotary embeddings (rope.dimension_count {rope_dim} of head size {head_dim}) "
            "are not supported."
        )
    if key("attention.temperature_scale") is not None:
        raise ModelFormatError(f"{where}: attention temperature scaling (Ministral 3's llama_4_scaling) is not "
                               "supported.")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    nextn = int(key("nextn_predict_layers") or 0)
    config: Dict[str, Any] = {
        "model_type": desc.model_type,
        "architectures": [desc.hf_architecture],
        "hidden_size": hidden,
        "intermediate_size": int(ffn),
        # without the multi-token-prediction layers a converter appends (GLM-4.5, Qwen3.5): inference does not run them
        "num_hidden_layers": int(key("block_count", required=True)) - nextn,
        "num_nextn_predict_layers": nextn,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "vocab_size": int(key("vocab_size", len(tokens))),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon") or key("attention.layer_norm_epsilon")
                              or 1e-6),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta),
        "torch_dtype": "float16",
    }
    if rope_dim != head_dim or desc.model_type in _PARTIAL_ROPE:
        config["partial_rotary_factor"] = rope_dim / head_dim
    scaling = _rope_scaling(key, where)
    if scaling is not None:
        config["rope_scaling"] = scaling
    tables = _rope_tables(key, tensor_names, read, config, where)
    if tables is not None:
        config["rope_scaling"] = tables
    names = set(tensor_names)
    _FAMILY.get(desc.model_type, lambda *a: None)(config, key, names, arch)
    return config


def _rope_tables(key: Any, names: List[str], read: Optional[Reader], config: Dict[str, Any],
                 where: str) -> Optional[Dict[str, Any]]:
    """Per-frequency RoPE divisors stored as tensors, as a `longrope` rope_scaling (None: the file has none)."""
    present = [n for n in ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
               if n in names]
    if not present:
        return None
    if read is None:
        raise ModelFormatError(f"{where}: the RoPE factor tables ({', '.join(present)}) cannot be read here.")
    half = config["head_dim"] // 2
    tables = {n: [float(x) for x in read(n)] for n in present}
    for name, values in tables.items():
        if len(values) != half:
            raise ModelFormatError(f"{where}: {name} holds {len(values)} factors; head_dim / 2 = {half} expected.")
    if "rope_freqs.weight" in tables:  # Llama 3.1: one table whatever the length
        short = long = tables["rope_freqs.weight"]
        original = config["max_position_embeddings"]
        attention = 1.0
    else:
        short = tables.get("rope_factors_short.weight", tables.get("rope_factors_long.weight"))
        long = tables.get("rope_factors_long.weight", short)
        original = int(key("rope.scaling.original_context_length") or config["max_position_embeddings"])
        config["original_max_position_embeddings"] = original
        attention = key("rope.scaling.attn_factor")
    scaling: Dict[str, Any] = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                               "original_max_position_embeddings": original,
                               "factor": config["max_position_embeddings"] / original}
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    return scaling


def _gemma(config: Dict[str, Any], key: Any, names: Any, arch: str) -> None:
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    big = config["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    scale = key("attention.scale")
    config["query_pre_attn_scalar"] = (float(scale) ** -2 if scale else
                                       config["hidden_size"] / heads if big else head_dim)
    config["hidden_activation"] = "gelu_pytorch_tanh"
    window = int(key("attention.sliding_window") or 0)
    config["final_logit_softcapping"] = key("final_logit_softcapping") or None  # 0: off
    if arch == "gemma2":
        config["sliding_window"] = window or 4096
        config["attn_logit_softcapping"] = key("attn_logit_softcapping") or None
        return
    config["rope_local_base_freq"] = float(key("rope.freq_base_swa") or 10000.0)
    pattern = key("attention.sliding_window_pattern")
    config["sliding_window"] = window or None
    if not window:  # llama.cpp: a Gemma 3 file without a window attends globally in every layer
        config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    elif isinstance(pattern, list):  # per layer: true where the layer is local
        config["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        config["sliding_window_pattern"] = int(pattern or 6)


def _phi3(config: Dict[str, Any], key: Any, names: Any, arch: str) -> None:
    window = key("attention.sliding_window")
    config["sliding_window"] = int(window) if window else None
    config["original_max_position_embeddings"] = config.get(
        "original_max_position_embeddings", int(key("rope.scaling.original_context_length")
                                                or config["max_position_embeddings"]))


def _cohere(config: Dict[str, Any], key: Any, names: Any, arch: str) -> None:
    """Logit scale and q/k norms (Command-R+); Cohere 2's window on 3 of every 4 layers, as llama.cpp fixes it."""
    config["logit_scale"] = float(key("logit_scale", 1.0))
    config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in names
    if arch == "cohere2":
        config["sliding_window"] = int(key("attention.sliding_window", required=True))
        pattern = key("attention.sliding_window_pattern")
        if isinstance(pattern, list):  # per layer: true where the layer is local
            config["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            config["sliding_window_pattern"] = int(pattern or 4)


def _glm4(config: Dict[str, Any], key: Any, names: Any, arch: str) -> None:
    """q/k/v biases when the file has them; GLM-4.5's experts, shared experts, dense leading layers and routing,
    (its next-token-prediction layers are dropped by hf_config)."""
    config["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch != "glm4moe":
        return
    config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in names
    config["n_routed_experts"] = int(key("expert_count", required=True))
    config["num_experts_per_tok"] = int(key("expert_used_count", required=True))
    config["moe_intermediate_size"] = int(key("expert_feed_forward_length", required=True))
    config["n_shared_experts"] = int(key("expert_shared_count") or 0)
    config["first_k_dense_replace"] = int(key("leading_dense_block_count") or 0)
    config["routed_scaling_factor"] = float(key("expert_weights_scale") or 1.0)
    config["norm_topk_prob"] = bool(key("expert_weights_norm", True))
    config["n_group"] = int(key("expert_group_count") or 1)
    config["topk_group"] = int(key("expert_group_used_count") or 1)


def _experts(config: Dict[str, Any], key: Any, names: Any, arch: str) -> None:
    """Expert counts; for Qwen3-MoE the expert size and the layers that keep a dense MLP (no router tensor)."""
    count, used = int(key("expert_count")), int(key("expert_used_count") or 0)
    config["num_experts_per_tok"] = used
    if config["model_type"] == "mixtral":
        config["num_local_experts"] = count
        config["sliding_window"] = None
        return
    config["num_experts"] = count
    config["moe_intermediate_size"] = int(key("expert_feed_forward_length") or config["intermediate_size"])
    # llama.cpp renormalises the k routing weights of Qwen3-MoE unless the file says otherwise
    config["norm_topk_prob"] = bool(key("expert_weights_norm", True))
    config["mlp_only_layers"] = [i for i in range(config["num_hidden_layers"])
                                 if f"blk.{i}.ffn_gate_inp.weight" not in names]
    config["decoder_sparse_step"] = 1


def _gpt_oss(config: Dict[str, Any], key: Any, names: Any, arch: str) -> None:
    """Windows on even layers (llama.cpp's pattern for gpt-oss), experts of expert_feed_forward_length; YaRN as the
    released config.json has it (correction range not truncated), which the file does not record."""
    layers = config["num_hidden_layers"]
    config["sliding_window"] = int(key("attention.sliding_window") or 128)
    config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    config["num_local_experts"] = int(key("expert_count"))
    config["num_experts_per_tok"] = int(key("expert_used_count"))
    config["intermediate_size"] = int(key("expert_feed_forward_length") or config["intermediate_size"])
    config["attention_bias"] = True
    if "rope_scaling" in config:
        config["rope_scaling"]["truncate"] = False


def _deepseek(config: Dict[str, Any], key: Any, names: Any, arch: str) -> None:
    """MLA sizes from the *_mla keys (key_length / value_length describe the latent cache); sigmoid gating or a
    correction bias makes it V3. YaRN's mscale and mscale_all_dim are both taken from the file's log multiplier
    (0.1 * mscale_all_dim), as the released configs have them equal."""
    rank, rope = int(key("attention.kv_lora_rank")), int(key("rope.dimension_count"))
    config["kv_lora_rank"], config["qk_rope_head_dim"] = rank, rope
    config["qk_nope_head_dim"] = int(key("attention.key_length_mla")) - rope
    config["v_head_dim"] = int(key("attention.value_length_mla"))
    config["head_dim"] = rope
    config["num_key_value_heads"] = config["num_attention_heads"]
    config["q_lora_rank"] = key("attention.q_lora_rank")
    sigmoid = key("expert_gating_func") == 2 or any(n.endswith("exp_probs_b.bias") for n in names)
    if sigmoid:
        config["model_type"], config["architectures"] = "deepseek_v3", ["DeepseekV3ForCausalLM"]
    config["scoring_func"] = "sigmoid" if sigmoid else "softmax"
    config["first_k_dense_replace"] = int(key("leading_dense_block_count") or 0)
    config["n_routed_experts"] = int(key("expert_count"))
    config["num_experts_per_tok"] = int(key("expert_used_count"))
    config["moe_intermediate_size"] = int(key("expert_feed_forward_length"))
    config["n_shared_experts"] = int(key("expert_shared_count") or 0)
    config["routed_scaling_factor"] = float(key("expert_weights_scale") or 1.0)
    config["norm_topk_prob"] = bool(key("expert_weights_norm", False))
    groups = int(key("expert_group_count") or 1)
    config["n_group"], config["topk_group"] = groups, int(key("expert_group_used_count") or 1)
    config["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    log_mul = key("rope.scaling.yarn_log_multiplier")
    if "rope_scaling" in config and log_mul:
        config["rope_scaling"].update(mscale=float(log_mul) / 0.1, mscale_all_dim=float(log_mul) / 0.1)


def _qwen35(config: Dict[str, Any], key: Any, names: Any, arch: str) -> None:
    """Qwen3.5's linear-attention sizes (llama.cpp's ssm.* keys), its layer pattern and partial RoPE; the value
    heads are stored tiled (see engine/architectures/qwen3_5.py); the MoE's expert and shared-expert sizes."""
    groups, heads = int(key("ssm.group_count")), int(key("ssm.time_step_rank"))
    config.update(linear_conv_kernel_dim=int(key("ssm.conv_kernel")), linear_key_head_dim=int(key("ssm.state_size")),
                  linear_num_key_heads=groups, linear_num_value_heads=heads,
                  linear_value_head_dim=int(key("ssm.inner_size")) // heads,
                  full_attention_interval=int(key("full_attention_interval", 4)),
                  partial_rotary_factor=int(key("rope.dimension_count")) / config["head_dim"],
                  linear_value_head_order="tiled")
    if arch == "qwen35moe":
        config.update(num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
                      moe_intermediate_size=int(key("expert_feed_forward_length")),
                      shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length")))


_FAMILY: Dict[str, Callable[..., None]] = {
    "gemma2": _gemma, "gemma3_text": _gemma, "phi3": _phi3, "mixtral": _experts, "qwen3_moe": _experts,
    "gpt_oss": _gpt_oss, "deepseek_v2": _deepseek,
    "cohere": _cohere, "cohere2": _cohere, "glm4": _glm4, "glm4_moe": _glm4,
    "qwen3_5_text": _qwen35, "qwen3_5_moe_text": _qwen35,
}


def _eos_ids(meta: Dict[str, Any]) -> Optional[List[int]]:
    ids = [meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    found = [int(i) for i in dict.fromkeys(ids) if i is not None]
    return found or None


def _rope_scaling(key: Any, where: str) -> Optional[Dict[str, Any]]:
    kind = key("rope.scaling.type")
    factor = key("rope.scaling.factor")
    if kind in (None, "none") or (kind is None and not factor):
        return None
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "linear":
        raise ModelFormatError(f"{where}: GGUF RoPE scaling is linear but rope.scaling.factor is missing.")
    if kind == "yarn" and factor is not None:
        return {"rope_type": "yarn", "factor": float(factor),
                "original_max_position_embeddings": int(key("rope.scaling.original_context_length") or 4096)}
    if kind == "yarn":
        raise ModelFormatError(f"{where}: GGUF RoPE scaling is yarn but rope.scaling.factor is missing.")
    raise ModelFormatError(f"{where}: GGUF RoPE scaling {kind!r} is not supported (supported: linear, yarn).")
