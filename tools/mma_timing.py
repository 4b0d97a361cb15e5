"""Times the tensor-core GPTQ product (csrc/cuda/gptq_mma.cu) against dequantize + cuBLAS on Llama-2-7B shapes
for a chat turn's row counts, from CUDA graphs with the weights rotating past the L2 cache (tools/ext_timing.py's
timers). Prints µs per call, the bandwidth over the packed weights and the speed-up. On a GPU machine from the
repository root after building the module: `PYTHONPATH=. python tools/mma_timing.py`.
"""

from __future__ import annotations

from typing import List

import torch

from kobold_backend.ops import native
from tools.ext_timing import COPY_TBPS, copies_for, gptq_bytes, gptq_weight, time_graph

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 32000)]
ROWS = [9, 16, 50, 64, 128]


def main() -> None:
    loaded = native.load("cuda", mode="auto")
    assert loaded.module is not None and hasattr(loaded.module, "gptq_mma"), loaded.reason
    k_ = native.CudaKernels(loaded.module)
    print(f"{'shape':>12} {'rows':>4} {'mma us':>9} {'% copy':>7} {'dequant+cuBLAS us':>18} {'speed-up':>8}")
    for k, n in SHAPES:
        first = gptq_weight(k, n, 128, False, 0)
        nbytes = gptq_bytes(first)
        ws = [first] + [gptq_weight(k, n, 128, False, seed) for seed in range(1, copies_for(nbytes))]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            mma = time_graph(lambda i, x=x, ws=ws: k_._mma(x, ws[i]), len(ws))
            deq = time_graph(lambda i, x=x, ws=ws: k_._dequant_matmul(x, ws[i]), len(ws))
            pct = nbytes / (mma * 1e-6) / (COPY_TBPS * 1e12) * 100 if mma else float("nan")
            cols: List[str] = [f"{k}x{n}", str(m), f"{mma:.1f}" if mma else "-", f"{pct:.0f}",
                               f"{deq:.1f}" if deq else "-", f"{deq / mma:.2f}" if mma and deq else "-"]
            print(f"{cols[0]:>12} {cols[1]:>4} {cols[2]:>9} {cols[3]:>7} {cols[4]:>18} {cols[5]:>8}", flush=True)


if __name__ == "__main__":
    main()
