"""The `steer` action: add strength x vector to the residual stream after chosen decoder layers (repeng's
ControlModule / llama.cpp's control vectors), optionally rescaled back to the pre-steering norm."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from kobold_backend.engine.passthrough.base import Action, ActionContext
from kobold_backend.engine.passthrough.checks import (
    as_bool,
    as_entries,
    as_layers,
    as_number,
    as_object,
    resolve_in,
    type_name,
)
from kobold_backend.engine.passthrough.controlvector import ControlVector, ControlVectorError, load_control_vector

STEER_KEYS = ("vector", "strength", "layers", "normalize")
VECTOR_SUFFIXES = ("", ".gguf", ".safetensors")


class SteerAction(Action):
    """Entries are applied in request order; each adds its (pre-scaled) vector to the layers it names."""

    def __init__(self, by_layer: Dict[int, List[Tuple[torch.Tensor, bool]]]) -> None:
        self.by_layer = by_layer
        self.layers = frozenset(by_layer)

    def after_layer(self, index: int, hidden: torch.Tensor, pos: int) -> Optional[torch.Tensor]:
        for vec, normalize in self.by_layer.get(index, ()):
            if normalize:
                h = hidden.float()
                steered = h + vec.float()
                scale = h.norm(dim=-1, keepdim=True) / steered.norm(dim=-1, keepdim=True).clamp_min(1e-30)
                hidden = (steered * scale).to(hidden.dtype)
            else:
                hidden = hidden + vec
        return hidden


def _inline_vector(value: List[Any], ctx: ActionContext, sub: str) -> torch.Tensor:
    limit = ctx.config.max_inline_vector
    if len(value) > limit:
        raise ctx.error(f"an inline vector may hold at most {limit} numbers, not {len(value)}", sub)
    if len(value) != ctx.hidden_size:
        raise ctx.error(f"has {len(value)} numbers but the model's hidden size is {ctx.hidden_size}", sub)
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ctx.error(f"item {i} must be a number, not {type_name(v)}", sub)
    vec = torch.tensor([float(v) for v in value], dtype=torch.float32)
    if not bool(torch.isfinite(vec).all()):
        raise ctx.error("holds non-finite numbers", sub)
    return vec


def _file_vector(name: Any, ctx: ActionContext, sub: str) -> ControlVector:
    path = resolve_in(ctx.config.vectors_dir, name, ctx, sub, "control-vector", VECTOR_SUFFIXES)
    if not path.is_file():
        raise ctx.error(f"control vector {name!r} is not a file", sub)
    stat = path.stat()
    try:
        cv: ControlVector = ctx.config.vector_cache.get_or_load(
            (str(path), stat.st_mtime_ns, stat.st_size), lambda: load_control_vector(path))
    except ControlVectorError as e:
        raise ctx.error(f"control vector {name!r}: {e}", sub) from e
    for index, direction in cv.directions.items():
        if index >= ctx.num_layers:
            raise ctx.error(f"control vector {name!r} has direction.{index} but this model has layers "
                            f"0..{ctx.num_layers - 1}", sub)
        if direction.numel() != ctx.hidden_size:
            raise ctx.error(f"control vector {name!r} has length {direction.numel()} (direction.{index}) but the "
                            f"model's hidden size is {ctx.hidden_size}", sub)
    return cv


def build_steer(params: Any, ctx: ActionContext) -> SteerAction:
    """`{"vector": name | [floats], "strength": 1.0, "layers": [..], "normalize": false}` or a list of them."""
    by_layer: Dict[int, List[Tuple[torch.Tensor, bool]]] = {}
    for i, entry in enumerate(as_entries(params, ctx, ctx.config.max_steer_entries)):
        sub = f"[{i}]" if isinstance(params, list) else ""
        e = as_object(entry, ctx, sub, STEER_KEYS)
        if "vector" not in e:
            raise ctx.error("needs 'vector': a control-vector name or a list of floats", sub)
        strength = as_number(e.get("strength", 1.0), ctx, sub + ".strength")
        normalize = as_bool(e.get("normalize", False), ctx, sub + ".normalize")
        layers = as_layers(e["layers"], ctx, sub + ".layers") if "layers" in e else None
        vector = e["vector"]
        if isinstance(vector, list):
            direction = _inline_vector(vector, ctx, sub + ".vector")
            if layers is None:
                raise ctx.error("an inline vector needs 'layers' (the layers to add it after)", sub + ".layers")
            directions = {index: direction for index in layers}
        elif isinstance(vector, str):
            cv = _file_vector(vector, ctx, sub + ".vector")
            if layers is None:
                layers = list(cv.directions)
            missing = [index for index in layers if index not in cv.directions]
            if missing:
                raise ctx.error(f"control vector {vector!r} has no direction for layer {missing[0]} (it has "
                                f"{', '.join(str(k) for k in cv.directions)})", sub + ".layers")
            directions = {index: cv.directions[index] for index in layers}
        else:
            raise ctx.error(f"must be a control-vector name or a list of floats, not {type_name(vector)}",
                            sub + ".vector")
        for index, direction in directions.items():
            scaled = (strength * direction).to(device=ctx.layer_device(index), dtype=ctx.layer_dtype(index))
            by_layer.setdefault(index, []).append((scaled, normalize))
    return SteerAction(by_layer)
