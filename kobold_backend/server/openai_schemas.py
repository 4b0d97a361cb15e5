"""Bodies of the OpenAI-compatible routes: OpenAI's names (and the KoboldCpp names SillyTavern mixes in) are mapped
onto the KoboldAI field table of schemas.py, so validation and sampler settings are the same as on /api; OpenAI's
error shape; the engine requests for each choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from kobold_backend.engine.logprobs import MAX_TOP_LOGPROBS
from kobold_backend.engine.sampler_fields import openai_defaults, openai_renames
from kobold_backend.server.logprobs import KOBOLDCPP_TOP_LOGPROBS
from kobold_backend.server.schemas import (
    FIELDS,
    GenerateParams,
    ValidationFailed,
    field_schemas,
    parse_generate,
)

# OpenAI / SillyTavern names -> the KoboldAI field they set; the first one present wins, then the field's own
# name and aliases. The sampler settings' names come from engine/sampler_fields.py.
RENAMES: Dict[str, Tuple[str, ...]] = {
    "max_length": ("max_tokens", "max_completion_tokens", "max_new_tokens"),
    "stop_sequence": ("stop", "stopping_strings"),
    "sampler_seed": ("seed",),
    **openai_renames(),
    "use_default_badwordsids": ("ignore_eos",),
}
# KoboldAI fields that do not apply: the prompt comes from prompt/messages, stop strings are always cut from the
# output, and `logprobs` means something else in OpenAI's API (a count: completion_logprobs_count below).
EXCLUDED = frozenset({"prompt", "memory", "singleline", "trim_stop", "logprobs"})
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_PROMPTS = 16  # prompts in one /v1/completions list
ROLES = ("system", "user", "assistant")


class OpenAIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: Optional[str] = None) -> OpenAIError:
    return OpenAIError(message, 400, param, code)


Prompt = Union[str, List[int]]


@dataclass
class OpenAIRequest:
    """A validated /v1/completions or /v1/chat/completions body."""

    chat: bool
    params: GenerateParams
    prompts: List[Prompt] = field(default_factory=list)
    messages: List[Dict[str, Any]] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # alternatives per token to report; None: no logprobs


# -- validation -------------------------------------------------------------------------------------------

def _flag(body: Dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(key, f"'{key}' must be a boolean.")
    return value


def _sampler_params(body: Dict[str, Any], default_max_tokens: Optional[int]) -> GenerateParams:
    """The KoboldAI fields of the body, validated by schemas.parse_generate; errors name the key as sent."""
    kobold: Dict[str, Any] = {"prompt": ""}
    sent_as: Dict[str, str] = {}
    for f in FIELDS:
        if f.name in EXCLUDED:
            continue
        renamed = next((k for k in RENAMES.get(f.name, ()) if body.get(k) is not None), None)
        if renamed is not None:
            kobold[f.name] = body[renamed]
            sent_as[f.name] = renamed
            continue
        for key in (f.name, *f.aliases):
            if body.get(key) is not None:
                kobold[key] = body[key]
    present = {k for k in kobold if k != "prompt"}
    # OpenAI's sampling defaults (KoboldCpp's top-k 100 / top-p 0.92 / temperature 0.7 apply on /api only)
    for name, value in openai_defaults().items():
        if name not in present:
            kobold[name] = value
    if "max_length" not in present and default_max_tokens is not None:
        kobold["max_length"] = default_max_tokens
    schema = _response_format(body)
    if schema is not None:
        kobold["json_schema"] = schema
        sent_as["json_schema"] = "response_format"
    try:
        return parse_generate(kobold)
    except ValidationFailed as e:
        items = [(sent_as.get(k, k), msgs) for k, msgs in e.errors.items()]
        message = " ".join(f"Invalid '{k}': {' '.join(msgs)}" for k, msgs in items)
        raise invalid(items[0][0], message) from None


def _unsupported(body: Dict[str, Any]) -> None:
    """Reject what this server cannot do instead of silently ignoring it."""
    if body.get("echo"):
        raise invalid("echo", "'echo' is not supported; send echo=false (or leave it out).")
    if body.get("suffix"):
        raise invalid("suffix", "'suffix' (insertion) is not supported.")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise invalid("best_of", "'best_of' is not supported; use n.")
    for key in ("tools", "functions"):
        if body.get(key):
            raise invalid(key, f"'{key}' (tool calling) is not supported.")


def _top_count(body: Dict[str, Any], key: str) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid(key, f"'{key}' must be an integer from 0 to {MAX_TOP_LOGPROBS}.")
    return value


def completion_logprobs_count(body: Dict[str, Any]) -> Optional[int]:
    """/v1/completions `logprobs`: N alternatives per token (0-20); true means KoboldCpp's 5; null/false: none."""
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    if value is True:
        return KOBOLDCPP_TOP_LOGPROBS
    return _top_count(body, "logprobs")


