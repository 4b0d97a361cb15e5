"""The quantized KV cache's CUDA kernels (csrc/cuda/kv_quant.cu) against the torch definitions of
ops/kv_quant.py, and the model on a quantized cache with and without CUDA graphs.

Run on a GPU machine after building the module: `pytest -m gpu tests/test_kv_quant_gpu.py`
(`SECTIONS="tests kvtiming" GPU_FILES=tests/test_kv_quant_gpu.py bash tools/device_session.sh` builds, runs this
file and times the caches). Skipped where torch sees no CUDA device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import pytest
import torch

from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.perplexity import perplexity
from kobold_backend.engine.sampling import SamplerSettings
from kobold_backend.ops import kv_quant, native, reference
from kobold_backend.ops.kv_quant import QuantizedKV
from tests.ext_helpers import rope_tables

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEMO = Path(__file__).resolve().parents[1] / "kobold_backend" / "demo"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kernels() -> native.CudaKernels:
    result = native.load("cuda", mode="auto")
    assert result.module is not None, f"the CUDA kernels could not be loaded or built: {result.reason}"
    return native.CudaKernels(result.module)


def _cache(x: torch.Tensor, bits: int) -> QuantizedKV:
    buf = QuantizedKV.empty(tuple(x.shape), bits, torch.float16, x.device)
    buf.copy_(x)  # the torch quantizer: the kernel is checked on the integers it stores
    return buf


def _oracle(q: torch.Tensor, kq: QuantizedKV, vq: QuantizedKV, n: int, scale: float) -> torch.Tensor:
    """float64 attention of q over the dequantized first n positions (on the CPU)."""
    k = kq[:, :, :n].float().double().cpu()
    v = vq[:, :, :n].float().double().cpu()
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.double().cpu().view(b, hkv, hq // hkv, d)
    probs = torch.softmax(torch.matmul(qg, k.transpose(-1, -2)) * scale, dim=-1)
    return torch.matmul(probs, v).view(b, hq, d)


ATTN_CASES = [
    # (batch, query heads, KV heads, head dim, cached positions, allocated positions)
    (1, 32, 32, 128, 4000, 4608),
    (1, 32, 8, 128, 16000, 16384),
    (1, 28, 4, 128, 1, 64),
    (2, 8, 2, 64, 777, 1024),
    (1, 16, 8, 256, 300, 300),
    (1, 64, 4, 128, 2049, 4096),  # 16 query heads per KV head: two head groups per block
    (1, 8, 4, 32, 5, 512),
    (1, 12, 12, 96, 1000, 1024),
]


@pytest.mark.parametrize("bits", [(8, 8), (4, 4), (8, 4), (4, 8)])
@pytest.mark.parametrize("b,hq,hkv,d,n,s", ATTN_CASES)
def test_decode_attention_kernel_matches_float64_on_the_stored_integers(
        kernels: native.CudaKernels, bits: Tuple[int, int], b: int, hq: int, hkv: int, d: int, n: int,
        s: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(n + d)
    k = torch.randn(b, hkv, s, d, device="cuda", generator=g)
    k[..., 1] *= 6
    v = torch.randn(b, hkv, s, d, device="cuda", generator=g)
    kq, vq = _cache(k, bits[0]), _cache(v, bits[1])
    q = torch.randn(b, hq, d, device="cuda", generator=g).half()
    scale = d ** -0.5
    want = _oracle(q, kq, vq, n, scale)
    got = kernels.kvq_decode_attention(q, kq, vq, n, None, scale)
    assert got is not None and got.dtype == torch.float16
    rel = ((got.double().cpu() - want).norm() / want.norm()).item()
    assert rel < 4e-3, rel
    # graph form: length rounded up, positions after the device position masked
    pos = torch.tensor([n - 1], device="cuda")
    at = kernels.kvq_decode_attention(q.float(), kq, vq, s, pos, scale)
    assert at is not None and at.dtype == torch.float32
    rel = ((at.double().cpu() - want).norm() / want.norm()).item()
    assert rel < 1e-4, rel


@pytest.mark.parametrize("window,softcap", [(7, None), (300, 30.0), (None, 0.5)])
def test_decode_attention_kernel_applies_the_window_and_soft_cap(kernels: native.CudaKernels, window: Optional[int],
                                                                 softcap: Optional[float]) -> None:
    g = torch.Generator(device="cuda").manual_seed(11)
    b, hq, hkv, d, n, s = 1, 16, 8, 128, 1500, 2048
    kq = _cache(torch.randn(b, hkv, s, d, device="cuda", generator=g), 8)
    vq = _cache(torch.randn(b, hkv, s, d, device="cuda", generator=g), 4)
    q = torch.randn(b, hq, d, device="cuda", generator=g).half()
    k64, v64 = kq[:, :, :n].float().double().cpu(), vq[:, :, :n].float().double().cpu()
    want = reference.decode_attention(q.double().cpu(), k64, v64, n, d ** -0.5, window, softcap)
    got = kernels.kvq_decode_attention(q, kq, vq, n, None, d ** -0.5, window, softcap)
    assert ((got.double().cpu() - want).norm() / want.norm()).item() < 4e-3
    at = kernels.kvq_decode_attention(q, kq, vq, s, torch.tensor([n - 1], device="cuda"), d ** -0.5, window, softcap)
    assert ((at.double().cpu() - want).norm() / want.norm()).item() < 4e-3


@pytest.mark.parametrize("bits", [(8, 8), (4, 4), (8, 4)])
@pytest.mark.parametrize("t,pos_dev", [(1, True), (1, False), (37, False)])
def test_rope_write_kernel_stores_what_the_torch_quantizer_stores(
        kernels: native.CudaKernels, bits: Tuple[int, int], t: int, pos_dev: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(t)
    b, hq, hkv, d, s = 2, 8, 4, 128, 64
    q = torch.randn(b, t, hq, d, device="cuda", generator=g).half()
    k = (torch.randn(b, t, hkv, d, device="cuda", generator=g) * 3).half()
    v = torch.randn(b, t, hkv, d, device="cuda", generator=g).half()
    cos, sin = (x.float().cuda() for x in rope_tables(s, d))
    pos = 20
    mine = [QuantizedKV.empty((b, hkv, s, d), n, torch.float16, "cuda") for n in bits]
    ref = [QuantizedKV.empty((b, hkv, s, d), n, torch.float16, "cuda") for n in bits]
    dev_pos: Optional[torch.Tensor] = torch.tensor([pos], device="cuda") if pos_dev else None
    q_out = kernels.kvq_rope_write(q, k, v, cos, sin, 0 if pos_dev else pos, dev_pos, *mine)
    assert q_out is not None
    q_ref = reference.rope_cache_write(q, k, v, cos, sin, pos, torch.zeros(b, hkv, s, d, device="cuda").half(),
                                       torch.zeros(b, hkv, s, d, device="cuda").half())
    torch.testing.assert_close(q_out, q_ref, rtol=2e-3, atol=2e-3)
    # the torch definition of the same write (the native path bypassed)
    q_rot, k_rot = kv_quant._rope(q, k, cos[pos: pos + t].view(1, t, 1, -1), sin[pos: pos + t].view(1, t, 1, -1))
    ref[0].write(k_rot.to(k.dtype).transpose(1, 2), pos)
    ref[1].write(v.transpose(1, 2), pos)
    for m, r in zip(mine, ref):
        span = slice(pos, pos + t)
        torch.testing.assert_close(m.scales[:, :, span], r.scales[:, :, span], rtol=2e-3, atol=1e-6)
        a = kv_quant.dequantize(m.data[:, :, span], r.scales[:, :, span], m.bits, rotated=True)
        c = kv_quant.dequantize(r.data[:, :, span], r.scales[:, :, span], r.bits, rotated=True)
        steps = ((a - c).abs() / r.scales[:, :, span].float().repeat_interleave(32, -1).clamp_min(1e-12))
        # float32 sums in another order may move a value sitting on a rounding boundary by one step
        assert steps.max().item() <= 1.0 + 1e-3 and (steps > 0.5).float().mean().item() < 0.01
        untouched = torch.ones(s, dtype=torch.bool)
        untouched[span] = False
        assert not m.data[:, :, untouched.cuda()].any() and not m.scales[:, :, untouched.cuda()].any()


@pytest.mark.parametrize("name", ["q8", "q4", "k8v4"])
def test_greedy_with_and_without_graphs_is_identical(checkpoints, name: str) -> None:
    lm = load_model(checkpoints.get("head32").path, device="cuda", max_seq_len=512, cache_dtype=name)
    greedy = SamplerSettings(temperature=0)
    prompt = torch.randint(3, lm.config.vocab_size, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    runs = []
    for graphs in (True, False):
        gen = Generator(lm.model, lm.tokenizer, use_graphs=graphs)
        first = gen.generate(GenerationRequest(prompt, 40, greedy)).token_ids
        reuse = gen.generate(GenerationRequest(prompt[:250] + [5, 6], 20, greedy)).token_ids
        runs.append((first, reuse))
    assert runs[0] == runs[1]


def test_cuda_and_cpu_agree_on_a_quantized_cache(checkpoints) -> None:
    path = checkpoints.get("head32").path
    ids = torch.randint(3, 200, (1, 150), generator=torch.Generator().manual_seed(5))
    out = []
    for device in ("cuda", "cpu"):
        lm = load_model(path, device=device, max_seq_len=256, cache_dtype="q8")
        cache = lm.model.new_cache()
        lm.model.forward(ids[:, :140].to(device), cache)
        steps = [lm.model.forward(ids[:, i:i + 1].to(device), cache)[0, -1].float().cpu() for i in range(140, 150)]
        out.append(torch.stack(steps))
    rel = ((out[0] - out[1]).norm() / out[1].norm()).item()
    assert rel < 2e-2, rel  # fp16 compute on the GPU against float32 on the CPU, the same quantizer


def test_demo_perplexity_on_cuda_meets_the_targets() -> None:
    lm = load_model(DEMO, device="cuda")
    ids = lm.tokenizer.encode((REPO / "docs" / "architecture.md").read_text(encoding="utf-8")[:3000])
    base = perplexity(lm.model, ids, "fp16", chunk=1).perplexity  # chunk 1: every token a decode step
    for name, limit in (("q8", 0.005), ("q4", 0.03)):
        got = perplexity(lm.model, ids, name, chunk=1).perplexity
        assert abs(got / base - 1) < limit, (name, got, base)
