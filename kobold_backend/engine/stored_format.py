"""The weight format of a model as stored on disk, from file headers (and EXL2's small group tables): the one
computation of a model's format and bits per weight, which `kobold-backend doctor --model` prints before anything
is loaded and the loader logs and reports (/api/v1/model, the web page) for the model it loaded.

The decoder layers' linear weights count (every tensor of two or more dimensions under a layer; norms and biases
are not weights), in bits per weight over their bytes in the files, scales, zeros and block headers included. It
is what the file holds, not what a device holds after loading (float16 tensors of a GGUF file, or GPTQ scales,
are float32 on the CPU): the load log of a GGUF file once said 11.55 bpw where the file holds 7.47.
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
_EXL2 = (".q_weight", ".q_scale", ".q_scale_max", ".q_groups", ".q_invperm")  # all of a linear but its bias


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


def _count(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _exl2_linear(file: Path, prefix: str, headers: Dict[str, Tuple[str, Tuple[int, ...]]]) -> Tuple[int, Counter]:
    """(weights, weights per bit width) of one EXL2 linear: K from q_invperm, N from q_weight, each width's rows from
    q_groups (a few int16 values, the only tensor data read)."""
    from safetensors import safe_open

    from kobold_backend.ops.exl2_weight import group_table

    k = headers[prefix + ".q_invperm"][1][0]
    qrows, n = headers[prefix + ".q_weight"][1][:2]
    with safe_open(str(file), "pt") as f:
        table = group_table(f.get_tensor(prefix + ".q_groups"), qrows, k)
    widths: Counter = Counter()
    for b, rows in zip(table.bits, table.rows):
        widths[b] += rows * n
    return k * n, widths


def _folder_format(folder: Path) -> WeightFormat:
    config = ModelConfig.from_dir(folder)
    quant = config.quant
    dense: Counter = Counter()
    exl2_widths: Counter = Counter()
    bits = weights = 0
    files = {file: _headers(file) for file in safetensors_files(folder)}
    # the engine's name of each stored tensor (a multimodal checkpoint keeps its text model under another prefix)
    engine_name = {v: k for k, v in config.description.stored_names([n for h in files.values() for n in h]).items()}
    for file, headers in files.items():
        for name, (dtype, shape) in headers.items():
            if not engine_name.get(name, name).startswith("model.layers."):
                continue
            n = _count(shape)
            nbytes = n * _DTYPE_BYTES.get(dtype, 2)
            if name.endswith(_EXL2):
                bits += nbytes * 8
                if name.endswith(".q_weight"):
                    count, widths = _exl2_linear(file, name[: -len(".q_weight")], headers)
                    weights += count
                    exl2_widths.update(widths)
            elif name.endswith(_PACKED):
                bits += nbytes * 8
                if name.endswith(".qweight") and quant is not None:
                    weights += n * 32 // quant.bits  # int32 words of `bits`-bit weights
            elif len(shape) >= 2:
                dense[dtype] += n
                bits += nbytes * 8
                weights += n
    bpw = bits / max(weights, 1)
    if exl2_widths:
        return WeightFormat("EXL2", "+".join(str(b) for b, _ in exl2_widths.most_common()) + "-bit", bpw)
    if quant is not None:
        group = "" if quant.group_size <= 0 else f" g{quant.group_size}"
        return WeightFormat(quant.method.upper(), f"{quant.bits}-bit{group}", bpw)
    names = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    dtype = dense.most_common(1)[0][0] if dense else "F16"
    return WeightFormat(names.get(dtype, dtype.lower()), "", bpw)
