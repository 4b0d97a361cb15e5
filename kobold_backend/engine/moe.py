"""Routed experts (Mixtral, Qwen3-MoE, GLM-4.5): a router picks the top-k experts of each token and only those run.

Every projection of the experts is stacked on a leading expert axis (`ExpertStack`), dense, GPTQ or a GGML block
format (GGUF's stacked `ffn_*_exps` tensors, rows kept as stored), so an expert is a view and a set of experts can
be gathered with device-side indices. Two execution paths, same math:

- grouped (prefill, and every CPU step): the chosen (token, expert) pairs are sorted by expert and each expert runs
  once on its rows; only experts that received a token are read;
- gathered (few rows on CUDA, i.e. decode, and any step being graph-captured): the chosen experts' weights are
  copied by device index into a buffer and each (token, slot) pair runs against its copy. The choice never reaches
  the host, so a decode step stays capturable in a CUDA graph, and only the routed experts' weights are read.

Routing follows transformers, in float32, by `Routing.scoring`:
- "softmax" (Mixtral, Qwen3-MoE, DeepSeek-V2): softmax over the router logits, top-k, optional renormalisation of
  the k weights to sum 1 (always for Mixtral, `norm_topk_prob` for Qwen3-MoE);
- "topk_softmax" (gpt-oss): top-k of the (biased) router logits, softmax over those k;
- "sigmoid" (DeepSeek-V3, GLM-4.5): sigmoid scores; the choice ranks scores + `correction_bias`
  (`e_score_correction_bias`), restricted to the `topk_group` best of `n_group` expert groups (a group ranked by
  the sum of its two best), the weights are the plain scores of the chosen, optionally renormalised (+1e-20).
DeepSeek's and GLM-4.5's router projections run in float32 (`Routing.fp32`), as transformers' do.
Weights are then multiplied by `scale` (`routed_scaling_factor`) and cast to the compute dtype; an expert's
output is down(act(gate(x) [+ b], up(x) [+ b])) [+ b] scaled by its routing weight, summed over the k experts.
`shared` experts (DeepSeek, GLM-4.5: one dense MLP of all of them together; Qwen3.5-MoE's sigmoid-gated one) run on
every token and are added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from kobold_backend import ops
from kobold_backend.engine.fuse import concat_outputs
from kobold_backend.ops.ggml import GGMLWeight
from kobold_backend.ops.gptq_weight import GPTQWeight

Weight = Union[torch.Tensor, GPTQWeight, GGMLWeight]
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# At most this many (token, expert) pairs take the gathered path on CUDA; more rows are prefill-sized and grouped.
GATHER_PAIRS = 16


def _project(x: torch.Tensor, w: Weight) -> torch.Tensor:
    if isinstance(w, GPTQWeight):
        return ops.gptq_matmul(x, w)
    if isinstance(w, GGMLWeight):
        return ops.ggml_matmul(x, w)
    return ops.linear(x, w)


@dataclass
class ExpertStack:
    """One projection of E experts: dense `weight` [E, N, K], or GPTQ `qweight` [E, K/8, N], `scales` and `zeros`
    [E, G, N], `perm` [E, K] or None (the layout of engine/gptq.py with an expert axis in front), or GGML blocks
    `blocks` uint8 [E, N, row_bytes] of type `ggml_type`."""

    in_features: int
    out_features: int
    weight: Optional[torch.Tensor] = None
    qweight: Optional[torch.Tensor] = None
    scales: Optional[torch.Tensor] = None
    zeros: Optional[torch.Tensor] = None
    perm: Optional[torch.Tensor] = None
    group_size: int = 0
    blocks: Optional[torch.Tensor] = None
    ggml_type: str = ""

    @classmethod
    def stack(cls, weights: Sequence[Weight]) -> ExpertStack:
        """Stack per-expert weights of one shape and kind (each expert is freed as soon as it is copied)."""
        first = weights[0]
        if isinstance(first, torch.Tensor):
            if not all(isinstance(w, torch.Tensor) and w.shape == first.shape for w in weights):
                raise ValueError("experts of one projection must all be dense and of one shape, or all GPTQ")
            return cls(int(first.shape[1]), int(first.shape[0]), weight=torch.stack(list(weights)))  # type: ignore[arg-type]
        if isinstance(first, GGMLWeight):
            if not all(isinstance(w, GGMLWeight) and w.bias is None and w.type_name == first.type_name
                       and w.data.shape == first.data.shape for w in weights):
                raise ValueError("GGML experts of one projection must share one block type and shape and have no bias")
            return cls(first.in_features, first.out_features, blocks=torch.stack([w.data for w in weights]),  # type: ignore[union-attr]
                       ggml_type=first.type_name)
        gw = [w for w in weights if isinstance(w, GPTQWeight)]
        if len(gw) != len(weights) or any(w.bias is not None for w in gw) or any(
                (w.qweight.shape, w.scales.shape, w.group_size) != (first.qweight.shape, first.scales.shape,
                                                                    first.group_size) for w in gw):
            raise ValueError("GPTQ experts of one projection must share shapes and group size and have no bias")
        perm = None
        if any(w.perm is not None for w in gw):
            identity = torch.arange(first.in_features, device=first.qweight.device)
            perm = torch.stack([identity if w.perm is None else w.perm for w in gw])
        return cls(first.in_features, first.out_features, qweight=torch.stack([w.qweight for w in gw]),
                   scales=torch.stack([w.scales for w in gw]), zeros=torch.stack([w.zeros for w in gw]),
                   perm=perm, group_size=first.group_size)

    @property
    def num_experts(self) -> int:
        held = next(t for t in (self.weight, self.qweight, self.blocks) if t is not None)
        return int(held.shape[0])

    def expert(self, e: int) -> Weight:
        """Expert e's weight (views, no copy)."""
        if self.weight is not None:
            return self.weight[e]
        if self.blocks is not None:
            return GGMLWeight(self.blocks[e], self.ggml_type, self.in_features, self.out_features)
        assert self.qweight is not None and self.scales is not None and self.zeros is not None
        return GPTQWeight(self.qweight[e], self.scales[e], self.zeros[e], None if self.perm is None else self.perm[e],
                          self.group_size, self.in_features, self.out_features)

    def gather(self, index: torch.Tensor) -> ExpertStack:
        """The experts named by the device tensor `index` (repeats allowed), copied into a new stack."""
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return ExpertStack(self.in_features, self.out_features, pick(self.weight), pick(self.qweight),
                           pick(self.scales), pick(self.zeros), pick(self.perm), self.group_size, pick(self.blocks),
                           self.ggml_type)

    def tensors(self) -> Iterator[torch.Tensor]:
        for t in (self.weight, self.qweight, self.scales, self.zeros, self.perm, self.blocks):
            if t is not None:
                yield t


