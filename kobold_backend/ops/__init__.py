"""The operations the model calls, dispatched to the native extension where it is loaded, else to torch.

`kobold_backend.ops.reference` defines each op; `kobold_backend.ops.native` loads the compiled kernels.
"""

from kobold_backend.ops.reference import (
    add_rms_norm,
    attention,
    decode_attention,
    decode_attention_at,
    gptq_dequantize,
    gptq_matmul,
    linear,
    rms_norm,
    rope_cache_write,
    rope_cache_write_at,
    silu_mul,
)

__all__ = [
    "add_rms_norm",
    "attention",
    "decode_attention",
    "decode_attention_at",
    "gptq_dequantize",
    "gptq_matmul",
    "linear",
    "rms_norm",
    "rope_cache_write",
    "rope_cache_write_at",
    "silu_mul",
]