def chat_logprobs_count(body: Dict[str, Any]) -> Optional[int]:
    """/v1/chat/completions `logprobs: true` with `top_logprobs` N (0-20, default 0); None without logprobs."""
    wanted = _flag(body, "logprobs")
    if body.get("top_logprobs") is not None:
        count = _top_count(body, "top_logprobs")
        if not wanted:
            raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true.")
        return count
    return 0 if wanted else None


def _response_format(body: Dict[str, Any]) -> Optional[Any]:
    """The JSON schema that response_format asks for: json_schema's schema, {"type": "object"} for json_object, None
    for text."""
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, str)):
            raise invalid("response_format", "response_format json_schema needs "
                                             "{\"json_schema\": {\"schema\": {...}}}.")
        return schema
    raise invalid("response_format", "response_format type must be text, json_object or json_schema.")


def _common(body: Any) -> Tuple[Dict[str, Any], bool, bool]:
    if not isinstance(body, dict):
        raise invalid("body", "The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "'model' must be a string.")
    _unsupported(body)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("stream_options", "'stream_options' must be an object.")
        if not stream:
            raise invalid("stream_options", "'stream_options' is only allowed with stream=true.")
        include_usage = _flag(options, "include_usage")
    return body, stream, include_usage


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool)
                                                             for i in value)


def _prompts(value: Any) -> List[Prompt]:
    """prompt: a string, a list of strings, a list of token ids or a list of lists of token ids."""
    if isinstance(value, str):
        return [value]
    if _is_ids(value):
        return [list(value)]
    if isinstance(value, list) and value and all(isinstance(p, str) or _is_ids(p) for p in value):
        if len(value) > MAX_PROMPTS:
            raise invalid("prompt", f"At most {MAX_PROMPTS} prompts per request.")
        return [p if isinstance(p, str) else list(p) for p in value]
    if value is None:
        raise invalid("prompt", "'prompt' is required.")
    raise invalid("prompt", "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                            "lists of token ids.")


def parse_completion(body: Any) -> OpenAIRequest:
    """Validate a /v1/completions body."""
    body, stream, include_usage = _common(body)
    prompts = _prompts(body.get("prompt"))
    params = _sampler_params(body, COMPLETION_MAX_TOKENS)
    return OpenAIRequest(False, params, prompts=prompts, stream=stream, include_usage=include_usage,
                         logprobs=_with_beams(params, completion_logprobs_count(body)))


def _content(i: int, message: Dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("image_url", "image", "input_image"):
                raise invalid(f"messages[{i}].content[{j}]", "Image inputs are not supported: this engine runs "
                                                             "the text model only and does not load a vision tower.")
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise invalid(f"messages[{i}].content[{j}]", "Only {\"type\": \"text\", \"text\": ...} content "
                                                             "parts are supported.")
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(f"messages[{i}].content", "'content' must be a string or a list of text parts.")


def parse_messages(value: Any) -> List[Dict[str, Any]]:
    """Messages as the chat template sees them: role (system, user, assistant; developer reads as system),
    content as one string, and name when given."""
    if not isinstance(value, list) or not value:
        raise invalid("messages", "'messages' must be a non-empty list.")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}]", "Each message must be an object.")
        role = message.get("role")
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise invalid(f"messages[{i}].role", f"'role' must be one of {', '.join(ROLES)}; got {role!r}.")
        item: Dict[str, Any] = {"role": role, "content": _content(i, message)}
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise invalid(f"messages[{i}].name", "'name' must be a string.")
            item["name"] = name
        out.append(item)
    return out


def parse_chat(body: Any) -> OpenAIRequest:
    """Validate a /v1/chat/completions body (max_tokens defaults to the rest of the context)."""
    body, stream, include_usage = _common(body)
    messages = parse_messages(body.get("messages"))
    params = _sampler_params(body, None)
    return OpenAIRequest(True, params, messages=messages, stream=stream, include_usage=include_usage,
                         logprobs=_with_beams(params, chat_logprobs_count(body)))


def _with_beams(params: GenerateParams, logprobs: Optional[int]) -> Optional[int]:
    if logprobs is not None and params.num_beams > 1:
        raise invalid("logprobs", "'logprobs' cannot be combined with beam search (num_beams > 1).")
    return logprobs