def stack_expert_mlps(gates: Sequence[Weight], ups: Sequence[Weight],
                      downs: Sequence[Weight]) -> Tuple[ExpertStack, Optional[ExpertStack], ExpertStack]:
    """(gate_up, None, down) with gate and up fused per expert into one [gate; up] projection when every expert
    fuses (dense, GGML of one block type, or GPTQ with one act-order permutation for both), else (gate, up, down)."""
    fused: List[Optional[Weight]] = [concat_outputs([g, u]) for g, u in zip(gates, ups)]
    if all(f is not None for f in fused):
        return ExpertStack.stack(fused), None, ExpertStack.stack(downs)  # type: ignore[arg-type]
    return ExpertStack.stack(gates), ExpertStack.stack(ups), ExpertStack.stack(downs)


@dataclass(frozen=True)
class Routing:
    """How a router's logits pick experts (see the module docstring); the defaults are Mixtral's softmax."""

    scoring: str = "softmax"  # "softmax" | "topk_softmax" | "sigmoid"
    scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    #: the router projection runs in float32, a dense router's input and weight cast up (transformers' DeepSeek-V2/V3
    #: and GLM-4.5 routers); otherwise in the compute dtype (Mixtral, Qwen3-MoE, gpt-oss)
    fp32: bool = False


