"""The weight format of a model as stored on disk, from file headers only (no tensor data read): what
`kobold-backend doctor --model` prints before anything is loaded.

Counted like engine/weight_format.py counts a loaded model: the decoder layers' linear weights (every tensor of
two or more dimensions under a layer; norms and biases are not weights), bits per weight over their bytes in the
files. A GGUF file's blocks load as stored, so its figure equals the load log's; GPTQ/AWQ scales are counted as
stored (float16), where the loaded figure counts them in the compute dtype.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Dict, Tuple

from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.model_files import is_gguf_file
from kobold_backend.engine.weight_format import WeightFormat
from kobold_backend.engine.weights import safetensors_files, safetensors_header

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}
_PACKED = (".qweight", ".qzeros", ".scales", ".g_idx")


def stored_format(path: Path) -> WeightFormat:
    """The format of the model at `path` (a .gguf file or a Hugging Face folder)."""
    if is_gguf_file(path):
        return _gguf_format(path)
    return _folder_format(path)


def _gguf_format(path: Path) -> WeightFormat:
    from kobold_backend.engine.gguf.file import GGUFFile

    gguf = GGUFFile(path)
    try:
        types: Counter = Counter()
        bits = weights = 0
        for name in gguf.names():
            dims = gguf.shape(name)
            if not name.startswith("blk.") or len(dims) < 2:
                continue
            n = 1
            for d in dims:
                n *= d
            kind = gguf.type_name(name)
            if kind not in ("F32", "F16", "BF16"):
                types[kind] += n
            bits += gguf.raw(name).size * 8
            weights += n
    finally:
        gguf.close()
    detail = "+".join(t for t, _ in types.most_common())
    return WeightFormat("GGUF", detail, bits / max(weights, 1)) if detail else \
        WeightFormat("GGUF", "float", bits / max(weights, 1))


def _headers(file: Path) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    return {k: (str(v["dtype"]), tuple(v["shape"])) for k, v in safetensors_header(file).items()}  # type: ignore[arg-type]


def _folder_format(folder: Path) -> WeightFormat:
    config = ModelConfig.from_dir(folder)
    quant = config.quant
    dense: Counter = Counter()
    bits = weights = 0
    for file in safetensors_files(folder):
        for name, (dtype, shape) in _headers(file).items():
            if not name.startswith("model.layers."):
                continue
            n = 1
            for d in shape:
                n *= d
            nbytes = n * _DTYPE_BYTES.get(dtype, 2)
            if name.endswith(_PACKED):
                bits += nbytes * 8
                if name.endswith(".qweight") and quant is not None:
                    weights += n * 32 // quant.bits  # int32 words of `bits`-bit weights
            elif len(shape) >= 2:
                dense[dtype] += n
                bits += nbytes * 8
                weights += n
    bpw = bits / max(weights, 1)
    if quant is not None:
        group = "" if quant.group_size <= 0 else f" g{quant.group_size}"
        return WeightFormat(quant.method.upper(), f"{quant.bits}-bit{group}", bpw)
    names = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    dtype = dense.most_common(1)[0][0] if dense else "F16"
    return WeightFormat(names.get(dtype, dtype.lower()), "", bpw)
