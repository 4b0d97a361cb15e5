"""Synthetic GGUF files shaped like real Llama models (random block bytes) for benchmarks, written with the `gguf`
package's GGUFWriter as llama.cpp lays them out.

The type of each tensor follows one of llama.cpp's recipes (RECIPES): Q4_K_M and Q5_K_M give Q6_K to the output
head and to `attn_v` and `ffn_down` in the layers its `use_more_bits` rule picks (the first and last eighth of the
layers and every third one between), Q4_K / Q5_K everywhere else; Q4_0 is Q4_0 but for a Q6_K output head; Q8_0 is
Q8_0 throughout; norms are F32. Speed does not depend on the values, so each block is random bytes with its fp16
scale fields set small enough that activations stay finite: no quantizer runs, and a 7B file is written at disk
speed. Only the `llama` architecture is written (the tensors every Llama-family GGUF holds). The file has no
vocabulary: `tokenizer.ggml.model = "no_vocab"` tells llama.cpp so (it then makes `vocab_size` dummy tokens), so
its llama-bench times the same file; this engine benches it but will not serve it (there is no text to decode).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterator, Tuple

import numpy as np

from kobold_backend.bench.checkpoint import Shape
from kobold_backend.ops.ggml import GGML_TYPES, TYPE_IDS

# Byte offset and value of each block type's fp16 scale fields, chosen so the weights have a spread near 0.01
# (Q4_K: d * sc * q - dmin * m with sc, m, q uniform; Q6_K: d * sc * (q - 32) with int8 sc).
SCALE_FIELDS: Dict[str, Tuple[Tuple[int, float], ...]] = {
    "Q4_K": ((0, 4e-5), (2, 3e-4)),
    "Q5_K": ((0, 2e-5), (2, 3e-4)),
    "Q6_K": ((208, 6e-6),),
    "Q4_0": ((0, 1.5e-3),),
    "Q8_0": ((0, 1e-4),),
}
# llama.cpp's file types written here: (the type of most matrices, of the `use_more_bits` V/down layers, of the
# output head).
RECIPES: Dict[str, Tuple[str, str, str]] = {
    "Q4_K_M": ("Q4_K", "Q6_K", "Q6_K"),
    "Q5_K_M": ("Q5_K", "Q6_K", "Q6_K"),
    "Q4_0": ("Q4_0", "Q4_0", "Q6_K"),
    "Q8_0": ("Q8_0", "Q8_0", "Q8_0"),
}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers whose V and down projections get more bits in the *_M recipes."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def recipe_types(shape: Shape, recipe: str = "Q4_K_M") -> Iterator[Tuple[str, Tuple[int, int], str]]:
    """(GGUF tensor name, (rows, columns), type) of every tensor of a Llama `shape` in one of RECIPES."""
    base, more_bits, head = RECIPES[recipe]
    head_dim = shape.head_dim or shape.hidden // shape.heads
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    yield "token_embd.weight", (shape.vocab, shape.hidden), base
    for i in range(shape.layers):
        more = more_bits if use_more_bits(i, shape.layers) else base
        yield f"blk.{i}.attn_norm.weight", (1, shape.hidden), "F32"
        yield f"blk.{i}.attn_q.weight", (q, shape.hidden), base
        yield f"blk.{i}.attn_k.weight", (kv, shape.hidden), base
        yield f"blk.{i}.attn_v.weight", (kv, shape.hidden), more
        yield f"blk.{i}.attn_output.weight", (shape.hidden, q), base
        yield f"blk.{i}.ffn_norm.weight", (1, shape.hidden), "F32"
        yield f"blk.{i}.ffn_gate.weight", (shape.intermediate, shape.hidden), base
        yield f"blk.{i}.ffn_up.weight", (shape.intermediate, shape.hidden), base
        yield f"blk.{i}.ffn_down.weight", (shape.hidden, shape.intermediate), more
    yield "output_norm.weight", (1, shape.hidden), "F32"
    yield "output.weight", (shape.vocab, shape.hidden), head


def q4_k_m_types(shape: Shape) -> Iterator[Tuple[str, Tuple[int, int], str]]:
    """recipe_types in the Q4_K_M recipe."""
    return recipe_types(shape, "Q4_K_M")


def random_blocks(rows: int, cols: int, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes]: random quants with the type's scale fields set (see SCALE_FIELDS)."""
    _, block, size = GGML_TYPES[TYPE_IDS[type_name]]
    data = rng.integers(0, 256, size=(rows * (cols // block), size), dtype=np.uint8)
    for offset, value in SCALE_FIELDS[type_name]:
        data[:, offset:offset + 2] = np.array([value], dtype=np.float16).view(np.uint8)
    return data.reshape(rows, cols // block * size)


def write_synthetic_gguf(path: Path, shape: Shape, seed: int = 0, context_length: int = 8192,
                         recipe: str = "Q4_K_M") -> Path:
    """Write a GGUF of a Llama `shape` in one of RECIPES to `path` (no vocabulary: the bench feeds token ids)."""
    import gguf  # the writer is llama.cpp's own package; only the bench needs it

    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    if shape.model_type != "llama":
        raise ValueError(f"synthetic GGUF files are written for llama shapes only, not {shape.model_type}")
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    head_dim = shape.head_dim or shape.hidden // shape.heads
    writer.add_name("synthetic")
    writer.add_context_length(context_length)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{recipe}"])
    writer.add_tokenizer_model("no_vocab")
    for name, (rows, cols), kind in recipe_types(shape, recipe):
        if kind == "F32":
            writer.add_tensor(name, np.ones(cols, dtype=np.float32))
        else:
            writer.add_tensor(name, random_blocks(rows, cols, kind, rng),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
