"""OpenAI-compatible routes under /v1 (models, completions, chat completions, streamed or not) on the same work queue,
API key and CORS rules as the KoboldAI routes, answering errors in OpenAI's shape."""

from __future__ import annotations

import json
import logging
import queue as _queue
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from flask import Blueprint, Response, current_app, jsonify, request, stream_with_context
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound

from kobold_backend.engine.chat_template import ChatFormatter, TemplateCompileError, TemplateRenderError
from kobold_backend.engine.request import GenerationRequest, resolve_seed
from kobold_backend.engine.template_pool import RendererBusy
from kobold_backend.engine.tokenizer import TokenizerFailed
from kobold_backend.errors import OutOfContextError, RequestError
from kobold_backend.server import passthrough, sse
from kobold_backend.server.auth import ALLOWED_HEADERS, add_cors_headers
from kobold_backend.server.engine_holder import ActiveModel
from kobold_backend.server.errors import BUSY_MESSAGE, ApiError
from kobold_backend.server.logprobs import chat_logprobs, completion_logprobs, kobold_logprobs
from kobold_backend.server.openai_schemas import (
    OpenAIError,
    OpenAIRequest,
    openai_finish_reason,
    openai_request,
    parse_chat,
    parse_completion,
    prompt_and_length,
)
from kobold_backend.server.queue import POLL_SECONDS, Job, ServiceBusy, WorkQueue
from kobold_backend.server.schemas import grammar_constraint
from kobold_backend.server.state import ServerState, client_disconnected, get_state, read_json

log = logging.getLogger(__name__)

bp = Blueprint("openai", __name__)

OWNER = "kobold_backend"
CORS_METHODS = "GET, POST, OPTIONS"
NO_TEMPLATE = ("This model has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja) "
               "and the server was started without --chat-template FILE; use /v1/completions or give a template.")


@dataclass(frozen=True)
class Prompt:
    """One prompt to continue: prompt `index`'s `request` has the n choices; its j-th choice is choice number
    index * n + j of the answer."""

    index: int
    request: GenerationRequest

    @property
    def prompt_ids(self) -> List[int]:
        return self.request.prompt_ids

    def choice_index(self, j: int) -> int:
        return self.index * self.request.n + j

    @property
    def choice_indexes(self) -> range:
        return range(self.choice_index(0), self.choice_index(self.request.n))


@dataclass(frozen=True)
class ChoiceResult:
    index: int
    text: str
    finish_reason: str
    completion_tokens: int
    passthrough_results: Optional[Dict[str, Any]] = None
    logprobs: Optional[Dict[str, Any]] = None  # in the route's OpenAI shape, when the request asked for them


@dataclass(frozen=True)
class Meta:
    """What every chunk and answer of one request repeats."""

    id: str
    created: int
    model: str
    chat: bool
    include_usage: bool


# -- CORS and errors (auth.py checks the key of every /v1 path) --------------------------------------------------

@bp.after_request
def _cors(resp: Any) -> Any:
    """Like /api, but the preflight's requested headers are allowed as asked: OpenAI's JavaScript client sends
    its own X-Stainless-* headers."""
    asked = request.headers.get("Access-Control-Request-Headers", ALLOWED_HEADERS)
    return add_cors_headers(resp, get_state().config.cors_origins, CORS_METHODS, asked)


def _error_response(e: OpenAIError) -> Response:
    resp = jsonify(e.body())
    resp.status_code = e.status
    for k, v in e.headers.items():
        resp.headers[k] = v
    return resp


