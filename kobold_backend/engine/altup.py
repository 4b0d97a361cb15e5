"""Gemma 3n's layer pieces, read as transformers' modeling_gemma3n computes them: AltUp (several parallel residual
streams; each layer runs on one and corrects the others) and the Laurel branch (a low-rank residual beside
attention).

- `AltUpStreams` (model level): `expand(h)` turns the scaled embedding into n streams (stream 0 itself, stream i
  its projection i - 1 rescaled to the embedding's RMS); `collapse(streams)` projects streams 1.. back the same
  way and averages all n.
- `AltUpLayer` (one per layer), called as `layer(streams, run, per_layer_input)`: predict every stream from all of
  them (coefficients from a router on the active stream), `run` the decoder layer on the active prediction,
  correct every stream by the layer's innovation, then add the per-layer input's gate
  (`per_layer_input.PerLayerGate.delta` of the scaled corrected active stream) to streams 1.. (as transformers
  does; the active stream is 0 in every released model).
- `Laurel`: `x + norm(right(left(x)))` of the normed layer input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

import torch

from kobold_backend import ops
from kobold_backend.engine.model import Weight, project
from kobold_backend.engine.per_layer_input import PerLayerGate


def _rescaled(x: torch.Tensor, rms: torch.Tensor) -> torch.Tensor:
    """x scaled to the per-row RMS `rms` (its own RMS floored at sqrt(1e-5))."""
    own = torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * rms / own


@dataclass
class AltUpStreams:
    projections: List[Weight]  # n - 1 of [hidden, hidden]: embedding -> stream i
    unprojections: List[Weight]  # n - 1 of [hidden, hidden]: stream i -> output
    device: torch.device  # where the projections live (the embedding's device)
    dtype: torch.dtype

    def expand(self, h: torch.Tensor) -> torch.Tensor:
        rms = torch.mean(h ** 2, dim=-1, keepdim=True) ** 0.5
        return torch.stack([h] + [_rescaled(project(h, w).to(h.dtype), rms) for w in self.projections])

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        streams = streams.to(device=self.device, dtype=self.dtype)  # from the last layer's device
        rms = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
        outs = [streams[0]] + [_rescaled(project(s, w).to(s.dtype), rms)
                               for s, w in zip(streams[1:], self.unprojections)]
        return torch.stack(outs).mean(dim=0)

    def tensors(self) -> Iterator[Weight]:
        yield from self.projections
        yield from self.unprojections


@dataclass
class AltUpLayer:
    router: Weight  # [n, hidden]
    router_norm: torch.Tensor  # [hidden]
    prediction: torch.Tensor  # [n * n, n]
    correction: torch.Tensor  # [n, n]
    output_scale: Optional[torch.Tensor]  # [hidden], None without altup_correct_scale
    gate: PerLayerGate
    active: int
    eps: float

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = project(ops.rms_norm(x, self.router_norm, self.eps) * x.shape[-1] ** -1.0, self.router)
        return torch.tanh(routed.float()).to(x.dtype)

    def __call__(self, streams: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor],
                 per_layer_input: Optional[torch.Tensor]) -> torch.Tensor:
        n = streams.shape[0]
        mods = self._modalities(streams[self.active])
        coefs = torch.nn.functional.linear(mods, self.prediction).view(*mods.shape[:-1], n, n).transpose(-1, -2)
        predictions = (torch.matmul(streams.permute(1, 2, 3, 0), coefs).permute(3, 0, 1, 2) + streams)
        predictions = predictions.to(streams.dtype)
        out = run(predictions[self.active])
        weights = torch.nn.functional.linear(self._modalities(out), self.correction) + 1.0
        corrected = (out - predictions[self.active]).unsqueeze(0) * weights.permute(2, 0, 1).unsqueeze(-1)
        corrected = (corrected + predictions).to(out.dtype)
        if per_layer_input is not None:
            first = corrected[self.active]
            if self.output_scale is not None:
                first = first * self.output_scale
            corrected[1:] += self.gate.delta(first, per_layer_input)
        return corrected

    def tensors(self) -> Iterator[Weight]:
        yield from (self.router, self.router_norm, self.prediction, self.correction)
        if self.output_scale is not None:
            yield self.output_scale
        yield from self.gate.tensors()


@dataclass
class Laurel:
    left: Weight  # hidden -> rank
    right: Weight  # rank -> hidden
    norm: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + ops.rms_norm(project(project(x, self.left), self.right), self.norm, self.eps)

    def tensors(self) -> Iterator[Weight]:
        yield from (self.left, self.right, self.norm)
