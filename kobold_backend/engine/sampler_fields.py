"""Every sampler setting, declared once: its type, the range the engine accepts, the default (which switches the
sampler off), what it does, and the name, default and range it has in each dialect.

Derived from this table: `SamplerSettings` and its validation (engine/sampling.py), the KoboldAI/KoboldCpp body's
sampler keys with their 422 checks and OpenAPI schema (server/schemas.py FIELDS, server/openapi.py), OpenAI's other
names for them (server/openai_schemas.RENAMES), United's GenerationSettings names and defaults (`united_values`,
read by host/backend), OpenAI's defaults (`openai_defaults`), the `generate` command's sampler flags and their
defaults (`cli_defaults`), the web page's sampler inputs (`page_controls`, rendered into the page at / by
server/web.py) and the table in docs/samplers.md (`markdown_table`, checked by a test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

MAX_MAGNITUDE = 1e6  # larger settings only overflow float32 arithmetic on the device
REP_PEN_MODES = ("kobold_united", "koboldcpp")
SAMPLER_IDS = {0: "top_k", 1: "top_a", 2: "top_p/min_p", 3: "tfs", 4: "typical", 5: "temperature", 6: "rep_pen"}
DEFAULT_ORDER = (6, 0, 1, 3, 4, 2, 5)
DEFAULT_BREAKERS = ("\n", ":", '"', "*")
MAX_DRY_BREAKERS = 24
SAME = object()  # a dialect's default or range that is the engine's own


@dataclass(frozen=True)
class SamplerField:
    """One sampler setting. `minimum`/`maximum` bound what the engine accepts (`above`: the minimum itself is
    refused); `kobold` is its key in KoboldAI/KoboldCpp bodies (None: not sent there), with KoboldCpp's default,
    range and description where they differ from the engine's; `openai` lists the other names OpenAI clients (and
    SillyTavern) use, and `openai_default` its default on /v1 when that is not KoboldCpp's; `united` is the
    attribute of United's GenerationSettings, with United's default; `cli` makes it a flag of `kobold-backend
    generate`, whose default is the KoboldAI API's (one default for the command line and the HTTP API);
    `page_label` shows it on the web page (with `page_step`, and `page_default` when the page starts from another
    value than KoboldCpp's default)."""

    name: str
    kind: str
    default: Any
    doc: str
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    above: bool = False
    choices: Tuple[Any, ...] = ()
    kobold: Optional[str] = None
    kobold_default: Any = SAME
    kobold_minimum: Any = SAME
    kobold_maximum: Any = SAME
    kobold_aliases: Tuple[str, ...] = ()
    kobold_doc: str = ""
    max_items: Optional[int] = None
    openai: Tuple[str, ...] = ()
    openai_default: Any = SAME
    united: Optional[str] = None
    united_default: Any = None
    cli: bool = False
    page_label: str = ""
    page_step: Optional[float] = None
    page_default: Any = SAME

    def wire_default(self) -> Any:
        return self.default if self.kobold_default is SAME else self.kobold_default

    def wire_range(self) -> Tuple[Optional[float], Optional[float]]:
        low = self.minimum if self.kobold_minimum is SAME else self.kobold_minimum
        high = self.maximum if self.kobold_maximum is SAME else self.kobold_maximum
        return low, high


S = SamplerField
SAMPLER_FIELDS: Tuple[SamplerField, ...] = (
    S("temperature", "number", 1.0, "Sampling temperature; 0 picks the most likely token.",
      kobold="temperature", kobold_default=0.7, kobold_minimum=0, openai_default=1.0, united="temp",
      united_default=0.5, cli=True, page_label="Temperature", page_step=0.05),
    S("top_k", "integer", 0, "Top-k (0 = off).", kobold="top_k", kobold_default=100, kobold_minimum=0,
      openai_default=0, united="top_k", united_default=0, cli=True, page_label="Top-k"),
    S("top_p", "number", 1.0, "Top-p / nucleus (1 = off).", minimum=0, maximum=1, kobold="top_p",
      kobold_default=0.92, openai_default=1.0, united="top_p", united_default=0.9, cli=True,
      page_label="Top-p", page_step=0.01),
    S("top_a", "number", 0.0, "Top-a (0 = off).", minimum=0, kobold="top_a", united="top_a", united_default=0.0,
      page_label="Top-a", page_step=0.01),
    S("tfs", "number", 1.0, "Tail-free sampling (1 = off).", minimum=0, maximum=1, kobold="tfs", united="tfs",
      united_default=1.0, page_label="TFS", page_step=0.01),
    S("typical", "number", 1.0, "Typical sampling (1 = off).", minimum=0, maximum=1, kobold="typical",
      openai=("typical_p",), united="typical", united_default=1.0, page_label="Typical", page_step=0.01),
    S("min_p", "number", 0.0, "Min-p (0 = off); runs with top-p in sampler slot 2.", minimum=0, maximum=1,
      kobold="min_p", page_label="Min-p", page_step=0.01),
    S("rep_pen", "number", 1.0, "Repetition penalty (1 = off; the rule is rep_pen_mode's).", minimum=0, above=True,
      kobold="rep_pen", kobold_minimum=1, kobold_doc="Repetition penalty (KoboldCpp semantics; 1 = off). Aliases "
      "repeat_penalty and repetition_penalty; the largest value wins.",
      kobold_aliases=("repeat_penalty", "repetition_penalty"), united="rep_pen", united_default=1.1, cli=True,
      page_label="Rep. penalty", page_step=0.01, page_default=1.07),
    S("rep_pen_range", "integer", 0, "Tokens looked back by the repetition penalty.", minimum=0,
      kobold="rep_pen_range", kobold_default=320, united="rep_pen_range", united_default=2048,
      page_label="Rep. range"),
    S("rep_pen_slope", "number", 1.0, "Penalty factor of the older half of the range.", minimum=0,
      kobold="rep_pen_slope", united="rep_pen_slope", united_default=1.0, page_label="Rep. slope", page_step=0.05),
    S("rep_pen_mode", "choice", "kobold_united", "Which repetition-penalty rule: KoboldAI United's or KoboldCpp's "
      "(the KoboldAI routes use koboldcpp, United kobold_united).", choices=REP_PEN_MODES),
    S("presence_penalty", "number", 0.0, "Subtracted from every token seen in the range.", kobold="presence_penalty",
      kobold_minimum=-100, kobold_maximum=100),
    S("frequency_penalty", "number", 0.0, "Subtracted per occurrence of a token in the range.",
      kobold="frequency_penalty", kobold_minimum=-100, kobold_maximum=100),
    S("sampler_order", "int_list", DEFAULT_ORDER, "Sampler ids 0-6 (0 top-k, 1 top-a, 2 top-p/min-p, 3 tfs, "
      "4 typical, 5 temperature, 6 rep pen); 6 is prepended when missing.", minimum=0, maximum=6, max_items=7,
      kobold="sampler_order", united="sampler_order", united_default=(6, 0, 1, 2, 3, 4, 5)),
    S("dynatemp_range", "number", 0.0, "Dynamic temperature range (0 = off).", minimum=0, kobold="dynatemp_range"),
    S("dynatemp_exponent", "number", 1.0, "Dynamic temperature exponent.", kobold="dynatemp_exponent",
      kobold_minimum=0),
    S("smoothing_factor", "number", 0.0, "Quadratic smoothing factor (0 = off).", minimum=0,
      kobold="smoothing_factor"),
    S("mirostat", "integer", 0, "Mirostat mode 0 (off), 1 or 2.", minimum=0, maximum=2, kobold="mirostat",
      openai=("mirostat_mode",)),
    S("mirostat_tau", "number", 5.0, "Mirostat target surprise.", minimum=0, kobold="mirostat_tau"),
    S("mirostat_eta", "number", 0.1, "Mirostat learning rate.", minimum=0, kobold="mirostat_eta"),
    S("dry_multiplier", "number", 0.0, "DRY multiplier (0 = off).", minimum=0, kobold="dry_multiplier"),
    S("dry_base", "number", 1.75, "DRY base.", minimum=0, kobold="dry_base", kobold_minimum=1),
    S("dry_allowed_length", "integer", 2, "DRY: repeats up to this length are free.", minimum=0,
      kobold="dry_allowed_length"),
    S("dry_penalty_last_n", "integer", 0, "DRY look-back (<= 0: the whole context).", kobold="dry_penalty_last_n",
      kobold_default=320, kobold_minimum=-1),
    S("dry_sequence_breakers", "string_list", DEFAULT_BREAKERS, "DRY sequence breakers: a list or a JSON string of "
      "a list (at most 24 are used).", max_items=MAX_DRY_BREAKERS, kobold="dry_sequence_breakers"),
    S("xtc_threshold", "number", 0.1, "XTC threshold (> 0.5 turns XTC off).", minimum=0, maximum=1,
      kobold="xtc_threshold", kobold_default=0.2),
    S("xtc_probability", "number", 0.0, "XTC probability (0 = off).", minimum=0, maximum=1,
      kobold="xtc_probability"),
    S("logit_bias", "bias_map", {}, "Token id -> bias added to its logit, clamped to [-100, 100] (at most 32).",
      kobold="logit_bias"),
    S("banned_token_ids", "id_list", (), "Token ids that may not be generated (KoboldAI: custom_token_bans, a "
      "comma-separated string)."),
)
BY_NAME: Dict[str, SamplerField] = {f.name: f for f in SAMPLER_FIELDS}
BY_KOBOLD: Dict[str, SamplerField] = {f.kobold: f for f in SAMPLER_FIELDS if f.kobold is not None}


def united_values(setting: Callable[[str], Any]) -> Dict[str, Any]:
    """SamplerSettings keywords from United's GenerationSettings: `setting(united_name)` gives United's value (or
    None for United's default), converted to the field's type."""
    out: Dict[str, Any] = {}
    for f in SAMPLER_FIELDS:
        if f.united is None:
            continue
        value = setting(f.united)
        value = f.united_default if value is None else value
        out[f.name] = (float(value) if f.kind == "number" else int(value) if f.kind == "integer"
                       else tuple(int(i) for i in value))
    return out


def openai_renames() -> Dict[str, Tuple[str, ...]]:
    """KoboldAI key -> the other names OpenAI clients send it under."""
    return {f.kobold: f.openai for f in SAMPLER_FIELDS if f.kobold is not None and f.openai}


def openai_defaults() -> Dict[str, Any]:
    """KoboldAI key -> the default /v1 applies when the body does not set it (where it is not KoboldCpp's)."""
    return {f.kobold: f.openai_default for f in SAMPLER_FIELDS
            if f.kobold is not None and f.openai_default is not SAME}


def cli_defaults() -> Dict[str, Any]:
    """Setting -> its default as a flag of `kobold-backend generate` (the settings that are flags there): the
    KoboldAI API's default, so a prompt samples the same from the command line as over /api/v1."""
    return {f.name: f.wire_default() for f in SAMPLER_FIELDS if f.cli}


def page_controls() -> List[Dict[str, Any]]:
    """The web page's sampler inputs: body key, label, integer or not, KoboldAI range, step and first value."""
    out = []
    for f in SAMPLER_FIELDS:
        if not f.page_label or f.kobold is None:
            continue
        low, high = f.wire_range()
        out.append({"key": f.kobold, "label": f.page_label, "integer": f.kind == "integer", "min": low,
                    "max": high, "step": 1 if f.kind == "integer" else f.page_step,
                    "value": f.wire_default() if f.page_default is SAME else f.page_default})
    return out


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, tuple):
        return "[" + ", ".join(repr(v) if isinstance(v, str) else str(v) for v in value) + "]"
    text = repr(value) if isinstance(value, str) else str(value)
    return text.replace("|", "\\|").replace("\n", "\\n")