def as_openai_error(e: BaseException) -> OpenAIError:
    """Every exception a /v1 route can raise, in OpenAI's terms (no traceback: unexpected ones are logged)."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ServiceBusy):
        return OpenAIError(BUSY_MESSAGE, 503, None, "server_busy", {"Retry-After": "1"})
    if isinstance(e, TemplateRenderError):
        return OpenAIError(f"The chat template rejected the messages: {e}", 400, "messages", "chat_template_error")
    if isinstance(e, TemplateCompileError):
        return OpenAIError(f"The chat template does not compile: {e}", 422, None, "chat_template_error")
    if isinstance(e, RendererBusy):
        return OpenAIError(str(e), 503, None, "server_busy", {"Retry-After": "1"})
    if isinstance(e, OutOfContextError):
        return OpenAIError(str(e), 400, "prompt", "context_length_exceeded")
    if isinstance(e, TokenizerFailed):
        return OpenAIError(str(e), 422, e.field, "tokenizer_error")
    if isinstance(e, RequestError):
        return OpenAIError(str(e), 400, e.field)
    if isinstance(e, ApiError):
        return OpenAIError(e.msg, e.status, None, e.type)
    if isinstance(e, HTTPException):
        headers = {k: v for k, v in e.get_headers() if k.lower() != "content-type"}
        return OpenAIError(e.description or e.name, e.code or 500, None, None, headers)
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        log.error("out of GPU memory: %s", e)
        return OpenAIError("Out of GPU memory.", 507, None, "out_of_memory")
    log.exception("unhandled error", exc_info=e)
    return OpenAIError("Internal server error.", 500)


@bp.errorhandler(Exception)
def _error(e: Exception) -> Any:
    return _error_response(as_openai_error(e))


# -- models ------------------------------------------------------------------------------------------------------

def _model_card(state: ServerState, active: ActiveModel) -> Dict[str, Any]:
    return {"id": active.name, "object": "model", "created": int(state.perf.started), "owned_by": OWNER}


@bp.get("/models")
def list_models() -> Any:
    state = get_state()
    active = state.holder.active
    return jsonify({"object": "list", "data": [] if active is None else [_model_card(state, active)]})


@bp.get("/models/<path:model_id>")
def get_model(model_id: str) -> Any:
    state = get_state()
    active = state.holder.active
    if active is None or model_id != active.name:
        raise OpenAIError(f"The model '{model_id}' does not exist.", 404, "model", "model_not_found")
    return jsonify(_model_card(state, active))


@bp.route("/<path:rest>", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
def unknown(rest: str) -> Any:
    """OpenAI's shape for the paths under /v1 that are not served (405 when only the method is wrong)."""
    methods = {m for rule in current_app.url_map.iter_rules() if rule.rule == request.path
               for m in rule.methods or ()}
    if methods:
        raise MethodNotAllowed(sorted(methods))
    raise NotFound(f"Unknown route: {request.method} {request.path}.")


# -- completions -------------------------------------------------------------------------------------------------

@bp.post("/completions")
def completions() -> Any:
    body = read_json(empty={})
    return _serve(parse_completion(body), body)


@bp.post("/chat/completions")
def chat_completions() -> Any:
    body = read_json(empty={})
    return _serve(parse_chat(body), body)


def _formatter(state: ServerState, active: ActiveModel) -> ChatFormatter:
    source = state.config.chat_template or active.tokenizer.chat_template
    if source is None:
        raise OpenAIError(NO_TEMPLATE, 400, "messages", "no_chat_template")
    return ChatFormatter(source, active.tokenizer, active.path)


def _plan(state: ServerState, active: ActiveModel, req: OpenAIRequest) -> List[Prompt]:
    """The prompts in answer order: prompt p's j-th choice has index p * n + j and seed + j (one seed for every
    prompt: sampler_seed/seed, or a random one)."""
    params = req.params
    if req.chat:
        from kobold_backend.engine.tokenizer import check_tokenize_size, surely_longer_than

        formatter = _formatter(state, active)
        text = formatter.render(req.messages)
        if surely_longer_than(active.tokenizer, text, active.max_context):
            raise OpenAIError(f"This model's context holds {active.max_context} tokens; the messages take more.",
                              400, "messages", "context_length_exceeded")
        check_tokenize_size(text, "messages")
        ids = formatter.encode(text)
        prompts = [prompt_and_length(params, ids, active.tokenizer, active.max_context, chat=True)]
    else:
        prompts = [prompt_and_length(params, p, active.tokenizer, active.max_context, chat=False)
                   for p in req.prompts]
    seed = resolve_seed(params.sampler_seed)
    return [Prompt(p, openai_request(params, ids, max_new, seed, req.logprobs))
            for p, (ids, max_new) in enumerate(prompts)]


