"""The GGML block-format kernels (csrc/cpu/ggml_cpu.cpp, csrc/cuda/ggml.cu) against the torch dequantization of
kobold_backend/ops/ggml.py, which tests/test_ggml_blocks.py checks bit for bit against the `gguf` package.

CPU: the kernel's dequantization equals the torch one exactly, and its GEMV (1..8 rows) and prompt path equal a
float64 matmul on those weights within fp32 / output-dtype rounding, for every block type, odd row counts,
several blocks per row, with and without bias. GPU (`-m gpu`): the CUDA kernels against the same CPU oracle
within fp16 rounding, and a whole GGUF model decoding token by token on CUDA against the CPU. The integer GEMV
(csrc/cuda/ggml_q8.cu, `ggml_kernel = "q8"`) is checked against the oracle fed the activations quantized by its
written rule (`q8_activations`) within fp16 rounding, and against the plain oracle within int8 rounding, for
every block type on every row length of the 7B/8B/13B/70B matrices, 1..8 rows, blocks-per-row counts that are
not multiples of 256 elements where the format allows, graph replay equal to eager bit for bit. Q4_0 / Q8_0 /
Q6_K re-laid out at load for it (ops/ggml.py `repack`) give the stored blocks' result bit for bit, and a GGUF model
loaded for the integer GEMV holds them re-laid out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch

from kobold_backend import ops
from kobold_backend.bench.checkpoint import Shape
from kobold_backend.bench.gguf_checkpoint import q4_k_m_types, use_more_bits, write_synthetic_gguf
from kobold_backend.ops import native
from kobold_backend.ops.ggml import GGML_TYPES, KERNEL_TYPES, REPACKED, TYPE_IDS, GGMLWeight, ggml_dequantize
from tests.fixtures.ggml_quant import quantize_rows
from tests.fixtures.int8_activations import q8_activations

# Byte offsets of each block type's fp16 fields (kept finite when blocks are random bytes).
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
CPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative error of one rounding to the output dtype plus fp32 sums over a few thousand products.
REL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_weight(type_name: str, n: int, k: int, seed: int, random_bytes: bool = False, bias: bool = False,
                device: str = "cpu", bias_dtype: torch.dtype = torch.float32) -> GGMLWeight:
    """A [n, k] layer: quantized from random weights by the tests' quantizer, or random blocks (every quant bit
    pattern) with finite fp16 scale fields."""
    rng = np.random.default_rng(seed)
    _, block, size = GGML_TYPES[TYPE_IDS[type_name]]
    if random_bytes:
        blocks = rng.integers(0, 256, size=(n * (k // block), size), dtype=np.uint8)
        for off in F16_FIELDS[type_name]:
            blocks[:, off:off + 2] = rng.uniform(-0.05, 0.05, size=(blocks.shape[0], 1)).astype(np.float16).view(
                np.uint8)
        data = blocks.reshape(n, -1)
    else:
        data = quantize_rows(rng.standard_normal((n, k)).astype(np.float32) * 0.05, type_name)
    b = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.1).to(bias_dtype) if bias else None
    return GGMLWeight(torch.from_numpy(np.ascontiguousarray(data)).to(device), type_name, k, n,
                      bias=None if b is None else b.to(device))


def oracle(x: torch.Tensor, w: GGMLWeight) -> torch.Tensor:
    """float64 x @ dequant(w).T + bias on the CPU."""
    y = x.cpu().double() @ ggml_dequantize(_cpu(w)).double().t()
    return y if w.bias is None else y + w.bias.cpu().double()


def _cpu(w: GGMLWeight) -> GGMLWeight:
    return GGMLWeight(w.data.cpu(), w.type_name, w.in_features, w.out_features,
                      None if w.bias is None else w.bias.cpu())


def assert_rel(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = ((got.double().cpu() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)).max().item()
    assert torch.isfinite(got).all(), what
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"


def rows_of(type_name: str, blocks: int) -> int:
    return GGML_TYPES[TYPE_IDS[type_name]][1] * blocks


@pytest.fixture(scope="module")
def cpu() -> native.CpuKernels:
    result = native.load("cpu", mode="auto")
    assert result.module is not None, f"the CPU kernels could not be loaded or built: {result.reason}"
    return native.CpuKernels(result.module)


# ---------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("random_bytes", [False, True])
@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_cpu_dequantize_equals_torch(cpu: native.CpuKernels, type_name: str, random_bytes: bool) -> None:
    w = make_weight(type_name, 13, rows_of(type_name, 3), seed=TYPE_IDS[type_name], random_bytes=random_bytes)
    ref = ggml_dequantize(w)
    torch.testing.assert_close(cpu.ggml_dequantize(w), ref, rtol=0, atol=0)
    torch.testing.assert_close(cpu.ggml_dequantize(w, torch.float16), ref.half(), rtol=0, atol=0)
    torch.testing.assert_close(cpu.ggml_dequantize(w, torch.bfloat16), ref.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_cpu_gemv_every_row_count(cpu: native.CpuKernels, type_name: str, dtype: torch.dtype) -> None:
    k = rows_of(type_name, 5)
    w = make_weight(type_name, 37, k, seed=3 + TYPE_IDS[type_name], bias=True, bias_dtype=dtype)
    for m in range(1, 9):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        y = cpu.ggml_matmul(x, w)
        assert y.dtype == dtype and tuple(y.shape) == (m, 37)
        assert_rel(y, oracle(x, w), REL_TOL[dtype], f"{type_name} {dtype} rows={m}")


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_cpu_prompt_path_and_strided_rows(cpu: native.CpuKernels, type_name: str) -> None:
    """More rows than the GEMV takes go through the kernel's dequantization and one matmul; a row view with a
    stride wider than K is read through its stride."""
    k = rows_of(type_name, 2)
    w = make_weight(type_name, 19, k, seed=40 + TYPE_IDS[type_name], random_bytes=True)
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(5))
    assert_rel(cpu.ggml_matmul(x, w), oracle(x, w), 2e-5, f"{type_name} 21 rows")
    wide = torch.randn(3, k + 40, generator=torch.Generator().manual_seed(6))[:, 8:8 + k]
    assert wide.stride(0) == k + 40
    assert_rel(cpu.ggml_matmul(wide, w), oracle(wide, w), 2e-5, f"{type_name} strided rows")


def test_ops_dispatch_uses_the_kernels_and_falls_back_without_them(cpu: native.CpuKernels,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    w = make_weight("Q4_K", 9, 512, seed=1, bias=True)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2))
    calls = []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(cpu.module, name)

    monkeypatch.setattr(native, "cpu_kernels", lambda: native.CpuKernels(Spy()))
    assert_rel(ops.ggml_matmul(x, w), oracle(x, w), 2e-5, "dispatched")
    assert "ggml_gemv" in calls

    monkeypatch.setattr(native, "cpu_kernels", lambda: None)  # no native module (KOBOLD_BACKEND_EXT=torch)
    assert_rel(ops.ggml_matmul(x, w), oracle(x, w), 2e-5, "torch fallback")


def test_doctor_names_the_ggml_path(cpu: native.CpuKernels) -> None:
    from kobold_backend.doctor import doctor_report

    lines = doctor_report().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("CPU kernels: "))
    ggml_line = next(line for line in lines[at:] if "GGML block kernels" in line)
    assert ggml_line.endswith(": native") and "Q4_K" in ggml_line


def test_cpu_kernel_refuses_a_type_it_does_not_know(cpu: native.CpuKernels) -> None:
    with pytest.raises(ValueError, match="unsupported block type 99"):
        cpu._call("ggml_dequantize", type=99, w=0, row_bytes=0, n=1, k=32, out=0, out_dtype=0)


def test_ggml_kernel_setting_names_a_known_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    from kobold_backend.ops import cuda_kernels

    assert cuda_kernels.CudaKernels(object()).ggml_kernel == cuda_kernels.DEFAULT_GGML_KERNEL
    monkeypatch.setattr(cuda_kernels, "DEFAULT_GGML_KERNEL", "q4")
    with pytest.raises(ValueError, match="KOBOLD_BACKEND_GGML_KERNEL must be one of classic, q8, q8-pdl, not 'q4'"):
        cuda_kernels.CudaKernels(object())


# ---------------------------------------------------------------------------------------------- bench file


def test_synthetic_gguf_loads_with_the_q4_k_m_types(tmp_path: Path) -> None:
    from kobold_backend.engine.loader import load_model

    shape = Shape(256, 512, 8, 4, 2, 300)
    path = write_synthetic_gguf(tmp_path / "m.gguf", shape)
    lm = load_model(path, device="cpu", with_tokenizer=False, max_seq_len=32)
    more = [i for i in range(8) if use_more_bits(i, 8)]
    assert more == [0, 3, 6, 7]  # the first and last eighth, and (i - layers // 8) % 3 == 2
    for i, layer in enumerate(lm.model.layers):
        down: Optional[GGMLWeight] = layer.down_proj
        assert isinstance(down, GGMLWeight) and down.type_name == ("Q6_K" if i in more else "Q4_K")
    types = {name: kind for name, _, kind in q4_k_m_types(shape)}
    assert types["output.weight"] == "Q6_K" and types["blk.1.attn_v.weight"] == "Q4_K"
    logits = lm.model.forward(torch.tensor([[1, 5, 9]]), lm.model.new_cache())
    assert torch.isfinite(logits).all()


def test_bench_runs_on_a_gguf_file(tmp_path: Path) -> None:
    import json

    from kobold_backend.cli.main import main

    path = write_synthetic_gguf(tmp_path / "m.gguf", Shape(256, 512, 2, 4, 2, 300))
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(path), "--device", "cpu", "--quick", "--json", str(out)]) == 0
    ours = json.loads(out.read_text())["kobold_backend"]
    decode = ours["decode_tokens_per_s"]
    assert set(decode) == {"16", "100"} and all(v > 0 for v in decode.values())


def test_bench_gguf_flag_errors_are_one_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    import sys

    from kobold_backend.cli.main import main

    assert main(["bench", "--format", "gguf", "--preset", "qwen2.5-7b", "--device", "cpu"]) == 1
    assert "--format gguf writes llama-shaped files; preset qwen2.5-7b is qwen2" in caplog.text
    assert main(["bench", "--format", "gguf", "--model", str(tmp_path), "--device", "cpu"]) == 1
    assert "drop it to bench --model" in caplog.text
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    assert main(["bench", "--format", "gguf", "--preset", "llama2-7b", "--device", "cpu"]) == 1
    assert "llama.cpp's `gguf` package, which is not installed here" in caplog.text


# ---------------------------------------------------------------------------------------------- CUDA

@pytest.fixture(scope="module")
def cuda() -> native.CudaKernels:
    result = native.load("cuda", mode="auto")
    assert result.module is not None, f"the CUDA kernels could not be loaded or built: {result.reason}"
    return native.CudaKernels(result.module)


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
@pytest.mark.parametrize("shape", [(4096, 1024), (11008, 512), (512, 37)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernels_match_the_cpu_oracle(cuda: native.CudaKernels, type_name: str, shape: tuple) -> None:
    k, n = shape
    k = k // GGML_TYPES[TYPE_IDS[type_name]][1] * GGML_TYPES[TYPE_IDS[type_name]][1]
    w = make_weight(type_name, n, k, seed=n + TYPE_IDS[type_name], random_bytes=True, bias=n == 37,
                    device="cuda", bias_dtype=torch.float16)
    ref = ggml_dequantize(_cpu(w))
    torch.testing.assert_close(cuda.ggml_dequantize(w).cpu(), ref.half(), rtol=0, atol=0)
    for m in (1, 2, 3, 5, 8, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half()
        y = cuda.ggml_matmul(x.cuda(), w)
        assert y.dtype == torch.float16 and y.is_cuda and tuple(y.shape) == (m, n)
        int8 = cuda.ggml_kernel != "classic" and m <= 8  # the integer GEMV rounds the activations its way
        assert_rel(y, oracle(q8_activations(x) if int8 else x, w), 4e-3, f"{type_name} {k}x{n} rows={m}")
    wide = torch.randn(2, k + 8, generator=torch.Generator().manual_seed(9)).half().cuda()[:, 4:4 + k]
    int8 = cuda.ggml_kernel != "classic"
    want = oracle(q8_activations(wide.cpu()) if int8 else wide, w)
    assert_rel(cuda.ggml_matmul(wide, w), want, 4e-3, f"{type_name} misaligned rows")


# Row lengths K of the Llama/Mistral 7B, Llama-3 8B, Llama-2 13B and 70B matrices (hidden, MLP) and short rows.
Q8_ROW_LENGTHS = [4096, 11008, 14336, 5120, 13824, 8192, 28672, 256, 768]


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_q8_gemv_matches_the_oracle(cuda: native.CudaKernels, type_name: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda, "ggml_kernel", "q8")
    block = GGML_TYPES[TYPE_IDS[type_name]][1]
    lengths = Q8_ROW_LENGTHS + ([32 * 13, 32 * 3] if block == 32 else [])  # K % 256 != 0 where allowed
    for i, k in enumerate(lengths):
        n = 67 if i % 2 else 40  # 67: a block of four warps only partly used
        w = make_weight(type_name, n, k, seed=7 * i + TYPE_IDS[type_name], random_bytes=i % 3 != 0, bias=i % 2 == 1,
                        device="cuda", bias_dtype=torch.float16)
        for m in range(1, 9):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + i)).half()
            x[0, :16] = 0  # an all-zero group (d = 0)
            y = cuda.ggml_matmul(x.cuda(), w)
            assert y.dtype == torch.float16 and tuple(y.shape) == (m, n)
            assert_rel(y, oracle(q8_activations(x), w), 4e-3, f"q8 {type_name} K={k} N={n} rows={m}")
            assert_rel(y, oracle(x, w), 3e-2, f"q8 {type_name} K={k} rows={m} vs fp16 activations")
    wide = torch.randn(2, 768 + 8, generator=torch.Generator().manual_seed(9)).half().cuda()[:, 8:8 + 768]
    w = make_weight(type_name, 33, 768, seed=5, random_bytes=True, device="cuda")
    assert_rel(cuda.ggml_matmul(wide, w), oracle(q8_activations(wide), w), 4e-3, f"q8 {type_name} strided rows")


@pytest.mark.parametrize("kernel", ["q8", "q8-pdl"])
@pytest.mark.parametrize("type_name", sorted(REPACKED))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_repacked_gemv_equals_the_stored_blocks_gemv(cuda: native.CudaKernels, type_name: str, kernel: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_0 / Q8_0 / Q6_K re-laid out when placed (`Repacked<T>`, 16-byte loads): the GEMV gives the stored
    blocks' GEMV's result bit for bit (same steps, same arithmetic) on every row length of the 7B..70B matrices
    and odd block counts, 1..8 rows, within int8 rounding of the oracle; more rows (the prompt path) and the
    dequantization go through the file layout and equal the stored weight's."""
    monkeypatch.setattr(cuda, "ggml_kernel", kernel)
    block = GGML_TYPES[TYPE_IDS[type_name]][1]
    lengths = Q8_ROW_LENGTHS + ([32 * 13, 32 * 3] if block == 32 else [256 * 3])
    for i, k in enumerate(lengths):
        n = 67 if i % 2 else 40
        w = make_weight(type_name, n, k, seed=5 * i + TYPE_IDS[type_name], random_bytes=i % 3 != 0,
                        bias=i % 2 == 1, device="cuda", bias_dtype=torch.float16)
        r = cuda.ggml_place(w)
        assert r.type_name == REPACKED[type_name] and r.data.shape[1] % 16 == 0 and r.data.data_ptr() % 16 == 0
        for m in range(1, 9):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + i)).half().cuda()
            x[0, :16] = 0
            y = cuda.ggml_matmul(x, r)
            assert torch.equal(y, cuda.ggml_matmul(x, w)), f"{kernel} {type_name} K={k} rows={m}"
            assert_rel(y, oracle(q8_activations(x), w), 4e-3, f"repacked {type_name} K={k} N={n} rows={m}")
        x = torch.randn(12, k, generator=torch.Generator().manual_seed(i)).half().cuda()
        assert torch.equal(cuda.ggml_matmul(x, r), cuda.ggml_matmul(x, w)), f"{type_name} K={k} 12 rows"
        assert torch.equal(cuda.ggml_dequantize(r), cuda.ggml_dequantize(w))
        half = GGMLWeight(r.data[n // 2:], r.type_name, k, n - n // 2,  # a row slice (split fused projections)
                          None if r.bias is None else r.bias[n // 2:])
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).half().cuda()
        assert torch.equal(cuda.ggml_matmul(x, half), cuda.ggml_matmul(x, w)[:, n // 2:])
    monkeypatch.setattr(cuda, "ggml_kernel", "classic")
    w = make_weight(type_name, 8, 512, seed=1, device="cuda")
    assert cuda.ggml_place(w) is w  # the classic GEMV reads the file's blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_q8_gemv_wide_grid_and_unaligned_k_blocks(cuda: native.CudaKernels,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An output dimension of a vocabulary (32000 features) and a Q4_K row 8 bytes off a 16-byte boundary (which
    the integer GEMV cannot load 16 bytes at a time, so the classic kernel serves it)."""
    monkeypatch.setattr(cuda, "ggml_kernel", "q8")
    w = make_weight("Q6_K", 32000, 256, seed=2, random_bytes=True, device="cuda")
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(3)).half()
    assert_rel(cuda.ggml_matmul(x.cuda(), w), oracle(q8_activations(x), w), 4e-3, "q8 Q6_K 256x32000")
    w = make_weight("Q4_K", 5, 512, seed=4, random_bytes=True)
    flat = torch.zeros(w.data.numel() + 8, dtype=torch.uint8, device="cuda")
    shifted = flat[8:].view(5, -1)
    shifted.copy_(w.data)
    w8 = GGMLWeight(shifted, "Q4_K", 512, 5)
    assert w8.data.data_ptr() % 16 == 8
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(5)).half()
    assert_rel(cuda.ggml_matmul(x.cuda(), w8), oracle(x, w), 4e-3, "Q4_K at an 8-byte offset")


@pytest.mark.parametrize("kernel", ["classic", "q8", "q8-pdl", "q8-pdl repacked"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ggml_graph_replay_equals_eager(cuda: native.CudaKernels, kernel: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda, "ggml_kernel", kernel.split()[0])
    for type_name in ("Q4_K", "Q6_K", "Q8_0", "Q4_0"):
        w = make_weight(type_name, 300, 4096, seed=11, random_bytes=True, device="cuda")
        if kernel.endswith("repacked"):
            w = cuda.ggml_place(w)
        x = torch.randn(3, 4096, device="cuda").half()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            cuda.ggml_matmul(x, w)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = cuda.ggml_matmul(x, w)
        for seed in range(3):
            x.copy_(torch.randn(3, 4096, generator=torch.Generator().manual_seed(seed)).half().cuda())
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, cuda.ggml_matmul(x, w)), f"{kernel} {type_name} replay {seed}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_q8_pdl_chain_equals_the_plain_launch(cuda: native.CudaKernels,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Four GEMVs chained through their outputs (each quantizes the previous one's output, the programmatic
    launch waits for that), eagerly and replayed from a CUDA graph: bit for bit the plain launches' result."""
    types = ("Q4_K", "Q6_K", "Q8_0", "Q5_K")
    ws = [make_weight(t, 2048, 2048, seed=20 + i, device="cuda") for i, t in enumerate(types)]
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(1)).half().cuda()

    def chain() -> torch.Tensor:
        y = x
        for w in ws:
            y = cuda.ggml_matmul(y, w) * 0.5
        return y

    monkeypatch.setattr(cuda, "ggml_kernel", "q8")
    want = chain()
    monkeypatch.setattr(cuda, "ggml_kernel", "q8-pdl")
    assert torch.equal(chain(), want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("kernel", ["classic", "q8", "q8-pdl"])
@pytest.mark.parametrize("plan", ["Q4_K_M", "legacy"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gguf_decode_matches_cpu(plan: str, kernel: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF model decoding one token at a time (the GEMV path) on CUDA in fp16 gives the CPU float32 logits
    within fp16 accuracy (int8 activations: three times that) at every step, and the same greedy token wherever
    the CPU's top two are not a near tie."""
    from kobold_backend.engine.loader import load_model
    from tests.fixtures.checkpoints import build_checkpoint
    from tests.fixtures.gguf_files import write_gguf
    from tests.test_gguf_model import PLANS, SPM_SPEC

    kern = native.cuda_kernels()
    assert kern is not None
    monkeypatch.setattr(kern, "ggml_kernel", kernel)
    tol = 1e-2 if kernel == "classic" else 3e-2
    hf = build_checkpoint(SPM_SPEC, tmp_path / "hf").path
    write_gguf(hf, tmp_path / "g", PLANS[plan])
    cpu_lm = load_model(tmp_path / "g" / "model.gguf", device="cpu")
    gpu_lm = load_model(tmp_path / "g" / "model.gguf", device="cuda", dtype="float16")
    assert gpu_lm.model.layers[0].down_proj.data.is_cuda
    placed = [w for layer in gpu_lm.model.layers for w in vars(layer).values() if isinstance(w, GGMLWeight)]
    # the integer GEMV's instances read Q4_0 / Q8_0 / Q6_K re-laid out (ops/ggml.py repack), the classic one not
    assert placed and not any(w.type_name in (REPACKED if kernel != "classic" else REPACKED.values())
                              for w in placed)
    cpu_cache, gpu_cache = cpu_lm.model.new_cache(64), gpu_lm.model.new_cache(64)
    prompt = torch.tensor([[1, 15, 300, 7, 42]])
    a = cpu_lm.model.forward(prompt, cpu_cache)[0, -1]
    b = gpu_lm.model.forward(prompt.cuda(), gpu_cache)[0, -1].float().cpu()
    for step in range(16):
        assert ((a - b).norm() / a.norm()).item() < tol, f"step {step}"
        top = torch.topk(a, 2).values
        token = int(torch.argmax(a))
        if (top[0] - top[1]).item() > tol * a.abs().max().item():
            assert token == int(torch.argmax(b)), f"step {step}"
        a = cpu_lm.model.forward(torch.tensor([[token]]), cpu_cache)[0, -1]
        b = gpu_lm.model.forward(torch.tensor([[token]], device="cuda"), gpu_cache)[0, -1].float().cpu()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gemv_replays_from_a_cuda_graph(cuda: native.CudaKernels) -> None:
    """Graph decode captures the GEMV: it runs on the capturing stream and a replay reads the new input."""
    w = make_weight("Q4_K", 256, 1024, seed=3, random_bytes=True, device="cuda")
    x = torch.randn(1, 1024, device="cuda").half()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cuda.ggml_matmul(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cuda.ggml_matmul(x, w)
    x.copy_(torch.randn(1, 1024, device="cuda").half())
    graph.replay()
    torch.cuda.synchronize()
    int8 = cuda.ggml_kernel != "classic"  # the integer GEMV rounds the activations its way
    assert_rel(y, oracle(q8_activations(x.cpu()) if int8 else x, w), 4e-3, "graph replay")
