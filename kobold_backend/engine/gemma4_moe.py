"""Gemma 4's mixture-of-experts block (26B-A4B), read as transformers' modeling_gemma4 computes it: beside the
dense MLP, a router on the residual stream sends each token to `top_k_experts` of `num_experts` experts.

The layer hands this block the residual stream normed without a weight (its `post_norm` is ones); the block applies
each branch's own norm weight to it: the dense MLP reads it times `pre_feedforward_layernorm`, the experts times
`pre_feedforward_layernorm_2`, the router times `router.scale * hidden ** -0.5`. Router: softmax in float32, top-k,
weights renormalised to sum 1, then times `per_expert_scale`. Output:
`norm_1(dense) + norm_2(experts)`; the layer applies `post_feedforward_layernorm` after it.

Experts are stored stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]). Many rows (prefill)
run each chosen expert once on its rows; a few rows (decode) gather the chosen experts' weights by device index, so
a CUDA graph can capture the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Tuple

import torch
import torch.nn.functional as F

from kobold_backend import ops
from kobold_backend.engine.model import Weight, project

#: rows up to which the gathered (graph-capturable) path runs
GATHER_ROWS = 16


@dataclass
class Gemma4MoE:
    gate: Weight  # dense MLP
    up: Weight
    down: Weight
    dense_norm: torch.Tensor  # pre_feedforward_layernorm
    dense_out_norm: torch.Tensor  # post_feedforward_layernorm_1
    router: torch.Tensor  # [E, H]
    router_scale: torch.Tensor  # [H]
    expert_scale: torch.Tensor  # [E]
    expert_norm: torch.Tensor  # pre_feedforward_layernorm_2
    expert_out_norm: torch.Tensor  # post_feedforward_layernorm_2
    gate_up: torch.Tensor  # [E, 2I, H]
    experts_down: torch.Tensor  # [E, H, I]
    top_k: int
    eps: float

    def __call__(self, x: torch.Tensor, index: int, passthrough: Any) -> torch.Tensor:
        d = x * self.dense_norm
        dense = project(ops.gelu_tanh_mul(project(d, self.gate), project(d, self.up)), self.down)
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.route(flat)
        xe = flat * self.expert_norm
        run = self._gathered if flat.shape[0] <= GATHER_ROWS else self._grouped
        out = run(xe, weights, experts).view_as(x)
        return ops.rms_norm(dense, self.dense_out_norm, self.eps) + ops.rms_norm(out, self.expert_out_norm, self.eps)

    def route(self, flat: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        scaled = flat * self.router_scale * flat.shape[-1] ** -0.5
        probs = torch.softmax(F.linear(scaled, self.router).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.expert_scale.float()[experts], experts

    def _expert(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(ops.gelu_tanh_mul(gate, up), down)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            rows, slot = torch.where(experts == e)
            y = self._expert(x[rows], self.gate_up[e], self.experts_down[e]) * weights[rows, slot, None].to(x.dtype)
            out.index_add_(0, rows, y)
        return out

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up.index_select(0, experts.reshape(-1)).view(*experts.shape, *self.gate_up.shape[1:])
        down = self.experts_down.index_select(0, experts.reshape(-1)).view(*experts.shape,
                                                                            *self.experts_down.shape[1:])
        h = torch.einsum("rd,rkod->rko", x, gate_up)
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("rki,rkoi->rko", ops.gelu_tanh_mul(gate, up), down)
        return (y * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)

    def tensors(self) -> Iterator[Any]:
        yield from (self.gate, self.up, self.down, self.dense_norm, self.dense_out_norm, self.router,
                    self.router_scale, self.expert_scale, self.expert_norm, self.expert_out_norm, self.gate_up,
                    self.experts_down)