def _job(state: ServerState, active: ActiveModel, req: OpenAIRequest, plan: List[Prompt], channel: _queue.Queue,
         extra: Optional[passthrough.RequestPassthrough]) -> Callable[[Job], List[ChoiceResult]]:
    """The worker's side: the prompts one after another, each prompt's choices run by the generator; text and ends
    also go to `channel` for streaming."""

    def run(job: Job) -> List[ChoiceResult]:
        if state.holder.active is not active:
            raise OpenAIError("The model was changed while this request waited; send it again.", 503, None,
                              "model_changed")
        results: List[ChoiceResult] = []
        for prompt in plan:
            if results and job.abort_event.is_set():
                break
            results.extend(_run_prompt(state, active, req, prompt, job, channel, extra))
        return results

    return run


def _run_prompt(state: ServerState, active: ActiveModel, req: OpenAIRequest, prompt: Prompt, job: Job,
                channel: _queue.Queue, extra: Optional[passthrough.RequestPassthrough]) -> List[ChoiceResult]:
    """One prompt's n choices as the generator streams them (Generator.stream_choices)."""
    gen_req = replace(prompt.request, abort=job.abort_event, grammar=grammar_constraint(req.params, active.tokenizer))
    attached: List[Any] = [None]  # the passthrough of the choice that runs now

    def hooks(choice: GenerationRequest) -> Any:
        attached[0] = extra.attach(active, choice) if extra is not None else None
        return attached[0]

    results: List[ChoiceResult] = []
    job.new_run()
    current = 0
    pieces: List[str] = []
    for item in active.generator.stream_choices(gen_req, hooks if extra is not None else None):
        if item.index != current:
            job.new_run()
            current, pieces = item.index, []
        index, ev = prompt.choice_index(item.index), item.event
        if ev.text:
            pieces.append(ev.text)
            job.emit(ev.text)
            channel.put(("text", index, ev.text))
        if item.stats is None:
            continue
        items = ev.logprobs
        logprobs = None
        if items is not None:
            logprobs = (chat_logprobs if req.chat else completion_logprobs)(active.tokenizer, items)
        pt = attached[0]
        state.perf.record(item.stats, passthrough=pt is not None, genkey=req.params.genkey,
                          logprobs=None if items is None else kobold_logprobs(active.tokenizer, items))
        result = ChoiceResult(index, "".join(pieces), openai_finish_reason(ev.finish_reason),
                              int(item.stats.completion_tokens), pt.results() if pt is not None else None, logprobs)
        channel.put(("end", index, result))
        results.append(result)
    return results


