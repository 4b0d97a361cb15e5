"""Synthetic EXL2 checkpoints (exllamav2's format, docs/exl2.md) shaped like real models, for benchmarks.

Random packed words (every bit pattern is a valid quantized value), random 4-bit scale codes, a random input
permutation per linear, and per-linear width mixes like those exllamav2's optimizer picks near the target: at
4.0 bpw attention linears 10 % 5-bit + 90 % 4-bit in groups of 32 and MLP linears 80 % 4-bit + 20 % 3-bit in
groups of 64 (about 4.0 bpw over a Llama-2-7B's layers), the head at 6 bits in groups of 32. Groups are stored
widest first, as exllamav2's kernels require. Written one shard per layer, like the GPTQ writer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from kobold_backend.bench.checkpoint import Shape, save_shard, synthetic_config, write_index

# (width, share of the rows, group size) per kind of linear, widest first; keyed by target bpw
MIXES: Dict[float, Dict[str, Sequence[Tuple[int, float, int]]]] = {
    4.0: {"attn": ((5, 0.1, 32), (4, 0.9, 32)), "mlp": ((4, 0.8, 64), (3, 0.2, 64)), "head": ((6, 1.0, 32),)},
}


def group_plan(k: int, mix: Sequence[Tuple[int, float, int]]) -> List[Tuple[int, int]]:
    """(width, rows) of each group over k rows: each width's share rounded to whole groups, the last width taking
    what remains."""
    plan: List[Tuple[int, int]] = []
    left = k
    for i, (bits, share, size) in enumerate(mix):
        rows = left if i == len(mix) - 1 else min(left, -(-int(k * share) // size) * size)
        left -= rows
        while rows > 0:
            plan.append((bits, min(size, rows)))
            rows -= size
    return plan


def exl2_tensors(k: int, n: int, mix: Sequence[Tuple[int, float, int]], gen: torch.Generator,
                 device: str) -> Dict[str, torch.Tensor]:
    """One linear's EXL2 tensors with random contents (columns padded to a multiple of 32, as the converter does)."""
    np_ = -(-n // 32) * 32
    plan = group_plan(k, mix)
    qrows = [-(-rows * bits // 32) for bits, rows in plan]
    starts = [sum(qrows[:i]) for i in range(len(plan))]
    q_weight = torch.randint(-(2**31), 2**31 - 1, (sum(qrows), np_), dtype=torch.int32, generator=gen, device=device)
    q_groups = torch.tensor([v for (bits, _), s in zip(plan, starts) for v in (bits, s)], dtype=torch.int16)
    return {
        "q_weight": q_weight,
        "q_scale": torch.randint(-(2**31), 2**31 - 1, (len(plan), np_ // 8), dtype=torch.int32, generator=gen,
                                 device=device),
        "q_scale_max": (torch.rand(len(plan), generator=gen, device=device) * 0.0005 + 0.0005).half(),
        "q_groups": q_groups.to(device),
        "q_invperm": torch.argsort(torch.randperm(k, generator=gen, device=device)).to(torch.int32),
    }


def write_synthetic_exl2(folder: Path, shape: Shape, bpw: float = 4.0, seed: int = 0, device: Optional[str] = None,
                         max_position_embeddings: int = 8192) -> Path:
    """config.json (with the converter's quantization_config) and one safetensors shard per layer (+ one for the
    embeddings, final norm and head) with an index."""
    from kobold_backend.engine.config import ModelConfig
    from kobold_backend.engine.device_map import config_shapes

    if bpw not in MIXES:
        raise ValueError(f"no EXL2 width mix for {bpw} bpw (have {sorted(MIXES)})")
    mixes = MIXES[bpw]
    folder.mkdir(parents=True, exist_ok=True)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(seed)
    config = synthetic_config(shape, max_position_embeddings)
    config["quantization_config"] = {"quant_method": "exl2", "version": "0.3.2", "bits": bpw,
                                     "head_bits": mixes["head"][0][0],
                                     "calibration": {"rows": 0, "length": 0, "dataset": "(synthetic)"}}
    parsed = ModelConfig.from_dict({k: v for k, v in config.items() if k != "quantization_config"})
    unit = 1.0 - parsed.features.norm_offset
    groups: Dict[str, Dict[str, Tuple[int, ...]]] = {}
    for name, dims in config_shapes(parsed).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(layer, {})[name] = dims
    weight_map: Dict[str, str] = {}
    total = 0
    for number, shapes in enumerate(groups.values()):
        tensors: Dict[str, torch.Tensor] = {}
        for name, dims in shapes.items():
            if name.endswith(("norm.weight", "layernorm.weight")):
                tensors[name] = torch.full(dims, unit, dtype=torch.float16)
            elif name.endswith(".weight") and len(dims) == 2 and name != "model.embed_tokens.weight":
                prefix = name[: -len(".weight")]
                kind = "head" if prefix == "lm_head" else "attn" if ".self_attn." in prefix else "mlp"
                for suffix, t in exl2_tensors(dims[1], dims[0], mixes[kind], gen, dev).items():
                    tensors[f"{prefix}.{suffix}"] = t
            else:
                tensors[name] = (torch.randn(dims, generator=gen, device=dev) * 0.02).half()
        total += save_shard(folder, number, len(groups), tensors, weight_map)
    write_index(folder, total, weight_map, config)
    return folder
