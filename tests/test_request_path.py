"""One request path: every dialect (KoboldAI, OpenAI, United, the command line) converts to the same engine
GenerationRequest for equivalent inputs; the engine's context policy; the sampler settings declared once in
engine/sampler_fields.py and what is derived from them (SamplerSettings, the KoboldAI field table, OpenAI's names,
United's names and defaults, the docs table); a bad setting refused with one message per dialect, validated once."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict

import pytest

from kobold_backend.cli.main import generate_request
from kobold_backend.engine import sampler_fields, sampling
from kobold_backend.engine.request import (
    GenerationRequest,
    clamp_new_tokens,
    fit_ids,
    fit_lengths,
    new_tokens_to_fill,
    request_context,
    resolve_seed,
)
from kobold_backend.engine.sampler_fields import SAMPLER_FIELDS
from kobold_backend.engine.sampling import SamplerSettings
from kobold_backend.engine.tokenizer import load_tokenizer
from kobold_backend.errors import OutOfContextError, RequestError
from kobold_backend.host.backend import make_model_backend
from kobold_backend.host.tokenizer_adapter import UnitedTokenizer
from kobold_backend.server import openai_schemas, schemas

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "kobold_backend" / "demo"
CONTEXT = 64
PROMPT = "Once upon a time there was a"
CHOSEN = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "rep_pen": 1.1}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(DEMO)


def engine_defaults() -> Dict[str, Any]:
    """Every KoboldAI sampler key at the engine's default, so that the KoboldCpp defaults do not differ from what
    the command line and United leave unset."""
    return {f.kobold: list(f.default) if isinstance(f.default, tuple) else f.default
            for f in SAMPLER_FIELDS if f.kobold is not None}


def kobold(tokenizer: Any) -> GenerationRequest:
    body = dict(engine_defaults(), prompt=PROMPT, max_length=20, sampler_seed=7, stop_sequence=["\n\n"],
                trim_stop=True, **CHOSEN)
    return schemas.kobold_request(schemas.parse_generate(body), tokenizer, CONTEXT, 180)


def openai(tokenizer: Any) -> GenerationRequest:
    body = dict(engine_defaults(), prompt=PROMPT, max_tokens=20, seed=7, stop=["\n\n"], **CHOSEN)
    req = openai_schemas.parse_completion(body)
    ids, max_new = openai_schemas.prompt_and_length(req.params, PROMPT, tokenizer, CONTEXT, chat=False)
    return openai_schemas.openai_request(req.params, ids, max_new, resolve_seed(req.params.sampler_seed))


def cli(tokenizer: Any) -> GenerationRequest:
    args = argparse.Namespace(prompt=PROMPT, max_new_tokens=20, greedy=False, seed=7, stop=["\n\n"],
                              **{k: v for k, v in CHOSEN.items()})
    return generate_request(args, tokenizer)


def united(tokenizer: Any) -> GenerationRequest:
    backend = make_model_backend()()
    backend.generator = SimpleNamespace(max_context=CONTEXT)
    backend.tokenizer = UnitedTokenizer(tokenizer)
    united_names = {"temperature": "temp"}
    settings = SimpleNamespace(**{united_names.get(k, k): v for k, v in CHOSEN.items()},
                               **{f.united: f.default for f in SAMPLER_FIELDS
                                  if f.united is not None and f.name not in CHOSEN})
    return backend._united_request(tokenizer.encode(PROMPT), 20, settings, 1, 7)


def comparable(req: GenerationRequest) -> Dict[str, Any]:
    """The request's fields, without what belongs to a dialect's semantics: the repetition-penalty rule
    (KoboldCpp's on the HTTP routes), and United's always-banned BOS."""
    out = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}
    out["settings"] = dataclasses.replace(req.settings, rep_pen_mode="-", banned_token_ids=())
    return out


def test_every_dialect_yields_the_same_engine_request(tokenizer: Any) -> None:
    want = comparable(cli(tokenizer))
    assert want["prompt_ids"][0] == tokenizer.bos_id and want["max_new_tokens"] == 20 and want["seed"] == 7
    assert want["settings"].top_k == 40 and want["settings"].rep_pen == 1.1
    assert comparable(kobold(tokenizer)) == want
    assert comparable(openai(tokenizer)) == want
    from_united = comparable(united(tokenizer))
    assert from_united.pop("stop_strings") == ()  # United stops through its own stopper hooks
    assert from_united.pop("abort") is not None  # the backend's abort event
    assert from_united == {k: v for k, v in want.items() if k not in ("stop_strings", "abort")}
    assert kobold(tokenizer).settings.rep_pen_mode == "koboldcpp"
    assert united(tokenizer).settings.rep_pen_mode == "kobold_united"
    assert united(tokenizer).settings.banned_token_ids == (tokenizer.bos_id,)


def test_n_is_split_by_the_engine_with_consecutive_seeds(tokenizer: Any) -> None:
    body = {"prompt": PROMPT, "n": 3, "sampler_seed": 2**64 - 2}
    req = schemas.kobold_request(schemas.parse_generate(body), tokenizer, CONTEXT, 10)
    assert req.n == 3
    choices = req.choices()
    assert [c.seed for c in choices] == [2**64 - 2, 2**64 - 1, 0]
    assert all(c.n == 1 and c.prompt_ids == req.prompt_ids for c in choices)
    streamed = schemas.kobold_request(schemas.parse_generate(body, stream=True), tokenizer, CONTEXT, 10)
    assert streamed.n == 1
    random_first = GenerationRequest([1], 4, seed=-1, n=2).choices()
    assert random_first[0].seed >= 0 and random_first[1].seed == random_first[0].seed + 1


def test_the_context_policy() -> None:
    assert request_context(100) == 100 and request_context(100, 40) == 40 and request_context(100, 400) == 100
    assert request_context(100, 1) == 2
    # KoboldCpp's rule: the prompt keeps min(context - 4, 16) tokens, never fewer than one
    assert clamp_new_tokens(100, 500) == 84 and clamp_new_tokens(100, 10) == 10
    assert clamp_new_tokens(10, 500) == 4 and clamp_new_tokens(4, 500) == 3 and clamp_new_tokens(2, 9) == 1
    assert fit_lengths(100, 500, 50) == (16, 34)
    assert fit_ids([1, 5, 6, 7, 8], 3, bos_id=1) == [1, 7, 8]
    assert fit_ids([5, 6, 7, 8], 3, bos_id=1) == [6, 7, 8]
    assert fit_ids([1, 5], 3, bos_id=1) == [1, 5]
    assert new_tokens_to_fill(10, 4) == 6 and new_tokens_to_fill(10, 4, 3) == 3
    with pytest.raises(OutOfContextError):
        new_tokens_to_fill(10, 10)


def test_united_requests_follow_the_policy(tokenizer: Any) -> None:
    backend = make_model_backend()()
    backend.generator = SimpleNamespace(max_context=16)
    backend.tokenizer = UnitedTokenizer(tokenizer)
    bos = tokenizer.bos_id
    forever = backend._united_request(list(range(100, 110)), 10**7, None, 2, 0)
    assert forever.prompt_ids == [bos] + list(range(100, 110)) and forever.max_new_tokens == 5 and forever.n == 2
    trimmed = backend._united_request(list(range(100, 130)), 6, None, 1, 0)
    assert trimmed.prompt_ids == [bos] + list(range(121, 130)) and trimmed.max_new_tokens == 6


def test_openai_chat_keeps_the_messages_whole(tokenizer: Any) -> None:
    params = openai_schemas.parse_chat({"messages": [{"role": "user", "content": "hi"}]}).params
    ids = list(range(1, 41))
    assert openai_schemas.prompt_and_length(params, ids, tokenizer, CONTEXT, chat=True) == (ids, CONTEXT - 40)
    with pytest.raises(openai_schemas.OpenAIError) as info:
        openai_schemas.prompt_and_length(params, list(range(1, 70)), tokenizer, CONTEXT, chat=True)
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"


# -- the settings table ---------------------------------------------------------------------------------------

def test_sampler_settings_are_the_table() -> None:
    fields = dataclasses.fields(SamplerSettings)
    assert [f.name for f in fields] == [f.name for f in SAMPLER_FIELDS]
    defaults = SamplerSettings()
    assert all(getattr(defaults, f.name) == f.default for f in SAMPLER_FIELDS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        defaults.top_k = 3  # type: ignore[misc]


def test_the_kobold_fields_openai_names_and_united_defaults_come_from_the_table() -> None:
    for f in SAMPLER_FIELDS:
        if f.kobold is None:
            assert f.kobold not in schemas.FIELDS_BY_NAME
            continue
        body = schemas.FIELDS_BY_NAME[f.kobold]
        assert (body.kind, body.default, (body.minimum, body.maximum), body.description, body.aliases) == (
            f.kind, f.wire_default(), f.wire_range(), f.kobold_doc or f.doc, f.kobold_aliases)
        assert openai_schemas.RENAMES.get(f.kobold, ()) in ((), f.openai)
    assert openai_schemas.RENAMES["typical"] == ("typical_p",)
    assert openai_schemas.RENAMES["mirostat"] == ("mirostat_mode",)
    united = sampler_fields.united_values(lambda name: None)
    assert united["temperature"] == 0.5 and united["rep_pen_range"] == 2048
    assert united["sampler_order"] == (6, 0, 1, 2, 3, 4, 5)
    sent = sampler_fields.united_values(lambda name: {"temp": "0.3", "top_k": 7.0}.get(name))
    assert sent["temperature"] == 0.3 and sent["top_k"] == 7 and isinstance(sent["top_k"], int)


def test_the_docs_table_is_the_table() -> None:
    text = (REPO / "docs" / "samplers.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- sampler-fields:begin -->\n(.*?)<!-- sampler-fields:end -->", text, re.S)
    assert found is not None, "docs/samplers.md lost its sampler-fields markers"
    assert found.group(1) == sampler_fields.markdown_table(), (
        "docs/samplers.md's settings table is stale: paste kobold_backend.engine.sampler_fields.markdown_table()")


def test_the_api_docs_field_table_is_the_kobold_field_table() -> None:
    text = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    assert schemas.markdown_table() in text, (
        "docs/api.md's field table is stale: paste kobold_backend.server.schemas.markdown_table()")


# -- one message per dialect, validated once --------------------------------------------------------------------

@pytest.mark.parametrize("key,value,message", [
    ("top_p", 1.5, "Must be greater than or equal to 0 and less than or equal to 1."),
    ("rep_pen", 0.5, "Must be greater than or equal to 1."),
    ("mirostat", 3, "Must be greater than or equal to 0 and less than or equal to 2."),
])
def test_a_bad_setting_has_one_message_per_dialect(key: str, value: Any, message: str) -> None:
    with pytest.raises(schemas.ValidationFailed) as kobold_error:
        schemas.parse_generate({"prompt": "x", key: value})
    assert kobold_error.value.errors == {key: [message]}  # answered 422 on /api
    with pytest.raises(openai_schemas.OpenAIError) as openai_error:
        openai_schemas.parse_completion({"prompt": "x", key: value})
    assert (openai_error.value.status, openai_error.value.param) == (400, key)
    assert openai_error.value.message == f"Invalid '{key}': {message}"


def test_the_engine_names_the_bad_field_for_united_and_the_cli() -> None:
    with pytest.raises(RequestError) as info:
        SamplerSettings(top_p=1.5).validate()
    assert (str(info.value), info.value.field) == ("top_p must be between 0 and 1", "top_p")
    with pytest.raises(RequestError) as info:
        SamplerSettings(rep_pen=0.0).validate()
    assert (str(info.value), info.value.field) == ("rep_pen must be > 0", "rep_pen")


def test_settings_are_validated_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = sampling._checked_value
    monkeypatch.setattr(sampling, "_checked_value", lambda f, v: calls.append(f.name) or real(f, v))
    settings = SamplerSettings(top_k=5)
    settings.validate()
    assert len(calls) == len(SAMPLER_FIELDS)
    settings.validate()
    sampling.Sampler(settings, 10)
    assert len(calls) == len(SAMPLER_FIELDS)
    dataclasses.replace(settings, top_k=6).validate()  # a new value is a new object, checked afresh
    assert len(calls) == 2 * len(SAMPLER_FIELDS)
    bad = SamplerSettings(top_p=2.0)
    for _ in range(2):  # a failed check is not remembered
        with pytest.raises(RequestError):
            bad.validate()


def test_each_choice_has_its_own_grammar_state(tokenizer: Any) -> None:
    pytest.importorskip("llguidance")
    from kobold_backend.engine.grammar import GrammarConstraint

    grammar = GrammarConstraint.build(tokenizer, gbnf='root ::= "yes" | "no"')
    first, second = GenerationRequest([1], 4, grammar=grammar, n=2).choices()
    assert first.grammar is grammar and second.grammar is not grammar
    fresh = second.grammar.allowed_mask()
    token = int(fresh.nonzero()[0])
    first.grammar.accept(token)
    assert not bool((first.grammar.allowed_mask() == fresh).all())  # the first choice moved on ...
    assert bool((second.grammar.allowed_mask() == fresh).all())  # ... the second did not
