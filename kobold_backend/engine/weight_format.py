"""What a model's weights are stored as, in words and bits per weight, for the load log, doctor and the model
routes ("GGUF Q4_K+Q6_K, 4.90 bpw", "GPTQ 4-bit g128, 4.16 bpw", "EXL2 4+3+6-bit, 4.13 bpw", "float16, 16.00 bpw");
engine/stored_format.py computes it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightFormat:
    """`name` ("GGUF", "GPTQ", "AWQ", "EXL2" or a float dtype), `detail` (block types, bits and group size, or EXL2's
    widths by share) and what the decoder layers' linear weights take in the model's files, in bits per weight
    (scales, zeros and block headers included)."""

    name: str
    detail: str
    bits_per_weight: float

    def __str__(self) -> str:
        head = f"{self.name} {self.detail}".strip()
        return f"{head}, {self.bits_per_weight:.2f} bpw"
