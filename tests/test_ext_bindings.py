"""The kernel wrappers call each compiled kernel by parameter name (ops/marshal.call); the names and their order
must be the binding's own. Oracle: the lambda parameter lists in csrc/*/module_*.cpp, read from the source."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from kobold_backend.engine.exl2 import load_exl2_linear
from kobold_backend.engine.weights import WeightReader
from kobold_backend.ops.cpu_kernels import CPU_SIGNATURES, CpuKernels
from kobold_backend.ops.cuda_kernels import CUDA_SIGNATURES, CudaKernels
from kobold_backend.ops.exl2_weight import EXL2Weight
from kobold_backend.ops.ggml import GGMLWeight, row_bytes
from kobold_backend.ops.kv_quant import QuantizedKV
from kobold_backend.ops.marshal import call
from tests.ext_helpers import make_gptq, random, rope_tables

EXL2_DATA = Path(__file__).resolve().parent / "data" / "exl2" / "exl2-4.0"


def exl2_linear() -> EXL2Weight:
    """One linear of the exllamav2-made fixture (tests/test_exl2.py), fp16 bias-free, its words in fresh (aligned)
    memory as on a GPU."""
    with WeightReader(EXL2_DATA) as reader:
        w = load_exl2_linear(reader, "model.layers.0.self_attn.q_proj", 256, 256, torch.float16, "cpu")
    w.q_weight = w.q_weight.clone()
    return w

CSRC = Path(__file__).resolve().parent.parent / "csrc"
BINDING = re.compile(r'm\.def\(\s*"(\w+)",\s*\[\]\(([^)]*)\)', re.S)


def bound_parameters(source: Path) -> Dict[str, Tuple[str, ...]]:
    """kernel name -> the parameter names of its pybind11 lambda, in order."""
    out: Dict[str, Tuple[str, ...]] = {}
    for name, params in BINDING.findall(source.read_text(encoding="utf-8")):
        out[name] = tuple(p.split()[-1] for p in params.split(",") if p.strip())
    return out


@pytest.mark.parametrize("source, table", [("cpu/module_cpu.cpp", CPU_SIGNATURES),
                                           ("cuda/module_cuda.cpp", CUDA_SIGNATURES)])
def test_signature_tables_match_the_bindings(source: str, table: Dict[str, Tuple[str, ...]]) -> None:
    bound = bound_parameters(CSRC / source)
    assert set(table) <= set(bound)
    for kernel, names in table.items():
        assert names == bound[kernel], kernel


def test_call_orders_named_arguments_and_refuses_wrong_names() -> None:
    seen: List[Tuple[int, ...]] = []

    class Module:
        def kern(self, *args: int) -> None:
            seen.append(args)

    table = {"kern": ("a", "b", "c")}
    call(Module(), "kern", table, c=3, a=1, b=2)
    assert seen == [(1, 2, 3)]
    with pytest.raises(TypeError, match="needs the argument 'b'"):
        call(Module(), "kern", table, a=1, c=3)
    with pytest.raises(TypeError, match="takes no argument 'd'"):
        call(Module(), "kern", table, a=1, b=2, c=3, d=4)


class Recorder:
    """A stand-in for a compiled module: records each kernel's positional arguments by the binding's names."""

    def __init__(self, signatures: Dict[str, Tuple[str, ...]]) -> None:
        self.signatures = signatures
        self.calls: Dict[str, Dict[str, Any]] = {}

    def __getattr__(self, kernel: str) -> Any:
        if kernel not in self.signatures:  # a module attribute it does not declare
            raise AttributeError(kernel)

        def record(*args: Any) -> None:
            names = self.signatures[kernel]
            assert len(args) == len(names), kernel
            self.calls.setdefault(kernel, dict(zip(names, args)))

        return record


def test_cuda_wrappers_name_every_argument_of_their_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CudaKernels op reaches its kernel with the binding's arguments (run on CPU fp16 tensors with the
    stream and workspace stubbed, since no GPU is needed to check the marshalling)."""
    module = Recorder(CUDA_SIGNATURES)
    k = CudaKernels(module)
    monkeypatch.setattr(k, "_stream", lambda device: 77)
    monkeypatch.setattr(k, "_workspace", lambda device, stream: (1, 2, 3, 4))
    half = torch.float16
    x = random((2, 64), half, seed=0)
    w = make_gptq(64, 32, 32, seed=1, dtype=half)
    k.rms_norm(x, torch.ones(64, dtype=half), 1e-5)
    k.gptq_matmul(x, w)
    monkeypatch.setattr(k, "_sms", {0: 132})
    w64 = make_gptq(128, 64, 32, seed=8, dtype=half)
    k.gptq_matmul(random((12, 128), half, seed=9), w64)  # 9..128 rows: the tensor-core product
    k.gptq_dequantize(w)
    q = random((1, 3, 4, 8), half, seed=2)
    kv = random((1, 3, 2, 8), half, seed=3)
    cos, sin = (t.to(half) for t in rope_tables(16, 8))
    kc, vc = torch.zeros(1, 2, 16, 8, dtype=half), torch.zeros(1, 2, 16, 8, dtype=half)
    k.rope_cache_write(q, kv, kv, cos, sin, 5, kc, vc)
    k.decode_attention(q[:, 0], kc, vc, 9, 0.25)
    k.silu_mul(x, x)
    ew = exl2_linear()
    k.exl2_matmul(random((2, ew.in_features), half, seed=4), ew)
    k.exl2_dequantize(ew)
    gw = GGMLWeight(torch.zeros(32, row_bytes("Q8_0", 64), dtype=torch.uint8), "Q8_0", 64, 32)
    k.ggml_kernel = "classic"
    k.ggml_matmul(x, gw)
    k.ggml_kernel = "q8-pdl"
    k.ggml_matmul(x, gw)
    k.ggml_dequantize(gw)
    kq = QuantizedKV.empty((1, 2, 16, 32), 4, half, "cpu")
    vq = QuantizedKV.empty((1, 2, 16, 32), 8, half, "cpu")
    k.kvq_decode_attention(random((1, 4, 32), half, seed=4), kq, vq, 9, None, 0.25)
    cos32, sin32 = (t.to(half) for t in rope_tables(16, 32))
    k.kvq_rope_write(random((1, 1, 4, 32), half, seed=5), random((1, 1, 2, 32), half, seed=6),
                     random((1, 1, 2, 32), half, seed=7), cos32, sin32, 0, torch.tensor([3]), kq, vq)
    assert sorted(module.calls) == sorted(CUDA_SIGNATURES)
    c = module.calls
    q8 = c["ggml_gemv_q8"]
    assert (q8["rows"], q8["k"], q8["n"], q8["pdl"], q8["type"]) == (2, 64, 32, True, 8) and q8["scratch"] != 0
    assert (c["rms_norm"]["rows"], c["rms_norm"]["d"], c["rms_norm"]["eps"]) == (2, 64, pytest.approx(1e-5))
    assert c["rms_norm"]["residual"] == 0 and c["rms_norm"]["stream"] == 77
    mma = c["gptq_mma"]
    assert (mma["rows"], mma["k"], mma["n"], mma["group_size"], mma["groups"], mma["splits"]) == (12, 128, 64, 32, 4, 2)
    gemv = c["gptq_gemv"]
    assert (gemv["rows"], gemv["k"], gemv["n"], gemv["group_size"], gemv["groups"]) == (2, 64, 32, 32, 2)
    assert gemv["qweight"] == w.qweight.data_ptr() and gemv["ws"] == (1, 2, 3, 4)
    rope = c["rope_cache_write"]
    assert (rope["b"], rope["t"], rope["hq"], rope["hkv"], rope["d"], rope["pos"], rope["max_pos"]) == \
        (1, 3, 4, 2, 8, 5, 16)
    assert rope["kcs"] == kc.stride()[:3] and rope["pos_dev"] == 0
    att = c["decode_attention"]
    assert (att["hq"], att["hkv"], att["seq_len"], att["scale"], att["pos_dev"]) == (4, 2, 9, 0.25, 0)
    assert c["silu_mul"]["n"] == x.numel()
    eg = c["exl2_gemv"]
    assert (eg["rows"], eg["k"], eg["n"], eg["n_stored"]) == (2, 256, 256, 256)
    assert eg["chunks"] == ew.chunks.data_ptr() and eg["perm"] == ew.perm.data_ptr() and eg["ws"] == (1, 2, 3, 4)
    assert c["exl2_dequantize"]["q_scale_max"] == ew.q_scale_max.data_ptr()
    assert (c["ggml_gemv"]["type"], c["ggml_gemv"]["rows"], c["ggml_gemv"]["row_bytes"]) == (8, 2, 68)
    assert c["ggml_dequantize"]["w"] == gw.data.data_ptr()
    kvq = c["kvq_decode_attention"]
    assert (kvq["hq"], kvq["hkv"], kvq["d"], kvq["k_bits"], kvq["v_bits"], kvq["seq_len"], kvq["pos_dev"]) == \
        (4, 2, 32, 4, 8, 9, 0)
    assert kvq["kd"] == kq.data.data_ptr() and kvq["vss"] == vq.scales.stride()[:3] and kvq["ws"] == (1, 2, 3, 4)
    assert (kvq["q_f16"], kvq["out_f16"], kvq["window"], kvq["softcap"]) == (1, 1, 0, 0.0)
    w = c["kvq_rope_write"]
    assert (w["b"], w["t"], w["hq"], w["hkv"], w["d"], w["k_bits"], w["v_bits"], w["max_pos"]) == \
        (1, 1, 4, 2, 32, 4, 8, 16)
    assert w["pos_dev"] != 0 and w["vscale"] == vq.scales.data_ptr() and w["kds"] == kq.data.stride()[:3]


