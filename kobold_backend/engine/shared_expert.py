"""A routed MoE block plus an always-on shared expert scaled by a sigmoid gate (Qwen3.5-MoE, Qwen3-Next):
out = experts(x) + sigmoid(x @ shared_gate^T) * down(act(gate(x), up(x)))."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from kobold_backend.engine.model import Weight, project


@dataclass
class WithSharedExpert:
    """`routed` (engine/moe.py RoutedExperts) and the shared expert's dense MLP with its [1, H] gate."""

    routed: Any
    gate: Weight
    up: Weight
    down: Weight
    shared_gate: Weight
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def tensors(self) -> Iterator[Any]:
        yield from self.routed.tensors()
        yield from (self.gate, self.up, self.down, self.shared_gate)

    def __call__(self, x: torch.Tensor, index: int = 0, passthrough: Optional[Any] = None) -> torch.Tensor:
        shared = project(self.act(project(x, self.gate), project(x, self.up)), self.down)
        return self.routed(x, index, passthrough) + torch.sigmoid(project(x, self.shared_gate)) * shared
