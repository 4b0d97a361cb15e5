"""Model folders under --models-dir: listing, path confinement, load parameters and load jobs."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from kobold_backend.errors import ModelFormatError, RequestError
from kobold_backend.server.errors import ApiError
from kobold_backend.server.queue import Job

DEMO_ID = "__demo__"

# Parameter ids (United's get_requested_parameters and our fallback) -> load_model keyword.
PARAM_TO_KWARG = {
    "max_ctx": "max_seq_len", "max_context": "max_seq_len", "max_seq_len": "max_seq_len",
    "device": "device", "dtype": "dtype", "embed_on_cpu": "embed_on_cpu",
    "ntk_alpha": "rope_alpha", "rope_alpha": "rope_alpha",
    "compress_emb": "compress_pos_emb", "compress_pos_emb": "compress_pos_emb",
}


def resolve_model(models_dir: Path, name: str) -> Path:
    """The real path of a model folder named by a client; it must lie inside models_dir."""
    root = os.path.realpath(str(models_dir))
    candidate = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, candidate]) != root or candidate == root:
        raise ApiError("The model path must name a folder inside the models folder.", 403, "forbidden")
    if not os.path.isfile(os.path.join(candidate, "config.json")):
        raise ApiError(f"No model folder named {name!r} in the models folder.", 404, "key_error")
    return Path(candidate)


def list_models(models_dir: Optional[Path]) -> List[Dict[str, str]]:
    """Folders holding a config.json, one or two levels below models_dir (`name` or `org/name`)."""
    if models_dir is None or not Path(models_dir).is_dir():
        return []
    root = Path(models_dir)
    found = []
    for config in sorted(list(root.glob("*/config.json")) + list(root.glob("*/*/config.json"))):
        rel = config.parent.relative_to(root).as_posix()
        found.append({"id": rel, "name": rel})
    return found


def _host_parameters() -> Any:
    """The United plugin's parameter module (kobold_backend.host.parameters), when it is installed."""
    if importlib.util.find_spec("kobold_backend.host.parameters") is None:
        return None
    import kobold_backend.host.parameters as host_parameters

    return host_parameters


def requested_parameters(model_path: Optional[Path]) -> List[Dict[str, Any]]:
    """The load parameters shown by the web page: the United plugin's list when that module exists,
    else the server's own short list (context size and device)."""
    host = _host_parameters()
    if host is not None:
        return list(host.requested_parameters(model_path))
    max_ctx = 4096
    if model_path is not None:
        try:
            from kobold_backend.engine.config import ModelConfig

            max_ctx = min(ModelConfig.from_dir(model_path).max_position_embeddings, 32768)
        except Exception:  # noqa: BLE001 - an unreadable config only loses the better default
            max_ctx = 4096
    return [
        {"uitype": "slider", "unit": "int", "label": "Max context", "id": "max_ctx", "min": 128,
         "max": max(128, max_ctx), "step": 128, "default": min(max_ctx, 4096),
         "tooltip": "Size of the KV cache in tokens."},
        {"uitype": "dropdown", "unit": "text", "label": "Device", "id": "device", "default": "auto",
         "tooltip": "Where the model runs.",
         "children": [{"text": "auto", "value": "auto"}, {"text": "CPU", "value": "cpu"},
                      {"text": "CUDA", "value": "cuda"}]},
    ]


def load_kwargs(parameters: Dict[str, Any], model_path: Path) -> Dict[str, Any]:
    """load_model keywords from parameter values keyed by parameter id; the plugin's load_options does the
    mapping when it exists (RequestError names a bad field), else the ids of the short list are read."""
    host = _host_parameters()
    if host is not None:
        from kobold_backend.engine.config import ModelConfig

        return dict(host.load_options(parameters, ModelConfig.from_dir(model_path)).load_kwargs())
    kwargs: Dict[str, Any] = {}
    for key, value in parameters.items():
        kw = PARAM_TO_KWARG.get(key)
        if kw is None or value in (None, ""):
            continue
        try:
            if kw == "max_seq_len":
                kwargs[kw] = int(value)
            elif kw in ("rope_alpha", "compress_pos_emb"):
                kwargs[kw] = float(value)
            elif kw == "embed_on_cpu":
                kwargs[kw] = value in (True, "true", "True", 1, "1", "on")
            else:
                kwargs[kw] = str(value)
        except (TypeError, ValueError):
            raise RequestError(f"{key} has an invalid value {value!r}", key) from None
    device = kwargs.get("device")
    if device is not None and device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise RequestError("device must be auto, cpu, cuda or cuda:N", "device")
    return kwargs


def load_job(holder: Any, path: Optional[Path], parameters: Optional[Dict[str, Any]]) -> Callable[[Job], None]:
    """A worker job loading `path` (None: the demo model, built on first use). `parameters` are the web page's
    values keyed by parameter id; None keeps the server's own load settings."""

    def run(job: Job) -> None:
        target = path
        if target is None:
            from kobold_backend.demo import ensure_demo_model

            target = Path(ensure_demo_model())
            holder.demo_path = target.resolve()
        kwargs = load_kwargs(parameters, target) if parameters is not None else {}
        try:
            holder.load(target, **kwargs)
        except (ModelFormatError, ValueError, RuntimeError, OSError) as e:
            raise ApiError(f"Loading {target.name} failed: {e}", 422, "load_error") from None

    return run
