"""The `lora` action: PEFT LoRA adapters (lora_dir/<name>/adapter_config.json + adapter_model.safetensors)
applied per request as y = W x + scale * scaling * B (A x) through linear_delta, base weights untouched.

scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora; adapters are loaded once per model layout
and kept in an LRU cache on the devices of the layers they target.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from kobold_backend.engine.passthrough.base import Action, ActionContext
from kobold_backend.engine.passthrough.checks import as_entries, as_number, as_object, resolve_in

LORA_KEYS = ("name", "scale")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Checkpoints that store q/k/v or gate/up fused (Phi-3) get adapters on the fused module: its B rows are the parts'.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "qkv_proj": "self_attn", "gate_up_proj": "mlp"}


class LoraFormatError(ValueError):
    """An adapter folder this engine cannot apply; the message names what was found."""


@dataclass
class LoraAdapter:
    """targets[(layer, proj)] = (A^T [in, r], (scaling * B)^T [r, out]) on the layer's device and dtype."""

    targets: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]]


def projection_dims(config: Any) -> Dict[str, Tuple[int, int]]:
    """(in_features, out_features) of each projection, from the model config (weights may be fused at load); an
    output-gated attention's q_proj yields the gate too."""
    h, i = int(config.hidden_size), int(config.intermediate_size)
    q, kv = int(config.num_heads * config.head_dim), int(config.num_kv_heads * config.head_dim)
    features = getattr(config, "features", None)
    q_out = 2 * q if features is not None and features.attn_output_gate else q
    return {"q_proj": (h, q_out), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _check_config(cfg: Dict[str, Any]) -> Tuple[float, bool]:
    """(lora_alpha, use_rslora) after refusing every PEFT option this engine does not implement."""
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraFormatError(f"peft_type is {peft_type}; only LORA adapters are supported")
    if cfg.get("fan_in_fan_out"):
        raise LoraFormatError("fan_in_fan_out adapters (GPT-2 style Conv1D) are not supported")
    if cfg.get("use_dora"):
        raise LoraFormatError("DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoraFormatError(f"bias={cfg.get('bias')!r} is not supported; only bias='none'")
    if cfg.get("lora_bias"):
        raise LoraFormatError("lora_bias adapters are not supported")
    if cfg.get("modules_to_save"):
        raise LoraFormatError(f"modules_to_save ({cfg['modules_to_save']}) replaces whole modules; not supported")
    if cfg.get("alpha_pattern"):
        raise LoraFormatError("per-module alpha_pattern is not supported")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraFormatError(f"lora_alpha is {alpha!r}, not a number")
    return float(alpha), bool(cfg.get("use_rslora", False))


def load_lora(folder: Path, model: Any) -> LoraAdapter:
    """Read and check one PEFT adapter folder against `model`; tensors go to each target layer's device/dtype."""
    from safetensors import safe_open

    config_path = folder / "adapter_config.json"
    weights_path = folder / "adapter_model.safetensors"
    if not config_path.is_file():
        raise LoraFormatError("adapter_config.json is missing")
    if not weights_path.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise LoraFormatError("only adapter_model.bin is present; convert it to adapter_model.safetensors")
        raise LoraFormatError("adapter_model.safetensors is missing")
    try:
        cfg = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LoraFormatError(f"adapter_config.json is not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise LoraFormatError("adapter_config.json is not a JSON object")
    alpha, rslora = _check_config(cfg)
    num_layers = len(model.layers)
    dims = projection_dims(model.config)
    pieces: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            # LoRA keys first, so an adapter on lm_head is refused for its target, not for its saved base weight.
            for key in sorted(f.keys(), key=lambda k: "lora_" not in k):
                if "lora_" not in key:
                    raise LoraFormatError(f"tensor {key} is a whole weight, not a LoRA A/B pair (saved embedding "
                                          "or modules_to_save layers are not supported)")
                match = _KEY.search(key)
                if match is None:
                    raise LoraFormatError(f"tensor {key} targets a module kobold_backend cannot apply LoRA to "
                                          f"(supported: {', '.join(PROJECTIONS)} in the decoder layers)")
                layer, block, proj, which = int(match.group(1)), match.group(2), match.group(3), match.group(4)
                if proj not in _BLOCK or _BLOCK[proj] != block:
                    raise LoraFormatError(f"tensor {key} targets {block}.{proj}, which kobold_backend cannot apply "
                                          f"LoRA to (supported: {', '.join(list(PROJECTIONS) + list(FUSED))})")
                if layer >= num_layers:
                    raise LoraFormatError(f"tensor {key} is for layer {layer} but the model has {num_layers} layers")
                if block == "self_attn" and model.layers[layer].mixer is not None:
                    raise LoraFormatError(f"tensor {key} targets the attention of layer {layer}, whose token mixer "
                                          "(linear attention) takes no LoRA; only its MLP can be adapted")
                pieces.setdefault((layer, proj), {})[which] = f.get_tensor(key)
    except LoraFormatError:
        raise
    except Exception as e:
        raise LoraFormatError(f"adapter_model.safetensors cannot be read ({e})") from e
    if not pieces:
        raise LoraFormatError("adapter_model.safetensors holds no LoRA weights")
    targets: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj), ab in sorted(pieces.items()):
        if set(ab) != {"A", "B"}:
            raise LoraFormatError(f"layer {layer} {proj} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        parts = FUSED.get(proj, (proj,))
        in_f, out_f = dims[parts[0]][0], sum(dims[p][1] for p in parts)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
            raise LoraFormatError(f"layer {layer} {proj}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not "
                                  f"fit a [{out_f}, {in_f}] projection (expected A [r, {in_f}], B [{out_f}, r])")
        r = int(a.shape[0])
        scaling = alpha / (math.sqrt(r) if rslora else r)
        dev, dtype = model.layers[layer].device, model.layers[layer].input_norm.dtype
        a_t = a.float().t().contiguous().to(device=dev, dtype=dtype)
        start = 0
        for part in parts:  # a fused module's delta is its parts' deltas stacked: B's rows split the same way
            if (layer, part) in targets:
                raise LoraFormatError(f"layer {layer} {part} is adapted twice (as {part} and inside {proj})")
            end = start + dims[part][1]
            b_t = (scaling * b[start:end].float()).t().contiguous().to(device=dev, dtype=dtype)
            targets[(layer, part)] = (a_t, b_t)
            start = end
    return LoraAdapter(targets)


class LoraAction(Action):
    """Sums scale_j * scaling_j * B_j(A_j x) over the request's adapters for each targeted projection."""

    def __init__(self, by_target: Dict[Tuple[int, str], List[Tuple[torch.Tensor, torch.Tensor, float]]]) -> None:
        self.by_target = by_target

    def linear_delta(self, index: int, proj: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        parts = self.by_target.get((index, proj))
        if not parts:
            return None
        delta: Optional[torch.Tensor] = None
        for a_t, b_t, scale in parts:
            d = torch.matmul(torch.matmul(x, a_t) * scale, b_t)
            delta = d if delta is None else delta + d
        return delta


def _layout_key(model: Any) -> Tuple[Any, ...]:
    cfg = model.config
    devices = tuple((str(layer.device), str(layer.input_norm.dtype)) for layer in model.layers)
    return (cfg.num_layers, tuple(sorted(projection_dims(cfg).items())), devices)


def build_lora(params: Any, ctx: ActionContext) -> LoraAction:
    """`[{"name": adapter, "scale": 1.0}, ...]` (or one such object)."""
    by_target: Dict[Tuple[int, str], List[Tuple[torch.Tensor, torch.Tensor, float]]] = {}
    for i, entry in enumerate(as_entries(params, ctx, ctx.config.max_loras)):
        sub = f"[{i}]" if isinstance(params, list) else ""
        e = as_object(entry, ctx, sub, LORA_KEYS)
        if "name" not in e:
            raise ctx.error("needs 'name': an adapter folder in the server's LoRA folder", sub + ".name")
        scale = as_number(e.get("scale", 1.0), ctx, sub + ".scale")
        folder = resolve_in(ctx.config.lora_dir, e["name"], ctx, sub + ".name", "LoRA adapter")
        if not folder.is_dir():
            raise ctx.error(f"LoRA adapter {e['name']!r} is not a folder", sub + ".name")
        stamp = tuple(
            (p.stat().st_mtime_ns, p.stat().st_size) if p.exists() else None
            for p in (folder / "adapter_config.json", folder / "adapter_model.safetensors")
        )
        key = (str(folder), stamp, _layout_key(ctx.model))
        try:
            adapter: LoraAdapter = ctx.config.lora_cache.get_or_load(key, lambda f=folder: load_lora(f, ctx.model))
        except LoraFormatError as err:
            raise ctx.error(f"LoRA adapter {e['name']!r}: {err}", sub + ".name") from err
        for target, (a_t, b_t) in adapter.targets.items():
            by_target.setdefault(target, []).append((a_t, b_t, scale))
    return LoraAction(by_target)