def _range(low: Optional[float], high: Optional[float], above: bool = False) -> str:
    if low is None and high is None:
        return ""
    left = "" if low is None else f"{'>' if above else '≥'} {low:g}"
    right = "" if high is None else f"≤ {high:g}"
    return ", ".join(p for p in (left, right) if p)


def markdown_table() -> str:
    """The settings table of docs/samplers.md (between its `sampler-fields` markers)."""
    rows: List[str] = [
        "| setting | type | engine range | off (engine default) | KoboldAI key (default, range) | OpenAI names "
        "| United (default) | what it does |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in SAMPLER_FIELDS:
        kind = "one of " + ", ".join(f.choices) if f.kind == "choice" else f.kind.replace("_", " ")
        kobold = ""
        if f.kobold is not None:
            low, high = f.wire_range()
            extra = ", ".join(p for p in (_cell(f.wire_default()), _range(low, high)) if p)
            kobold = f"`{f.kobold}` ({extra})" if extra else f"`{f.kobold}`"
        openai = ", ".join(f"`{n}`" for n in f.openai)
        united = f"`{f.united}` ({_cell(f.united_default)})" if f.united else ""
        doc = f.doc if not f.kobold_doc else f"{f.doc} KoboldAI: {f.kobold_doc}"
        rows.append(f"| `{f.name}` | {kind} | {_range(f.minimum, f.maximum, f.above)} | {_cell(f.default)} "
                    f"| {kobold} | {openai} | {united} | {doc} |")
    return "\n".join(rows) + "\n"
