"""Checks and times each GPTQ 4-bit GEMV kernel (split-K, whole-K, whole-K lean with and without programmatic
dependent launch, the automatic choice) against the copy roofline.

For every shape of a Llama-2-7B/13B/70B decode step and 1, 2, 4 and 8 rows: the kernel's output against the
reference dequantization in float32 (relative error, every output written: the output is poisoned with NaN
first), then its time per call replayed from a CUDA graph, with the weights rotated over copies larger than the
L2 cache so each call reads HBM. Bandwidth counts the bytes a call must read (qweight, scales, zeros);
"% copy" divides it by the device-to-device copy bandwidth measured in the same process (read + write).
Run on a GPU machine from the repository root: `PYTHONPATH=. python tools/gptq_gemv_bench.py`.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, List, Optional, Tuple

import torch

from kobold_backend.bench.timing import copy_bandwidth
from kobold_backend.ops import native, reference
from kobold_backend.ops.cuda_kernels import (
    GEMV_AUTO,
    GEMV_SPLIT_K,
    GEMV_WHOLE_K,
    GEMV_WHOLE_K_512,
    GEMV_WHOLE_K_LEAN,
    GEMV_WHOLE_K_LEAN_PDL,
)
from kobold_backend.ops.gptq_weight import GPTQWeight

ROTATE_BYTES = 512 << 20  # well past the H200's 60 MB L2
VARIANTS = (("split-K", GEMV_SPLIT_K), ("whole-K", GEMV_WHOLE_K), ("wholeK512", GEMV_WHOLE_K_512),
            ("lean", GEMV_WHOLE_K_LEAN), ("lean+pdl", GEMV_WHOLE_K_LEAN_PDL), ("auto", GEMV_AUTO))
# Llama-2-7B (o, up, down, fused qkv, fused gate+up): 1, 2, 4 and 8 rows; 13B and 70B (fused qkv, o, gate+up,
# down): 1 row.
SHAPES_7B = ((4096, 4096), (4096, 11008), (11008, 4096), (4096, 12288), (4096, 22016))
SHAPES_LARGE = ((5120, 15360), (13824, 5120), (8192, 10240), (8192, 8192), (8192, 57344), (28672, 8192))


def gptq_weight(k: int, n: int, group: int, act_order: bool, seed: int) -> GPTQWeight:
    g = torch.Generator(device="cuda").manual_seed(seed)
    groups = -(-k // group)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=g, device="cuda", dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=g, device="cuda") * 0.02 + 0.002).half()
    zeros = torch.randint(0, 16, (groups, n), generator=g, device="cuda").half()
    perm = torch.randperm(k, generator=g, device="cuda") if act_order else None
    return GPTQWeight(qweight, scales, zeros, perm, group, k, n, None)


def weight_bytes(w: GPTQWeight) -> int:
    return w.qweight.numel() * 4 + w.scales.numel() * 2 + w.zeros.numel() * 2


def graph_us(fn: Callable[[int], None], calls: int, replays: int = 5) -> float:
    """Median microseconds per call over `replays` replays of a graph holding `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def copy_tbps() -> float:
    """Device-to-device copy bandwidth in TB/s (read + written), measured as the bench measures its roofline.

    Not from a graph: on the H200 the same 1 GiB copy replayed from a CUDA graph measured 2.70 TB/s, issued
    eagerly 4.13-4.15 TB/s (2026-12-02, same call), and the eager figure is the roofline the bench reports."""
    return copy_bandwidth(torch.device("cuda")) / 1e12


def rel_error(kernels: native.CudaKernels, w: GPTQWeight, m: int, variant: int) -> float:
    x = torch.randn(m, w.in_features, device="cuda").half()
    xp = x.float() if w.perm is None else x.float().index_select(1, w.perm)  # rows are stored in perm order
    want = xp @ reference.gptq_dequantize(w).float()
    got = torch.full((m, w.out_features), float("nan"), device="cuda", dtype=torch.float16)
    kernels.gptq_matmul(x, w, out=got, variant=variant)
    torch.cuda.synchronize()
    if not bool(torch.isfinite(got).all()):
        return math.inf
    return float((got.float() - want).norm() / want.norm())


Row = Tuple[str, int, str, float, float, float]


def run(kernels: native.CudaKernels, tbps: float, shapes: List[Tuple[int, int]], rows: List[int],
        act_rows: List[int]) -> List[Row]:
    out: List[Row] = []
    for k, n in shapes:
        for act in (False, True):
            ms = act_rows if act else rows
            if not ms:
                continue
            w0 = gptq_weight(k, n, 128, act, seed=1)
            nbytes = weight_bytes(w0)
            ws = [w0] + [gptq_weight(k, n, 128, act, seed=2 + i)
                         for i in range(max(1, math.ceil(ROTATE_BYTES / nbytes)) - 1)]
            for m in ms:
                x = torch.randn(m, k, device="cuda").half()
                y = torch.empty(m, n, device="cuda", dtype=torch.float16)
                for name, variant in VARIANTS:
                    try:
                        err = rel_error(kernels, w0, m, variant)
                    except (RuntimeError, ValueError) as exc:  # the whole-K kernel refuses shapes outside its range
                        print(f"  {k}x{n} M={m} {name}: {str(exc).splitlines()[0]}", file=sys.stderr)
                        continue

                    def gemv(i: int, ws: List[GPTQWeight] = ws, x: torch.Tensor = x, y: torch.Tensor = y,
                             v: int = variant) -> None:
                        kernels.gptq_matmul(x, ws[i % len(ws)], out=y, variant=v)

                    try:
                        us = graph_us(gemv, 2 * len(ws))
                    except RuntimeError as exc:  # e.g. a launch attribute the graph capture refuses: say so, go on
                        print(f"  {k}x{n} M={m} {name}: not timed: {str(exc).splitlines()[0]}", file=sys.stderr)
                        continue
                    gbps = nbytes / (us * 1e-6) / 1e9
                    label = f"{k}x{n}" + (" act" if act else "")
                    out.append((label, m, name, err, us, gbps))
                    print(f"{label:<16} M={m} {name:<9} err {err:.1e} {us:8.2f} us {gbps:7.0f} GB/s "
                          f"{100 * gbps / (tbps * 1e3):5.1f}%", flush=True)
            del ws
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the three 7B shapes at 1 row only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    kernels: Optional[native.CudaKernels] = native.cuda_kernels()
    if kernels is None:
        print(f"CUDA kernels not loaded: {native.status()['cuda']}", file=sys.stderr)
        return 1
    tbps = copy_tbps()
    print(f"# {torch.cuda.get_device_name(0)}; torch {torch.__version__}; copy {tbps:.2f} TB/s (read + write)")
    if args.quick:
        rows = run(kernels, tbps, list(SHAPES_7B[:3]), [1], [1])
    else:
        rows = run(kernels, tbps, list(SHAPES_7B), [1, 2, 4, 8], [1]) + run(kernels, tbps, list(SHAPES_LARGE), [1], [])
    worst = max((r[3] for r in rows), default=math.inf)
    print(f"# worst relative error {worst:.1e} (fp16 GEMV vs float32 reference; limit 5e-3)")
    return 0 if worst < 5e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
