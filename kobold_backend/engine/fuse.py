"""Load-time fusion of projections that read the same input (q/k/v, gate/up) into one wider weight.

One wide product replaces two or three narrow ones: fewer launches per token and better use of the
GPU. GPTQ layers fuse only when their act-order permutations agree.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from kobold_backend.ops.gptq_weight import GPTQWeight

Weight = Union[torch.Tensor, GPTQWeight]


def concat_outputs(weights: Sequence[Weight]) -> Optional[Weight]:
    """A weight whose output is the concatenation of the given weights' outputs, or None if they can't fuse."""
    first = weights[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(w, torch.Tensor) and w.dtype == first.dtype and w.device == first.device
                   for w in weights):
            return None
        return torch.cat(list(weights), dim=0)  # type: ignore[arg-type]
    if not all(isinstance(w, GPTQWeight) for w in weights):
        return None
    gw = [w for w in weights if isinstance(w, GPTQWeight)]
    same = all(
        w.group_size == first.group_size and w.in_features == first.in_features
        and (w.bias is None) == (first.bias is None) for w in gw
    )
    perms = [w.perm for w in gw]
    if perms[0] is None:
        same = same and all(p is None for p in perms)
    else:
        same = same and all(p is not None and torch.equal(p, perms[0]) for p in perms)
    if not same:
        return None
    return GPTQWeight(
        qweight=torch.cat([w.qweight for w in gw], dim=1),
        scales=torch.cat([w.scales for w in gw], dim=1),
        zeros=torch.cat([w.zeros for w in gw], dim=1),
        perm=first.perm,
        group_size=first.group_size,
        in_features=first.in_features,
        out_features=sum(w.out_features for w in gw),
        bias=None if first.bias is None else torch.cat([w.bias for w in gw]),  # type: ignore[misc]
    )
