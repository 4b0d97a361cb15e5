"""GGML block dequantization (kobold_backend/ops/ggml.py) against the `gguf` package's numpy dequantizers, bit for bit.

Blocks come from two sources: the tests' own quantizer (tests/fixtures/ggml_quant.py, written from ggml's block
definitions) on random weights, and random bytes with finite fp16 scale fields, so every bit pattern a file may
hold is read the same way as by llama.cpp's Python package.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from kobold_backend.ops.ggml import GGML_TYPES, TYPE_IDS, GGMLWeight, dequantize_rows, ggml_matmul, row_bytes
from tests.fixtures.ggml_quant import quantize_rows

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
# Byte offsets of the fp16 fields in each block (kept finite in the random-bytes test).
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _oracle(data: np.ndarray, type_name: str, n: int) -> np.ndarray:
    return dequantize(data, GGMLQuantizationType[type_name]).reshape(data.shape[0], n).astype(np.float32)


def test_type_table_matches_gguf() -> None:
    from gguf.constants import GGML_QUANT_SIZES

    for tid, (name, block, size) in GGML_TYPES.items():
        qtype = GGMLQuantizationType[name]
        assert int(qtype) == tid
        assert GGML_QUANT_SIZES[qtype] == (block, size)


@pytest.mark.parametrize("type_name", TYPES)
def test_quantized_weights_dequantize_like_gguf(type_name: str) -> None:
    rng = np.random.default_rng(TYPE_IDS[type_name])
    n, k = 24, 512
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 2.0, size=(n, 1)).astype(np.float32)
    data = quantize_rows(w, type_name)
    assert data.shape == (n, row_bytes(type_name, k))
    ours = dequantize_rows(torch.from_numpy(data), type_name, k).numpy()
    ref = _oracle(data, type_name, k)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, ref)
    # The fixture quantizer must also be a usable quantizer (fixtures rely on it for model-level tests).
    err = np.linalg.norm(ref - w) / np.linalg.norm(w)
    assert err < {"F32": 1e-7, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01, "Q6_K": 0.03, "Q5_0": 0.06,
                  "Q5_1": 0.06, "Q5_K": 0.06}.get(type_name, 0.12), err


@pytest.mark.parametrize("type_name", [t for t in TYPES if t in F16_FIELDS])
def test_random_blocks_dequantize_like_gguf(type_name: str) -> None:
    rng = np.random.default_rng(100 + TYPE_IDS[type_name])
    _, block, size = GGML_TYPES[TYPE_IDS[type_name]]
    rows, k = 16, block * 4
    data = rng.integers(0, 256, size=(rows * 4, size), dtype=np.uint8)
    for off in F16_FIELDS[type_name]:
        data[:, off : off + 2] = rng.uniform(-2, 2, size=(rows * 4, 1)).astype(np.float16).view(np.uint8)
    data = data.reshape(rows, 4 * size)
    ours = dequantize_rows(torch.from_numpy(data.copy()), type_name, k).numpy()
    np.testing.assert_array_equal(ours, _oracle(data, type_name, k))


def test_matmul_uses_the_dequantized_weight() -> None:
    rng = np.random.default_rng(7)
    w = rng.standard_normal((32, 256)).astype(np.float32)
    data = torch.from_numpy(quantize_rows(w, "Q4_K"))
    weight = GGMLWeight(data, "Q4_K", in_features=256, out_features=32, bias=torch.arange(32.0))
    x = torch.from_numpy(rng.standard_normal((3, 256)).astype(np.float32))
    ref = torch.from_numpy(_oracle(data.numpy(), "Q4_K", 256)).double()
    expected = x.double() @ ref.t() + torch.arange(32.0).double()
    torch.testing.assert_close(ggml_matmul(x, weight).double(), expected, rtol=1e-5, atol=1e-4)
    assert weight.bits_per_weight == pytest.approx(4.5)


def test_row_length_must_fill_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        row_bytes("Q4_K", 100)
