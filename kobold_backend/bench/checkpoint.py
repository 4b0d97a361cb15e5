"""Synthetic GPTQ 4-bit checkpoints shaped like real models (random weights) for benchmarks.

Weight values do not change speed; scales are kept small so activations stay finite and greedy
decoding is meaningful enough to compare graph and eager outputs. Tensors are drawn on the GPU when there is
one and written one safetensors shard per layer (plus one for the embeddings and head) with an index, so no more
than one layer is ever held in host memory: a Mixtral-8x7B-shaped checkpoint (~25 GB) is written at disk speed.
Names and config.json follow each family's Hub checkpoints (Llama, Gemma 2, Mixtral with per-expert GPTQ).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

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
    family: str = "llama"  # "llama" | "gemma2" | "mixtral"
    head_dim: Optional[int] = None  # None: hidden // heads
    experts: int = 0  # routed experts per layer (mixtral); intermediate is one expert's
    top_k: int = 0


PRESETS: Dict[str, Shape] = {
    "llama2-7b": Shape(4096, 11008, 32, 32, 32, 32000),
    "llama2-13b": Shape(5120, 13824, 40, 40, 40, 32000),
    "llama3-8b": Shape(4096, 14336, 32, 32, 8, 128256, rope_theta=500000.0),
    "gemma2-9b": Shape(3584, 14336, 42, 16, 8, 256000, family="gemma2", head_dim=256),
    "mixtral-8x7b": Shape(4096, 14336, 32, 32, 8, 32000, rope_theta=1e6, family="mixtral", experts=8, top_k=2),
    # the same layers, 8 of 32: ~6 GB instead of ~25 GB to write and load; decode tok/s is ~4x the full model's
    "mixtral-8x7b-8l": Shape(4096, 14336, 8, 32, 8, 32000, rope_theta=1e6, family="mixtral", experts=8, top_k=2),
    "tiny": Shape(128, 384, 2, 4, 2, 512),
    "tiny-gemma2": Shape(128, 384, 2, 4, 2, 512, family="gemma2", head_dim=64),
    "tiny-mixtral": Shape(128, 384, 2, 4, 2, 512, family="mixtral", experts=4, top_k=2),
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


def _mlp_linears(shape: Shape) -> Iterator[Tuple[str, int, int]]:
    """(checkpoint prefix under the layer, in, out) of every MLP linear."""
    h, i = shape.hidden, shape.intermediate
    if shape.family == "mixtral":
        for e in range(shape.experts):
            p = f"block_sparse_moe.experts.{e}"
            yield from ((f"{p}.w1", h, i), (f"{p}.w3", h, i), (f"{p}.w2", i, h))
    else:
        yield from (("mlp.gate_proj", h, i), ("mlp.up_proj", h, i), ("mlp.down_proj", i, h))


def _config(shape: Shape, head_dim: int, max_position_embeddings: int) -> Dict[str, Any]:
    config: Dict[str, Any] = {
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": head_dim,
        "vocab_size": shape.vocab, "rms_norm_eps": 1e-5, "rope_theta": shape.rope_theta,
        "max_position_embeddings": max_position_embeddings, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float16", "tie_word_embeddings": False,
    }
    if shape.family == "gemma2":
        config.update(architectures=["Gemma2ForCausalLM"], model_type="gemma2", rms_norm_eps=1e-6,
                      tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                      hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim, sliding_window=4096,
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    elif shape.family == "mixtral":
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=shape.experts,
                      num_experts_per_tok=shape.top_k, sliding_window=None)
    else:
        config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    return config


def write_synthetic_gptq(
    folder: Path, shape: Shape, group_size: int = 128, act_order: bool = False, seed: int = 0,
    device: Optional[str] = None, max_position_embeddings: int = 8192,
) -> Path:
    """Write config.json, quantize_config.json and the sharded safetensors with their index."""
    folder.mkdir(parents=True, exist_ok=True)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(seed)
    h, d = shape.hidden, shape.head_dim or shape.hidden // shape.heads
    qd, kv = shape.heads * d, shape.kv_heads * d
    gemma = shape.family == "gemma2"
    # Gemma's norms multiply by (1 + weight): zeros are its unit norms
    unit = torch.zeros(h, dtype=torch.float16) if gemma else torch.ones(h, dtype=torch.float16)
    shards = shape.layers + 1
    weight_map: Dict[str, str] = {}
    total = [0]

    def save(index: int, tensors: Dict[str, torch.Tensor]) -> None:
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        host = {k: v.cpu().contiguous() for k, v in tensors.items()}
        save_file(host, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in host})
        total[0] += sum(t.numel() * t.element_size() for t in host.values())

    def randn(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=dev) * 0.02).half()

    top: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(shape.vocab, h), "model.norm.weight": unit}
    if not gemma:
        top["lm_head.weight"] = randn(shape.vocab, h)
    save(0, top)
    del top
    attention = [("self_attn.q_proj", h, qd), ("self_attn.k_proj", h, kv), ("self_attn.v_proj", h, kv),
                 ("self_attn.o_proj", qd, h)]
    norms = ["input_layernorm", "post_attention_layernorm"]
    if gemma:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for layer in range(shape.layers):
        p = f"model.layers.{layer}"
        tensors: Dict[str, torch.Tensor] = {f"{p}.{n}.weight": unit.clone() for n in norms}
        if shape.family == "mixtral":
            router = torch.randn((shape.experts, h), generator=gen, device=dev) / h ** 0.5  # logits of O(1)
            tensors[f"{p}.block_sparse_moe.gate.weight"] = router.half()
        for name, k, n in attention + list(_mlp_linears(shape)):
            for suffix, t in _gptq_tensors(k, n, group_size, act_order, gen, dev).items():
                tensors[f"{p}.{name}.{suffix}"] = t
        save(layer + 1, tensors)
    index = {"metadata": {"total_size": total[0]}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    quant = {"bits": 4, "group_size": group_size, "desc_act": act_order, "sym": True, "quant_method": "gptq",
             "checkpoint_format": "gptq"}
    (folder / "config.json").write_text(json.dumps(_config(shape, d, max_position_embeddings), indent=1))
    (folder / "quantize_config.json").write_text(json.dumps(quant, indent=1))
    return folder
