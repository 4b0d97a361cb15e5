"""KoboldCpp's /api/extra: version, context size, SSE streaming, check, abort, token counting, perf, last logprobs."""

from __future__ import annotations

from typing import Any, Iterator, List

from flask import Blueprint, Response, jsonify, stream_with_context

from kobold_backend import __version__
from kobold_backend.engine.tokenizer import check_tokenize_size
from kobold_backend.server import passthrough, sse
from kobold_backend.server.errors import BadJson
from kobold_backend.server.generation import generation_job
from kobold_backend.server.queue import Job, ServiceBusy
from kobold_backend.server.schemas import parse_generate
from kobold_backend.server.state import client_disconnected, get_state, read_json

# Lite and SillyTavern gate features on this: SSE >= 1.40, memory/trim_stop >= 1.49, DRY >= 1.70, XTC >= 1.74.
KOBOLDCPP_VERSION = "1.76"
# How long a tokencount waits for the one tokenizing slot before it is answered 503.
TOKENIZE_WAIT_SECONDS = 30.0
IDS_PER_PIECE = 8192

bp = Blueprint("api_extra", __name__)


@bp.get("/version")
def version() -> Any:
    return jsonify({"result": "KoboldCpp", "version": KOBOLDCPP_VERSION,
                    "protected": bool(get_state().config.api_key), "txt2img": False, "vision": False,
                    "transcribe": False, "multiplayer": False, "websearch": False, "tts": False,
                    "kobold_backend": __version__})


@bp.get("/true_max_context_length")
def true_max_context_length() -> Any:
    return jsonify({"value": get_state().require_model().max_context})


@bp.get("/perf")
def perf() -> Any:
    state = get_state()
    return jsonify(state.perf.snapshot(state.queue.queued(), state.queue.idle()))


@bp.get("/preloadstory")
def preloadstory() -> Any:
    return jsonify({})


@bp.post("/generate/stream")
def generate_stream() -> Any:
    state = get_state()
    body = read_json(empty={})
    params = parse_generate(body, stream=True)
    state.require_model()
    extra = passthrough.from_body(state, body, params)
    job = Job(generation_job(state.holder, params, state.config.default_max_length, state.perf, extra),
              genkey=params.genkey, streaming=True)
    state.queue.submit(job)
    disconnected = client_disconnected()
    events = job.events(disconnected)
    try:
        # Errors before the first event (no model, a bad prompt) still get a proper status and JSON body.
        first = next(events, None)
    except BaseException:
        state.queue.cancel(job)
        raise
    body = sse.event_stream(job, state.queue, first, events, disconnected)
    return Response(stream_with_context(body), mimetype=sse.MIMETYPE, headers=sse.HEADERS)


@bp.route("/generate/check", methods=["GET", "POST"])
def generate_check() -> Any:
    body = read_json(empty={})
    genkey = body.get("genkey") if isinstance(body, dict) else None
    job = get_state().queue.find(genkey if isinstance(genkey, str) else None)
    text = job.partial_text() if job is not None else ""
    return jsonify({"results": [{"text": text}]})


@bp.post("/last_logprobs")
def last_logprobs() -> Any:
    """KoboldCpp's {"logprobs": ...} of the last finished generation that asked for them (else null); when that
    generation had a genkey, only a body with the same genkey gets them."""
    body = read_json(empty={})
    genkey = body.get("genkey") if isinstance(body, dict) else None
    return jsonify({"logprobs": get_state().perf.logprobs_for(genkey if isinstance(genkey, str) else None)})


@bp.post("/abort")
def abort() -> Any:
    body = read_json(empty={})
    genkey = body.get("genkey") if isinstance(body, dict) else None
    success, done = get_state().queue.abort(genkey if isinstance(genkey, str) else None)
    return jsonify({"success": "true" if success else "false", "done": "true" if done else "false"})


def _token_body() -> Any:
    try:
        body = read_json(empty={})
    except BadJson:
        return None
    return body if isinstance(body, dict) and isinstance(body.get("prompt"), str) else None


@bp.post("/tokencount")
@bp.post("/tokenize")
def tokencount() -> Any:
    body = _token_body()
    if body is None:
        return jsonify({"value": -1, "ids": []}), 400
    state = get_state()
    tokenizer = state.require_model().tokenizer
    check_tokenize_size(body["prompt"])
    # Tokenizing runs on the request thread, outside the generation queue: one at a time bounds the memory and
    # CPU a client can take with large texts (a 30 MB text takes seconds and over a GB while it is counted).
    if not state.tokenize_slot.acquire(timeout=TOKENIZE_WAIT_SECONDS):
        raise ServiceBusy("another text is being tokenized")
    try:
        ids = list(tokenizer.encode(body["prompt"], add_bos=False))
    finally:
        state.tokenize_slot.release()
    if body.get("special", True) is not False:
        ids = [int(i) for i in tokenizer.prefix_ids] + ids
    return Response(_token_json(ids), mimetype="application/json")


def _token_json(ids: List[int]) -> Iterator[str]:
    """{"value": n, "ids": [...]} in pieces of IDS_PER_PIECE ids: one json.dumps of a million ids would hold
    Python's GIL for its whole length, and every other request thread with it."""
    yield f'{{"value": {len(ids)}, "ids": ['
    for start in range(0, len(ids), IDS_PER_PIECE):
        yield ("," if start else "") + ",".join(map(str, ids[start:start + IDS_PER_PIECE]))
    yield "]}"


@bp.post("/detokenize")
def detokenize() -> Any:
    try:
        body = read_json(empty={})
    except BadJson:
        body = None
    ids = body.get("ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return jsonify({"result": "", "success": False}), 400
    tokenizer = get_state().require_model().tokenizer
    return jsonify({"result": tokenizer.decode([i for i in ids if 0 <= i < 2**31]), "success": True})
