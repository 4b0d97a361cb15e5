"""GGUF tensor names <-> Hugging Face names, and undoing llama.cpp's Q/K row permutation.

llama.cpp's converter reorders the rows of each Q and K head for its interleaved RoPE: within a head of size D,
Hugging Face row `j * D/2 + i` (half j, pair i) is stored at row `2 i + j`. This engine rotates halves, so the
loader moves every row back; rows are whole quantization blocks, so the stored bytes are only reordered.
"""

from __future__ import annotations

import re
from typing import Dict, Optional

import torch

_GLOBAL: Dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK: Dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_HF_BLOCK = {hf: gg for gg, hf in _BLOCK.items()}
_HF_GLOBAL = {hf: gg for gg, hf in _GLOBAL.items()}
_HF_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def gguf_name(hf_name: str) -> Optional[str]:
    """The GGUF name of a Hugging Face tensor name, or None when GGUF has no such tensor."""
    m = _HF_NAME.match(hf_name)
    if m is not None:
        base = _HF_BLOCK.get(m.group(2))
        return None if base is None else f"blk.{m.group(1)}.{base}.{m.group(3)}"
    stem, _, suffix = hf_name.rpartition(".")
    base = _HF_GLOBAL.get(stem)
    return None if base is None else f"{base}.{suffix}"


def hf_name(gguf_tensor: str) -> Optional[str]:
    """The Hugging Face name of a GGUF tensor name, or None for tensors the engine does not read."""
    parts = gguf_tensor.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK:
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL:
        return f"{_GLOBAL[parts[0]]}.{parts[1]}"
    return None


def unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows [num_heads * D, ...] in llama.cpp's interleaved order -> Hugging Face's rotate-half order."""
    d = rows.shape[0] // num_heads
    return rows.reshape(num_heads, d // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)
