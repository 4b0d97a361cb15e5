"""Synthetic GPTQ 4-bit checkpoints shaped like real models (random weights) for benchmarks.

Weight values do not change speed; scales are kept small so activations stay finite and greedy
decoding is meaningful enough to compare graph and eager outputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float = 10000.0


PRESETS: Dict[str, Shape] = {
    "llama2-7b": Shape(4096, 11008, 32, 32, 32, 32000),
    "llama2-13b": Shape(5120, 13824, 40, 40, 40, 32000),
    "llama3-8b": Shape(4096, 14336, 32, 32, 8, 128256, rope_theta=500000.0),
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


def write_synthetic_gptq(
    folder: Path, shape: Shape, group_size: int = 128, act_order: bool = False, seed: int = 0,
    device: Optional[str] = None, max_position_embeddings: int = 8192,
) -> Path:
    """Write config.json, quantize_config.json and model.safetensors (one tensor set per layer, all on CPU)."""
    folder.mkdir(parents=True, exist_ok=True)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(seed)
    h, i, d = shape.hidden, shape.intermediate, shape.hidden // shape.heads
    kv = shape.kv_heads * d
    tensors: Dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (torch.randn((shape.vocab, h), generator=gen, device=dev) * 0.02).half(),
        "model.norm.weight": torch.ones(h, dtype=torch.float16),
        "lm_head.weight": (torch.randn((shape.vocab, h), generator=gen, device=dev) * 0.02).half(),
    }
    dims = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}
    for layer in range(shape.layers):
        p = f"model.layers.{layer}"
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        for name, (k, n) in dims.items():
            for suffix, t in _gptq_tensors(k, n, group_size, act_order, gen, dev).items():
                tensors[f"{p}.{name}.{suffix}"] = t
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": i,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab, "rms_norm_eps": 1e-5,
        "rope_theta": shape.rope_theta, "max_position_embeddings": max_position_embeddings,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16", "tie_word_embeddings": False,
    }
    quant = {"bits": 4, "group_size": group_size, "desc_act": act_order, "sym": True, "quant_method": "gptq",
             "checkpoint_format": "gptq"}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "quantize_config.json").write_text(json.dumps(quant, indent=1))
    return folder
