"""Models under --models-dir (Hugging Face folders and .gguf files): listing, path confinement, load parameters and
load jobs."""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from kobold_backend.engine.model_files import is_gguf_file, is_model_file
from kobold_backend.errors import ModelFormatError, RequestError
from kobold_backend.server.errors import ApiError
from kobold_backend.server.queue import Job
from kobold_backend.server.text_checks import bad_text_position

DEMO_ID = "__demo__"


# A model name is `name` or `org/name`; longer ones are not folder names this server lists.
MAX_MODEL_NAME = 512


def check_model_name(name: object) -> str:
    """The one check of a model name from a client (PUT /api/v1/model, /ui/load, /ui/parameters) before it
    touches the file system: a non-empty string of valid Unicode without NUL or other control characters."""
    if not isinstance(name, str) or not name:
        raise ApiError("The model name must be a non-empty string.", 422, "bad_input")
    if len(name) > MAX_MODEL_NAME:
        raise ApiError(f"The model name is longer than {MAX_MODEL_NAME} characters.", 422, "bad_input")
    if bad_text_position(name) is not None or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ApiError("The model name holds a NUL, a control character or invalid Unicode.", 422, "bad_input")
    return name


def require_models_dir(config: Any) -> Path:
    """The --models-dir folder; without it every model-management route answers 501 (docs/serve.md)."""
    if config.models_dir is None:
        raise ApiError("Loading and unloading models over the API needs --models-dir.", 501, "not_implemented")
    return Path(config.models_dir)


def resolve_model(models_dir: Path, name: object) -> Path:
    """The real path of a model folder or .gguf file named by a client; it must lie inside models_dir."""
    name = check_model_name(name)
    root = os.path.realpath(str(models_dir))
    try:
        candidate = os.path.realpath(os.path.join(root, name))
    except (ValueError, OSError):
        raise ApiError("The model name is not a valid path.", 422, "bad_input") from None
    if os.path.commonpath([root, candidate]) != root or candidate == root:
        raise ApiError("The model path must name a folder inside the models folder.", 403, "forbidden")
    try:  # a FIFO, device or socket in place of the file is refused by name, never opened (engine/model_files.py)
        if is_gguf_file(candidate):
            return Path(candidate)
        found = is_model_file(os.path.join(candidate, "config.json"))
    except ModelFormatError as e:
        raise ApiError(f"Loading {name} failed: {e}", 422, "load_error") from None
    if not found:
        raise ApiError(f"No model folder or .gguf file named {name!r} in the models folder.", 404, "key_error")
    return Path(candidate)


def list_models(models_dir: Optional[Path]) -> List[Dict[str, str]]:
    """Folders holding a config.json and .gguf files, one or two levels below models_dir (`name` or `org/name`;
    a .gguf keeps its file name)."""
    if models_dir is None or not Path(models_dir).is_dir():
        return []
    root = Path(models_dir)
    folders = [c.parent for c in list(root.glob("*/config.json")) + list(root.glob("*/*/config.json"))]
    files = [f for f in list(root.glob("*.gguf")) + list(root.glob("*/*.gguf")) if f.is_file()]
    found = []
    for path in sorted(folders + files):
        rel = path.relative_to(root).as_posix()
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


def confined_draft(config: Any, parameters: Dict[str, Any]) -> Dict[str, Any]:
    """The load parameters with a named draft model resolved inside --models-dir like the model itself (403/404)."""
    from kobold_backend.engine.load_options import NO_DRAFT

    name = parameters.get("draft_model")
    if parameters.get("speculative") != "draft" or name in (None, "", NO_DRAFT):
        return parameters
    return dict(parameters, draft_model=str(resolve_model(require_models_dir(config), name)))


def check_context(kwargs: Dict[str, Any], model_path: Path) -> None:
    """A requested context (max_ctx) must be at least engine.loader.MIN_SEQ_LEN (2) and at most the model's
    trained context times its RoPE stretch; the loader then checks that its KV cache fits in free memory."""
    seq = kwargs.get("max_seq_len")
    if seq is None:
        return
    from kobold_backend.engine.config import ModelConfig
    from kobold_backend.engine.loader import MIN_SEQ_LEN, context_limit

    limit = context_limit(ModelConfig.from_dir(model_path), kwargs.get("rope_alpha", 1.0),
                          kwargs.get("compress_pos_emb", 1.0))
    if not MIN_SEQ_LEN <= int(seq) <= limit:
        raise RequestError(f"max_ctx must be between {MIN_SEQ_LEN} and {limit} for this model (its trained context "
                           "times the RoPE scaling in use)", "max_ctx")


# One model is checked at a time (its tokenizer and headers held meanwhile); a second load waits for the first.
_CHECKING = threading.Lock()


@contextlib.contextmanager
def _load_errors(target: Path) -> Iterator[None]:
    """A bad load parameter stays a RequestError (422 naming the field); a model's fault becomes 422 load_error."""
    message = None
    try:
        yield
    except RequestError:
        raise
    except (ModelFormatError, ValueError, RuntimeError, OSError, MemoryError) as e:  # PlanError is a ValueError
        message = f"Loading {target.name} failed: {e}"
        traceback.clear_frames(e.__traceback__)  # the refused load's locals (a tokenizer, headers) go now
    if message is not None:
        from kobold_backend.engine.release import return_freed_memory

        return_freed_memory()
        raise ApiError(message, 422, "load_error")


def load_job(holder: Any, path: Optional[Path], parameters: Optional[Dict[str, Any]]) -> Callable[[Job], None]:
    """A worker job loading `path` (None: the demo model, built on first use). `parameters` are the web page's
    values keyed by parameter id; None keeps the server's own load settings.

    For a model of --models-dir everything that can be checked without its weights is checked here, in the
    request's thread, while the worker keeps serving the current model: the parameters, the context, and the
    model's files (engine.loader.open_checkpoint: config, tokenizer, chat template, shard index, headers). A model
    that fails them is refused with 422 and never replaces the current one; the job then swaps the models."""
    from kobold_backend.engine.loader import open_checkpoint

    checkpoint = None
    kwargs: Dict[str, Any] = {}
    if path is not None:
        with _CHECKING, _load_errors(path):
            kwargs = load_kwargs(parameters, path) if parameters is not None else {}
            check_context(kwargs, path)
            checkpoint = open_checkpoint(path)

    def run(job: Job) -> None:
        target, settings = path, kwargs
        if target is None:
            from kobold_backend.demo import ensure_demo_model

            target = Path(ensure_demo_model())
            holder.demo_path = target.resolve()
            with _load_errors(target):
                settings = load_kwargs(parameters, target) if parameters is not None else {}
                check_context(settings, target)
        with _load_errors(target):
            holder.load(target, checkpoint=checkpoint, **settings)

    return run
