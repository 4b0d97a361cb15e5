"""Synthetic GPTQ 4-bit checkpoints shaped like real models (random weights) for benchmarks.

Weight values do not change speed; scales are kept small so activations stay finite and greedy
decoding is meaningful enough to compare graph and eager outputs. Tensors are drawn on the GPU when there is
one and written one safetensors shard per layer (plus one for the embeddings and head) with an index, so no more
than one layer is ever held in host memory: a Mixtral-8x7B-shaped checkpoint (~25 GB) is written at disk speed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

if TYPE_CHECKING:  # torch is imported where tensors are made: `kobold-backend bench --help` reads PRESETS only
    import torch


@dataclass(frozen=True)
class Shape:
    """A model shape; `model_type` picks the architecture description, whose layout names the tensors written."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float = 10000.0
    model_type: str = "llama"
    head_dim: Optional[int] = None
    tie_word_embeddings: bool = False
    extra_config: Tuple[Tuple[str, Any], ...] = ()  # further config.json keys (experts, windows, ...)


_GEMMA2 = (("hidden_activation", "gelu_pytorch_tanh"), ("query_pre_attn_scalar", 256), ("sliding_window", 4096),
           ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0), ("rms_norm_eps", 1e-6))
_MIXTRAL = (("num_local_experts", 8), ("num_experts_per_tok", 2), ("sliding_window", None))

PRESETS: Dict[str, Shape] = {
    "llama2-7b": Shape(4096, 11008, 32, 32, 32, 32000),
    "llama2-13b": Shape(5120, 13824, 40, 40, 40, 32000),
    # Llama-2-70B: 64 heads over 8 KV heads (~35 GB of GPTQ tensors: fits one H200 with its cache)
    "llama2-70b": Shape(8192, 28672, 80, 64, 8, 32000),
    "llama3-8b": Shape(4096, 14336, 32, 32, 8, 128256, rope_theta=500000.0),
    # Qwen2.5-7B-Instruct: q/k/v biases, 28 heads over 4 KV heads, a 152k vocabulary, untied head
    "qwen2.5-7b": Shape(3584, 18944, 28, 28, 4, 152064, rope_theta=1000000.0, model_type="qwen2",
                        extra_config=(("use_sliding_window", False), ("sliding_window", 131072),
                                      ("max_window_layers", 28))),
    # Qwen2.5-0.5B: the draft model of Qwen2.5-7B (tied head; its 151936-row vocabulary pads less than the 7B's)
    "qwen2.5-0.5b": Shape(896, 4864, 24, 14, 2, 151936, rope_theta=1000000.0, model_type="qwen2",
                          tie_word_embeddings=True, extra_config=(("use_sliding_window", False),
                                                                  ("sliding_window", 131072),
                                                                  ("max_window_layers", 24))),
    # Gemma-2-9B: head_dim 256, soft-caps, local/global layers with a 4096 window, 256k vocabulary, tied head
    "gemma2-9b": Shape(3584, 14336, 42, 16, 8, 256000, model_type="gemma2", head_dim=256, tie_word_embeddings=True,
                       extra_config=_GEMMA2),
    # Mixtral-8x7B: 8 experts of 14336, top-2, per-expert GPTQ (~25 GB); "-8l": the same with 8 of its 32 layers
    # (~6 GB to write and load when device time is short; decode tok/s is then ~4x the full model's)
    "mixtral-8x7b": Shape(4096, 14336, 32, 32, 8, 32000, rope_theta=1e6, model_type="mixtral",
                          extra_config=_MIXTRAL),
    "mixtral-8x7b-8l": Shape(4096, 14336, 8, 32, 8, 32000, rope_theta=1e6, model_type="mixtral",
                             extra_config=_MIXTRAL),
    "tiny": Shape(128, 384, 2, 4, 2, 512),
    "tiny-gemma2": Shape(128, 384, 2, 4, 2, 512, model_type="gemma2", head_dim=64, tie_word_embeddings=True,
                         extra_config=_GEMMA2),
    "tiny-mixtral": Shape(128, 384, 2, 4, 2, 512, model_type="mixtral",
                          extra_config=(("num_local_experts", 4), ("num_experts_per_tok", 2))),
}


# Linears that read the same input get one act-order permutation, as in real checkpoints: GPTQ orders a
# linear's inputs by its Hessian's diagonal, which depends only on the input (so q/k/v agree, and gate/up).
_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up",
                 "w1": "w1_w3", "w3": "w1_w3"}


