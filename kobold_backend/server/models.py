"""Model folders under --models-dir: listing, path confinement, load parameters and load jobs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from kobold_backend.errors import ModelFormatError, RequestError
from kobold_backend.server.errors import ApiError
from kobold_backend.server.queue import Job

DEMO_ID = "__demo__"


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


def requested_parameters(model_path: Optional[Path]) -> List[Dict[str, Any]]:
    """The load parameters shown by the web page: the engine's load-option schema, as United shows it."""
    from kobold_backend.engine import load_options

    return list(load_options.requested_parameters(model_path))


def load_kwargs(parameters: Dict[str, Any], model_path: Path) -> Dict[str, Any]:
    """load_model keywords from parameter values keyed by parameter id (RequestError names a bad field,
    PlanError a layer split that does not fit)."""
    from kobold_backend.engine import load_options

    return dict(load_options.planned_load_options(parameters, model_path).load_kwargs())


def load_job(holder: Any, path: Optional[Path], parameters: Optional[Dict[str, Any]]) -> Callable[[Job], None]:
    """A worker job loading `path` (None: the demo model, built on first use). `parameters` are the web page's
    values keyed by parameter id; None keeps the server's own load settings."""

    def run(job: Job) -> None:
        target = path
        if target is None:
            from kobold_backend.demo import ensure_demo_model

            target = Path(ensure_demo_model())
            holder.demo_path = target.resolve()
        try:
            kwargs = load_kwargs(parameters, target) if parameters is not None else {}
            holder.load(target, **kwargs)
        except RequestError:
            raise
        except (ModelFormatError, ValueError, RuntimeError, OSError) as e:  # PlanError is a ValueError
            raise ApiError(f"Loading {target.name} failed: {e}", 422, "load_error") from None

    return run
