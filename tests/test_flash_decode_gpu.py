"""The templated flash-decoding body (csrc/cuda/flash_decode.cu) for every cache dtype (fp16, q8, q4, k8v4) against
float64 attention on the CPU, up to 16k positions; the previous kernels (KOBOLD_BACKEND_ATTN=legacy) against the
same oracle; a CUDA-graph replay against the eager call, bit for bit.

Run on a GPU machine after building the module: `pytest -m gpu tests/test_flash_decode_gpu.py`. Skipped where torch
sees no CUDA device.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import pytest
import torch

from kobold_backend.engine.cache import CACHE_DTYPES
from kobold_backend.ops import native, reference
from kobold_backend.ops.kv_quant import BITS, QuantizedKV

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = [
    # (batch, query heads, KV heads, head dim, attended positions, allocated positions)
    (1, 32, 32, 128, 4000, 4096),    # Llama-2-7B at the bench's short context
    (1, 32, 32, 128, 16000, 16384),  # ... and at its long one
    (1, 32, 8, 128, 16000, 16384),   # GQA, 4 query heads per block
    (1, 28, 4, 128, 1, 64),          # 7 query heads per KV head, one position
    (2, 8, 2, 64, 777, 1024),
    (1, 16, 8, 256, 300, 300),
    (1, 64, 4, 128, 2049, 4096),     # 16 query heads per KV head: two head groups per block
    (1, 2, 1, 128, 33, 40),          # one tile and one position of a second
]
TOL = {"fp16": 2e-3, "q8": 4e-3, "q4": 4e-3, "k8v4": 4e-3}


@pytest.fixture(scope="module")
def kernels() -> native.CudaKernels:
    result = native.load("cuda", mode="auto")
    assert result.module is not None, f"the CUDA kernels could not be loaded or built: {result.reason}"
    return native.CudaKernels(result.module)


def _buffer(x: torch.Tensor, scheme: str) -> Any:
    if scheme not in BITS:
        return x.half()
    return QuantizedKV.empty(tuple(x.shape), BITS[scheme], torch.float16, x.device).copy_(x)


def _caches(name: str, b: int, hkv: int, s: int, d: int, seed: int) -> Tuple[Any, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(b, hkv, s, d, device="cuda", generator=g)
    k[..., 1] *= 6  # an outlier channel
    v = torch.randn(b, hkv, s, d, device="cuda", generator=g)
    ks, vs = CACHE_DTYPES[name]
    return _buffer(k, ks), _buffer(v, vs)


def _dense64(c: Any, n: int) -> torch.Tensor:
    """The first n positions as the kernel must see them (dequantized), float64 on the CPU."""
    return c[:, :, :n].float().double().cpu()


def _call(kernels: native.CudaKernels, name: str) -> Callable[..., Optional[torch.Tensor]]:
    """(q, k, v, length, pos or None, scale) -> output, through the binding the engine uses for this dtype."""
    def run(q: torch.Tensor, kc: Any, vc: Any, length: int, pos: Optional[torch.Tensor], scale: float):
        if name == "fp16":
            if pos is None:
                return kernels.decode_attention(q, kc, vc, length, scale)
            return kernels.decode_attention_at(q, kc, vc, pos, length, scale)
        return kernels.kvq_decode_attention(q, kc, vc, length, pos, scale)
    return run


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("legacy", [False, True], ids=["flash_decode", "legacy"])
@pytest.mark.parametrize("name", list(CACHE_DTYPES))
@pytest.mark.parametrize("b,hq,hkv,d,n,s", CASES)
def test_decode_attention_matches_float64(kernels: native.CudaKernels, monkeypatch: pytest.MonkeyPatch,
                                          legacy: bool, name: str, b: int, hq: int, hkv: int, d: int, n: int,
                                          s: int) -> None:
    if legacy:
        monkeypatch.setenv("KOBOLD_BACKEND_ATTN", "legacy")
    kc, vc = _caches(name, b, hkv, s, d, n + d)
    q = torch.randn(b, hq, d, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n)).half()
    scale = d ** -0.5
    want = reference.decode_attention(q.double().cpu(), _dense64(kc, n), _dense64(vc, n), n, scale)
    run = _call(kernels, name)
    got = run(q, kc, vc, n, None, scale)
    assert got is not None and got.dtype == torch.float16 and got.shape == (b, hq, d)
    assert _rel(got, want) < TOL[name], (name, _rel(got, want))
    # the graph form: the plan made for all s positions, those after the device position masked
    at = run(q, kc, vc, s, torch.tensor([n - 1], device="cuda"), scale)
    assert at is not None and _rel(at, want) < TOL[name], (name, _rel(at, want))


@pytest.mark.parametrize("name", list(CACHE_DTYPES))
def test_graph_replay_equals_the_eager_call(kernels: native.CudaKernels, name: str) -> None:
    """The kernel captured once for a 16384-position bucket, replayed at two positions: the same bits as eager."""
    b, hq, hkv, d, s = 1, 32, 8, 128, 16384
    kc, vc = _caches(name, b, hkv, s, d, 7)
    q = torch.randn(b, hq, d, device="cuda", generator=torch.Generator(device="cuda").manual_seed(8)).half()
    pos = torch.tensor([0], device="cuda")
    run = _call(kernels, name)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(q, kc, vc, s, pos, 0.088)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(q, kc, vc, s, pos, 0.088)
    for p in (9000, 15999):
        pos.fill_(p)
        graph.replay()
        torch.cuda.synchronize()
        eager = run(q, kc, vc, s, torch.tensor([p], device="cuda"), 0.088)
        assert torch.equal(out, eager), (name, p)
        want = reference.decode_attention(q.double().cpu(), _dense64(kc, p + 1), _dense64(vc, p + 1), p + 1, 0.088)
        assert _rel(out, want) < TOL[name]