def _gptq_tensors(
    k: int, n: int, group: int, perm: Optional[torch.Tensor], gen: torch.Generator, device: str
) -> Dict[str, torch.Tensor]:
    import torch

    groups = -(-k // group)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=gen, device=device)
    scales = (torch.rand((groups, n), generator=gen, device=device) * 0.002 + 0.001).half()
    qzeros = torch.full((groups, n // 8), 0x77777777, dtype=torch.int32, device=device)
    g_idx = torch.arange(k, dtype=torch.int32, device=device) // group
    if perm is not None:
        g_idx = (torch.argsort(perm) // group).to(torch.int32)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}


def synthetic_config(shape: Shape, max_position_embeddings: int = 8192) -> Dict[str, Any]:
    """config.json of a synthetic checkpoint of `shape`."""
    from kobold_backend.engine.architectures import lookup

    arch = lookup(shape.model_type, [], "bench preset")
    config: Dict[str, Any] = {
        "architectures": [arch.class_names[0]], "model_type": shape.model_type, "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
        "rms_norm_eps": 1e-5, "rope_theta": shape.rope_theta, "max_position_embeddings": max_position_embeddings,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16",
        "tie_word_embeddings": shape.tie_word_embeddings,
    }
    if shape.head_dim is not None:
        config["head_dim"] = shape.head_dim
    config.update(dict(shape.extra_config))
    return config


def save_shard(folder: Path, number: int, shards: int, tensors: Dict[str, torch.Tensor],
               weight_map: Dict[str, str]) -> int:
    """Write shard `number` (0-based) of `shards` as model-0000N-of-0000M.safetensors, name its tensors in
    `weight_map`; returns its tensor bytes (for the index's total_size)."""
    from safetensors.torch import save_file

    file = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(folder / file), metadata={"format": "pt"})
    weight_map.update({k: file for k in tensors})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_index(folder: Path, total: int, weight_map: Dict[str, str], config: Dict[str, Any]) -> None:
    """model.safetensors.index.json (total_size and weight_map) and config.json of a sharded synthetic folder."""
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def write_synthetic_gptq(
    folder: Path, shape: Shape, group_size: int = 128, act_order: bool = False, seed: int = 0,
    device: Optional[str] = None, max_position_embeddings: int = 8192,
) -> Path:
    """Write config.json, quantize_config.json and one safetensors shard per layer (+ one for the rest) with an
    index: every tensor the architecture's layout names (engine/device_map.config_shapes), GPTQ linears (routed
    experts too; routers dense, as GPTQ repos keep them), unit norms (zeros where the architecture adds 1), small
    embeddings and biases."""
    import torch

    from kobold_backend.engine.config import ModelConfig
    from kobold_backend.engine.device_map import config_shapes

    folder.mkdir(parents=True, exist_ok=True)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(seed)
    config = synthetic_config(shape, max_position_embeddings)
    quant = {"bits": 4, "group_size": group_size, "desc_act": act_order, "sym": True, "quant_method": "gptq",
             "checkpoint_format": "gptq"}
    parsed = ModelConfig.from_dict(dict(config, quantization_config=quant))
    unit = 1.0 - parsed.features.norm_offset
    groups: Dict[str, Dict[str, Tuple[int, ...]]] = {}
    for name, dims in config_shapes(parsed).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(layer, {})[name] = dims
    shards = len(groups)
    weight_map: Dict[str, str] = {}
    total = 0
    for number, shapes in enumerate(groups.values()):
        tensors: Dict[str, torch.Tensor] = {}
        perms: Dict[Tuple[str, str, int], torch.Tensor] = {}
        for name, dims in shapes.items():
            if name.endswith(".qweight"):
                prefix = name[: -len(".qweight")]
                k, n = dims[0] * 8, dims[1]
                perm = None
                if act_order:
                    parent, leaf = prefix.rsplit(".", 1)
                    key = (parent, _SHARED_INPUT.get(leaf, leaf), k)
                    perm = perms.get(key)
                    if perm is None:
                        perm = perms[key] = torch.randperm(k, generator=gen, device=dev)
                for suffix, t in _gptq_tensors(k, n, group_size, perm, gen, dev).items():
                    tensors[f"{prefix}.{suffix}"] = t
            elif name.endswith(("norm.weight", "layernorm.weight")):
                tensors[name] = torch.full(dims, unit, dtype=torch.float16)
            elif name.endswith((".weight", ".bias")):
                tensors[name] = (torch.randn(dims, generator=gen, device=dev) * 0.02).half()
        total += save_shard(folder, number, shards, tensors, weight_map)
    write_index(folder, total, weight_map, config)
    (folder / "quantize_config.json").write_text(json.dumps(quant, indent=1))
    return folder
