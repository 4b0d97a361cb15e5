"""The operations the model calls, dispatched to the native extension where it is loaded, else to torch.

`kobold_backend.ops.reference` defines each op; `kobold_backend.ops.native` loads the compiled kernels.
"""

from kobold_backend.ops.reference import (
    add_rms_norm,
    attention,
    decode_attention,
    gptq_dequantize,
    gptq_matmul,
    linear,
    rms_norm,
    rope_cache_write,
    silu_mul,
)

__all__ = [
    "add_rms_norm",
    "attention",
    "decode_attention",
    "gptq_dequantize",
    "gptq_matmul",
    "linear",
    "rms_norm",
    "rope_cache_write",
    "silu_mul",
]
