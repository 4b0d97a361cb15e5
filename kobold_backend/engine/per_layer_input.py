"""Per-layer embeddings (Gemma 4's and Gemma 3n's "PLE"): every decoder layer gets its own small input per token,
which it gates into its residual stream after the MLP, as transformers' modeling_gemma4 / gemma3n compute it.

`PerLayerEmbedding` (model level) turns the token ids and the scaled main embedding into `[B, T, layers, D]`:
a second embedding (times sqrt(D)) plus an RMSNorm'd projection of the main embedding (times hidden ** -0.5),
their sum times 2 ** -0.5. `PerLayerGate` (one per layer) adds
`norm(projection(gelu_tanh(gate(h)) * input))` to h.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from kobold_backend import ops
from kobold_backend.engine.model import Weight, project


@dataclass
class PerLayerEmbedding:
    """The model-level half: `inputs(ids, h)` -> the per-layer inputs of every layer."""

    embed: torch.Tensor  # [vocab, layers * dim]
    embed_scale: float  # sqrt(dim), rounded to the embedding dtype as transformers rounds it
    projection: Weight  # hidden -> layers * dim
    norm: torch.Tensor  # [dim]
    num_layers: int
    dim: int
    eps: float

    def inputs(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.embed.device)
        # Gemma 3n's table is shorter than the vocabulary: ids past it read row 0
        rows = self.embed[torch.where(ids < self.embed.shape[0], ids, torch.zeros_like(ids))]
        tokens = rows.to(device=h.device, dtype=h.dtype) * self.embed_scale
        mixed = project(h, self.projection) * h.shape[-1] ** -0.5
        mixed = ops.rms_norm(mixed.view(*h.shape[:-1], self.num_layers, self.dim), self.norm, self.eps)
        return (mixed + tokens.view_as(mixed)) * 2 ** -0.5

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from (self.embed, self.projection, self.norm)


@dataclass
class PerLayerGate:
    """The layer-level half: h + norm(projection(gelu_tanh(gate(h)) * input))."""

    gate: Weight  # hidden -> dim
    projection: Weight  # dim -> hidden
    norm: torch.Tensor  # [hidden]
    eps: float

    def __call__(self, h: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        return h + self.delta(h, per_layer_input)

    def delta(self, h: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        """norm(projection(gelu_tanh(gate(h)) * input)), which Gemma 3n adds to its other AltUp streams."""
        x = ops.gelu_tanh_mul(project(h, self.gate), per_layer_input)
        return ops.rms_norm(project(x, self.projection), self.norm, self.eps)

    def tensors(self) -> Iterator[Weight]:
        yield from (self.gate, self.projection, self.norm)
