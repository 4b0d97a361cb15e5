"""The OpenAPI 3 document of /api/v1 (= /api/latest), /api/extra and the OpenAI-compatible /v1, built from the same
field tables that validate the bodies (schemas.FIELDS; openai_schemas for /v1), so the description cannot drift."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from kobold_backend import __version__
from kobold_backend.server.openai_schemas import openapi_schemas as openai_input_schemas
from kobold_backend.server.schemas import openapi_schema


def _ref(name: str) -> Dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: Dict[str, Any], description: str = "OK") -> Dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _obj(props: Dict[str, Any], required: Sequence[str] = ()) -> Dict[str, Any]:
    """An object schema; only the names in `required` must be present."""
    return {"type": "object", "properties": props, "required": list(required)}


def _op(summary: str, responses: Dict[str, Any], body: Optional[Dict[str, Any]] = None,
        tags: Optional[List[str]] = None, body_required: bool = True) -> Dict[str, Any]:
    op: Dict[str, Any] = {"summary": summary, "responses": responses, "tags": tags or []}
    if body is not None:
        op["requestBody"] = {"required": body_required, "content": {"application/json": {"schema": body}}}
    return op


STR = {"type": "string"}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}
# One server-sent event: `event: message` and one `data:` line holding {"token", "finish_reason"} as JSON.
SSE_EVENT = {"type": "object", "required": ["event", "data"],
             "properties": {"event": {"type": "string", "enum": ["message"]}, "data": STR}}
ERR = {
    "401": _json(_ref("Unauthorized"), "API key missing or wrong (only with --api-key)"),
    "403": _json(_ref("BasicError"), "Host header refused on a loopback bind (type forbidden)"),
    "503": _json(_ref("BasicError"), "Busy: the queue is full (type service_unavailable)"),
}
BODY_ERR = dict(ERR, **{
    "400": _json(_ref("BasicError"), "The body is not valid JSON (type bad_input)"),
    "413": _json(_ref("BasicError"), "The body is larger than the server accepts"),
    "422": _json(_ref("ValidationError"), "Invalid fields (each named, with its messages)"),
})
GEN_ERR = dict(BODY_ERR, **{
    "501": _json(_ref("BasicError"), "No model is loaded (type not_implemented)"),
    "507": _json(_ref("BasicError"), "Out of GPU memory"),
})
MODEL_ERR = dict(GEN_ERR, **{
    "403": _json(_ref("BasicError"), "Outside the models folder, or Host header refused (type forbidden)"),
    "404": _json(_ref("BasicError"), "No such model folder"),
    "415": _json(_ref("BasicError"), "Not sent as application/json (nor with X-Requested-With)"),
    "422": {"description": "Invalid name or parameters, or the model failed to load",
            "content": {"application/json": {"schema": {"oneOf": [_ref("ValidationError"), _ref("BasicError")]}}}},
    "501": _json(_ref("BasicError"), "The server was started without --models-dir"),
})
V1_ERR = {code: _json(_ref("OpenAIError"), text) for code, text in (
    ("400", "Invalid request (the field is in error.param)"), ("401", "Incorrect API key"),
    ("403", "Host header refused on a loopback bind"), ("413", "The body is larger than the server accepts"),
    ("501", "No model is loaded"), ("503", "Busy, or the model changed while the request waited"),
    ("507", "Out of GPU memory"))}


def _kobold_paths() -> Dict[str, Any]:
    value_int = _json(_obj({"value": INT}, ["value"]))
    result_str = _json(_obj({"result": STR}, ["result"]))
    genkey = _obj({"genkey": {"type": "string", "nullable": True}})
    v1, extra = "/api/v1", "/api/extra"
    tokens_200 = _json(_ref("TokenCount"))
    tokens_400 = _json(_ref("TokenCount"), "No prompt string in the body")
    return {
        f"{v1}/generate": {"post": _op("Generate text (one result per n)",
                                       dict(GEN_ERR, **{"200": _json(_ref("GenerationOutput"))}),
                                       _ref("GenerationInput"), ["generate"])},
        f"{v1}/model": {
            "get": _op("Loaded model name (ReadOnly when none), its architecture class and weight format",
                       dict(ERR, **{"200": _json(_obj({"result": STR, "architecture": {"type": ["string", "null"]},
                                                       "format": STR, "bits_per_weight": {"type": "number"}},
                                                      ["result"]))}), tags=["model"]),
            "put": _op("Load a model folder from --models-dir (ReadOnly unloads); needs --models-dir",
                       dict(MODEL_ERR, **{"200": _json({"type": "object"})}),
                       _obj({"model": STR}, ["model"]), ["model"]),
        },
        f"{v1}/info/version": {"get": _op("API version", dict(ERR, **{"200": result_str}), tags=["info"])},
        f"{v1}/info/version/latest": {"get": _op("API version", dict(ERR, **{"200": result_str}), tags=["info"])},
        f"{v1}/info/version/list": {"get": _op("API versions", dict(ERR, **{"200": _json(_obj(
            {"results": {"type": "array", "items": STR}}, ["results"]))}), tags=["info"])},
        f"{v1}/config/max_length": {"get": _op("Default generation length", dict(ERR, **{"200": value_int}),
                                               tags=["config"])},
        f"{v1}/config/max_context_length": {"get": _op("Context size in tokens",
                                                       dict(GEN_ERR, **{"200": value_int}), tags=["config"])},
        f"{v1}/config/soft_prompt": {
            "get": _op("Soft prompt (always empty)", dict(ERR, **{"200": _json(_obj({"value": STR}, ["value"]))}),
                       tags=["config"]),
            "put": _op("Set the soft prompt (only \"\" or null is accepted)",
                       dict(BODY_ERR, **{"200": _json({"type": "object"})}),
                       _obj({"value": {"type": "string", "nullable": True}}), ["config"], body_required=False),
        },
        f"{v1}/config/soft_prompts_list": {"get": _op("Soft prompts (none)", dict(ERR, **{"200": _json(_obj(
            {"values": {"type": "array", "items": _obj({"value": STR}, ["value"])}}, ["values"]))}),
            tags=["config"])},
        f"{extra}/version": {"get": _op("KoboldCpp-compatible version and feature flags",
                                        dict(ERR, **{"200": _json(_ref("ExtraVersion"))}), tags=["extra"])},
        f"{extra}/true_max_context_length": {"get": _op("Context size in tokens", dict(GEN_ERR, **{"200": value_int}),
                                                        tags=["extra"])},
        f"{extra}/perf": {"get": _op("Figures of the last generation", dict(ERR, **{"200": _json({"type": "object"})}),
                                     tags=["extra"])},
        f"{extra}/preloadstory": {"get": _op("Preloaded story (none)", dict(ERR, **{"200": _json({"type": "object"})}),
                                             tags=["extra"])},
        f"{extra}/generate/stream": {"post": _op(
            "Generate with server-sent events", dict(GEN_ERR, **{"200": {
                "description": "`event: message` + `data: {\"token\", \"finish_reason\"}` per event",
                "content": {"text/event-stream": {"schema": SSE_EVENT}}}}),
            _ref("GenerationInput"), ["generate"])},
        f"{extra}/generate/check": {
            "get": _op("Partial text of a running generation started without genkey",
                       dict(BODY_ERR, **{"200": _json(_ref("CheckOutput"))}), tags=["generate"]),
            "post": _op("Partial text of the generation with this genkey",
                        dict(BODY_ERR, **{"200": _json(_ref("CheckOutput"))}), genkey, ["generate"],
                        body_required=False),
        },
        f"{extra}/abort": {"post": _op("Abort the generation with this genkey (or the only one running)",
                                       dict(BODY_ERR, **{"200": _json(_obj(
                                           {"success": {"type": "string", "enum": ["true", "false"]},
                                            "done": {"type": "string", "enum": ["true", "false"]}},
                                           ["success", "done"]))}),
                                       genkey, ["generate"], body_required=False)},
        f"{extra}/last_logprobs": {"post": _op(
            "Logprobs of the last generation that asked for them (logprobs: true); null otherwise or when that "
            "generation had another genkey",
            dict(BODY_ERR, **{"200": _json(_obj({"logprobs": {"type": "object", "nullable": True}}, ["logprobs"]))}),
            genkey, ["generate"], body_required=False)},
        f"{extra}/tokencount": {"post": _op("Token ids of a text", dict(GEN_ERR, **{
            "200": tokens_200, "400": tokens_400}), _ref("TokenCountInput"), ["tokens"])},
        f"{extra}/tokenize": {"post": _op("Token ids of a text (alias of tokencount)", dict(GEN_ERR, **{
            "200": tokens_200, "400": tokens_400}), _ref("TokenCountInput"), ["tokens"])},
        f"{extra}/detokenize": {"post": _op("Text of token ids", dict(GEN_ERR, **{
            "200": _json(_ref("Detokenized")), "400": _json(_ref("Detokenized"), "No list of ids")}),
            _obj({"ids": {"type": "array", "items": INT}}, ["ids"]), ["tokens"])},
    }


def _openai_paths() -> Dict[str, Any]:
    def generation(kind: str) -> Dict[str, Any]:
        # With stream=true: `data: {chunk}` events (x-sse-data: each event's JSON), then `data: [DONE]`; an error
        # after the first event is one `data: {"error": ...}` event before [DONE].
        answer = _json(_ref(f"{kind}Output"))
        answer["content"]["text/event-stream"] = {"schema": STR, "x-sse-data": {
            "oneOf": [_ref(f"{kind}Chunk"), _ref("OpenAIError")]}}
        return dict(V1_ERR, **{"200": answer})

    model_404 = dict(V1_ERR, **{"200": _json(_ref("ModelCard")), "404": _json(_ref("OpenAIError"), "No such model")})
    return {
        "/v1/models": {"get": _op("The loaded model (an empty list when none)", dict(V1_ERR, **{"200": _json(_obj(
            {"object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": _ref("ModelCard")}},
            ["object", "data"]))}), tags=["openai"])},
        "/v1/models/{model_id}": {"get": dict(_op("One model by id", model_404, tags=["openai"]), parameters=[
            {"name": "model_id", "in": "path", "required": True, "schema": STR}])},
        "/v1/completions": {"post": _op("Text completion (OpenAI)", generation("Completion"),
                                        _ref("CompletionInput"), ["openai"])},
        "/v1/chat/completions": {"post": _op("Chat completion through the model's chat template (OpenAI)",
                                             generation("ChatCompletion"), _ref("ChatCompletionInput"), ["openai"])},
    }


def _output_schemas() -> Dict[str, Any]:
    usage = _obj({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT},
                 ["prompt_tokens", "completion_tokens", "total_tokens"])
    finish = {"type": "string", "enum": ["stop", "length"]}
    head = {"id": STR, "object": STR, "created": INT, "model": STR}
    chunk_finish = dict(finish, nullable=True)
    chunk_usage = dict(usage, nullable=True)
    nullable = {"type": "object", "nullable": True}
    return {
        "GenerationOutput": _obj({"results": {"type": "array", "items": _obj({
            "text": STR, "finish_reason": finish, "prompt_tokens": INT, "completion_tokens": INT,
            "passthrough_results": {"type": "object"}},
            ["text", "finish_reason", "prompt_tokens", "completion_tokens"])}}, ["results"]),
        "CheckOutput": _obj({"results": {"type": "array", "items": _obj({"text": STR}, ["text"])}}, ["results"]),
        "TokenCountInput": _obj({"prompt": STR, "special": {"type": "boolean", "default": True, "nullable": True}},
                                ["prompt"]),
        "TokenCount": _obj({"value": INT, "ids": {"type": "array", "items": INT}}, ["value", "ids"]),
        "Detokenized": _obj({"result": STR, "success": BOOL}, ["result", "success"]),
        "ExtraVersion": _obj({"result": STR, "version": STR, "protected": BOOL, "txt2img": BOOL, "vision": BOOL,
                              "transcribe": BOOL, "multiplayer": BOOL, "websearch": BOOL, "tts": BOOL,
                              "kobold_backend": STR}, ["result", "version", "protected"]),
        "BasicError": _obj({"detail": _obj({"msg": STR, "type": STR}, ["msg", "type"])}, ["detail"]),
        "Unauthorized": _obj({"detail": _obj({"error": STR, "msg": STR, "type": STR}, ["msg", "type"])},
                             ["detail"]),
        "ValidationError": _obj({"detail": {"type": "object", "additionalProperties": {
            "type": "array", "items": STR}}}, ["detail"]),
        "OpenAIError": _obj({"error": _obj({"message": STR, "type": STR, "param": {"type": "string", "nullable": True},
                                            "code": {"type": "string", "nullable": True}},
                                           ["message", "type", "param", "code"])}, ["error"]),
        "ModelCard": _obj({"id": STR, "object": {"type": "string", "enum": ["model"]}, "created": INT,
                           "owned_by": STR}, ["id", "object", "created", "owned_by"]),
        "CompletionOutput": _obj(dict(head, choices={"type": "array", "items": _obj({
            "text": STR, "index": INT, "logprobs": {"nullable": True}, "finish_reason": finish},
            ["text", "index", "finish_reason"])}, usage=usage), ["id", "object", "created", "model", "choices",
                                                                 "usage"]),
        "ChatCompletionOutput": _obj(dict(head, choices={"type": "array", "items": _obj({
            "index": INT, "message": _obj({"role": {"type": "string", "enum": ["assistant"]}, "content": STR},
                                          ["role", "content"]),
            "logprobs": {"nullable": True}, "finish_reason": finish}, ["index", "message", "finish_reason"])},
            usage=usage), ["id", "object", "created", "model", "choices", "usage"]),
        "CompletionChunk": _obj(dict(head, object={"type": "string", "enum": ["text_completion"]}, choices={
            "type": "array", "items": _obj({"text": STR, "index": INT, "logprobs": nullable,
                                            "finish_reason": chunk_finish},
                                           ["text", "index", "logprobs", "finish_reason"])}, usage=chunk_usage),
            ["id", "object", "created", "model", "choices"]),
        "ChatCompletionChunk": _obj(dict(head, object={"type": "string", "enum": ["chat.completion.chunk"]}, choices={
            "type": "array", "items": _obj({"index": INT, "delta": _obj({
                "role": {"type": "string", "enum": ["assistant"]}, "content": STR}), "logprobs": nullable,
                "finish_reason": chunk_finish}, ["index", "delta", "logprobs", "finish_reason"])}, usage=chunk_usage),
            ["id", "object", "created", "model", "choices"]),
    }


def openapi_document() -> Dict[str, Any]:
    """The whole document; the same text is served under /api/v1 and /api/latest."""
    schemas = dict(_output_schemas(), GenerationInput=openapi_schema(), **openai_input_schemas())
    return {
        "openapi": "3.0.3",
        "info": {"title": "kobold_backend API", "version": __version__,
                 "description": "KoboldAI United /api/v1 (also at /api/latest), KoboldCpp /api/extra and the "
                                "OpenAI-compatible /v1. Unknown body keys are ignored; null counts as absent."},
        "paths": dict(_kobold_paths(), **_openai_paths()),
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{}, {"bearer": []}],
    }
