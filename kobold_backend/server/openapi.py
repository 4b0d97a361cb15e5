"""The OpenAPI 3 document of /api/v1 (= /api/latest) and /api/extra, built from the schemas' field table."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from kobold_backend import __version__
from kobold_backend.server.schemas import openapi_schema


def _ref(name: str) -> Dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: Dict[str, Any], description: str = "OK") -> Dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _obj(props: Dict[str, Any], required: Optional[List[str]] = None) -> Dict[str, Any]:
    return {"type": "object", "properties": props, "required": required or list(props)}


def _op(summary: str, responses: Dict[str, Any], body: Optional[Dict[str, Any]] = None,
        tags: Optional[List[str]] = None) -> Dict[str, Any]:
    op: Dict[str, Any] = {"summary": summary, "responses": responses, "tags": tags or []}
    if body is not None:
        op["requestBody"] = {"required": False, "content": {"application/json": {"schema": body}}}
    return op


# One server-sent event: `event: message` and one `data:` line holding {"token", "finish_reason"} as JSON.
SSE_EVENT = {"type": "object", "required": ["event", "data"],
             "properties": {"event": {"type": "string", "enum": ["message"]}, "data": {"type": "string"}}}
ERR = {
    "401": _json(_ref("Unauthorized"), "API key missing or wrong (only with --api-key)"),
    "503": _json(_ref("BasicError"), "Busy: the queue is full (type service_unavailable)"),
}
GEN_ERR = dict(ERR, **{
    "400": _json(_ref("BasicError"), "The body is not valid JSON (type bad_input)"),
    "422": _json(_ref("ValidationError"), "Invalid fields"),
    "501": _json(_ref("BasicError"), "No model is loaded (type not_implemented)"),
})


def openapi_document() -> Dict[str, Any]:
    """The whole document; the same text is served under /api/v1 and /api/latest."""
    value_int = _json(_obj({"value": {"type": "integer"}}))
    result_str = _json(_obj({"result": {"type": "string"}}))
    genkey = _obj({"genkey": {"type": "string"}}, [])
    v1, extra = "/api/v1", "/api/extra"
    paths = {
        f"{v1}/generate": {"post": _op("Generate text (one result per n)",
                                       dict(GEN_ERR, **{"200": _json(_ref("GenerationOutput"))}),
                                       _ref("GenerationInput"), ["generate"])},
        f"{v1}/model": {
            "get": _op("Loaded model name (ReadOnly when none) and its architecture class",
                       dict(ERR, **{"200": _json(_obj({"result": {"type": "string"},
                                                       "architecture": {"type": ["string", "null"]}},
                                                      ["result"]))}), tags=["model"]),
            "put": _op("Load a model folder from --models-dir (ReadOnly unloads)",
                       dict(GEN_ERR, **{"200": _json({"type": "object"}),
                                        "403": _json(_ref("BasicError"), "Outside the models folder"),
                                        "404": _json(_ref("BasicError"), "No such model folder")}),
                       _obj({"model": {"type": "string"}}), ["model"]),
        },
        f"{v1}/info/version": {"get": _op("API version", {"200": result_str}, tags=["info"])},
        f"{v1}/info/version/latest": {"get": _op("API version", {"200": result_str}, tags=["info"])},
        f"{v1}/info/version/list": {"get": _op("API versions", {"200": _json(_obj(
            {"results": {"type": "array", "items": {"type": "string"}}}))}, tags=["info"])},
        f"{v1}/config/max_length": {"get": _op("Default generation length", dict(ERR, **{"200": value_int}),
                                               tags=["config"])},
        f"{v1}/config/max_context_length": {"get": _op("Context size in tokens",
                                                       dict(GEN_ERR, **{"200": value_int}), tags=["config"])},
        f"{v1}/config/soft_prompt": {
            "get": _op("Soft prompt (always empty)", dict(ERR, **{"200": _json(_obj({"value": {"type": "string"}}))}),
                       tags=["config"]),
            "put": _op("Set the soft prompt (only \"\" is accepted)",
                       dict(GEN_ERR, **{"200": _json({"type": "object"})}),
                       _obj({"value": {"type": "string"}}, []), ["config"]),
        },
        f"{v1}/config/soft_prompts_list": {"get": _op("Soft prompts (none)", dict(ERR, **{"200": _json(_obj(
            {"values": {"type": "array", "items": _obj({"value": {"type": "string"}})}}))}), tags=["config"])},
        f"{extra}/version": {"get": _op("KoboldCpp-compatible version and feature flags",
                                        {"200": _json(_ref("ExtraVersion"))}, tags=["extra"])},
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
                       dict(ERR, **{"200": _json(_ref("CheckOutput"))}), tags=["generate"]),
            "post": _op("Partial text of the generation with this genkey",
                        dict(ERR, **{"200": _json(_ref("CheckOutput"))}), genkey, ["generate"]),
        },
        f"{extra}/abort": {"post": _op("Abort the generation with this genkey (or the only one running)",
                                       dict(ERR, **{"200": _json(_obj({"success": {"type": "string",
                                                                                   "enum": ["true", "false"]},
                                                                       "done": {"type": "string",
                                                                                "enum": ["true", "false"]}}))}),
                                       genkey, ["generate"])},
        f"{extra}/tokencount": {"post": _op("Token ids of a text", dict(GEN_ERR, **{
            "200": _json(_ref("TokenCount")), "400": _json(_ref("TokenCount"), "No prompt string")}),
            _ref("TokenCountInput"), ["tokens"])},
        f"{extra}/tokenize": {"post": _op("Token ids of a text (alias of tokencount)", dict(GEN_ERR, **{
            "200": _json(_ref("TokenCount")), "400": _json(_ref("TokenCount"), "No prompt string")}),
            _ref("TokenCountInput"), ["tokens"])},
        f"{extra}/detokenize": {"post": _op("Text of token ids", dict(GEN_ERR, **{
            "200": _json(_ref("Detokenized")), "400": _json(_ref("Detokenized"), "No list of ids")}),
            _obj({"ids": {"type": "array", "items": {"type": "integer"}}}), ["tokens"])},
    }
    schemas = {
        "GenerationInput": openapi_schema(),
        "GenerationOutput": _obj({"results": {"type": "array", "items": _obj({
            "text": {"type": "string"}, "finish_reason": {"type": "string", "enum": ["stop", "length"]},
            "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"}})}}),
        "CheckOutput": _obj({"results": {"type": "array", "items": _obj({"text": {"type": "string"}})}}),
        "TokenCountInput": _obj({"prompt": {"type": "string"}, "special": {"type": "boolean", "default": True}},
                                ["prompt"]),
        "TokenCount": _obj({"value": {"type": "integer"}, "ids": {"type": "array", "items": {"type": "integer"}}}),
        "Detokenized": _obj({"result": {"type": "string"}, "success": {"type": "boolean"}}),
        "ExtraVersion": _obj({"result": {"type": "string"}, "version": {"type": "string"},
                              "protected": {"type": "boolean"}, "txt2img": {"type": "boolean"},
                              "vision": {"type": "boolean"}, "transcribe": {"type": "boolean"}}),
        "BasicError": _obj({"detail": _obj({"msg": {"type": "string"}, "type": {"type": "string"}})}),
        "Unauthorized": _obj({"detail": _obj({"error": {"type": "string"}, "msg": {"type": "string"},
                                              "type": {"type": "string"}})}),
        "ValidationError": _obj({"detail": {"type": "object", "additionalProperties": {
            "type": "array", "items": {"type": "string"}}}}),
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "kobold_backend KoboldAI API", "version": __version__,
                 "description": "KoboldAI United /api/v1 (also at /api/latest) and KoboldCpp /api/extra. "
                                "Unknown body keys are ignored."},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{}, {"bearer": []}],
    }
