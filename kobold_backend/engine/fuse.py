"""Load-time fusion of projections that read the same input (q/k/v, gate/up) into one wider weight.

One wide product replaces two or three narrow ones: fewer launches per token and better use of the
GPU. GPTQ layers fuse only when their act-order permutations agree; GGML block layers when they share a format.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from kobold_backend.ops.ggml import GGMLWeight
from kobold_backend.ops.gptq_weight import GPTQWeight

Weight = Union[torch.Tensor, GPTQWeight, GGMLWeight]


def concat_outputs(weights: Sequence[Weight]) -> Optional[Weight]:
    """A weight whose output is the concatenation of the given weights' outputs, or None if they can't fuse."""
    first = weights[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(w, torch.Tensor) and w.dtype == first.dtype and w.device == first.device
                   for w in weights):
            return None
        return torch.cat(list(weights), dim=0)  # type: ignore[arg-type]
    if all(isinstance(w, GGMLWeight) for w in weights):
        return _concat_ggml([w for w in weights if isinstance(w, GGMLWeight)])
    if not all(isinstance(w, GPTQWeight) for w in weights):
        return None
    gw = [w for w in weights if isinstance(w, GPTQWeight)]
    same = all(
        w.group_size == first.group_size and w.in_features == first.in_features and w.bits == first.bits
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
        bits=first.bits,
    )


def _concat_ggml(weights: List[GGMLWeight]) -> Optional[GGMLWeight]:
    """Rows of blocks stack like dense rows when every part has the same format and input size."""
    first = weights[0]
    if not all(w.type_name == first.type_name and w.in_features == first.in_features
               and w.data.device == first.data.device and (w.bias is None) == (first.bias is None) for w in weights):
        return None
    return GGMLWeight(
        data=torch.cat([w.data for w in weights], dim=0),
        type_name=first.type_name,
        in_features=first.in_features,
        out_features=sum(w.out_features for w in weights),
        bias=None if first.bias is None else torch.cat([w.bias for w in weights]),  # type: ignore[misc]
    )
