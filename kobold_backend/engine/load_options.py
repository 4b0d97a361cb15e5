"""The engine's load options: their schema in KoboldAI United's parameter-dict format (rendered by the United
plugin and by the server's web page alike), and their conversion into load_model() arguments with the layer
split planned against free memory by kobold_backend.engine.device_map.

Parameter ids: "valid_layers" (the "Valid Display" total), "<i>_Layers" per CUDA device, "CPU_Layers",
"max_ctx", "compress_emb", "ntk_alpha", "cache_dtype" (the compute dtype), "kv_cache" (the KV cache's storage:
fp16, q8, q4, k8v4), "embed_on_cpu", "threads" (CPU threads; 0 = the physical cores), "speculative", "draft_model",
"draft_tokens". Saved settings use the same ids.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.cpu_threads import MAX_THREADS, default_threads
from kobold_backend.engine.device_map import HardwareProbe, plan_split
from kobold_backend.engine.speculative import MAX_DRAFT_TOKENS
from kobold_backend.errors import KoboldBackendError, RequestError

CPU_LAYERS = "CPU_Layers"
MENU_LAYERS = "Layers"
MENU_CONFIG = "Configuration"
CACHE_DTYPES = (  # short texts: a dropdown shows one line (the page's is about 290 pixels wide); the tooltip explains
    ("auto", "Auto (by device and checkpoint)"),
    ("float16", "16-bit float (float16)"),
    ("bfloat16", "16-bit brain float (bfloat16)"),
    ("float32", "32-bit float (float32)"),
)
SPECULATIVE_MODES = (
    ("off", "Off"),
    ("ngram", "Prompt lookup (n-gram drafts)"),
    ("draft", "Draft model (the folder below)"),
)
NO_DRAFT = "none"  # the draft-folder field's empty value (United refuses a parameter whose default is "")
KV_CACHES = (
    ("fp16", "16-bit (exact)"),
    ("q8", "8-bit (half the memory)"),
    ("k8v4", "8-bit keys, 4-bit values"),
    ("q4", "4-bit (a quarter; some loss)"),
)
CTX_STEP = 256
DEFAULT_CTX_CAP = 8192


def gpu_names() -> List[str]:
    """Names of the CUDA devices torch sees, in index order ([] without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def layer_ids(gpu_count: int) -> List[str]:
    return [f"{i}_Layers" for i in range(gpu_count)] + [CPU_LAYERS]


def _as_int(value: Any, name: str) -> int:
    """A whole number (a JSON number or a string holding one, as United's forms send); NaN and infinities are
    refused like any other non-number."""
    try:
        number = float(value)
        if not math.isfinite(number):
            raise ValueError
        return int(number)
    except (TypeError, ValueError, OverflowError):
        raise RequestError(f"{name} must be a whole number, got {value!r:.40}", name) from None


def _as_float(value: Any, name: str) -> float:
    """A finite number (NaN and infinities refused)."""
    try:
        number = float(value)
        if not math.isfinite(number):
            raise ValueError
        return number
    except (TypeError, ValueError, OverflowError):
        raise RequestError(f"{name} must be a finite number, got {value!r:.40}", name) from None


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _ctx_range(native: int) -> Dict[str, int]:
    default = min(native, DEFAULT_CTX_CAP)
    return {
        "min": min(CTX_STEP, default),
        "max": min(max(16384, native * 4), max(native, 131072)),
        "default": default,
    }


def _default_split(num_layers: int, gpu_count: int) -> Dict[str, int]:
    split = {key: 0 for key in layer_ids(gpu_count)}
    split["0_Layers" if gpu_count else CPU_LAYERS] = num_layers
    return split


def _saved_split(saved: Dict[str, Any], num_layers: int, gpu_count: int) -> Dict[str, int]:
    """The saved layer split if it names every current device and sums to the layer count, else the default."""
    ids = layer_ids(gpu_count)
    try:
        split = {key: _as_int(saved[key], key) for key in ids}
    except (KeyError, RequestError):
        return _default_split(num_layers, gpu_count)
    if sum(split.values()) != num_layers or min(split.values()) < 0:
        return _default_split(num_layers, gpu_count)
    return split


def _error_parameters(reason: str) -> List[Dict[str, Any]]:
    """A display entry whose check can never pass, so United keeps Load disabled and shows why."""
    return [{
        "uitype": "Valid Display",
        "unit": "text",
        "label": f"kobold_backend cannot load this model: {reason}",
        "id": "valid_model",
        "default": "",
        "tooltip": reason,
        "check": {"sum": [], "value": 1, "check": "="},
        "check_message": reason,
        "menu_path": MENU_CONFIG,
        "extra_classes": "",
        "refresh_model_inputs": False,
    }]


def requested_parameters(
    model_path: Optional[Union[str, Path]],
    saved: Optional[Dict[str, Any]] = None,
    gpus: Optional[Sequence[str]] = None,
) -> List[Dict[str, Any]]:
    """United's parameter dicts for this model folder; `saved` values (same ids) replace the defaults.

    `gpus` are the CUDA device names (default: what torch sees). A folder this engine cannot run gets a
    single display entry naming the reason, which keeps United's Load button disabled.
    """
    if model_path is None:
        return _error_parameters("no model folder was given and none was found under models/.")
    try:
        config = ModelConfig.from_dir(model_path)
    except KoboldBackendError as exc:
        return _error_parameters(str(exc))
    saved = dict(saved or {})
    names = list(gpu_names() if gpus is None else gpus)
    n = config.num_layers
    split = _saved_split(saved, n, len(names))
    ids = layer_ids(len(names))
    check = {"sum": ids, "value": n, "check": "="}
    params: List[Dict[str, Any]] = [{
        "uitype": "Valid Display",
        "unit": "text",
        "label": f"Current Allocated Layers: %1/{n}",
        "id": "valid_layers",
        "default": "",
        "tooltip": "Every layer must be placed on exactly one device.",
        "max": n,
        "step": 1,
        "check": dict(check),
        "menu_path": MENU_LAYERS,
        "extra_classes": "",
        "refresh_model_inputs": False,
    }]
    devices = [(f"{i}_Layers", f"{name} Layers", f"GPU {i} ({name})") for i, name in enumerate(names)]
    devices.append((CPU_LAYERS, "CPU (system RAM) Layers", "the CPU, in system RAM (slow)"))
    for key, label, where in devices:
        params.append({
            "uitype": "slider",
            "unit": "int",
            "label": label,
            "id": key,
            "min": 0,
            "max": n,
            "step": 1,
            "default": split[key],
            "tooltip": f"The number of the model's {n} layers to run on {where}.",
            "check": dict(check),
            "check_message": f"The sum of assigned layers must equal {n}",
            "menu_path": MENU_LAYERS,
            "extra_classes": "",
            "refresh_model_inputs": False,
        })
    ctx = _ctx_range(config.max_position_embeddings)
    max_ctx = ctx["default"]
    if "max_ctx" in saved:
        try:
            max_ctx = max(ctx["min"], min(ctx["max"], _as_int(saved["max_ctx"], "max_ctx")))
        except RequestError:
            max_ctx = ctx["default"]
    params.append({
        "uitype": "slider",
        "unit": "int",
        "label": "Maximum Context",
        "id": "max_ctx",
        "min": ctx["min"],
        "max": ctx["max"],
        "step": CTX_STEP,
        "default": max_ctx,
        "tooltip": (f"Tokens of context the KV cache holds (the model was trained on "
                    f"{config.max_position_embeddings}; go beyond that only with RoPE scaling below)."),
        "menu_path": MENU_CONFIG,
        "extra_classes": "",
        "refresh_model_inputs": False,
    })
    params.append(_float_slider(
        "compress_emb", "Embedding Compression (linear RoPE)", 1.0, 8.0, 0.25, saved,
        "Divide positions by this factor (SuperHOT-style linear RoPE scaling), on top of any scaling in "
        "config.json. Use the value the model was fine-tuned with; 1 = off.",
    ))
    params.append(_float_slider(
        "ntk_alpha", "NTK alpha (RoPE base scaling)", 1.0, 32.0, 0.25, saved,
        "NTK-aware RoPE scaling: the RoPE base is multiplied by alpha^(d/(d-2)). Around 2.6 doubles the "
        "usable context of an unscaled model; 1 = off.",
    ))
    dtype = str(saved.get("cache_dtype", "auto"))
    params.append({
        "uitype": "dropdown",
        "unit": "text",
        "label": "Compute / KV cache dtype",
        "id": "cache_dtype",
        "default": dtype if dtype in dict(CACHE_DTYPES) else "auto",
        "tooltip": "The dtype of activations and of the KV cache. Auto: float16 on a GPU, bfloat16 for bfloat16 "
                   "checkpoints, float32 on the CPU (layers on the CPU always use float32, which takes twice the "
                   "memory of 16 bits).",
        "children": [{"text": text, "value": value} for value, text in CACHE_DTYPES],
        "menu_path": MENU_CONFIG,
        "extra_classes": "",
        "refresh_model_inputs": False,
    })
    kv = str(saved.get("kv_cache", "fp16"))
    params.append({
        "uitype": "dropdown",
        "unit": "text",
        "label": "KV cache quantization",
        "id": "kv_cache",
        "default": kv if kv in dict(KV_CACHES) else "fp16",
        "tooltip": ("How the KV cache stores keys and values: 8- or 4-bit groups of 32 with fp16 scales fit a "
                    "longer context in the same memory (like exllamav2's Q8/Q4 cache or KoboldCpp's --quantkv): "
                    "16-bit is the compute dtype, exact; 8-bit about half of it, near-lossless; 8-bit keys with "
                    "4-bit values about 40 %; 4-bit about a quarter, with a small quality loss."),
        "children": [{"text": text, "value": value} for value, text in KV_CACHES],
        "menu_path": MENU_CONFIG,
        "extra_classes": "",
        "refresh_model_inputs": False,
    })
    params.append({
        "uitype": "toggle",
        "unit": "bool",
        "label": "Embeddings in system RAM",
        "id": "embed_on_cpu",
        "default": _as_bool(saved.get("embed_on_cpu", False)),
        "tooltip": "Keep the token embedding table in system RAM instead of GPU memory (saves VRAM).",
        "menu_path": MENU_CONFIG,
        "extra_classes": "",
        "refresh_model_inputs": False,
    })
    params.append(_threads_parameter(saved))
    params.extend(_speculation_parameters(saved))
    return params


def _threads_parameter(saved: Dict[str, Any]) -> Dict[str, Any]:
    """CPU threads for torch and the native CPU kernels; 0 = the engine's default (the physical cores)."""
    cores = default_threads()
    try:
        value = max(0, min(MAX_THREADS, _as_int(saved.get("threads", 0), "threads")))
    except RequestError:
        value = 0
    return {
        "uitype": "slider",
        "unit": "int",
        "label": "CPU threads (0 = physical cores)",
        "id": "threads",
        "min": 0,
        "max": max(cores, value, os.cpu_count() or 1),
        "step": 1,
        "default": value,
        "tooltip": f"Threads for the layers on the CPU; 0 uses the physical cores ({cores} here). Fewer help when "
                   "other programs keep the cores busy.",
        "menu_path": MENU_CONFIG,
        "extra_classes": "",
        "refresh_model_inputs": False,
    }


def _speculation_parameters(saved: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The speculative-decoding entries: mode, draft model folder, tokens drafted per round."""
    mode = str(saved.get("speculative", "off"))
    tokens = saved.get("draft_tokens", 0)
    try:
        tokens = max(0, min(MAX_DRAFT_TOKENS, _as_int(tokens, "draft_tokens")))
    except RequestError:
        tokens = 0
    common = {"menu_path": MENU_CONFIG, "extra_classes": "", "refresh_model_inputs": False}
    return [
        dict(common, uitype="dropdown", unit="text", label="Speculative decoding", id="speculative",
             default=mode if mode in dict(SPECULATIVE_MODES) else "off",
             tooltip="Draft several tokens cheaply and let the model check them in one pass: same output "
                     "distribution, faster when the drafts are often right (repetitive text, a good draft model). "
                     "Prompt lookup needs no second model; a draft model must share the tokenizer.",
             children=[{"text": text, "value": value} for value, text in SPECULATIVE_MODES]),
        dict(common, uitype="text", unit="text", label="Draft model folder", id="draft_model",
             default=str(saved.get("draft_model", "") or NO_DRAFT),
             tooltip="For 'Draft model': a small model with the same tokenizer (e.g. a 0.5B of the same family); "
                     f"on the server's web page, a model name from its models folder. '{NO_DRAFT}': no draft."),
        dict(common, uitype="slider", unit="int", label="Draft tokens per round (0 = default)", id="draft_tokens",
             min=0, max=MAX_DRAFT_TOKENS, step=1, default=tokens,
             tooltip="How many tokens are drafted before the model checks them (default 4 with a draft model, "
                     "5 with prompt lookup)."),
    ]


def _float_slider(
    key: str, label: str, low: float, high: float, step: float, saved: Dict[str, Any], tooltip: str
) -> Dict[str, Any]:
    value = 1.0
    if key in saved:
        try:
            value = max(low, min(high, _as_float(saved[key], key)))
        except RequestError:
            value = 1.0
    return {
        "uitype": "slider",
        "unit": "float",
        "label": label,
        "id": key,
        "min": low,
        "max": high,
        "step": step,
        "default": value,
        "tooltip": tooltip,
        "menu_path": MENU_CONFIG,
        "extra_classes": "",
        "refresh_model_inputs": False,
    }


@dataclass
class LoadOptions:
    """Keyword arguments for kobold_backend.engine.loader.load_model, plus the values to save."""

    device: str
    layer_devices: Optional[List[str]]
    max_seq_len: int
    rope_alpha: float
    compress_pos_emb: float
    dtype: Optional[str]
    embed_on_cpu: bool
    values: Dict[str, Any]
    layer_counts: Dict[str, int]
    cache_dtype: str = "fp16"
    speculation: Optional[Dict[str, Any]] = None  # load_model's speculative / draft_model / draft_tokens
    threads: Optional[int] = None  # None: the engine's default (engine/cpu_threads.py)

    def load_kwargs(self) -> Dict[str, Any]:
        return {
            "device": self.device,
            "layer_devices": self.layer_devices,
            "max_seq_len": self.max_seq_len,
            "rope_alpha": self.rope_alpha,
            "compress_pos_emb": self.compress_pos_emb,
            "dtype": self.dtype,
            "embed_on_cpu": self.embed_on_cpu,
            "cache_dtype": self.cache_dtype,
            **({"threads": self.threads} if self.threads else {}),  # else the host's own setting stays
            **(self.speculation or {}),  # only when submitted: else the server's own flags stay
        }


def load_options(
    values: Dict[str, Any], config: ModelConfig, gpus: Optional[Sequence[str]] = None
) -> LoadOptions:
    """Turn submitted parameter values (ids as above; strings accepted) into load_model arguments.

    Missing values take the defaults requested_parameters() shows. Raises RequestError naming the field
    when the layer split does not add up or a value is out of range.
    """
    names = list(gpu_names() if gpus is None else gpus)
    n = config.num_layers
    ids = layer_ids(len(names))
    if any(key in values for key in ids):
        split = {key: _as_int(values.get(key, 0), key) for key in ids}
    else:
        split = _default_split(n, len(names))
    for key, count in split.items():
        if count < 0:
            raise RequestError(f"{key} must not be negative", key)
    if sum(split.values()) != n:
        raise RequestError(f"the layer counts add up to {sum(split.values())}, not the model's {n} layers",
                           "valid_layers")
    layer_devices: List[str] = []
    for i in range(len(names)):
        layer_devices += [f"cuda:{i}"] * split[f"{i}_Layers"]
    layer_devices += ["cpu"] * split[CPU_LAYERS]
    main = next((d for d in layer_devices if d != "cpu"), "cpu")
    ctx = _ctx_range(config.max_position_embeddings)
    max_ctx = _as_int(values.get("max_ctx", ctx["default"]), "max_ctx")
    if max_ctx < 2:
        raise RequestError("max_ctx must be at least 2", "max_ctx")
    compress = _as_float(values.get("compress_emb", 1.0), "compress_emb")
    alpha = _as_float(values.get("ntk_alpha", 1.0), "ntk_alpha")
    if compress <= 0:
        raise RequestError("compress_emb must be positive", "compress_emb")
    if alpha <= 0:
        raise RequestError("ntk_alpha must be positive", "ntk_alpha")
    dtype = str(values.get("cache_dtype", "auto"))
    if dtype not in dict(CACHE_DTYPES):
        raise RequestError(f"cache_dtype must be one of {', '.join(dict(CACHE_DTYPES))}", "cache_dtype")
    kv = str(values.get("kv_cache", "fp16"))
    if kv not in dict(KV_CACHES):
        raise RequestError(f"kv_cache must be one of {', '.join(dict(KV_CACHES))}", "kv_cache")
    if kv != "fp16" and config.head_dim % 32:
        raise RequestError(f"kv_cache {kv} needs a head size that is a multiple of 32; this model's is "
                           f"{config.head_dim}", "kv_cache")
    embed_on_cpu = _as_bool(values.get("embed_on_cpu", False))
    threads = _as_int(values.get("threads", 0) or 0, "threads")
    if not 0 <= threads <= MAX_THREADS:
        raise RequestError(f"threads must be between 0 (the physical cores) and {MAX_THREADS}", "threads")
    speculation = _speculation_values(values)
    spec_kwargs: Optional[Dict[str, Any]] = None
    if speculation["speculative"] != "off":
        spec_kwargs = speculation
    elif "speculative" in values:  # an explicit "off" also switches off what the server was started with
        spec_kwargs = {"speculative": "off"}
    saved = dict(split, max_ctx=max_ctx, compress_emb=compress, ntk_alpha=alpha, cache_dtype=dtype,
                 kv_cache=kv, embed_on_cpu=embed_on_cpu, threads=threads, speculative=speculation["speculative"],
                 draft_model=speculation.get("draft_model", NO_DRAFT), draft_tokens=speculation["draft_tokens"])
    uniform = len(set(layer_devices)) <= 1
    return LoadOptions(
        device=main,
        layer_devices=None if uniform else layer_devices,
        max_seq_len=max_ctx,
        rope_alpha=alpha,
        compress_pos_emb=compress,
        dtype=None if dtype == "auto" else dtype,
        embed_on_cpu=embed_on_cpu,
        values=saved,
        cache_dtype=kv,
        speculation=spec_kwargs,
        threads=threads or None,
        layer_counts={("cpu" if key == CPU_LAYERS else f"cuda:{key[: -len('_Layers')]}"): count
                      for key, count in split.items()},
    )


def _speculation_values(values: Dict[str, Any]) -> Dict[str, Any]:
    """speculative / draft_model / draft_tokens from submitted values, checked (RequestError names the field)."""
    mode = str(values.get("speculative", "off") or "off")
    if mode not in dict(SPECULATIVE_MODES):
        raise RequestError(f"speculative must be one of {', '.join(dict(SPECULATIVE_MODES))}", "speculative")
    tokens = _as_int(values.get("draft_tokens", 0) or 0, "draft_tokens")
    if not 0 <= tokens <= MAX_DRAFT_TOKENS:
        raise RequestError(f"draft_tokens must be between 0 and {MAX_DRAFT_TOKENS}", "draft_tokens")
    out: Dict[str, Any] = {"speculative": mode, "draft_tokens": tokens}
    if mode == "draft":
        folder = str(values.get("draft_model", "") or "").strip()
        if folder in ("", NO_DRAFT):
            raise RequestError("speculative decoding with a draft model needs the draft model folder", "draft_model")
        out["draft_model"] = folder
    return out


def planned_load_options(
    values: Dict[str, Any], folder: Union[str, Path], gpus: Optional[Sequence[str]] = None,
    probe: Optional[HardwareProbe] = None,
) -> LoadOptions:
    """load_options() with the layer split planned by device_map.plan_split, the placement the CLI's
    --gpu-split/--cpu-layers get: each device's weights, KV cache and buffers are checked against its free
    memory (`probe`, default this machine) before anything is read, and PlanError names the device and the
    shortfall; CPU layers come first, norm and lm_head go on the first GPU given layers."""
    options = load_options(values, ModelConfig.from_dir(folder), gpus)
    plan = plan_split(folder, options.max_seq_len, layer_counts=options.layer_counts,
                      embed_on_cpu=options.embed_on_cpu, dtype=options.dtype, probe=probe,
                      cache_dtype=options.cache_dtype)
    if plan is not None:
        options.device = plan.head_device
        options.layer_devices = None if plan.uniform else list(plan.layer_devices)
    return options
