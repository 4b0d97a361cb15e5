"""Synthetic GPTQ 4-bit checkpoints shaped like real models (random weights) for benchmarks.

Weight values do not change speed; scales are kept small so activations stay finite and greedy
decoding is meaningful enough to compare graph and eager outputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from safetensors.torch import save_file


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


PRESETS: Dict[str, Shape] = {
    "llama2-7b": Shape(4096, 11008, 32, 32, 32, 32000),
    "llama2-13b": Shape(5120, 13824, 40, 40, 40, 32000),
    "llama3-8b": Shape(4096, 14336, 32, 32, 8, 128256, rope_theta=500000.0),
    # Qwen2.5-7B-Instruct: q/k/v biases, 28 heads over 4 KV heads, a 152k vocabulary, untied head
    "qwen2.5-7b": Shape(3584, 18944, 28, 28, 4, 152064, rope_theta=1000000.0, model_type="qwen2",
                        extra_config=(("use_sliding_window", False), ("sliding_window", 131072),
                                      ("max_window_layers", 28))),
    "tiny": Shape(128, 384, 2, 4, 2, 512),
}


def _gptq_tensors(
    k: int, n: int, group: int, act_order: bool, gen: torch.Generator, device: str
) -> Dict[str, torch.Tensor]:
    groups = -(-k // group)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=gen, device=device)
    scales = (torch.rand((groups, n), generator=gen, device=device) * 0.002 + 0.001).half()
    qzeros = torch.full((groups, n // 8), 0x77777777, dtype=torch.int32, device=device)
    g_idx = torch.arange(k, dtype=torch.int32, device=device) // group
    if act_order:
        perm = torch.randperm(k, generator=gen, device=device)
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


def write_synthetic_gptq(
    folder: Path, shape: Shape, group_size: int = 128, act_order: bool = False, seed: int = 0,
    device: Optional[str] = None, max_position_embeddings: int = 8192,
) -> Path:
    """Write config.json, quantize_config.json and safetensors shards with their index: every tensor the
    architecture's layout names (engine/device_map.config_shapes) as GPTQ linears, norms of ones, small
    embeddings and biases. One shard per layer (plus one for the embeddings and head), drawn on the GPU when
    there is one, so no more than one layer is ever held in host memory."""
    from kobold_backend.engine.config import ModelConfig
    from kobold_backend.engine.device_map import config_shapes

    folder.mkdir(parents=True, exist_ok=True)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(seed)
    config = synthetic_config(shape, max_position_embeddings)
    quant = {"bits": 4, "group_size": group_size, "desc_act": act_order, "sym": True, "quant_method": "gptq",
             "checkpoint_format": "gptq"}
    shapes = config_shapes(ModelConfig.from_dict(dict(config, quantization_config=quant)))
    groups: List[List[str]] = [[] for _ in range(shape.layers + 1)]
    for name in shapes:
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        groups[0 if layer is None else int(layer) + 1].append(name)
    weight_map: Dict[str, str] = {}
    total = 0
    for index, names in enumerate(groups):
        tensors: Dict[str, torch.Tensor] = {}
        for name in names:
            dims = shapes[name]
            if name.endswith(".qweight"):
                prefix = name[: -len(".qweight")]
                for suffix, t in _gptq_tensors(dims[0] * 8, dims[1], group_size, act_order, gen, dev).items():
                    tensors[f"{prefix}.{suffix}"] = t
            elif name.endswith(("norm.weight", "layernorm.weight")):
                tensors[name] = torch.ones(dims, dtype=torch.float16)
            elif name.endswith((".weight", ".bias")):
                tensors[name] = (torch.randn(dims, generator=gen, device=dev) * 0.02).half()
        file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        host = {k: v.cpu().contiguous() for k, v in tensors.items()}
        save_file(host, str(folder / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in host})
        total += sum(t.numel() * t.element_size() for t in host.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "quantize_config.json").write_text(json.dumps(quant, indent=1))
    return folder
