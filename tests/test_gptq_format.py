"""GPTQ checkpoint format: the test packer against the format definition, and the engine's loaded GPTQWeight
(true zeros, act-order sort, perm) against the packer's dequantized weights for every format variant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kobold_backend import ops
from kobold_backend.engine.loader import load_model
from kobold_backend.ops.gptq_weight import GPTQWeight
from tests.fixtures.checkpoints import GPTQ_NAMES, LINEARS, CheckpointFactory
from tests.fixtures.gptq_pack import pack_cols, pack_rows, quantize_pack, unpack_reference


def test_nibble_order_follows_the_format() -> None:
    # Rows 8r+j sit in bits 4j..4j+3 of qweight[r, n]; columns 8c+j in bits 4j of qzeros[g, c].
    q = torch.arange(1, 9).view(8, 1)
    assert pack_rows(q).numpy().view(np.uint32).tolist() == [[0x87654321]]
    z = torch.tensor([[15, 0, 0, 0, 0, 0, 0, 14]])
    assert pack_cols(z).numpy().view(np.uint32).tolist() == [[0xE000000F]]


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, -1])
def test_packer_round_trips_through_the_format(fmt: str, sym: bool, act_order: bool, group_size: int) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g)
    p = quantize_pack(w, group_size, sym, act_order, fmt, generator=torch.Generator().manual_seed(1))
    groups = 1 if group_size == -1 else 96 // group_size
    assert p.qweight.shape == (12, 48) and p.qweight.dtype == torch.int32
    assert p.qzeros.shape == (groups, 6) and p.qzeros.dtype == torch.int32
    assert p.scales.shape == (groups, 48) and p.scales.dtype == torch.float16
    assert p.g_idx.shape == (96,) and p.g_idx.dtype == torch.int32
    assert torch.equal(unpack_reference(p.qweight, p.qzeros, p.scales, p.g_idx, fmt), p.dequantized)
    # Each group holds group_size rows; act-order scatters them, otherwise g_idx is k // group_size.
    assert torch.bincount(p.g_idx.long()).tolist() == [96 // groups] * groups
    trivial = torch.arange(96) // (96 // groups)
    assert torch.equal(p.g_idx.long(), trivial) != (act_order and groups > 1)
    # Round-to-nearest: the error is at most half a step of the group's scale (plus the scale's fp16 rounding).
    step = p.scales.float()[p.g_idx.long()].t()
    assert ((p.dequantized - w).abs() <= step * 0.504 + 1e-6).all()
    if sym:
        stored = 0x77777777 if fmt == "gptq" else 0x88888888
        assert (p.qzeros.numpy().view(np.uint32) == stored).all()


def test_v1_cannot_store_a_zero_point_of_zero() -> None:
    w = torch.rand(8, 32) + 0.1  # all positive: the asymmetric zero point is 0
    with pytest.raises(ValueError, match="zero point of 0"):
        quantize_pack(w, 32, sym=False, checkpoint_format="gptq")
    p = quantize_pack(w, 32, sym=False, checkpoint_format="gptq_v2")
    assert (p.zeros == 0).all()


def test_fixture_zero_points_cover_the_edge_cases(checkpoints: CheckpointFactory) -> None:
    """v1 asym stays in 1..15 (see gptq_pack); the gptq_v2 fixture stores true zeros 0 and 15."""
    v1 = torch.cat([p.zeros.flatten() for p in checkpoints.get("gptq_v1_asym_g32").packed.values()])
    assert v1.min() >= 1 and len(v1.unique()) > 5
    v2 = torch.cat([p.zeros.flatten() for p in checkpoints.get("gptq_v2_asym_g32").packed.values()])
    assert v2.min() == 0 and v2.max() == 15


@pytest.mark.parametrize("name", GPTQ_NAMES)
def test_engine_dequantizes_every_layer_like_the_packer(name: str, checkpoints: CheckpointFactory) -> None:
    built = checkpoints.get(name)
    quant = built.spec.quant
    lm = load_model(built.path, device="cpu")
    assert lm.config.quant is not None and lm.config.quant.checkpoint_format == quant.checkpoint_format
    for i, layer in enumerate(lm.model.layers):
        for linear in LINEARS:
            packed = built.packed[f"model.layers.{i}.{linear}"]
            w = layer.weight(linear.split(".")[1])
            assert isinstance(w, GPTQWeight)
            n, k = packed.dequantized.shape
            assert (w.in_features, w.out_features) == (k, n)
            assert w.group_size == (k if quant.group_size == -1 else quant.group_size)
            assert w.bits == quant.bits
            sorted_rows = ops.gptq_dequantize(w).float()
            # an act-order down_proj's permutation is folded into gate/up's output columns (engine/mlp_fold.py)
            row_perm, col_perm = w.perm, None
            if quant.act_order and linear == "mlp.down_proj":
                assert w.perm is None and layer.mlp_perm is not None
                row_perm = layer.mlp_perm
            elif quant.act_order and linear in ("mlp.gate_proj", "mlp.up_proj"):
                col_perm = layer.mlp_perm
            if quant.act_order:
                assert row_perm is not None
                assert sorted(row_perm.tolist()) == list(range(k))
                # sorted row i is original row row_perm[i], and the groups are contiguous in sorted order
                assert bool((packed.g_idx.long()[row_perm][1:] >= packed.g_idx.long()[row_perm][:-1]).all())
                original = torch.empty_like(sorted_rows)
                original[row_perm] = sorted_rows
            else:
                assert w.perm is None and layer.mlp_perm is None, f"{name}: trivial g_idx not detected"
                original = sorted_rows
            zeros = w.zeros.float()
            if col_perm is not None:
                original = torch.empty_like(original).index_copy_(1, col_perm, original)
                zeros = torch.empty_like(zeros).index_copy_(1, col_perm, zeros)
            torch.testing.assert_close(original, packed.dequantized.t(), rtol=1e-6, atol=1e-6)
            assert torch.equal(zeros, packed.zeros.float()), f"{name}: zeros are not the true zeros"
            # and the product, which gathers the activation through perm (or takes it permuted, when folded)
            x = torch.randn(3, k, generator=torch.Generator().manual_seed(i))
            ref = x @ packed.dequantized.t()
            x_in = x if w.perm is not None or row_perm is None else x.index_select(1, row_perm)
            ref = ref if col_perm is None else ref.index_select(1, col_perm)
            torch.testing.assert_close(ops.gptq_matmul(x_in, w), ref, rtol=1e-5, atol=1e-5)

@pytest.mark.gpu
@pytest.mark.parametrize("name", GPTQ_NAMES)
def test_gpu_dequantize_and_matmul(name: str, checkpoints: CheckpointFactory) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    built = checkpoints.get(name)
    lm = load_model(built.path, device="cuda", dtype="float16")
    for i, layer in enumerate(lm.model.layers):
        for linear in LINEARS:
            packed = built.packed[f"model.layers.{i}.{linear}"]
            w = layer.weight(linear.split(".")[1])
            assert w.qweight.device.type == "cuda"
            rows = ops.gptq_dequantize(w).float().cpu()
            # an act-order down_proj's permutation is folded into gate/up's output columns (engine/mlp_fold.py)
            mlp_perm = None if layer.mlp_perm is None else layer.mlp_perm.cpu()
            row_perm = mlp_perm if w.perm is None and linear == "mlp.down_proj" else w.perm
            col_perm = mlp_perm if linear in ("mlp.gate_proj", "mlp.up_proj") else None
            original = rows if row_perm is None else torch.empty_like(rows).index_copy_(0, row_perm.cpu(), rows)
            if col_perm is not None:
                original = torch.empty_like(original).index_copy_(1, col_perm, original)
            # fp16 products of exact (q - z) and fp16 scales: one half-precision rounding at most
            torch.testing.assert_close(original, packed.dequantized.t(), rtol=1e-3, atol=1e-4)
            x = torch.randn(5, w.in_features, generator=torch.Generator().manual_seed(i))
            x_in = x if w.perm is not None or row_perm is None else x.index_select(1, row_perm.cpu())
            y = ops.gptq_matmul(x_in.half().cuda(), w).float().cpu()
            ref = x.half().float() @ packed.dequantized.t()
            ref = ref if col_perm is None else ref.index_select(1, col_perm)
            assert (y - ref).norm() / ref.norm() < 2e-3
