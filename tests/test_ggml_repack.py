"""The load-time re-layout of Q4_0, Q8_0 and Q6_K rows for the CUDA integer GEMV (ops/ggml.py `repack`): the
layout is the one written down in ops/ggml.py's docstring (quant bytes of every block, then the blocks' fp16 d,
then zeros to a multiple of 16 bytes), undoing it gives the file's bytes back exactly, and the dequantization of a
re-laid-out weight equals the file blocks' dequantization (tests/test_ggml_blocks.py checks that one against the
`gguf` package) bit for bit. Row slices and row concatenations (fused projections) keep meaning the same rows."""

from __future__ import annotations

import pytest
import torch

from kobold_backend import ops
from kobold_backend.ops.ggml import (
    REPACKED,
    GGMLWeight,
    dequantize_rows,
    ggml_dequantize,
    kernel_layout_ok,
    repack,
    row_bytes,
    unpack,
)
from tests.test_ggml_kernels import make_weight

# (type, bytes of quants per block, offset of the fp16 d in the file's block)
LAYOUT = {"Q4_0": (16, 0), "Q8_0": (32, 0), "Q6_K": (208, 208)}


@pytest.mark.parametrize("type_name", sorted(REPACKED))
@pytest.mark.parametrize("k", [256, 512, 2304, 11008])
@pytest.mark.parametrize("random_bytes", [False, True])
def test_repack_layout_and_dequantization(type_name: str, k: int, random_bytes: bool) -> None:
    w = make_weight(type_name, 7, k, seed=k + len(type_name), random_bytes=random_bytes)
    r = repack(w)
    body, off = LAYOUT[type_name]
    size = w.data.shape[1] // (k // w.block_size)
    nb = k // w.block_size
    assert r.type_name == REPACKED[type_name] and r.file_type_name == type_name and r.block_size == w.block_size
    assert r.data.shape == (7, row_bytes(r.type_name, k)) and r.data.shape[1] % 16 == 0
    assert r.data.shape[1] - w.data.shape[1] < 16
    blocks = w.data.reshape(7, nb, size)
    for b in (0, nb // 2, nb - 1):  # the written-down layout, block by block
        quants = torch.cat([blocks[:, b, :off], blocks[:, b, off + 2:]], dim=1)
        assert torch.equal(r.data[:, body * b:body * (b + 1)], quants)
        assert torch.equal(r.data[:, body * nb + 2 * b:body * nb + 2 * b + 2], blocks[:, b, off:off + 2])
    assert not r.data[:, (body + 2) * nb:].any()
    assert torch.equal(unpack(r).data, w.data) and unpack(r).type_name == type_name
    want = ggml_dequantize(w)
    got = ggml_dequantize(r)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit, NaN patterns included
    assert torch.equal(dequantize_rows(r.data[2:5], r.type_name, k).view(torch.int32),
                       want[2:5].view(torch.int32))
    fused = GGMLWeight(torch.cat([r.data, repack(make_weight(type_name, 3, k, seed=1)).data]), r.type_name, k, 10)
    assert torch.equal(ggml_dequantize(fused)[:7].view(torch.int32), want.view(torch.int32))


def test_repacked_weights_stay_off_the_file_layout_kernels() -> None:
    """Only the CUDA integer GEMV reads the re-layout: every other kernel's layout check refuses it, the CPU ops
    fall back to the torch dequantization, and placing a CPU weight leaves it as the file has it."""
    w = make_weight("Q6_K", 4, 512, seed=3)
    r = repack(w)
    assert kernel_layout_ok(w, w.data.device) and not kernel_layout_ok(r, r.data.device)
    assert kernel_layout_ok(r, r.data.device, repacked=True)
    assert ops.ggml_place(w) is w
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ops.ggml_matmul(x, r), x @ ggml_dequantize(w).t())  # the torch path, not the CPU GEMV