def _serve(req: OpenAIRequest, body: Dict[str, Any]) -> Any:
    state = get_state()
    active = state.require_model()
    extra = passthrough.from_body(state, body, req.params)
    plan = _plan(state, active, req)
    channel: _queue.Queue = _queue.Queue()
    job = Job(_job(state, active, req, plan, channel, extra), genkey=req.params.genkey)
    state.queue.submit(job)
    disconnected = client_disconnected()
    meta = Meta(id=("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex, created=int(time.time()),
                model=active.name, chat=req.chat, include_usage=req.include_usage)
    if not req.stream:
        results = job.wait(disconnected) or []
        return jsonify(_answer(meta, plan, results))
    events = _events(job, channel, disconnected)
    try:
        # Errors before the first event (a bad token id, a swapped model) still get a status and a JSON body.
        first = next(events, None)
    except BaseException:
        state.queue.cancel(job)
        raise
    body = _stream(meta, plan, first, events, job, state.queue)
    return Response(stream_with_context(body), mimetype=sse.MIMETYPE, headers=sse.HEADERS)


# -- answers -----------------------------------------------------------------------------------------------------

def _usage(plan: List[Prompt], results: List[ChoiceResult]) -> Dict[str, int]:
    """Each prompt counts once however many choices continue it."""
    prompt = sum(len(p.prompt_ids) for p in plan)
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _answer(meta: Meta, plan: List[Prompt], results: List[ChoiceResult]) -> Dict[str, Any]:
    """The non-streamed answer; a choice that never ran (its request was aborted) is empty with "length"."""
    by_index = {r.index: r for r in results}
    choices = []
    for index in (i for p in plan for i in p.choice_indexes):
        r = by_index.get(index, ChoiceResult(index, "", "length", 0))
        choice: Dict[str, Any]
        if meta.chat:
            choice = {"index": r.index, "message": {"role": "assistant", "content": r.text}, "logprobs": r.logprobs,
                      "finish_reason": r.finish_reason}
        else:
            choice = {"text": r.text, "index": r.index, "logprobs": r.logprobs, "finish_reason": r.finish_reason}
        if r.passthrough_results is not None:
            choice["passthrough_results"] = r.passthrough_results
        choices.append(choice)
    return {"id": meta.id, "object": "chat.completion" if meta.chat else "text_completion", "created": meta.created,
            "model": meta.model, "choices": choices, "usage": _usage(plan, results)}


def format_chunk(meta: Meta, choices: List[Dict[str, Any]], usage: Optional[Dict[str, int]] = None) -> bytes:
    """One server-sent event: `data: {json}` and a blank line. With include_usage every chunk has "usage"
    (null but in the last one), as OpenAI sends it."""
    obj: Dict[str, Any] = {"id": meta.id, "object": "chat.completion.chunk" if meta.chat else "text_completion",
                           "created": meta.created, "model": meta.model, "choices": choices}
    if meta.include_usage:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def _choice_chunk(meta: Meta, index: int, text: Optional[str], finish_reason: Optional[str],
                  role: bool = False, logprobs: Optional[Dict[str, Any]] = None) -> bytes:
    """One choice's chunk; the logprobs of all its tokens come with its finish_reason chunk."""
    if meta.chat:
        delta: Dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice: Dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
    else:
        choice = {"text": text or "", "index": index, "logprobs": logprobs, "finish_reason": finish_reason}
    return format_chunk(meta, [choice])


def _events(job: Job, channel: _queue.Queue, disconnected: Callable[[], bool]) -> Iterator[Tuple[Any, ...]]:
    """The job's ("text", index, text) and ("end", index, ChoiceResult) items until it is done; the job's error
    is raised here; a client that goes away aborts the job."""
    while True:
        try:
            item = channel.get(timeout=POLL_SECONDS)
        except _queue.Empty:
            item = None
        if item is not None:
            yield item
            continue
        if disconnected():
            job.abort_event.set()
            return
        if job.done_event.is_set() and channel.empty():
            if job.error is not None:
                raise job.error
            return


def _stream(meta: Meta, plan: List[Prompt], first: Optional[Tuple[Any, ...]], rest: Iterator[Tuple[Any, ...]],
            job: Job, work: WorkQueue) -> Iterator[bytes]:
    """The SSE body: per choice (chat: a first chunk with the role) text chunks, a chunk with finish_reason; a usage
    chunk when asked for; `data: [DONE]`. Closing it early (the client went away) aborts the job."""
    started = set()
    results: List[ChoiceResult] = []
    try:
        for kind, index, payload in _chain(first, rest):
            if meta.chat and index not in started:
                started.add(index)
                yield _choice_chunk(meta, index, None, None, role=True)
            if kind == "text":
                yield _choice_chunk(meta, index, payload, None)
            else:
                results.append(payload)
                yield _choice_chunk(meta, index, None, payload.finish_reason, logprobs=payload.logprobs)
        if meta.include_usage:
            yield format_chunk(meta, [], _usage(plan, results))
        yield DONE
    except Exception as e:  # noqa: BLE001 - the status is sent: the error goes into the stream instead
        yield b"data: " + json.dumps(as_openai_error(e).body()).encode() + b"\n\n"
        yield DONE
    finally:
        if not job.done_event.is_set():
            work.cancel(job)


def _chain(first: Optional[Tuple[Any, ...]], rest: Iterator[Tuple[Any, ...]]) -> Iterator[Tuple[Any, ...]]:
    if first is not None:
        yield first
    yield from rest