def test_cpu_wrappers_name_every_argument_of_their_kernel() -> None:
    module = Recorder(CPU_SIGNATURES)
    k = CpuKernels(module)
    x = random((2, 64), torch.float32, seed=0)
    w = make_gptq(64, 32, 32, seed=1)
    k.rms_norm(x, torch.ones(64), 1e-5)
    k.gptq_matmul(x, w)
    k.gptq_dequantize(w)
    q = random((1, 3, 4, 8), torch.float32, seed=2)
    kv = random((1, 3, 2, 8), torch.float32, seed=3)
    cos, sin = rope_tables(16, 8)
    kc, vc = torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16, 8)
    k.rope_cache_write(q, kv, kv, cos.float(), sin.float(), 5, kc, vc)
    k.decode_attention(q[:, 0], kc, vc, 9, 0.25)
    k.silu_mul(x, x)
    gw = GGMLWeight(torch.zeros(32, row_bytes("Q4_K", 256), dtype=torch.uint8), "Q4_K", 256, 32)
    k.ggml_matmul(random((3, 256), torch.float32, seed=4), gw)
    k.ggml_dequantize(gw, torch.float16)
    kq = QuantizedKV.empty((1, 2, 16, 32), 8, torch.float32, "cpu")
    vq = QuantizedKV.empty((1, 2, 16, 32), 4, torch.float32, "cpu")
    assert k.kvq_decode_attention(random((1, 4, 32), torch.float32, seed=4), kq, vq, 7, 0.25) is not None
    assert sorted(module.calls) == sorted(CPU_SIGNATURES)
    c = module.calls
    kvq = c["kvq_decode_attention"]
    assert (kvq["hq"], kvq["hkv"], kvq["d"], kvq["k_bits"], kvq["v_bits"], kvq["seq_len"]) == (4, 2, 32, 8, 4, 7)
    assert kvq["ks"] == kq.scales.data_ptr() and kvq["vds"] == vq.data.stride()[:3]
    assert (c["gptq_gemv"]["rows"], c["gptq_gemv"]["out_dtype"], c["gptq_gemv"]["bias"]) == (2, 0, 0)
    assert (c["rope_cache_write"]["pos"], c["decode_attention"]["seq_len"]) == (5, 9)
    assert c["silu_mul"]["threads"] == torch.get_num_threads()
    assert (c["ggml_gemv"]["type"], c["ggml_gemv"]["rows"], c["ggml_gemv"]["k"]) == (12, 3, 256)
    assert c["ggml_dequantize"]["out_dtype"] == 1


def test_cuda_ggml_rows_and_re_laid_out_weights_reach_the_integer_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q8_0 weight re-laid out (ops/ggml.py repack) goes to ggml_gemv_q8 as type 8 | 0x100 with its padded row
    bytes, for up to 8 rows; 9 rows go through dequantization in the file's layout."""
    from kobold_backend.ops.ggml import repack

    half = torch.float16
    module = Recorder(CUDA_SIGNATURES)
    k = CudaKernels(module)
    monkeypatch.setattr(k, "_stream", lambda device: 77)
    monkeypatch.setattr(k, "ggml_kernel", "q8-pdl")
    gw = repack(GGMLWeight(torch.zeros(32, row_bytes("Q8_0", 96), dtype=torch.uint8), "Q8_0", 96, 32))
    k.ggml_matmul(random((8, 96), half, seed=0), gw)
    q8 = module.calls["ggml_gemv_q8"]
    assert (q8["type"], q8["row_bytes"], q8["rows"]) == (0x108, 112, 8) and "ggml_dequantize" not in module.calls
    k.ggml_matmul(random((9, 96), half, seed=0), gw)
    assert module.calls["ggml_dequantize"]["type"] == 8  # the file's layout
