"""Times the CUDA GGML GEMVs, classic (csrc/cuda/ggml.cu), q8 and q8-pdl (csrc/cuda/ggml_q8.cu), on Llama-2-7B
shapes beside the GPTQ GEMV of the same shapes.

Per kernel: microseconds per call from a CUDA graph (the GPU time; the q8 kernel's time includes its activation
quantization launch), the bandwidth that achieves over the weight bytes and that as a share of the H200's
device-to-device copy (tools/ext_timing.py's COPY_TBPS). Weights rotate over copies larger than the L2 cache, as
in tools/ext_timing.py (whose timers this uses). Run on a GPU machine from the repository root after building the
module: `PYTHONPATH=. python tools/ggml_timing.py [--quick]` (--quick: Q4_K and Q6_K only).
"""

from __future__ import annotations

import sys
from typing import List, Optional

import torch

from kobold_backend.bench.gguf_checkpoint import SCALE_FIELDS
from kobold_backend.ops import native
from kobold_backend.ops.ggml import GGML_TYPES, REPACKED, TYPE_IDS, GGMLWeight, row_bytes
from tools.ext_timing import COPY_TBPS, copies_for, gptq_bytes, gptq_weight, time_graph

SCALES = dict(SCALE_FIELDS, Q8_0=((0, 1e-3),), Q4_0=((0, 1e-3),), Q5_K=SCALE_FIELDS["Q4_K"])


def ggml_weight(type_name: str, k: int, n: int, seed: int) -> GGMLWeight:
    g = torch.Generator(device="cuda").manual_seed(seed)
    size = GGML_TYPES[TYPE_IDS[type_name]][2]
    data = torch.randint(0, 256, (n, row_bytes(type_name, k)), generator=g, device="cuda", dtype=torch.uint8)
    blocks = data.view(-1, size)
    for offset, value in SCALES[type_name]:
        blocks[:, offset:offset + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8).cuda()
    return GGMLWeight(data, type_name, k, n)


def row(name: str, m: int, k: int, n: int, us: Optional[float], nbytes: int) -> str:
    if us is None:
        return f"{name:<22} M={m} {k:5d}x{n:<5d} not timed (graph capture failed)"
    gbps = nbytes / us / 1e3
    return f"{name:<22} M={m} {k:5d}x{n:<5d} {us:8.1f} us {gbps:6.0f} GB/s {100 * gbps / (COPY_TBPS * 1e3):4.0f}% copy"


def main() -> None:
    kern = native.cuda_kernels()
    assert kern is not None and hasattr(kern.module, "ggml_gemv"), "build the CUDA module with the GGML kernels"
    kernels = ["classic"] + (["q8", "q8-pdl"] if hasattr(kern.module, "ggml_gemv_q8") else [])
    types = ("Q4_K", "Q6_K") if "--quick" in sys.argv else ("Q4_K", "Q6_K", "Q5_K", "Q8_0", "Q4_0")
    for k, n, m in [(4096, 4096, 1), (4096, 11008, 1), (11008, 4096, 1), (4096, 32000, 1), (4096, 11008, 4)]:
        x = torch.randn(m, k, device="cuda").half()
        for type_name in types:
            w0 = ggml_weight(type_name, k, n, 0)
            ws = [w0] + [ggml_weight(type_name, k, n, i + 1) for i in range(copies_for(w0.nbytes) - 1)]
            # "q8-pdl R": the weights re-laid out as placing them on CUDA does (Q4_0, Q8_0, Q6_K; ops/ggml.py repack)
            repack = type_name in REPACKED and getattr(kern.module, "ggml_q8_repacked", False)
            for kernel in kernels + (["q8-pdl R"] if repack else []):
                kern.ggml_kernel = kernel.split()[0]
                run = [kern.ggml_place(w) for w in ws] if kernel.endswith(" R") else ws

                def gemv(i: int, ws: List[GGMLWeight] = run, x: torch.Tensor = x) -> None:
                    kern.ggml_matmul(x, ws[i % len(ws)])

                us = time_graph(gemv, len(run) * 2)
                print(row(f"ggml {kernel:<8s} {type_name}", m, k, n, us, w0.nbytes), flush=True)
                del run
            del ws
        g0 = gptq_weight(k, n, 128, False, seed=1)
        gs = [g0] + [gptq_weight(k, n, 128, False, seed=2 + i) for i in range(copies_for(gptq_bytes(g0)) - 1)]

        def gptq(i: int, gs: list = gs, x: torch.Tensor = x) -> None:
            kern.gptq_matmul(x, gs[i % len(gs)])

        print(row("gptq_gemv g128", m, k, n, time_graph(gptq, len(gs) * 2), gptq_bytes(g0)), flush=True)
        del gs
    w = ggml_weight("Q4_K", 4096, 11008, 0)
    print(row("ggml_dequantize Q4_K", 1, 4096, 11008, time_graph(lambda i: kern.ggml_dequantize(w), 20), w.nbytes))


if __name__ == "__main__":
    main()
