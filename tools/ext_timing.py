"""Times the native kernels on Llama-2-7B shapes: the CUDA kernels (one table) and the CPU GPTQ GEMV.

For each kernel: microseconds per call issued eagerly from Python and replayed from a CUDA graph (the
graph time is the GPU time), and the bandwidth the graph time achieves. Weights rotate over copies
larger than the L2 cache, so each call reads from HBM as in a real decode step. Run on a GPU machine from
the repository root: `PYTHONPATH=. python tools/ext_timing.py` (tools/device_ext_check.sh does so after
building the module). `--cpu` times only the CPU GEMV against the torch reference (no GPU needed).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable, List, Optional, Tuple

import torch

from kobold_backend.ops import native, reference
from kobold_backend.ops.gptq_weight import GPTQWeight

COPY_TBPS = 4.2  # device-to-device copy on the lent H200 (shared/perf/anchors.md), read + write
ROTATE_BYTES = 512 << 20  # well past the 60 MB L2


def gptq_weight(k: int, n: int, group: int, act_order: bool, seed: int, device: str = "cuda",
                dtype: torch.dtype = torch.float16) -> GPTQWeight:
    g = torch.Generator(device=device).manual_seed(seed)
    groups = -(-k // group)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=g, device=device, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=g, device=device) * 0.02 + 0.002).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=g, device=device).to(dtype)
    perm = torch.randperm(k, generator=g, device=device) if act_order else None
    return GPTQWeight(qweight, scales, zeros, perm, group, k, n, None)


def gptq_bytes(w: GPTQWeight) -> int:
    return w.qweight.numel() * 4 + w.scales.numel() * 2 + w.zeros.numel() * 2


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(ROTATE_BYTES / max(nbytes, 1)))


def time_eager(fn: Callable[[int], None], calls: int) -> float:
    """Microseconds per call, calls issued from Python one after the other."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        fn(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def time_graph(fn: Callable[[int], None], calls: int, replays: int = 5) -> Optional[float]:
    """Microseconds per call from a CUDA graph holding `calls` calls (None when capture fails)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for i in range(calls):
                fn(i)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fn(i)
    except RuntimeError as exc:
        print(f"  (graph capture failed: {exc})", file=sys.stderr)
        return None
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


Row = Tuple[str, str, float, Optional[float], int]


def measure(name: str, shape: str, fn: Callable[[int], None], nbytes: int, calls: int) -> Row:
    return name, shape, time_eager(fn, calls), time_graph(fn, calls), nbytes


def gemv_rows(k_: native.CudaKernels, quick: bool) -> List[Row]:
    rows = []
    shapes = [(4096, 4096, 1, False), (4096, 11008, 1, False), (11008, 4096, 1, False), (4096, 4096, 1, True),
              (4096, 11008, 8, False)]
    for k, n, m, act in shapes:
        w0 = gptq_weight(k, n, 128, act, seed=1)
        count = copies_for(gptq_bytes(w0))
        ws = [w0] + [gptq_weight(k, n, 128, act, seed=2 + i) for i in range(count - 1)]
        x = torch.randn(m, k, device="cuda").half()
        y = torch.empty(m, n, device="cuda", dtype=torch.float16)
        label = "gptq_gemv" + (" act-order" if act else "")

        def gemv(i: int, ws: List[GPTQWeight] = ws, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            k_.gptq_matmul(x, ws[i % len(ws)], out=y)

        rows.append(measure(label, f"M={m} {k}x{n} g128", gemv, gptq_bytes(w0), 20 if quick else len(ws) * 2))
        if m == 1 and not act:
            dense = [torch.randn(n, k, device="cuda").half() for _ in range(copies_for(k * n * 2))]

            def linear(i: int, d: List[torch.Tensor] = dense, x: torch.Tensor = x) -> None:
                torch.nn.functional.linear(x, d[i % len(d)])

            rows.append(measure("torch fp16 GEMV", f"M=1 {k}x{n} dense", linear, k * n * 2,
                                20 if quick else len(dense) * 2))
            del dense
        del ws
    w = gptq_weight(4096, 11008, 128, False, seed=3)
    out = torch.empty(4096, 11008, device="cuda", dtype=torch.float16)
    rows.append(measure("gptq_dequantize", "4096x11008 g128", lambda i: k_.gptq_dequantize(w, out=out),
                        gptq_bytes(w) + out.numel() * 2, 10))
    x = torch.randn(2048, 4096, device="cuda").half()
    rows.append(measure("dequant + cuBLAS", "M=2048 4096x11008", lambda i: k_.gptq_matmul(x, w),
                        gptq_bytes(w) + out.numel() * 4 + x.numel() * 2, 5))
    return rows


def small_rows(k_: native.CudaKernels) -> List[Row]:
    rows = []
    h = torch.randn(1, 4096, device="cuda").half()
    wn = torch.ones(4096, device="cuda").half()
    yn, ro = torch.empty_like(h), torch.empty_like(h)
    rows.append(measure("rms_norm", "1x4096", lambda i: k_.rms_norm(h, wn, 1e-5, out=yn), 4096 * 6, 200))
    rows.append(measure("add_rms_norm", "1x4096",
                        lambda i: k_.add_rms_norm(h, h, wn, 1e-5, out=yn, residual_out=ro), 4096 * 10, 200))
    g, u = torch.randn(1, 11008, device="cuda").half(), torch.randn(1, 11008, device="cuda").half()
    ys = torch.empty_like(g)
    rows.append(measure("silu_mul", "1x11008", lambda i: k_.silu_mul(g, u, out=ys), 11008 * 6, 200))
    q = torch.randn(1, 1, 32, 128, device="cuda").half()
    kc = torch.zeros(1, 32, 4096, 128, device="cuda", dtype=torch.float16)
    vc = torch.zeros_like(kc)
    cos, sin = torch.randn(4096, 128, device="cuda").half(), torch.randn(4096, 128, device="cuda").half()
    qo = torch.empty_like(q)
    rows.append(measure("rope_cache_write", "T=1 32+32 heads d128",
                        lambda i: k_.rope_cache_write(q, q, q, cos, sin, 100, kc, vc, out=qo), 32 * 128 * 2 * 5, 200))
    return rows


def attention_rows(k_: native.CudaKernels, contexts: List[int]) -> List[Row]:
    rows = []
    q = torch.randn(1, 32, 128, device="cuda").half()
    y = torch.empty_like(q)
    for ctx in contexts:
        cache_bytes = 2 * ctx * 32 * 128 * 2
        count = copies_for(cache_bytes)
        caches = [(torch.randn(1, 32, ctx, 128, device="cuda").half(),
                   torch.randn(1, 32, ctx, 128, device="cuda").half()) for _ in range(count)]

        def native_attn(i: int, c: List[Tuple[torch.Tensor, torch.Tensor]] = caches, ctx: int = ctx) -> None:
            kc, vc = c[i % len(c)]
            k_.decode_attention(q, kc, vc, ctx, 0.088, out=y)

        def torch_attn(i: int, c: List[Tuple[torch.Tensor, torch.Tensor]] = caches, ctx: int = ctx) -> None:
            kc, vc = c[i % len(c)]
            reference.decode_attention(q, kc, vc, ctx, 0.088)

        rows.append(measure("decode_attention", f"ctx {ctx} 32/32 heads d128", native_attn, cache_bytes, count * 2))
        rows.append(measure("torch reference attn", f"ctx {ctx}", torch_attn, cache_bytes, count * 2))
        del caches
    return rows


def decode_chain_rows(k_: native.CudaKernels) -> List[Row]:
    """The 224 GEMVs of one Llama-2-7B decode step over 32 layers of distinct weights (3.5 GB)."""
    shapes = [(4096, 4096)] * 4 + [(4096, 11008)] * 2 + [(11008, 4096)]
    layers = [[gptq_weight(k, n, 128, False, seed=100 * layer + j) for j, (k, n) in enumerate(shapes)]
              for layer in range(32)]
    xs = {k: torch.randn(1, k, device="cuda").half() for k in (4096, 11008)}
    outs = {n: torch.empty(1, n, device="cuda", dtype=torch.float16) for n in (4096, 11008)}
    total = sum(gptq_bytes(w) for layer in layers for w in layer)

    def step(_: int) -> None:
        for layer in layers:
            for w in layer:
                k_.gptq_matmul(xs[w.in_features], w, out=outs[w.out_features])

    return [measure("decode-step GEMVs", "32 layers x 7 (Llama-2-7B)", step, total, 3)]


def print_table(rows: List[Row]) -> None:
    header = f"{'kernel':<22} {'shape':<28} {'eager us':>10} {'graph us':>10} {'GB/s':>8} {'% copy':>7}"
    print(header)
    print("-" * len(header))
    for name, shape, eager, graph, nbytes in rows:
        gpu = graph if graph is not None else eager
        gbps = nbytes / (gpu * 1e-6) / 1e9 if gpu > 0 else float("nan")
        graph_text = f"{graph:10.2f}" if graph is not None else f"{'-':>10}"
        print(f"{name:<22} {shape:<28} {eager:10.2f} {graph_text} {gbps:8.0f} {100 * gbps / (COPY_TBPS * 1e3):6.0f}%")


def cpu_gemv(reference_calls: int = 2) -> None:
    """fp32 GPTQ GEMV at M=1 on the CPU: _ext_cpu against reference.gptq_matmul (dequantize + matmul)."""
    kernels = native.cpu_kernels()
    if kernels is None:
        print(f"CPU kernels not loaded: {native.status()['cpu']}", file=sys.stderr)
        return
    print(f"# CPU: {torch.get_num_threads()} threads, fp32, group 128, weights rotated over {ROTATE_BYTES >> 20} MB")
    header = f"{'shape':<18} {'native ms':>10} {'GB/s':>7} {'reference ms':>13} {'speed-up':>9}"
    print(header)
    print("-" * len(header))
    for k, n in [(4096, 4096), (4096, 11008), (11008, 4096)]:
        w0 = gptq_weight(k, n, 128, False, seed=1, device="cpu", dtype=torch.float32)
        ws = [w0] + [gptq_weight(k, n, 128, False, seed=2 + i, device="cpu", dtype=torch.float32)
                     for i in range(copies_for(gptq_bytes(w0)) - 1)]
        x = torch.randn(1, k)
        kernels.gptq_matmul(x, ws[0])
        start = time.perf_counter()
        rounds = 3
        for _ in range(rounds):
            for w in ws:
                kernels.gptq_matmul(x, w)
        native_ms = (time.perf_counter() - start) * 1e3 / (rounds * len(ws))
        start = time.perf_counter()
        for i in range(reference_calls):
            reference.gptq_matmul(x, ws[i % len(ws)])
        ref_ms = (time.perf_counter() - start) * 1e3 / reference_calls
        gbps = gptq_bytes(w0) / (native_ms * 1e-3) / 1e9
        print(f"{f'{k}x{n}':<18} {native_ms:10.2f} {gbps:7.1f} {ref_ms:13.1f} {ref_ms / native_ms:8.0f}x")
        del ws


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer calls, no 3.5 GB decode chain")
    parser.add_argument("--cpu", action="store_true", help="only the CPU GEMV (no GPU needed)")
    args = parser.parse_args()
    if args.cpu:
        cpu_gemv()
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    kernels = native.cuda_kernels()
    if kernels is None:
        print(f"CUDA kernels not loaded: {native.status()['cuda']}", file=sys.stderr)
        return 1
    print(f"# {torch.cuda.get_device_name(0)}; torch {torch.__version__}; module {native.status()['cuda']['file']}")
    rows = gemv_rows(kernels, args.quick) + small_rows(kernels) + attention_rows(kernels, [128, 4000, 8192])
    if not args.quick:
        rows += decode_chain_rows(kernels)
    print_table(rows)
    print()
    cpu_gemv()
    return 0


if __name__ == "__main__":
    sys.exit(main())