# -- prompts and engine requests ------------------------------------------------------------------------------

def prompt_and_length(params: GenerateParams, prompt: Prompt, tokenizer: Any, model_context: int,
                      chat: bool) -> Tuple[List[int], int]:
    """(prompt ids, max_new_tokens) by the engine's context policy. A completion prompt is fitted like the KoboldAI
    routes (max_tokens, default 16, clamped so min(context - 4, 16) tokens stay for the prompt, which loses tokens
    from its front, BOS kept); chat messages stay whole and max_tokens defaults to the rest of the context."""
    from kobold_backend.engine.request import fit_ids, fit_lengths, fit_text, new_tokens_to_fill, request_context

    if chat:
        ids = list(prompt)
        context = request_context(model_context, params.max_context_length)
        if len(ids) >= context:
            raise OpenAIError(f"This model's context holds {context} tokens, but the messages take {len(ids)}.",
                              400, "messages", "context_length_exceeded")
        return ids, new_tokens_to_fill(context, len(ids), params.max_length)
    wanted = COMPLETION_MAX_TOKENS if params.max_length is None else params.max_length
    budget, max_new = fit_lengths(model_context, wanted, params.max_context_length)
    if isinstance(prompt, str):
        ids = fit_text(tokenizer, "", prompt, budget)
    else:
        ids = fit_ids(prompt, budget, getattr(tokenizer, "bos_id", None))
    if not ids:
        raise invalid("prompt", "The prompt is empty and this model has no BOS token to start from.")
    return ids, max_new


def openai_request(params: GenerateParams, prompt_ids: List[int], max_new: int, seed: int,
                   logprobs: Optional[int] = None) -> Any:
    """The GenerationRequest of one prompt's n choices: the KoboldAI sampler settings, stop strings cut from the
    output, and the number of alternatives per token to report when the body asked for logprobs. The worker adds
    the abort event and each choice's own GrammarConstraint (schemas.grammar_constraint)."""
    from kobold_backend.engine.request import GenerationRequest

    return GenerationRequest(
        prompt_ids=list(prompt_ids), max_new_tokens=max_new, settings=params.settings,
        stop_strings=tuple(params.stop_sequence), ban_eos=params.use_default_badwordsids,
        bypass_eos=params.bypass_eos, seed=seed, banned_strings=tuple(params.banned_tokens), trim_stop=True,
        logprobs=logprobs, n=params.n,
    )


def openai_finish_reason(reason: Optional[str]) -> str:
    """"stop" for EOS and stop strings; "length" for the token limit (and an aborted generation)."""
    return "stop" if reason in ("stop", "stop_string") else "length"


# -- OpenAPI ------------------------------------------------------------------------------------------------------

def openapi_schemas() -> Dict[str, Any]:
    """CompletionInput and ChatCompletionInput: the KoboldAI field table under the names _sampler_params reads
    (RENAMES included, EXCLUDED left out), plus the OpenAI keys parse_completion and parse_chat check."""
    sampler = field_schemas(tuple(f for f in FIELDS if f.name not in EXCLUDED), RENAMES)
    ids = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
    common: Dict[str, Any] = dict(sampler, **{
        "model": {"type": "string", "nullable": True, "description": "Ignored: the loaded model answers."},
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {"type": "object", "nullable": True, "properties": {"include_usage": {"type": "boolean"}},
                           "description": "Only with stream=true."},
        "echo": {"type": "boolean", "nullable": True, "description": "Only false is supported."},
        "suffix": {"type": "string", "nullable": True, "description": "Only empty is supported."},
        "best_of": {"type": "integer", "nullable": True, "description": "Only 1 is supported."},
        "response_format": {"type": "object", "nullable": True, "description": "text, json_object or json_schema "
                            "({\"json_schema\": {\"schema\": {...}}}): the output is constrained to it."},
        "user": {"type": "string", "nullable": True},
    })
    completion = dict(common, prompt={"oneOf": [
        {"type": "string"}, {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": {"type": "string"}},
        ids, {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": ids}]})
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": [*ROLES, "developer"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]},
        "name": {"type": "string"}}}
    chat = dict(common, messages={"type": "array", "minItems": 1, "items": message})
    return {
        "CompletionInput": {"type": "object", "required": ["prompt"], "properties": completion,
                            "additionalProperties": True},
        "ChatCompletionInput": {"type": "object", "required": ["messages"], "properties": chat,
                                "additionalProperties": True},
    }
