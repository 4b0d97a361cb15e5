"""The KoboldAI/KoboldCpp generation body: one field table drives validation (422 per field), the
GenerationRequest built from it (`kobold_request`; context fitting is the engine's, engine/request.py) and the
OpenAPI schema."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from kobold_backend.engine.sampler_fields import BY_NAME, SAMPLER_FIELDS
from kobold_backend.errors import RequestError
from kobold_backend.server.logprobs import KOBOLDCPP_TOP_LOGPROBS

MAX_SEED = 2**64 - 1
MAX_STOP_SEQUENCES = 32
MAX_BANNED_STRINGS = 48
MAX_LOGIT_BIASES = 32


class ValidationFailed(Exception):
    """Per-field messages, answered as 422 {"detail": {field: [msgs]}} like KoboldAI United."""

    def __init__(self, errors: Dict[str, List[str]]) -> None:
        super().__init__(json.dumps(errors))
        self.errors = errors


@dataclass(frozen=True)
class Field:
    """One accepted key of the generation body. `kind` is the JSON type; `used` is False for keys that are
    accepted for compatibility and have no effect here."""

    name: str
    kind: str
    default: Any
    description: str
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    aliases: Tuple[str, ...] = ()
    max_items: Optional[int] = None
    used: bool = True
    required: bool = False


def kobold_field(name: str) -> Field:
    """The body key of the sampler setting `name`, as engine/sampler_fields.py declares it (KoboldCpp's default and
    range, its aliases)."""
    f = BY_NAME[name]
    low, high = f.wire_range()
    return Field(f.kobold or name, f.kind, f.wire_default(), f.kobold_doc or f.doc, minimum=low, maximum=high,
                 aliases=f.kobold_aliases, max_items=f.max_items)


F = Field
K = kobold_field
FIELDS: Tuple[Field, ...] = (
    F("prompt", "string", None, "The text to continue.", required=True),
    F("memory", "string", "", "Text kept at the front of the context when the prompt is trimmed to fit."),
    F("max_length", "integer", None, "Tokens to generate (default: 180); clamped so that the prompt keeps "
      "min(context-4, 16) tokens.", minimum=1),
    F("max_context_length", "integer", None, "Context size for this request (default and ceiling: the "
      "server's context); the prompt is trimmed from the front to fit max_context_length - max_length.",
      minimum=1),
    F("n", "integer", 1, "Number of completions, generated one after another (streaming uses 1).",
      minimum=1, maximum=5),
    K("temperature"),
    K("top_k"),
    K("top_p"),
    K("top_a"),
    K("min_p"),
    K("typical"),
    K("tfs"),
    K("rep_pen"),
    K("rep_pen_range"),
    K("rep_pen_slope"),
    K("presence_penalty"),
    K("frequency_penalty"),
    K("sampler_order"),
    F("sampler_seed", "integer", -1, "Seed of the sampler's RNG; -1 = random.", minimum=-1, maximum=MAX_SEED),
    F("sampler_full_determinism", "boolean", False, "Accepted; every seeded request is deterministic here.",
      used=False),
    F("stop_sequence", "string_list", (), "Stop strings (at most 32 are used, each at most 512 characters).",
      max_items=MAX_STOP_SEQUENCES),
    F("trim_stop", "boolean", False, "Cut the stop string (and what follows) from the output."),
    F("use_default_badwordsids", "boolean", False, "Ban the end-of-sequence token.",
      aliases=("ban_eos_token",)),
    F("bypass_eos", "boolean", False, "The EOS token may be sampled but does not end the generation."),
    F("singleline", "boolean", False, "Stop at the first newline (not included in the output)."),
    K("mirostat"),
    K("mirostat_tau"),
    K("mirostat_eta"),
    K("dry_multiplier"),
    K("dry_base"),
    K("dry_allowed_length"),
    K("dry_penalty_last_n"),
    K("dry_sequence_breakers"),
    K("xtc_threshold"),
    K("xtc_probability"),
    K("dynatemp_range"),
    K("dynatemp_exponent"),
    K("smoothing_factor"),
    K("logit_bias"),
    F("custom_token_bans", "string", "", "Comma-separated token ids that may not be generated."),
    F("banned_tokens", "string_list", (), "Strings that may not appear in the output (at most 48, each at most 512 "
      "characters).",
      aliases=("banned_strings",), max_items=MAX_BANNED_STRINGS),
    F("negative_prompt", "string", "", "Classifier-free guidance: text whose continuation is steered away from "
      "(used when guidance_scale != 1)."),
    F("guidance_scale", "number", 1.0, "Classifier-free guidance scale: log p_neg + scale * (log p - log p_neg); "
      "1 = off.", minimum=0, maximum=100),
    F("num_beams", "integer", 1, "Beam search width (1 = sample normally; beams are deterministic).", minimum=1,
      maximum=16),
    F("beam_length", "integer", 8, "Beam search look-ahead in tokens before a token is committed.", minimum=1,
      maximum=64),
    F("genkey", "string", "", "Client handle for /api/extra/generate/check and /api/extra/abort."),
    F("grammar", "string", "", "GBNF (or Lark) grammar the output must match; EOS only once it is complete. "
      "Needs the llguidance package; an invalid grammar is a 422 with the parser's message. At most 65536 "
      "characters."),
    F("json_schema", "schema", None, "JSON schema (an object or a JSON string) the output must match, as in "
      "TabbyAPI; not together with grammar. At most 65536 characters as JSON."),
    F("grammar_retain_state", "boolean", False, "Accepted and ignored (each request starts the grammar afresh).",
      used=False),
    F("images", "any_list", (), "Accepted and ignored (no vision support).", used=False),
    F("render_special", "boolean", False, "Accepted and ignored.", used=False),
    F("logprobs", "boolean", False, "Return each generated token's log-probability and its 5 most likely "
      "alternatives (the model's distribution before sampling) in the result's `logprobs`, KoboldCpp's shape; "
      "also kept for /api/extra/last_logprobs."),
    F("quiet", "boolean", False, "Accepted; nothing is printed per request anyway.", used=False),
    F("soft_prompt", "string", "", "Accepted and ignored (no soft prompts).", used=False),
    F("use_story", "boolean", False, "Accepted and ignored (the server keeps no story).", used=False),
    F("use_memory", "boolean", False, "Accepted and ignored; send `memory` instead.", used=False),
    F("use_authors_note", "boolean", False, "Accepted and ignored.", used=False),
    F("use_world_info", "boolean", False, "Accepted and ignored.", used=False),
    F("use_userscripts", "boolean", False, "Accepted and ignored.", used=False),
    F("frmttriminc", "boolean", False, "Accepted and ignored (output formatting is off).", used=False),
    F("frmtrmblln", "boolean", False, "Accepted and ignored.", used=False),
    F("frmtrmspch", "boolean", False, "Accepted and ignored.", used=False),
    F("frmtadsnsp", "boolean", False, "Accepted and ignored.", used=False),
    F("disable_output_formatting", "boolean", True, "Accepted and ignored.", used=False),
    F("disable_input_formatting", "boolean", True, "Accepted and ignored.", used=False),
)
FIELDS_BY_NAME: Dict[str, Field] = {f.name: f for f in FIELDS}


@dataclass
class GenerateParams:
    """A validated generation body: every field present, defaults filled in."""

    values: Dict[str, Any]
    stream: bool = False
    settings: Any = None  # the engine's SamplerSettings, built and validated once by parse_generate

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


# -- validation -------------------------------------------------------------------------------------

def _number_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _range_message(f: Field) -> str:
    fmt = _number_text
    if f.minimum is not None and f.maximum is not None:
        return f"Must be greater than or equal to {fmt(f.minimum)} and less than or equal to {fmt(f.maximum)}."
    if f.minimum is not None:
        return f"Must be greater than or equal to {fmt(f.minimum)}."
    return f"Must be less than or equal to {fmt(f.maximum)}."  # type: ignore[arg-type]


def _in_range(f: Field, x: float) -> bool:
    return (f.minimum is None or x >= f.minimum) and (f.maximum is None or x <= f.maximum)


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("Not a valid number.")
    try:
        x = float(value)
    except (ValueError, OverflowError):
        raise ValueError("Not a valid number.") from None
    if math.isnan(x) or math.isinf(x):
        raise ValueError("Special numeric values (nan or infinity) are not permitted.")
    return x


def _integer(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise ValueError("Not a valid integer.") from None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise ValueError("Not a valid integer.")


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        return value.strip().lower() in ("true", "1", "yes", "on")
    raise ValueError("Not a valid boolean.")


def _string_list(f: Field, value: Any) -> Tuple[str, ...]:
    if isinstance(value, str) and f.name == "dry_sequence_breakers":
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise ValueError("Not a valid list or JSON string of a list.") from None
    elif isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError("Not a valid list.")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise ValueError(f"Item {i}: Not a valid string.")
    items = tuple(s for s in value if s != "")
    return items[: f.max_items] if f.max_items is not None else items


def _int_list(f: Field, value: Any) -> Tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError("Not a valid list.")
    out = []
    for i, item in enumerate(value):
        try:
            x = _integer(item)
        except ValueError as e:
            raise ValueError(f"Item {i}: {e}") from None
        if not _in_range(f, x):
            raise ValueError(f"Item {i}: {_range_message(f)}")
        out.append(x)
    return tuple(out)


def _bias_map(value: Any) -> Dict[int, float]:
    if not isinstance(value, dict):
        raise ValueError("Not a valid mapping type.")
    out: Dict[int, float] = {}
    for key, bias in list(value.items())[:MAX_LOGIT_BIASES]:
        try:
            tid = _integer(key)
        except ValueError:
            raise ValueError(f"Key {key!r}: Not a valid token id.") from None
        if tid < 0:
            raise ValueError(f"Key {key!r}: Not a valid token id.")
        try:
            out[tid] = max(-100.0, min(100.0, _number(bias)))
        except ValueError as e:
            raise ValueError(f"Key {key!r}: {e}") from None
    return out


def _convert(f: Field, value: Any) -> Any:
    if f.kind == "string":
        if not isinstance(value, str):
            raise ValueError("Not a valid string.")
        return value
    if f.kind in ("number", "integer"):
        x: Any = _number(value) if f.kind == "number" else _integer(value)
        if not _in_range(f, x):
            raise ValueError(_range_message(f))
        return x
    if f.kind == "boolean":
        return _boolean(value)
    if f.kind == "string_list":
        return _string_list(f, value)
    if f.kind == "int_list":
        return _int_list(f, value)
    if f.kind == "bias_map":
        return _bias_map(value)
    if f.kind == "schema":
        if not isinstance(value, (dict, str)):
            raise ValueError("Not a valid JSON schema (an object or a JSON string of one).")
        return value
    if f.kind == "any_list":
        if not isinstance(value, (list, tuple)):
            raise ValueError("Not a valid list.")
        return tuple(value)
    raise AssertionError(f.kind)


def parse_generate(body: Any, stream: bool = False) -> GenerateParams:
    """Validate a generation body. Unknown keys are ignored; null counts as absent; every bad field is
    reported (ValidationFailed). Sampler settings are cross-checked by SamplerSettings.validate()."""
    if not isinstance(body, dict):
        raise ValidationFailed({"_schema": ["Invalid input type."]})
    errors: Dict[str, List[str]] = {}
    values: Dict[str, Any] = {}
    for f in FIELDS:
        present = [(k, body[k]) for k in (f.name, *f.aliases) if body.get(k) is not None]
        if not present:
            if f.required:
                errors[f.name] = ["Missing data for required field."]
            values[f.name] = f.default
            continue
        converted = []
        for key, raw in present:
            try:
                converted.append(_convert(f, raw))
            except ValueError as e:
                errors.setdefault(key, []).append(str(e))
        if converted:
            values[f.name] = max(converted) if f.name == "rep_pen" else converted[0]
    if errors:
        raise ValidationFailed(errors)
    if values["custom_token_bans"].strip():
        try:
            bans = tuple(int(x) for x in values["custom_token_bans"].split(",") if x.strip())
        except ValueError:
            raise ValidationFailed({"custom_token_bans": ["Not a valid comma-separated list of token ids."]}) \
                from None
        if any(b < 0 for b in bans):
            raise ValidationFailed({"custom_token_bans": ["Not a valid comma-separated list of token ids."]})
        values["custom_token_bans"] = bans
    else:
        values["custom_token_bans"] = ()
    order = tuple(values["sampler_order"])
    if len(set(order)) != len(order):
        raise ValidationFailed({"sampler_order": ["Sampler ids must not repeat."]})
    if 6 not in order:
        order = (6,) + order
    values["sampler_order"] = order
    if values["num_beams"] > 1 and values["negative_prompt"] and values["guidance_scale"] != 1.0:
        raise ValidationFailed({"num_beams": ["Beam search cannot be combined with a negative prompt."]})
    if values["num_beams"] > 1 and values["logprobs"]:
        raise ValidationFailed({"num_beams": ["Beam search cannot be combined with logprobs."]})
    params = GenerateParams(values=values, stream=stream)
    try:
        params.settings = sampler_settings(params)
        params.settings.validate()
    except RequestError as e:
        raise ValidationFailed({e.field or "_schema": [str(e)]}) from None
    return params


def sampler_settings(params: GenerateParams) -> Any:
    """The engine's SamplerSettings for these params: every setting with a KoboldAI key (engine/sampler_fields.py),
    KoboldCpp's repetition-penalty rule, custom_token_bans as banned ids (a DRY look-back of -1 reads as 0: the
    whole context)."""
    from kobold_backend.engine.sampling import SamplerSettings

    v = params.values
    values: Dict[str, Any] = {f.name: v[f.kobold] for f in SAMPLER_FIELDS if f.kobold is not None}
    values["dry_penalty_last_n"] = max(0, values["dry_penalty_last_n"])
    return SamplerSettings(**values, rep_pen_mode="koboldcpp", banned_token_ids=tuple(v["custom_token_bans"]))


# -- the engine request ------------------------------------------------------------------------------------------

def grammar_constraint(params: GenerateParams, tokenizer: Any) -> Any:
    """A fresh GrammarConstraint for `grammar` or `json_schema`, or None; RequestError (422) when it is invalid or
    llguidance is missing."""
    gbnf = params.grammar if params.grammar.strip() else None
    if gbnf is None and params.json_schema is None:
        return None
    from kobold_backend.engine.grammar import GrammarConstraint

    return GrammarConstraint.build(tokenizer, gbnf=gbnf, json_schema=params.json_schema)


def kobold_request(params: GenerateParams, tokenizer: Any, model_context: int, default_max_length: int,
                   abort: Any = None) -> Any:
    """The KoboldAI/KoboldCpp body as the engine's GenerationRequest: max_length clamped and memory + prompt
    trimmed by the engine's context policy, singleline as a "\\n" stop, n completions (1 when streaming) seeded
    from sampler_seed (or a random seed)."""
    from kobold_backend.engine.request import GenerationRequest, fit_lengths, fit_text

    wanted = default_max_length if params.max_length is None else params.max_length
    budget, max_new = fit_lengths(model_context, wanted, params.max_context_length)
    prompt_ids = fit_text(tokenizer, params.memory, params.prompt, budget)
    if not prompt_ids:
        raise RequestError("The prompt is empty and this model has no BOS token to start from.", "prompt")
    negative: Tuple[int, ...] = ()
    if params.negative_prompt and params.guidance_scale != 1.0:
        negative = tuple(fit_text(tokenizer, "", params.negative_prompt, budget))
    return GenerationRequest(
        prompt_ids=prompt_ids, max_new_tokens=max_new, settings=params.settings,
        stop_strings=tuple(params.stop_sequence) + (("\n",) if params.singleline else ()),
        ban_eos=params.use_default_badwordsids, bypass_eos=params.bypass_eos,
        seed=params.sampler_seed, abort=abort, banned_strings=tuple(params.banned_tokens),
        trim_stop=params.trim_stop, negative_prompt_ids=negative, guidance_scale=params.guidance_scale,
        num_beams=params.num_beams, beam_length=params.beam_length, grammar=grammar_constraint(params, tokenizer),
        logprobs=KOBOLDCPP_TOP_LOGPROBS if params.logprobs else None, n=1 if params.stream else params.n,
    )


def kobold_finish_reason(reason: Optional[str]) -> str:
    """KoboldCpp reports "stop" only for EOS; length, stop strings and aborts all read "length"."""
    return "stop" if reason == "stop" else "length"


# -- docs and OpenAPI ------------------------------------------------------------------------------------------

def markdown_table() -> str:
    """The field table of docs/api.md, from FIELDS (tests/test_request_path.py checks that the page holds it)."""
    rows = ["| field | type | range | default | meaning |", "|---|---|---|---|---|"]
    for f in FIELDS:
        name = f"`{f.name}`" + (" (alias " + ", ".join(f"`{a}`" for a in f.aliases) + ")" if f.aliases else "")
        kind = "integer list" if f.kind == "int_list" else f.kind.replace("_", " ")
        if f.minimum is not None and f.maximum is not None:
            span = f"{_number_text(f.minimum)}..{_number_text(f.maximum)}"
        elif f.minimum is not None:
            span = f">= {_number_text(f.minimum)}"
        else:
            span = "" if f.maximum is None else f"<= {_number_text(f.maximum)}"
        value = list(f.default) if isinstance(f.default, tuple) else f.default
        default = "required" if f.required else "" if value is None else f"`{json.dumps(value)}`"
        rows.append(f"| {name} | {kind} | {span} | {default} | {f.description} |")
    return "\n".join(rows) + "\n"


def openapi_schema() -> Dict[str, Any]:
    """JSON Schema of the generation body, derived from FIELDS."""
    return {"type": "object", "required": [f.name for f in FIELDS if f.required], "properties": field_schemas(FIELDS),
            "additionalProperties": True}


def field_schemas(fields: Tuple[Field, ...], renames: Optional[Dict[str, Tuple[str, ...]]] = None) -> Dict[str, Any]:
    """The OpenAPI property of every name a field is accepted under (its name, aliases and `renames`); null is
    allowed everywhere because parse_generate reads null as absent."""
    props: Dict[str, Any] = {}
    for f in fields:
        for name in (f.name, *f.aliases, *(renames or {}).get(f.name, ())):
            props[name] = _field_schema(f, alias_of=f.name if name != f.name else None)
    return props


def _field_schema(f: Field, alias_of: Optional[str]) -> Dict[str, Any]:
    s: Dict[str, Any]
    if f.kind in ("string", "number", "integer", "boolean"):
        s = {"type": f.kind}
        if f.minimum is not None:
            s["minimum"] = f.minimum
        if f.maximum is not None:
            s["maximum"] = f.maximum
    elif f.kind == "string_list":
        s = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
    elif f.kind == "int_list":
        s = {"type": "array", "items": {"type": "integer", "minimum": f.minimum, "maximum": f.maximum},
             "maxItems": f.max_items}
    elif f.kind == "bias_map":
        s = {"type": "object", "additionalProperties": {"type": "number"}}
    elif f.kind == "schema":
        s = {"oneOf": [{"type": "object"}, {"type": "string"}]}
    else:
        s = {"type": "array", "items": {}}
    if f.default is not None and not alias_of:
        s["default"] = list(f.default) if isinstance(f.default, tuple) else f.default
    s["nullable"] = True
    s["description"] = f"Alias of {alias_of}." if alias_of else f.description
    return s