@dataclass
class ExpertBiases:
    """Per-expert output biases (gpt-oss): `gate_up` [E, width of the gate_up stack], `up` [E, I] when up is not
    fused, `down` [E, H]."""

    gate_up: torch.Tensor
    up: Optional[torch.Tensor]
    down: torch.Tensor

    def pick(self, index: torch.Tensor) -> ExpertBiases:
        up = None if self.up is None else self.up.index_select(0, index)
        return ExpertBiases(self.gate_up.index_select(0, index), up, self.down.index_select(0, index))

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from (t for t in (self.gate_up, self.up, self.down) if t is not None)


@dataclass
class DenseMLP:
    """An always-on dense MLP beside the routed experts (DeepSeek's shared experts): down(act(gate(x), up(x))),
    scaled by sigmoid(x @ out_gate^T) when it has an `out_gate` [1, H] (Qwen3.5-MoE's and Qwen3-Next's
    shared_expert_gate)."""

    gate: Weight
    up: Weight
    down: Weight
    act: Activation
    out_gate: Optional[Weight] = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = _project(self.act(_project(x, self.gate), _project(x, self.up)), self.down)
        return out if self.out_gate is None else torch.sigmoid(_project(x, self.out_gate)) * out

    def tensors(self) -> Iterator[Any]:
        yield from (w for w in (self.gate, self.up, self.down, self.out_gate) if w is not None)


