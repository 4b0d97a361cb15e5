"""The CPU kernels of kobold_backend._ext_cpu against reference.py on fresh random inputs, outputs poisoned with NaN.

The module is the installed one (`pip install -e .` / `python setup.py build_ext --inplace`) or, failing
that, a JIT build made by this session.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kobold_backend import ops
from kobold_backend.ops import native, reference
from tests.ext_helpers import (
    as_float64,
    assert_close_rel,
    gptq_oracle,
    make_gptq,
    poisoned,
    random,
    rope_tables,
    tol_for,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels() -> native.CpuKernels:
    result = native.load("cpu", mode="auto")
    assert result.module is not None, f"the CPU kernels could not be loaded or built: {result.reason}"
    return native.CpuKernels(result.module)


# ---------------------------------------------------------------------------------------------- GPTQ

GEMV_CASES = [
    # (K, N, group size, act-order, rows, bias)
    (11008, 96, 128, True, 1, False),
    (11008, 130, 32, False, 3, True),
    (4096, 100, 32, True, 8, True),
    (4096, 37, -1, False, 2, False),
    (24, 5, 8, True, 1, True),
    (20, 3, 8, False, 4, False),  # K not a multiple of 8: the last packed row is half padding
    (128, 256, 64, True, 7, False),
]


@pytest.mark.parametrize("k,n,gs,act,m,bias", GEMV_CASES)
def test_gptq_gemv_fp32(kernels: native.CpuKernels, k: int, n: int, gs: int, act: bool, m: int, bias: bool) -> None:
    w = make_gptq(k, n, gs, act_order=act, bias=bias, seed=k + n + m)
    x = random((m, k), torch.float32, seed=m)
    out = poisoned((m, n), torch.float32)
    y = kernels.gptq_matmul(x, w, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_close_rel(y, gptq_oracle(x, w), 2e-5, f"gemv {k}x{n} g{gs} act={act} m={m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
def test_gptq_gemv_half_dtypes(kernels: native.CpuKernels, dtype: torch.dtype, m: int) -> None:
    w = make_gptq(4096, 72, 128, act_order=True, dtype=dtype, bias=True, seed=3)
    x = random((m, 4096), dtype, seed=4)
    y = kernels.gptq_matmul(x, w, out=poisoned((m, 72), dtype))
    assert y.dtype == dtype
    assert_close_rel(y, gptq_oracle(x, w), tol_for(dtype), f"gemv {dtype}")


def test_gptq_gemv_strided_rows(kernels: native.CpuKernels) -> None:
    w = make_gptq(256, 40, 32, act_order=True, seed=9)
    big = random((3, 300), torch.float32, seed=10)
    x = big[:, 10:266]  # row stride 300
    assert_close_rel(kernels.gptq_matmul(x, w, out=poisoned((3, 40), torch.float32)), gptq_oracle(x, w), 2e-5)


@pytest.mark.parametrize("m", [9, 33])
@pytest.mark.parametrize("gs", [32, 20])
def test_gptq_matmul_prompt_path(kernels: native.CpuKernels, m: int, gs: int) -> None:
    """More than 8 rows (or a group size that is not a multiple of 8) dequantize and use torch.matmul."""
    w = make_gptq(160, 48, gs, act_order=True, bias=True, seed=m)
    x = random((m, 160), torch.float32, seed=m + 1)
    assert_close_rel(kernels.gptq_matmul(x, w, out=poisoned((m, 48), torch.float32)), gptq_oracle(x, w), 2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n,gs", [(11008, 24, 128), (4096, 33, -1), (20, 7, 3), (64, 16, 32)])
def test_gptq_dequantize_bit_exact(kernels: native.CpuKernels, dtype: torch.dtype, k: int, n: int, gs: int) -> None:
    w = make_gptq(k, n, gs, dtype=dtype, seed=k * n)
    got = kernels.gptq_dequantize(w, out=poisoned((k, n), dtype))
    assert got.dtype == dtype
    assert torch.equal(got, reference.gptq_dequantize(w)), "dequantize differs from reference.py"
    # and the float64 oracle agrees to the rounding of the dtype
    assert_close_rel(got, reference.gptq_dequantize(as_float64(w)), tol_for(dtype))


def test_gptq_gemv_rejects_malformed_weight(kernels: native.CpuKernels) -> None:
    w = make_gptq(64, 16, 32, seed=1)
    w.scales = w.scales[:1].contiguous()
    with pytest.raises(ValueError, match="malformed GPTQWeight"):
        kernels.gptq_matmul(random((1, 64), torch.float32, seed=0), w)


# ---------------------------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4096), (3, 5, 4096), (7, 11)])
def test_rms_norm(kernels: native.CpuKernels, dtype: torch.dtype, shape: Any) -> None:
    x = random(shape, dtype, seed=len(shape), scale=3.0)
    w = random(shape[-1:], torch.float32, seed=2).abs() + 0.5
    y = kernels.rms_norm(x, w, 1e-5, out=poisoned(shape, dtype))
    assert_close_rel(y, reference.rms_norm(x.double(), w.double(), 1e-5), tol_for(dtype), "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(kernels: native.CpuKernels, dtype: torch.dtype) -> None:
    shape = (2, 3, 4096)
    x, r = random(shape, dtype, seed=1), random(shape, dtype, seed=2, scale=4.0)
    w = random((4096,), dtype, seed=3)
    y, ro = kernels.add_rms_norm(x, r, w, 1e-6, out=poisoned(shape, dtype), residual_out=poisoned(shape, dtype))
    ref_y, ref_ro = reference.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(ro, ref_ro), "residual_out must be x + residual rounded like torch"
    assert_close_rel(y, reference.rms_norm(ref_ro.double(), w.double(), 1e-6), tol_for(dtype), "add_rms_norm")


def test_rms_norm_strided_rows(kernels: native.CpuKernels) -> None:
    base = random((4, 64), torch.float32, seed=5)
    x = base[:, :48]
    w = random((48,), torch.float32, seed=6)
    assert_close_rel(kernels.rms_norm(x, w, 1e-5), reference.rms_norm(x.double(), w.double(), 1e-5), 2e-6)


# ---------------------------------------------------------------------------------------------- RoPE + cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,t,hq,hkv,d,pos,s", [(2, 3, 8, 2, 64, 5, 16), (1, 1, 32, 32, 128, 4095, 4096),
                                                (1, 7, 4, 1, 16, 0, 7)])
def test_rope_cache_write(kernels: native.CpuKernels, dtype: torch.dtype, b: int, t: int, hq: int, hkv: int,
                          d: int, pos: int, s: int) -> None:
    # q, k, v as views of one fused projection, as a qkv matmul would produce them (strided over T).
    qkv = random((b, t, (hq + 2 * hkv) * d), dtype, seed=pos + t)
    q = qkv[..., : hq * d].view(b, t, hq, d)
    k = qkv[..., hq * d : (hq + hkv) * d].view(b, t, hkv, d)
    v = qkv[..., (hq + hkv) * d :].view(b, t, hkv, d)
    cos64, sin64 = rope_tables(s, d)
    cos, sin = cos64.float(), sin64.float()
    kc, vc = poisoned((b, hkv, s, d), dtype), poisoned((b, hkv, s, d), dtype)
    q_rot = kernels.rope_cache_write(q, k, v, cos, sin, pos, kc, vc, out=poisoned((b, t, hq, d), dtype))

    kc_ref, vc_ref = torch.zeros(b, hkv, s, d, dtype=torch.float64), torch.zeros(b, hkv, s, d, dtype=torch.float64)
    q_ref = reference.rope_cache_write(q.double(), k.double(), v.double(), cos, sin, pos, kc_ref, vc_ref)
    tol = tol_for(dtype)
    assert_close_rel(q_rot, q_ref, tol, "q_rot")
    written = slice(pos, pos + t)
    assert_close_rel(kc[:, :, written], kc_ref[:, :, written], tol, "k cache")
    assert torch.equal(vc[:, :, written], v.transpose(1, 2)), "v is copied as is"
    untouched = torch.ones(s, dtype=torch.bool)
    untouched[written] = False
    assert torch.isnan(kc[:, :, untouched]).all() and torch.isnan(vc[:, :, untouched]).all(), "stray cache write"


def test_rope_half_tables(kernels: native.CpuKernels) -> None:
    """cos/sin stored in the compute dtype (fp16) are read as such."""
    q, k, v = (random((1, 2, 4, 32), torch.float16, seed=i) for i in range(3))
    cos64, sin64 = rope_tables(8, 32)
    cos, sin = cos64.half(), sin64.half()
    kc, vc = poisoned((1, 4, 8, 32), torch.float16), poisoned((1, 4, 8, 32), torch.float16)
    got = kernels.rope_cache_write(q, k, v, cos, sin, 3, kc, vc)
    ref = reference.rope_cache_write(q.double(), k.double(), v.double(), cos.double(), sin.double(), 3,
                                     torch.zeros(1, 4, 8, 32, dtype=torch.float64),
                                     torch.zeros(1, 4, 8, 32, dtype=torch.float64))
    assert_close_rel(got, ref, tol_for(torch.float16))


def test_rope_rejects_positions_past_the_cache(kernels: native.CpuKernels) -> None:
    q = k = v = random((1, 2, 1, 8), torch.float32, seed=0)
    cos, sin = (t.float() for t in rope_tables(4, 8))
    with pytest.raises(ValueError, match="outside"):
        kernels.rope_cache_write(q, k, v, cos, sin, 3, torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8))


# ---------------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,hq,hkv,d,seq,s", [(2, 8, 2, 64, 37, 40), (1, 32, 32, 128, 1, 8),
                                              (1, 32, 8, 128, 3000, 3001), (3, 6, 3, 40, 129, 129)])
def test_decode_attention(kernels: native.CpuKernels, dtype: torch.dtype, b: int, hq: int, hkv: int, d: int,
                          seq: int, s: int) -> None:
    q = random((b, hq, d), dtype, seed=seq)
    kc, vc = poisoned((b, hkv, s, d), dtype), poisoned((b, hkv, s, d), dtype)
    kc[:, :, :seq] = random((b, hkv, seq, d), dtype, seed=1)
    vc[:, :, :seq] = random((b, hkv, seq, d), dtype, seed=2)
    scale = d ** -0.5
    y = kernels.decode_attention(q, kc, vc, seq, scale, out=poisoned((b, hq, d), dtype))
    ref = reference.decode_attention(q.double(), kc[:, :, :seq].double(), vc[:, :, :seq].double(), seq, scale)
    assert_close_rel(y, ref, tol_for(dtype), "decode_attention")


def test_decode_attention_strided_query(kernels: native.CpuKernels) -> None:
    """q[:, 0] of a [B, T, Hq, D] tensor, as the model passes it."""
    q4 = random((2, 3, 4, 16), torch.float32, seed=1)
    kc, vc = random((2, 2, 9, 16), torch.float32, seed=2), random((2, 2, 9, 16), torch.float32, seed=3)
    q = q4[:, 1]
    ref = reference.decode_attention(q.double(), kc.double(), vc.double(), 9, 0.25)
    assert_close_rel(kernels.decode_attention(q, kc, vc, 9, 0.25), ref, 2e-5)


@pytest.mark.parametrize("pos,length", [(0, 16), (9, 16), (15, 16)])
def test_position_tensor_variants(kernels: native.CpuKernels, pos: int, length: int) -> None:
    """rope_cache_write_at / decode_attention_at (graph decode) match reference.py's definitions."""
    q, k, v = (random((1, 1, 4, 32), torch.float32, seed=i) for i in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    cos, sin = (t.float() for t in rope_tables(16, 32))
    kc, vc = random((1, 2, 16, 32), torch.float32, seed=7), random((1, 2, 16, 32), torch.float32, seed=8)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    p = torch.tensor([pos])
    q_rot = kernels.rope_cache_write_at(q, k, v, cos, sin, p, kc, vc)
    q_ref = reference.rope_cache_write_at(q, k, v, cos, sin, p, kc_ref, vc_ref)
    assert_close_rel(q_rot, q_ref, 2e-6, "rope_cache_write_at")
    assert_close_rel(kc, kc_ref, 2e-6, "k cache")
    assert torch.equal(vc, vc_ref)
    got = kernels.decode_attention_at(q_rot[:, 0], kc, vc, p, length, 0.2, out=poisoned((1, 4, 32), torch.float32))
    assert_close_rel(got, reference.decode_attention_at(q_ref[:, 0], kc_ref, vc_ref, p, length, 0.2), 2e-5)


# ---------------------------------------------------------------------------------------------- SiLU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1001,), (3, 11008)])
def test_silu_mul(kernels: native.CpuKernels, dtype: torch.dtype, shape: Any) -> None:
    gate, up = random(shape, dtype, seed=1, scale=4.0), random(shape, dtype, seed=2)
    y = kernels.silu_mul(gate, up, out=poisoned(shape, dtype))
    assert_close_rel(y, reference.silu_mul(gate.double(), up.double()), tol_for(dtype), "silu_mul")


# ---------------------------------------------------------------------------------------------- dispatch


def test_ops_dispatch_cpu_tensors_to_the_native_kernels(kernels: native.CpuKernels,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every public op on CPU tensors reaches _ext_cpu once the CPU slot holds native kernels."""
    calls = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            fn = getattr(kernels.module, name)

            def wrapped(*args: Any) -> Any:
                calls.append(name)
                return fn(*args)

            return wrapped

    slot = native._Slot("cpu")
    slot.resolved, slot.kernels = True, native.CpuKernels(Counting())
    monkeypatch.setitem(native._SLOTS, "cpu", slot)
    w = make_gptq(64, 16, 32, seed=2)
    x = random((1, 64), torch.float32, seed=1)
    assert torch.equal(ops.gptq_matmul(x, w), kernels.gptq_matmul(x, w))
    ops.gptq_dequantize(w)
    ops.rms_norm(x, torch.ones(64), 1e-5)
    ops.add_rms_norm(x, x, torch.ones(64), 1e-5)
    ops.silu_mul(x, x)
    q = random((1, 1, 2, 8), torch.float32, seed=3)
    cos, sin = (t.float() for t in rope_tables(4, 8))
    kc, vc = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)
    ops.rope_cache_write(q, q, q, cos, sin, 0, kc, vc)
    ops.decode_attention(q[:, 0], kc, vc, 1, 0.3)
    ops.rope_cache_write_at(q, q, q, cos, sin, torch.tensor([1]), kc, vc)
    ops.decode_attention_at(q[:, 0], kc, vc, torch.tensor([1]), 4, 0.3)
    assert calls.count("rope_cache_write") == 2 and calls.count("decode_attention") == 2
    assert sorted(set(calls)) == sorted(
        ["gptq_gemv", "gptq_dequantize", "rms_norm", "silu_mul", "rope_cache_write", "decode_attention"]
    )


def test_ops_fall_back_to_reference_for_other_dtypes(kernels: native.CpuKernels) -> None:
    x = random((2, 16), torch.float64, seed=0)
    w = torch.ones(16, dtype=torch.float64)
    assert torch.equal(kernels.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
