"""Load-time fold of an act-order down_proj's input permutation into the outputs of gate/up.

An act-order GPTQ linear keeps its rows sorted by group and gathers its input through `perm` on every call
(engine/gptq.py). For down_proj that input is act(gate) * up, which is elementwise in the intermediate
features, so storing gate's and up's output columns in down's `perm` order makes the intermediate arrive
already permuted: down then runs with `perm=None` and no gather, with the same products and sums as before.

The permutation stays on the layer as `mlp_perm` (the intermediate as stored: feature j is the checkpoint's
feature mlp_perm[j]) for the code that addresses the intermediate in checkpoint order: passthrough deltas
(LoRA) on gate/up/down, mapped in Model._delta.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch

from kobold_backend.ops.gptq_weight import GPTQWeight

if TYPE_CHECKING:
    from kobold_backend.engine.model import Layer

Foldable = Union[torch.Tensor, GPTQWeight]


def fold_down_permutation(layer: Layer) -> None:
    """Move down_proj's act-order input permutation into gate/up's output columns, in place, when exact.

    Needs a plain gate/up/down MLP (no routed `mlp`), an act-order GPTQ down_proj and gate/up (separate, or
    stored fused as gate_up_proj) that are GPTQ or dense weights; otherwise the layer is left as it is."""
    down = layer.down_proj
    if layer.mlp is not None or not isinstance(down, GPTQWeight) or down.perm is None:
        return
    perm = down.perm
    inter = down.in_features
    if layer.gate_up_proj is not None:
        parts = {"gate_up_proj": torch.cat([perm, perm + inter])}
    else:
        parts = {"gate_proj": perm, "up_proj": perm}
    weights = {name: getattr(layer, name) for name in parts}
    if not all(isinstance(w, (torch.Tensor, GPTQWeight)) for w in weights.values()):
        return
    for name, cols in parts.items():
        setattr(layer, name, permute_outputs(weights[name], cols.to(_device(weights[name]))))
        bias: Optional[torch.Tensor] = layer.biases.get(name)
        if bias is not None:
            layer.biases[name] = bias.index_select(0, cols.to(bias.device))
    layer.down_proj = GPTQWeight(down.qweight, down.scales, down.zeros, None, down.group_size, down.in_features,
                                 down.out_features, down.bias, down.bits)
    layer.mlp_perm = perm


def permute_outputs(w: Foldable, cols: torch.Tensor) -> Foldable:
    """The same linear with output j computing the given weight's output cols[j]."""
    if isinstance(w, torch.Tensor):
        return w.index_select(0, cols).contiguous()  # dense [N, K]: a row per output
    return GPTQWeight(
        qweight=w.qweight.index_select(1, cols).contiguous(),  # packing runs along K, so columns move whole
        scales=w.scales.index_select(1, cols).contiguous(),
        zeros=w.zeros.index_select(1, cols).contiguous(),
        perm=w.perm,
        group_size=w.group_size,
        in_features=w.in_features,
        out_features=w.out_features,
        bias=None if w.bias is None else w.bias.index_select(0, cols).contiguous(),
        bits=w.bits,
    )


def _device(w: Foldable) -> torch.device:
    return w.device if isinstance(w, torch.Tensor) else w.qweight.device