@dataclass
class RoutedExperts:
    """A sparse MoE block. `gate_up` holds [gate; up] fused when `up` is None, else only the gate projection.

    `router_bias` [E] is added to the logits (gpt-oss); `correction_bias` [E] biases the choice only (DeepSeek-V3);
    `shared` is an always-on dense MLP added to the routed output (DeepSeek's shared experts)."""

    router: Weight  # [E, H]: router logits = x @ router^T
    gate_up: ExpertStack
    up: Optional[ExpertStack]
    down: ExpertStack
    top_k: int
    renormalize: bool
    act: Activation  # act(gate, up) -> act(gate) * up
    routing: Routing = Routing()
    router_bias: Optional[torch.Tensor] = None
    correction_bias: Optional[torch.Tensor] = None
    biases: Optional[ExpertBiases] = None
    shared: Optional[DenseMLP] = None

    @property
    def num_experts(self) -> int:
        return self.down.num_experts

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(weights [M, k] in x's dtype, expert ids [M, k]) for rows x [M, H]."""
        scoring = self.routing.scoring
        router = self.router
        if self.routing.fp32 and isinstance(router, torch.Tensor):
            logits = ops.linear(x.float(), router.float())
        else:
            logits = _project(x, router).float()
        if self.router_bias is not None:
            logits = logits + self.router_bias.float()
        if scoring == "topk_softmax":
            top, experts = logits.topk(self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        elif scoring == "sigmoid":
            weights, experts = self._grouped_choice(torch.sigmoid(logits))
        else:
            weights, experts = self._grouped_choice(torch.softmax(logits, dim=-1))
        if self.renormalize and scoring != "topk_softmax":
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0.0))
        return (weights * self.routing.scale).to(x.dtype), experts

    def _grouped_choice(self, scores: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Top-k of `scores` (+ correction bias) within the best `topk_group` of `n_group` groups; the weights are
        the scores themselves."""
        choice = scores if self.correction_bias is None else scores + self.correction_bias.float()
        groups = self.routing.n_group
        if groups > 1:
            m, e = choice.shape
            per_group = choice.view(m, groups, e // groups)
            # DeepSeek-V3 ranks a group by its two best biased scores, V2 by its best
            rank = per_group.topk(min(2, e // groups), dim=-1).values.sum(-1) if self.routing.scoring == "sigmoid" \
                else per_group.max(dim=-1).values
            keep = torch.zeros_like(rank).scatter_(1, rank.topk(self.routing.topk_group, dim=-1).indices, 1.0)
            choice = choice.masked_fill(keep.repeat_interleave(e // groups, dim=1) == 0, float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices
        return scores.gather(1, experts), experts

    def tensors(self) -> Iterator[Any]:
        """Every weight held (for Model.nbytes): the router (a tensor or a GPTQWeight), biases, the stacks' tensors
        and the shared experts'."""
        yield self.router
        yield from (t for t in (self.router_bias, self.correction_bias) if t is not None)
        if self.biases is not None:
            yield from self.biases.tensors()
        for stack in (self.gate_up, self.up, self.down):
            if stack is not None:
                yield from stack.tensors()
        if self.shared is not None:
            yield from self.shared.tensors()

    def unread_bytes_per_token(self) -> int:
        """Bytes of the experts one token does not read (all but top_k of them): for decode rooflines."""
        stacks = sum(sum(t.numel() * t.element_size() for t in s.tensors())
                     for s in (self.gate_up, self.up, self.down) if s is not None)
        return stacks * (self.num_experts - self.top_k) // self.num_experts

    def __call__(self, x: torch.Tensor, index: int = 0, passthrough: Optional[Any] = None) -> torch.Tensor:
        """The block's output for normed hidden states x [..., H]. Low-rank passthrough deltas address named
        dense projections and do not apply to experts."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        weights, experts = self.route(rows)
        # a step being captured into a CUDA graph cannot read the choice on the host, whatever its size
        if rows.is_cuda and (rows.shape[0] * self.top_k <= GATHER_PAIRS or torch.cuda.is_current_stream_capturing()):
            out = self._gathered(rows, weights, experts)
        else:
            out = self._grouped(rows, weights, experts)
        if self.shared is not None:
            out = out + self.shared(rows)
        return out.view(shape)

    def _mlp(self, x: torch.Tensor, gate_up: Weight, up: Optional[Weight], down: Weight,
             biases: Optional[ExpertBiases] = None, e: int = 0) -> torch.Tensor:
        """One expert on rows x; `biases`' row `e` are its biases."""
        gu = _project(x, gate_up)
        upv = None if up is None else _project(x, up)
        if biases is not None:
            gu = gu + biases.gate_up[e]
            if upv is not None and biases.up is not None:
                upv = upv + biases.up[e]
        if upv is None:
            gate, upv = gu.chunk(2, dim=-1)
        else:
            gate = gu
        out = _project(self.act(gate, upv), down)
        return out if biases is None else out + biases.down[e]

    def _grouped(self, rows: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        slot_weight = weights.reshape(-1)
        out = torch.zeros_like(rows)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            token = pairs // self.top_k
            up = None if self.up is None else self.up.expert(e)
            y = self._mlp(rows.index_select(0, token), self.gate_up.expert(e), up, self.down.expert(e), self.biases, e)
            out.index_add_(0, token, y * slot_weight.index_select(0, pairs).unsqueeze(-1))
        return out

    def _gathered(self, rows: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        m, k = experts.shape
        flat = experts.reshape(-1)
        gate_up = self.gate_up.gather(flat)
        up = None if self.up is None else self.up.gather(flat)
        down = self.down.gather(flat)
        biases = None if self.biases is None else self.biases.pick(flat)
        outs = [self._mlp(rows[j // k : j // k + 1], gate_up.expert(j), None if up is None else up.expert(j),
                          down.expert(j), biases, j) for j in range(m * k)]
        y = torch.cat(outs, dim=0) * weights.reshape(-1, 1)
        return y.view(m, k, -1).sum(dim=1)
