"""The CUDA kernels of kobold_backend._ext_cuda against float64 oracles (reference.py on the CPU), outputs poisoned.

Run on a GPU machine after building the module: `pytest -m gpu tests/test_ext_cuda.py` (see
tools/device_ext_check.sh). Skipped where torch sees no CUDA device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kobold_backend import ops
from kobold_backend.doctor import doctor_report
from kobold_backend.ops import native, reference
from tests.ext_helpers import as_float64, assert_close_rel, gptq_oracle, make_gptq, poisoned, random, rope_tables

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

F16 = torch.float16
TOL = 4e-3  # one fp16 rounding of the output plus fp16 pair products / fp32 sums


@pytest.fixture(scope="module")
def kernels() -> native.CudaKernels:
    result = native.load("cuda", mode="auto")
    assert result.module is not None, f"the CUDA kernels could not be loaded or built: {result.reason}"
    return native.CudaKernels(result.module)


# ---------------------------------------------------------------------------------------------- GPTQ

GEMV_CASES = [
    # (K, N, group size, act-order, rows, bias)
    (4096, 4096, 128, False, 1, False),
    (11008, 4096, 128, True, 1, False),
    (4096, 11008, 32, True, 4, True),
    (4096, 4096, -1, False, 8, False),
    (11008, 4096, 128, False, 3, True),
    (5120, 13824, 128, True, 2, False),
    (1024, 36, 64, True, 5, False),  # one partial column tile
    (24, 8, 8, True, 1, True),
    (20, 12, 8, False, 2, False),  # K not a multiple of 8
    (64, 128256, 32, False, 1, False),  # many tiles, no split
    (4096, 4096, 128, False, 5, False),  # speculation's 5-row verification: 46 KB of x + the kernel's own 5 KB
]


@pytest.mark.parametrize("k,n,gs,act,m,bias", GEMV_CASES)
def test_gptq_gemv(kernels: native.CudaKernels, k: int, n: int, gs: int, act: bool, m: int, bias: bool) -> None:
    w = make_gptq(k, n, gs, act_order=act, dtype=F16, bias=bias, device="cuda", seed=k + n + m)
    x = random((m, k), F16, seed=m, device="cuda")
    out = poisoned((m, n), F16, "cuda")
    y = kernels.gptq_matmul(x, w, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_close_rel(y, gptq_oracle(x, w), TOL, f"gemv {k}x{n} g{gs} act={act} m={m}")
    again = kernels.gptq_matmul(x, w, out=poisoned((m, n), F16, "cuda"))
    assert torch.equal(y, again), "split-K results must not depend on block scheduling"
    for _, counters in kernels._workspaces.values():
        assert int(counters.count_nonzero()) == 0, "split-K counters must be left at zero"


WHOLE_K_CASES = [
    # (K, N, group size, act-order, rows, bias, x row stride - K): shapes the whole-K kernel takes
    (4096, 4096, 128, False, 1, False, 0),
    (11008, 4096, 128, True, 2, True, 0),
    (4096, 4100, 64, False, 8, True, 0),  # one partial 32-column tile
    (1024, 36, -1, True, 3, False, 0),
    (200, 44, 64, False, 5, False, 0),  # the last batch of 8 packed rows is partial
    (20, 12, 64, False, 2, True, 0),  # K not a multiple of 8: x staged element by element
    (4096, 12288, 128, False, 4, False, 4),  # x rows not 16-byte aligned: element by element too
    (4096, 4096, 128, False, 5, False, 0),  # dynamic shared memory under 48 KB, with the static arrays over it
]


@pytest.mark.parametrize("k,n,gs,act,m,bias,pad", WHOLE_K_CASES)
@pytest.mark.parametrize("variant", ["split-K", "whole-K", "whole-K-512", "whole-K-lean", "whole-K-lean-pdl"])
def test_gptq_gemv_each_kernel(kernels: native.CudaKernels, k: int, n: int, gs: int, act: bool, m: int, bias: bool,
                               pad: int, variant: str) -> None:
    """Each GEMV kernel forced on the same inputs: each matches the oracle, and repeats bit for bit."""
    from kobold_backend.ops.cuda_kernels import (
        GEMV_SPLIT_K,
        GEMV_WHOLE_K,
        GEMV_WHOLE_K_512,
        GEMV_WHOLE_K_LEAN,
        GEMV_WHOLE_K_LEAN_PDL,
    )

    code = {"split-K": GEMV_SPLIT_K, "whole-K": GEMV_WHOLE_K, "whole-K-512": GEMV_WHOLE_K_512,
            "whole-K-lean": GEMV_WHOLE_K_LEAN, "whole-K-lean-pdl": GEMV_WHOLE_K_LEAN_PDL}[variant]
    w = make_gptq(k, n, gs, act_order=act, dtype=F16, bias=bias, device="cuda", seed=k + n + m + pad)
    x = random((m, k + pad), F16, seed=m, device="cuda")[:, :k]
    if code == GEMV_WHOLE_K_512 and m > 2:
        with pytest.raises(ValueError, match="whole-K"):
            kernels.gptq_matmul(x, w, variant=code)
        return
    y = kernels.gptq_matmul(x, w, out=poisoned((m, n), F16, "cuda"), variant=code)
    assert_close_rel(y, gptq_oracle(x, w), TOL, f"{variant} {k}x{n} g{gs} act={act} m={m} pad={pad}")
    assert torch.equal(y, kernels.gptq_matmul(x, w, out=poisoned((m, n), F16, "cuda"), variant=code))


@pytest.mark.parametrize("lean", [False, True])
def test_gptq_gemv_whole_k_refuses_small_groups(kernels: native.CudaKernels, lean: bool) -> None:
    """A batch of 8 packed rows must lie in one group: group size 32 is refused, not computed wrong."""
    from kobold_backend.ops.cuda_kernels import GEMV_WHOLE_K, GEMV_WHOLE_K_LEAN

    w = make_gptq(4096, 4096, 32, dtype=F16, device="cuda", seed=3)
    x = random((1, 4096), F16, seed=3, device="cuda")
    with pytest.raises(ValueError, match="whole-K"):
        kernels.gptq_matmul(x, w, variant=GEMV_WHOLE_K_LEAN if lean else GEMV_WHOLE_K)


@pytest.mark.parametrize("k,n,act,m", [(4096, 4096, False, 1), (11008, 4096, True, 2), (4096, 12288, False, 8)])
def test_gptq_gemv_lean_large_inputs(kernels: native.CudaKernels, k: int, n: int, act: bool, m: int) -> None:
    """The lean kernel sums (q - zero) * x in fp16 before applying the scale, so those sums are ~1/scale larger
    than the other kernels' sums: with inputs up to ~2000 they overflow fp16 unless x is staged divided by a
    power of two, which the kernel does per block from max |x|. With several rows the first keeps small inputs, so
    one block holds rows of very different sizes."""
    from kobold_backend.ops.cuda_kernels import GEMV_WHOLE_K_LEAN

    w = make_gptq(k, n, 128, act_order=act, dtype=F16, device="cuda", seed=k + m)
    x = random((m, k), F16, seed=m, scale=500.0, device="cuda")
    if m > 1:
        x[0] = random((k,), F16, seed=m + 1, device="cuda")
    assert float(x.abs().max()) > 1500.0
    y = kernels.gptq_matmul(x, w, out=poisoned((m, n), F16, "cuda"), variant=GEMV_WHOLE_K_LEAN)
    want = gptq_oracle(x, w)
    for i in range(m):  # each row against its own scale: a row of small inputs must not lose them
        assert_close_rel(y[i:i + 1], want[i:i + 1], TOL, f"lean {k}x{n} act={act} m={m} row {i}")


@pytest.mark.parametrize("m,n,gs", [(129, 4096, 128), (300, 4096, 128), (1, 6, 8), (3, 64, 20), (12, 4100, 128)])
def test_gptq_matmul_dequant_path(kernels: native.CudaKernels, m: int, n: int, gs: int) -> None:
    """Prompt-sized inputs (past the tensor-core product's 128 rows), N % 4 != 0 and group sizes that are not
    multiples of 8, and 9..128 rows whose N is not a multiple of 64, dequantize + cuBLAS."""
    w = make_gptq(4096 if n > 64 else 160, n, gs, act_order=True, dtype=F16, bias=True, device="cuda", seed=m)
    x = random((m, w.in_features), F16, seed=m + 1, device="cuda")
    y = kernels.gptq_matmul(x, w, out=poisoned((m, n), F16, "cuda"))
    assert_close_rel(y, gptq_oracle(x, w), TOL, "dequant + matmul")


@pytest.mark.parametrize("k,n,gs", [(11008, 4096, 128), (4096, 11008, 32), (4096, 4096, -1), (20, 12, 3)])
def test_gptq_dequantize_bit_exact(kernels: native.CudaKernels, k: int, n: int, gs: int) -> None:
    w = make_gptq(k, n, gs, dtype=F16, device="cuda", seed=k)
    got = kernels.gptq_dequantize(w, out=poisoned((k, n), F16, "cuda"))
    assert torch.equal(got, reference.gptq_dequantize(w)), "dequantize differs from reference.py on the GPU"
    assert_close_rel(got, reference.gptq_dequantize(as_float64(w)), 1e-3)


# ---------------------------------------------------------------------------------------------- norms


@pytest.mark.parametrize("wdtype", [F16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4096), (3, 5, 4096), (7, 11), (2, 8192)])
def test_rms_norm(kernels: native.CudaKernels, wdtype: torch.dtype, shape: Any) -> None:
    x = random(shape, F16, seed=1, scale=3.0, device="cuda")
    w = (random(shape[-1:], torch.float32, seed=2).abs() + 0.5).to(wdtype).cuda()
    y = kernels.rms_norm(x, w, 1e-5, out=poisoned(shape, F16, "cuda"))
    assert_close_rel(y, reference.rms_norm(x.cpu().double(), w.cpu().double(), 1e-5), TOL, "rms_norm")


def test_add_rms_norm(kernels: native.CudaKernels) -> None:
    shape = (2, 3, 4096)
    x, r = random(shape, F16, seed=1, device="cuda"), random(shape, F16, seed=2, scale=4.0, device="cuda")
    w = random((4096,), F16, seed=3, device="cuda")
    y, ro = kernels.add_rms_norm(x, r, w, 1e-6, out=poisoned(shape, F16, "cuda"),
                                 residual_out=poisoned(shape, F16, "cuda"))
    assert torch.equal(ro, x + r), "residual_out must be the fp16 sum torch computes"
    assert_close_rel(y, reference.rms_norm((x + r).cpu().double(), w.cpu().double(), 1e-6), TOL, "add_rms_norm")


# ---------------------------------------------------------------------------------------------- RoPE + cache


@pytest.mark.parametrize("cos_dtype", [F16, torch.float32])
@pytest.mark.parametrize("b,t,hq,hkv,d,pos,s", [(1, 1, 32, 32, 128, 4000, 8192), (2, 5, 8, 2, 64, 3, 16),
                                                (1, 300, 32, 8, 128, 0, 512)])
def test_rope_cache_write(kernels: native.CudaKernels, cos_dtype: torch.dtype, b: int, t: int, hq: int, hkv: int,
                          d: int, pos: int, s: int) -> None:
    qkv = random((b, t, (hq + 2 * hkv) * d), F16, seed=t, device="cuda")
    q = qkv[..., : hq * d].view(b, t, hq, d)
    k = qkv[..., hq * d : (hq + hkv) * d].view(b, t, hkv, d)
    v = qkv[..., (hq + hkv) * d :].view(b, t, hkv, d)
    cos64, sin64 = rope_tables(s, d)
    cos, sin = cos64.to(cos_dtype).cuda(), sin64.to(cos_dtype).cuda()
    kc, vc = poisoned((b, hkv, s, d), F16, "cuda"), poisoned((b, hkv, s, d), F16, "cuda")
    q_rot = kernels.rope_cache_write(q, k, v, cos, sin, pos, kc, vc, out=poisoned((b, t, hq, d), F16, "cuda"))
    kc_ref = torch.zeros(b, hkv, s, d, dtype=torch.float64)
    vc_ref = torch.zeros(b, hkv, s, d, dtype=torch.float64)
    q_ref = reference.rope_cache_write(q.cpu().double(), k.cpu().double(), v.cpu().double(), cos.cpu().double(),
                                      sin.cpu().double(), pos, kc_ref, vc_ref)
    assert_close_rel(q_rot, q_ref, TOL, "q_rot")
    written = slice(pos, pos + t)
    assert_close_rel(kc[:, :, written], kc_ref[:, :, written], TOL, "k cache")
    assert torch.equal(vc[:, :, written], v.transpose(1, 2))
    untouched = torch.ones(s, dtype=torch.bool, device="cuda")
    untouched[written] = False
    assert torch.isnan(kc[:, :, untouched]).all() and torch.isnan(vc[:, :, untouched]).all(), "stray cache write"


# ---------------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("b,hq,hkv,d,seq,s", [
    (1, 32, 32, 128, 1, 64),
    (1, 32, 32, 128, 128, 4096),
    (1, 32, 32, 128, 4000, 4096),
    (1, 32, 32, 128, 8192, 8192),
    (1, 32, 8, 128, 8000, 8192),
    (2, 64, 8, 128, 3000, 3072),
    (1, 40, 4, 128, 777, 1024),  # 10 query heads per KV head: two head groups
    (3, 8, 8, 64, 513, 600),
    (1, 12, 4, 96, 1000, 1000),
    (1, 8, 2, 256, 2049, 4096),
])
def test_decode_attention(kernels: native.CudaKernels, b: int, hq: int, hkv: int, d: int, seq: int,
                          s: int) -> None:
    q = random((b, hq, d), F16, seed=seq, device="cuda")
    kc, vc = poisoned((b, hkv, s, d), F16, "cuda"), poisoned((b, hkv, s, d), F16, "cuda")
    kc[:, :, :seq] = random((b, hkv, seq, d), F16, seed=1, device="cuda")
    vc[:, :, :seq] = random((b, hkv, seq, d), F16, seed=2, device="cuda")
    scale = d ** -0.5
    y = kernels.decode_attention(q, kc, vc, seq, scale, out=poisoned((b, hq, d), F16, "cuda"))
    ref = reference.decode_attention(q.cpu().double(), kc[:, :, :seq].cpu().double(),
                                     vc[:, :, :seq].cpu().double(), seq, scale)
    assert_close_rel(y, ref, TOL, f"decode_attention seq={seq}")


@pytest.mark.parametrize("pos,length", [(0, 256), (255, 256), (1000, 4096), (4095, 4096), (5000, 8192)])
def test_position_tensor_variants(kernels: native.CudaKernels, pos: int, length: int) -> None:
    """rope_cache_write_at / decode_attention_at read the position on the device and mask what follows it."""
    s = 8192
    qkv = random((1, 1, 48 * 128), F16, seed=pos, device="cuda")
    q, k, v = qkv[..., :4096].view(1, 1, 32, 128), qkv[..., 4096:5120].view(1, 1, 8, 128), \
        qkv[..., 5120:].view(1, 1, 8, 128)
    cos64, sin64 = rope_tables(s, 128)
    cos, sin = cos64.half().cuda(), sin64.half().cuda()
    kc = random((1, 8, s, 128), F16, seed=1, device="cuda")
    vc = random((1, 8, s, 128), F16, seed=2, device="cuda")
    kc_ref, vc_ref = kc.clone(), vc.clone()
    p = torch.tensor([pos], device="cuda")
    q_rot = kernels.rope_cache_write_at(q, k, v, cos, sin, p, kc, vc, out=poisoned((1, 1, 32, 128), F16, "cuda"))
    q_ref = reference.rope_cache_write_at(q, k, v, cos, sin, p, kc_ref, vc_ref)
    assert_close_rel(q_rot, q_ref, TOL, "rope_cache_write_at")
    assert_close_rel(kc, kc_ref, TOL, "k cache")
    assert torch.equal(vc, vc_ref)
    got = kernels.decode_attention_at(q_rot[:, 0], kc, vc, p, length, 0.088, out=poisoned((1, 32, 128), F16, "cuda"))
    ref = reference.decode_attention(q_ref[:, 0].cpu().double(), kc_ref[:, :, : pos + 1].cpu().double(),
                                     vc_ref[:, :, : pos + 1].cpu().double(), pos + 1, 0.088)
    assert_close_rel(got, ref, TOL, "decode_attention_at")


def test_decode_attention_strided_query(kernels: native.CudaKernels) -> None:
    q4 = random((2, 3, 8, 128), F16, seed=1, device="cuda")
    kc, vc = random((2, 4, 300, 128), F16, seed=2, device="cuda"), random((2, 4, 300, 128), F16, seed=3, device="cuda")
    q = q4[:, 2]
    ref = reference.decode_attention(q.cpu().double(), kc.cpu().double(), vc.cpu().double(), 300, 0.088)
    assert_close_rel(kernels.decode_attention(q, kc, vc, 300, 0.088), ref, TOL)


# ---------------------------------------------------------------------------------------------- SiLU


@pytest.mark.parametrize("n,offset", [(11008, 0), (1001, 0), (4096, 1)])
def test_silu_mul(kernels: native.CudaKernels, n: int, offset: int) -> None:
    gate = random((n + offset,), F16, seed=1, scale=4.0, device="cuda")[offset:]
    up = random((n + offset,), F16, seed=2, device="cuda")[offset:]
    y = kernels.silu_mul(gate, up, out=poisoned((n,), F16, "cuda"))
    # torch's fp16 result, to within one fp16 rounding (exp implementations may differ in the last bit)
    torch.testing.assert_close(y, reference.silu_mul(gate, up), rtol=1e-3, atol=1e-3)
    assert_close_rel(y, reference.silu_mul(gate.cpu().double(), up.cpu().double()), TOL)


# ---------------------------------------------------------------------------------------------- dispatch, graphs


def test_ops_dispatch_cuda_fp16_to_native(kernels: native.CudaKernels) -> None:
    native.reset()
    assert native.cuda_kernels() is not None, native.status()["cuda"]
    w = make_gptq(4096, 4096, 128, dtype=F16, device="cuda", seed=5)
    x = random((1, 4096), F16, seed=6, device="cuda")
    assert torch.equal(ops.gptq_matmul(x, w), kernels.gptq_matmul(x, w))
    assert "CUDA kernels: " in doctor_report()


def test_gptq_gemv_lean_pdl_chain(kernels: native.CudaKernels) -> None:
    """Four GEMVs, each reading the previous one's output, launched with programmatic dependent launch: each
    must wait for its input although it starts its weight loads early. Eagerly and replayed from a CUDA graph,
    the chain must equal the same kernel launched plainly, bit for bit."""
    from kobold_backend.ops.cuda_kernels import GEMV_WHOLE_K_LEAN, GEMV_WHOLE_K_LEAN_PDL

    ws = [make_gptq(4096, 4096, 128, dtype=F16, device="cuda", seed=40 + i) for i in range(4)]
    x = random((1, 4096), F16, seed=44, device="cuda")
    ys = [torch.empty(1, 4096, dtype=F16, device="cuda") for _ in ws]

    def chain(variant: int) -> None:
        for i, w in enumerate(ws):
            kernels.gptq_matmul(x if i == 0 else ys[i - 1], w, out=ys[i], variant=variant)

    chain(GEMV_WHOLE_K_LEAN)
    want = [y.clone() for y in ys]
    assert_close_rel(want[0], gptq_oracle(x, ws[0]), TOL, "lean chain, first GEMV")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for y in ys:
            y.fill_(float("nan"))
        chain(GEMV_WHOLE_K_LEAN_PDL)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for i, (y, expected) in enumerate(zip(ys, want)):
        assert torch.equal(y, expected), f"eager PDL chain differs at GEMV {i}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        chain(GEMV_WHOLE_K_LEAN_PDL)
    for seed in (45, 46):
        x.copy_(random((1, 4096), F16, seed=seed, device="cuda"))
        chain(GEMV_WHOLE_K_LEAN)
        torch.cuda.synchronize()
        want = [y.clone() for y in ys]
        for y in ys:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (y, expected) in enumerate(zip(ys, want)):
            assert torch.equal(y, expected), f"graph PDL chain differs at GEMV {i} (seed {seed})"


def test_cuda_graph_capture_and_replay(kernels: native.CudaKernels) -> None:
    """GEMV (split-K workspace) and attention (split sequence) replay from a CUDA graph with new inputs."""
    w = make_gptq(11008, 4096, 128, act_order=True, dtype=F16, device="cuda", seed=7)
    x = random((1, 11008), F16, seed=8, device="cuda")
    q = random((1, 32, 128), F16, seed=9, device="cuda")
    kc, vc = random((1, 32, 4096, 128), F16, seed=10, device="cuda"), random((1, 32, 4096, 128), F16, seed=11,
                                                                             device="cuda")
    y, a = torch.empty(1, 4096, dtype=F16, device="cuda"), torch.empty(1, 32, 128, dtype=F16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.gptq_matmul(x, w, out=y)  # warm-up on the capture stream allocates its workspace
        kernels.decode_attention(q, kc, vc, 4000, 0.088, out=a)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kernels.gptq_matmul(x, w, out=y)
        kernels.decode_attention(q, kc, vc, 4000, 0.088, out=a)
    for seed in (20, 21):
        x.copy_(random((1, 11008), F16, seed=seed, device="cuda"))
        q.copy_(random((1, 32, 128), F16, seed=seed, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_rel(y, gptq_oracle(x, w), TOL, "graph gemv")
        ref = reference.decode_attention(q.cpu().double(), kc[:, :, :4000].cpu().double(),
                                         vc[:, :, :4000].cpu().double(), 4000, 0.088)
        assert_close_rel(a, ref, TOL, "graph attention")


def test_cuda_graph_decode_with_a_position_tensor(kernels: native.CudaKernels) -> None:
    """One captured RoPE + cache write + attention step replayed at several positions (the graph-decode path)."""
    s, length = 4096, 4096
    q, k, v = (random((1, 1, 32, 128), F16, seed=i, device="cuda") for i in range(3))
    cos64, sin64 = rope_tables(s, 128)
    cos, sin = cos64.half().cuda(), sin64.half().cuda()
    kc = random((1, 32, s, 128), F16, seed=5, device="cuda")
    vc = random((1, 32, s, 128), F16, seed=6, device="cuda")
    kc_ref, vc_ref = kc.clone(), vc.clone()
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    q_rot = torch.empty(1, 1, 32, 128, dtype=F16, device="cuda")
    a = torch.empty(1, 32, 128, dtype=F16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def step() -> None:
        kernels.rope_cache_write_at(q, k, v, cos, sin, pos, kc, vc, out=q_rot)
        kernels.decode_attention_at(q_rot[:, 0], kc, vc, pos, length, 0.088, out=a)

    with torch.cuda.stream(stream):
        step()  # the warm-up writes position 0; the oracle's cache gets the same write
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    reference.rope_cache_write_at(q, k, v, cos, sin, pos, kc_ref, vc_ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    for p in (7, 300, 3999):
        pos.fill_(p)
        for i, t in enumerate((q, k, v)):
            t.copy_(random((1, 1, 32, 128), F16, seed=10 * p + i, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        q_ref = reference.rope_cache_write_at(q, k, v, cos, sin, pos, kc_ref, vc_ref)
        assert torch.equal(vc, vc_ref)
        assert_close_rel(kc[:, :, p], kc_ref[:, :, p], TOL, "k cache")
        ref = reference.decode_attention(q_ref[:, 0].cpu().double(), kc_ref[:, :, : p + 1].cpu().double(),
                                         vc_ref[:, :, : p + 1].cpu().double(), p + 1, 0.088)
        assert_close_rel(a, ref, TOL, f"graph attention at {p}")
