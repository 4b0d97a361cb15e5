"""GGUF metadata -> the Hugging Face config dict the file was converted from (what `config.json` would hold).

Keys are llama.cpp's (`{arch}.embedding_length`, `{arch}.attention.head_count`, ...); each architecture this
engine reads from GGUF is one row of `ARCHITECTURES`: its Hugging Face `model_type` and whether llama.cpp's
converter permuted the rows of Q and K for its interleaved RoPE (undone at load, see names.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from kobold_backend.errors import ModelFormatError


@dataclass(frozen=True)
class GGUFArchitecture:
    model_type: str
    hf_architecture: str
    permuted_qk: bool


ARCHITECTURES: Dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", permuted_qk=True),  # also Mistral's files
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM", permuted_qk=False),
    "qwen3": GGUFArchitecture("qwen3", "Qwen3ForCausalLM", permuted_qk=False),
}


def architecture(arch: str, where: str) -> GGUFArchitecture:
    if arch not in ARCHITECTURES:
        raise ModelFormatError(
            f"{where}: GGUF architecture {arch!r} is not supported yet (supported: {', '.join(ARCHITECTURES)})."
        )
    return ARCHITECTURES[arch]


def hf_config(meta: Dict[str, Any], tensor_names: List[str], where: str) -> Dict[str, Any]:
    """The config.json equivalent of a GGUF file's metadata."""
    arch = str(meta.get("general.architecture"))
    desc = architecture(arch, where)

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ModelFormatError(f"{where}: GGUF metadata lacks {arch}.{name}.")
        return value

    hidden = int(key("embedding_length", required=True))
    heads = int(key("attention.head_count", required=True))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ModelFormatError(f"{where}: per-layer KV head counts are not supported.")
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelFormatError(
            f"{where}: partial rotary embeddings (rope.dimension_count {rope_dim} of head size {head_dim}) "
            "are not supported."
        )
    if "rope_freqs.weight" in tensor_names:
        raise ModelFormatError(
            f"{where}: the file carries per-frequency RoPE factors (rope_freqs.weight, Llama 3.1-style scaling), "
            "which GGUF loading does not read yet; use the safetensors release of this model."
        )
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config: Dict[str, Any] = {
        "model_type": desc.model_type,
        "architectures": [desc.hf_architecture],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", required=True)),
        "num_hidden_layers": int(key("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "vocab_size": int(key("vocab_size", len(tokens))),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta),
        "torch_dtype": "float16",
    }
    scaling = _rope_scaling(key, where)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _eos_ids(meta: Dict[str, Any]) -> Optional[List[int]]:
    ids = [meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    found = [int(i) for i in dict.fromkeys(ids) if i is not None]
    return found or None


def _rope_scaling(key: Any, where: str) -> Optional[Dict[str, Any]]:
    kind = key("rope.scaling.type")
    factor = key("rope.scaling.factor")
    if kind in (None, "none") or (kind is None and not factor):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise ModelFormatError(f"{where}: GGUF RoPE scaling {kind!r} is not supported (supported: linear).")
