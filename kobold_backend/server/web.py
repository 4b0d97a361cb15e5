"""The web page at / and the small JSON routes it uses (/ui/*) to pick, configure and load a model."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request

from kobold_backend.demo import demo_label
from kobold_backend.server import models as model_files
from kobold_backend.server.errors import ApiError
from kobold_backend.server.queue import Job
from kobold_backend.server.state import get_state, read_json

bp = Blueprint("web", __name__)


SAMPLER_MARK = "<!-- sampler-controls -->"


def sampler_inputs() -> str:
    """The page's sampler inputs, one per setting engine/sampler_fields.py shows on the page."""
    from kobold_backend.engine.sampler_fields import page_controls

    out = []
    for c in page_controls():
        attrs = {"id": c["key"], "type": "number", "min": c["min"], "max": c["max"], "step": c["step"],
                 "value": c["value"], "data-integer": "1" if c["integer"] else None}
        text = " ".join(f'{k}="{escape(_attr(v))}"' for k, v in attrs.items() if v is not None)
        out.append(f"<label>{escape(c['label'])} <input {text}></label>")
    return "\n          ".join(out)


def _attr(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


@bp.get("/")
def index() -> Any:
    page = Path(current_app.static_folder or "", "index.html").read_text(encoding="utf-8")
    resp = Response(page.replace(SAMPLER_MARK, sampler_inputs()), mimetype="text/html")
    resp.headers["Cache-Control"] = "no-cache"
    return resp


def _model_id(active: Any, models_dir: Any) -> Any:
    """The picker's id of the loaded model: the demo's, its name under --models-dir, else None (a --model outside
    it, which the page shows as its own entry)."""
    if active is None:
        return None
    if active.is_demo:
        return model_files.DEMO_ID
    if models_dir is not None:
        try:
            return Path(active.path).resolve().relative_to(Path(models_dir).resolve()).as_posix()
        except ValueError:
            return None
    return None


@bp.get("/ui/status")
def status() -> Any:
    state = get_state()
    active = state.holder.active
    return jsonify({
        "model": None if active is None else active.name,
        "model_id": _model_id(active, state.config.models_dir),
        "architecture": None if active is None else active.architecture,
        "weight_format": None if active is None else active.weight_format,
        "is_demo": bool(active is not None and active.is_demo),
        "demo_label": demo_label(active.path) if active is not None and active.is_demo else None,
        "max_context": None if active is None else active.max_context,
        "loading": state.holder.loading,
        "protected": bool(state.config.api_key),
        "models_dir": state.config.models_dir is not None,
        "default_max_length": state.config.default_max_length,
        # the page's Chat tab uses /v1/chat/completions when the model (or --chat-template) has a template
        "chat_template": active is not None and (state.config.chat_template is not None
                                                 or active.tokenizer.chat_template is not None),
    })


@bp.get("/ui/models")
def models() -> Any:
    found = model_files.list_models(get_state().config.models_dir)
    demo = {"id": model_files.DEMO_ID, "name": "Demo model (built in)", "description": demo_label()}
    return jsonify({"models": [demo] + found})


def _model_path(name: Any) -> Any:
    """The folder to load (None: the demo model); model management needs --models-dir, even for the demo."""
    models_dir = model_files.require_models_dir(get_state().config)
    if name == model_files.DEMO_ID:
        return None
    if not isinstance(name, str) or not name:
        raise ApiError("Choose a model.", 422, "bad_input")
    return model_files.resolve_model(models_dir, name)


@bp.get("/ui/parameters")
def parameters() -> Any:
    name = request.args.get("model")
    path = _model_path(name)
    if path is None:
        from kobold_backend.demo import ensure_demo_model

        path = Path(ensure_demo_model())
    return jsonify({"parameters": model_files.requested_parameters(path)})


@bp.post("/ui/load")
def load() -> Any:
    state = get_state()
    body = read_json(empty={})
    if not isinstance(body, dict):
        raise ApiError("Expected a JSON object.", 422, "bad_input")
    path = _model_path(body.get("model"))
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise ApiError("parameters must be an object.", 422, "bad_input")
    params = model_files.confined_draft(state.config, params)
    job = Job(model_files.load_job(state.holder, path, params))
    state.queue.submit(job)
    job.wait(lambda: False)
    return status()
