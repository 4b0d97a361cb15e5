"""KoboldAI United's /api/v1 (also mounted at /api/latest): the subset KoboldCpp serves and clients use."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify

from kobold_backend.server import models as model_files
from kobold_backend.server import passthrough
from kobold_backend.server.generation import RunResult, generation_job
from kobold_backend.server.openapi import openapi_document
from kobold_backend.server.queue import Job
from kobold_backend.server.schemas import ValidationFailed, parse_generate
from kobold_backend.server.state import client_disconnected, get_state, read_json

# KoboldCpp's answer; United 1.2.6 adds story, world-info and config PUT routes this server does not have.
API_VERSION = "1.2.5"

bp = Blueprint("api_v1", __name__)


@bp.post("/generate")
def generate() -> Any:
    state = get_state()
    body = read_json(empty={})
    params = parse_generate(body)
    state.require_model()
    extra = passthrough.from_body(state, body, params)
    job = Job(generation_job(state.holder, params, state.config.default_max_length, state.perf, extra),
              genkey=params.genkey)
    state.queue.submit(job)
    # A job aborted while it waited never ran: it answers one empty, "length" result.
    results = job.wait(client_disconnected()) or [RunResult("", "abort", 0, 0)]
    return jsonify({"results": [r.as_kobold() for r in results]})


@bp.get("/model")
def get_model() -> Any:
    active = get_state().holder.active
    if active is None:
        return jsonify({"result": "ReadOnly"})
    # "result" keeps KoboldAI's "<backend>/<name>" form that clients parse; the architecture and the weight format
    # ("format", "bits_per_weight") are extra keys
    return jsonify(dict({"result": f"kobold_backend/{active.name}", "architecture": active.architecture},
                        **(active.weight_format or {})))


@bp.put("/model")
def put_model() -> Any:
    state = get_state()
    body = read_json(empty={})
    if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
        raise ValidationFailed({"model": ["Missing data for required field."]})
    models_dir = model_files.require_models_dir(state.config)
    if body["model"] == "ReadOnly":
        job = Job(lambda job: state.holder.unload())
    else:
        path = model_files.resolve_model(models_dir, body["model"])
        job = Job(model_files.load_job(state.holder, path, None))
    state.queue.submit(job)
    job.wait(lambda: False)
    return jsonify({})


@bp.get("/info/version")
@bp.get("/info/version/latest")
def info_version() -> Any:
    return jsonify({"result": API_VERSION})


@bp.get("/info/version/list")
def info_version_list() -> Any:
    return jsonify({"results": [API_VERSION]})


@bp.get("/config/max_length")
def config_max_length() -> Any:
    state = get_state()
    active = state.holder.active
    ctx = active.max_context if active is not None else state.config.default_max_length * 2
    return jsonify({"value": min(state.config.default_max_length, max(1, ctx // 2))})


@bp.get("/config/max_context_length")
def config_max_context_length() -> Any:
    return jsonify({"value": get_state().require_model().max_context})


@bp.get("/config/soft_prompt")
def config_soft_prompt() -> Any:
    return jsonify({"value": ""})


@bp.put("/config/soft_prompt")
def put_soft_prompt() -> Any:
    body = read_json(empty={})
    value = body.get("value") if isinstance(body, dict) else None
    if value not in ("", None):
        raise ValidationFailed({"value": ["Soft prompts are not supported; only \"\" is accepted."]})
    return jsonify({})


@bp.get("/config/soft_prompts_list")
def config_soft_prompts_list() -> Any:
    return jsonify({"values": []})


@bp.get("/openapi.json")
def openapi_json() -> Any:
    return jsonify(openapi_document())
