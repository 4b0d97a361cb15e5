"""Grammar-constrained generation (engine/grammar.py and its wiring in the generator and the server): masks against a
brute-force oracle over the token bytes, sampled outputs checked by Python's re and json, rollback with banned
phrases, and the HTTP routes (KoboldAI, KoboldCpp SSE, OpenAI response_format)."""

from __future__ import annotations

import gc
import importlib.util
import json
import re
import sys
from typing import Any, Dict, List, Optional

import pytest
import torch

from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.sampling import SamplerSettings
from kobold_backend.engine.tokenizer import load_tokenizer
from kobold_backend.errors import RequestError
from tests.server_helpers import make_app
from tests.test_openai_api import sse_chunks
from tests.test_server_api import sse_events

HAVE_LLGUIDANCE = importlib.util.find_spec("llguidance") is not None
needs_llguidance = pytest.mark.skipif(not HAVE_LLGUIDANCE,
                                      reason="llguidance is not installed (it needs Python >= 3.9)")

YES_NO = 'root ::= ("yes" | "no") "."'
YES_NO_RE = re.compile(r"(yes|no)\.")
YES_NO_LARK_NO_FORCING = '%llguidance {"no_forcing": true}\nstart: ("yes" | "no") "."'
# Bounded: a random model finishes it within a few tokens whatever it samples.
LIST_GBNF = 'root ::= "[" item ("," " "? item){0,3} "]"\nitem ::= [a-c] | "x" [0-9]'
LIST_RE = re.compile(r"\[([a-c]|x[0-9])(, ?([a-c]|x[0-9])){0,3}\]")
N_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
RANDOM = SamplerSettings(temperature=1.0, top_k=0, top_p=1.0)
SEEDS = range(6)
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


def _build(tokenizer: Any, **kwargs: Any) -> Any:
    from kobold_backend.engine.grammar import GrammarConstraint

    return GrammarConstraint.build(tokenizer, **kwargs)


@pytest.fixture(scope="module", params=["dense_fp32", "llama3_rope"])
def lm(request: Any, checkpoints: Any) -> Any:
    """dense_fp32: sentencepiece, vocabulary 1000; llama3_rope: tokenizer.json, 1003 tokens padded to 1024 logits."""
    return load_model(checkpoints.get(request.param).path, device="cpu", max_seq_len=256)


@pytest.fixture(scope="module", params=["spm", "bpe"])
def tokenizer(request: Any, spm_dir: Any, bpe_dir: Any) -> Any:
    return load_tokenizer(spm_dir if request.param == "spm" else bpe_dir)


def _prompt(lm: Any) -> List[int]:
    return lm.tokenizer.encode("Answer the question: is it so?", add_bos=True)


def _generate(lm: Any, seed: int, max_new: int = 40, settings: SamplerSettings = RANDOM, **kwargs: Any) -> Any:
    gen = Generator(lm.model, lm.tokenizer)
    return gen.generate(GenerationRequest(_prompt(lm), max_new, settings, seed=seed, **kwargs))


# -- the constraint against an oracle ----------------------------------------------------------------------------

def _oracle_mask(tokenizer: Any, done: bytes, sentences: List[bytes]) -> torch.Tensor:
    """Token i may follow `done` iff done + its bytes is still a prefix of one of the sentences; EOS iff done is
    one of them."""
    allowed = torch.zeros(tokenizer.vocab_size, dtype=torch.bool)
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.token_bytes(i)
        if piece and any(s.startswith(done + piece) for s in sentences):
            allowed[i] = True
    if done in sentences:
        allowed[list(tokenizer.eos_ids)] = True
    return allowed


def _token_of(tokenizer: Any, piece: bytes) -> int:
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == piece)


def _longest_match(tokenizer: Any, data: bytes) -> List[int]:
    """Ids spelling `data` by the longest token at each point (mid-text tokens: no sentencepiece dummy space)."""
    ids = []
    while data:
        best = max((i for i in range(tokenizer.vocab_size)
                    if tokenizer.token_bytes(i) and data.startswith(tokenizer.token_bytes(i))),
                   key=lambda i: len(tokenizer.token_bytes(i)))
        ids.append(best)
        data = data[len(tokenizer.token_bytes(best)):]
    return ids


@needs_llguidance
@pytest.mark.parametrize("word", [b"yes.", b"no."])
def test_mask_matches_brute_force_oracle_step_by_step(tokenizer: Any, word: bytes) -> None:
    """Without forcing (Lark syntax, which the grammar field also takes) the mask is exactly the byte-level oracle;
    with it (llguidance's default) bytes the grammar forces come as their canonical tokens: a non-empty subset."""
    sentences = [b"yes.", b"no."]
    single = [_token_of(tokenizer, word[i:i + 1]) for i in range(len(word))]
    for forcing, grammar in ((False, YES_NO_LARK_NO_FORCING), (True, YES_NO)):
        for path in (single, _longest_match(tokenizer, word)):
            g = _build(tokenizer, gbnf=grammar)
            done = b""
            for token in path:
                mask, oracle = g.allowed_mask(), _oracle_mask(tokenizer, done, sentences)
                if forcing:
                    assert mask.any() and not (mask & ~oracle).any(), done
                else:
                    assert torch.equal(mask, oracle), done
                g.accept(token)
                done += tokenizer.token_bytes(token)
            assert done == word
            assert g.is_accepting() and g.is_finished()
            mask = g.allowed_mask()
            assert torch.equal(mask, _oracle_mask(tokenizer, done, sentences))  # nothing but EOS
            assert mask.nonzero().flatten().tolist() == sorted(tokenizer.eos_ids)


@needs_llguidance
def test_forced_bytes_come_as_their_canonical_tokens(tokenizer: Any) -> None:
    g = _build(tokenizer, gbnf=YES_NO)
    g.accept(_token_of(tokenizer, b"y"))  # "es." is forced now
    allowed = g.allowed_mask().nonzero().flatten().tolist()
    assert len(allowed) == 1 and tokenizer.token_bytes(allowed[0]) and b"es.".startswith(
        tokenizer.token_bytes(allowed[0]))
    if not tokenizer.adds_prefix_space():
        assert allowed == tokenizer.encode("es.")[:1]


@needs_llguidance
def test_mask_padding_and_rollback(tokenizer: Any) -> None:
    g = _build(tokenizer, gbnf=YES_NO_LARK_NO_FORCING)
    start = g.allowed_mask()
    padded = g.allowed_mask("cpu", tokenizer.vocab_size + 40)
    assert padded.shape == (tokenizer.vocab_size + 40,) and not padded[tokenizer.vocab_size:].any()
    assert torch.equal(padded[: tokenizer.vocab_size], start)
    g.accept(_token_of(tokenizer, b"y"))
    g.accept(_token_of(tokenizer, b"e"))
    assert torch.equal(g.allowed_mask(), _oracle_mask(tokenizer, b"ye", [b"yes.", b"no."]))
    g.rollback(2)
    assert torch.equal(g.allowed_mask(), start)
    assert not g.is_accepting() and not g.is_finished()


@needs_llguidance
def test_constrain_masks_logits_and_grammar_wins_over_bans(tokenizer: Any) -> None:
    g = _build(tokenizer, gbnf=YES_NO)
    logits = torch.randn(tokenizer.vocab_size + 3, generator=torch.Generator().manual_seed(0))
    allowed = g.allowed_mask("cpu", logits.numel())
    out = g.constrain(logits)
    assert torch.equal(out[allowed], logits[allowed]) and torch.isinf(out[~allowed]).all()
    first = allowed.nonzero().flatten().tolist()
    partly = g.constrain(logits, first[:1])
    assert torch.isinf(partly[first[0]]) and torch.isfinite(partly[first[1:]]).all()
    everything = g.constrain(logits, first)  # the bans would leave nothing: they are dropped
    assert torch.equal(everything, out)


@needs_llguidance
def test_llguidance_tokenizer_is_built_once_and_released(spm_dir: Any) -> None:
    from kobold_backend.engine import grammar

    tok = load_tokenizer(spm_dir)
    first = grammar.ll_tokenizer(tok)
    assert grammar.ll_tokenizer(tok) is first
    _build(tok, gbnf=YES_NO)
    assert grammar.ll_tokenizer(tok) is first
    assert tok in grammar._ll_tokenizers
    gc.collect()  # garbage left by earlier tests must not be counted as released here
    count = len(grammar._ll_tokenizers)
    del tok, first
    gc.collect()
    assert len(grammar._ll_tokenizers) == count - 1


@needs_llguidance
@pytest.mark.parametrize("text", ["hello world", "yes.", " leading space", "x\ny", "naïve €5"])
def test_llguidance_tokenizes_mid_text_without_a_dummy_space(tokenizer: Any, text: str) -> None:
    from kobold_backend.engine.grammar import ll_tokenizer

    lt = ll_tokenizer(tokenizer)
    ids = lt.tokenize_str(text)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
    assert lt.decode_bytes(ids) == text.encode()


@needs_llguidance
@pytest.mark.parametrize("kwargs,field,needle", [
    ({"gbnf": 'root ::= ("yes" | "no" "."'}, "grammar", "Expected ')'"),
    ({"gbnf": "root ::= missing"}, "grammar", "missing"),
    ({"gbnf": "root ::= [z-a]"}, "grammar", "invalid character class range"),
    ({"json_schema": {"type": "nonsense"}}, "json_schema", "nonsense"),
    ({"json_schema": '{"type": '}, "json_schema", "not valid JSON"),
    ({"json_schema": [1]}, "json_schema", "JSON object"),
    ({"gbnf": YES_NO, "json_schema": N_SCHEMA}, "grammar", "not both"),
])
def test_invalid_grammar_names_field_and_parser_message(spm_dir: Any, kwargs: Dict[str, Any], field: str,
                                                        needle: str) -> None:
    with pytest.raises(RequestError) as info:
        _build(load_tokenizer(spm_dir), **kwargs)
    assert info.value.field == field and needle in str(info.value)


def test_missing_llguidance_is_a_clear_request_error(spm_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kobold_backend.engine.grammar import MISSING_LIBRARY

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    for kwargs, field in (({"gbnf": YES_NO}, "grammar"), ({"json_schema": N_SCHEMA}, "json_schema")):
        with pytest.raises(RequestError) as info:
            _build(load_tokenizer(spm_dir), **kwargs)
        assert str(info.value) == MISSING_LIBRARY and info.value.field == field
    assert "pip install 'kobold-backend[grammar]'" in MISSING_LIBRARY


# -- generation --------------------------------------------------------------------------------------------------

@needs_llguidance
@pytest.mark.parametrize("gbnf,pattern", [(YES_NO, YES_NO_RE), (LIST_GBNF, LIST_RE)])
def test_sampled_outputs_always_match_the_grammar(lm: Any, gbnf: str, pattern: Any) -> None:
    texts = set()
    for seed in SEEDS:
        out = _generate(lm, seed, grammar=_build(lm.tokenizer, gbnf=gbnf))
        assert pattern.fullmatch(out.text), (seed, out.text)
        assert out.finish_reason == "stop"
        texts.add(out.text)
    free = {_generate(lm, seed, max_new=6).text for seed in SEEDS}
    assert not any(pattern.fullmatch(t) for t in free)  # without the grammar the model says something else


@needs_llguidance
def test_json_schema_outputs_parse_and_validate(lm: Any) -> None:
    bounded = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 99},
                                                "ok": {"type": "boolean"}},
               "required": ["n", "ok"], "additionalProperties": False}
    for seed in SEEDS:
        out = _generate(lm, seed, max_new=60, grammar=_build(lm.tokenizer, json_schema=bounded))
        obj = json.loads(out.text)
        assert set(obj) == {"n", "ok"} and isinstance(obj["ok"], bool), out.text
        assert isinstance(obj["n"], int) and not isinstance(obj["n"], bool) and -5 <= obj["n"] <= 99, out.text
        assert out.finish_reason == "stop"
    finished = 0
    for seed in SEEDS:  # unbounded integer and extra properties allowed: it may run out of tokens, never go wrong
        out = _generate(lm, seed, max_new=48, grammar=_build(lm.tokenizer, json_schema=json.dumps(N_SCHEMA)))
        if out.finish_reason == "stop":
            obj = json.loads(out.text)
            assert isinstance(obj, dict) and isinstance(obj["n"], int) and not isinstance(obj["n"], bool)
            finished += 1
        else:
            assert out.finish_reason == "length" and out.text.startswith("{"), out.text
    assert finished >= 1


@needs_llguidance
def test_eos_only_once_the_grammar_is_complete(lm: Any) -> None:
    eos = lm.tokenizer.eos_ids[0]
    pushy = SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, logit_bias={eos: 100.0})
    out = _generate(lm, 0, settings=pushy, grammar=_build(lm.tokenizer, gbnf='root ::= "abc" [0-9]*'))
    assert out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert out.text == "abc"  # EOS was wanted at every step and came as soon as the grammar allowed it
    digits = _generate(lm, 1, settings=pushy, grammar=_build(lm.tokenizer, gbnf="root ::= [0-9]+"))
    assert re.fullmatch(r"[0-9]+", digits.text) and digits.token_ids[-1] == eos


@needs_llguidance
@pytest.mark.parametrize("flags", [{}, {"ban_eos": True}, {"bypass_eos": True}])
def test_a_finished_grammar_ends_with_stop(lm: Any, flags: Dict[str, bool]) -> None:
    for seed in SEEDS[:3]:
        out = _generate(lm, seed, max_new=30, grammar=_build(lm.tokenizer, gbnf='root ::= "ok."'), **flags)
        assert out.text == "ok." and out.finish_reason == "stop"
        assert b"".join(lm.tokenizer.token_bytes(t) for t in out.token_ids) == b"ok."
        assert not set(out.token_ids) & set(lm.tokenizer.eos_ids)  # it ended without sampling EOS


@needs_llguidance
def test_banned_phrase_rewind_rolls_the_grammar_back(lm: Any) -> None:
    for seed in SEEDS:
        out = _generate(lm, seed, grammar=_build(lm.tokenizer, gbnf=YES_NO), banned_strings=["YES"])
        assert out.text == "no.", (seed, out.text)
    # a phrase that only completes later: "yes" is kept, "yes." would need the rewind past two tokens
    long = 'root ::= "yes" ("!" | "?" | ".")'
    for seed in SEEDS:
        out = _generate(lm, seed, grammar=_build(lm.tokenizer, gbnf=long), banned_strings=["s."])
        assert out.text in ("yes!", "yes?"), (seed, out.text)
    # banning every sentence: the grammar wins over the bans
    for seed in SEEDS[:2]:
        out = _generate(lm, seed, grammar=_build(lm.tokenizer, gbnf=YES_NO), banned_strings=["yes", "no"])
        assert YES_NO_RE.fullmatch(out.text), out.text


@needs_llguidance
def test_grammar_with_cfg_and_with_beams(lm: Any) -> None:
    negative = lm.tokenizer.encode("Something else entirely", add_bos=True)
    for scale in (0.0, 1.5):
        out = _generate(lm, 3, grammar=_build(lm.tokenizer, gbnf=YES_NO), negative_prompt_ids=negative,
                        guidance_scale=scale)
        assert YES_NO_RE.fullmatch(out.text), (scale, out.text)
    gen = Generator(lm.model, lm.tokenizer)
    with pytest.raises(RequestError) as info:
        gen.generate(GenerationRequest(_prompt(lm), 8, RANDOM, num_beams=2, grammar=_build(lm.tokenizer,
                                                                                            gbnf=YES_NO)))
    assert info.value.field == "num_beams" and "grammar" in str(info.value)


# -- HTTP --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(checkpoints: Any) -> Any:
    app = make_app(checkpoints.get("dense_fp32").path, chat_template=TEMPLATE)
    yield app.test_client()
    app.extensions["kobold_backend"].close()


def _kobold(client: Any, **body: Any) -> Any:
    return client.post("/api/v1/generate", json=dict({"prompt": "Is it so?", "max_length": 30, "temperature": 1,
                                                      "top_k": 0, "top_p": 1}, **body))


@needs_llguidance
def test_kobold_generate_with_grammar_and_json_schema(client: Any) -> None:
    for seed in SEEDS[:3]:
        resp = _kobold(client, grammar=YES_NO, sampler_seed=seed, n=2)
        assert resp.status_code == 200, resp.get_data(as_text=True)
        results = resp.get_json()["results"]
        assert len(results) == 2
        for r in results:
            assert YES_NO_RE.fullmatch(r["text"]) and r["finish_reason"] == "stop"
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    for body in ({"json_schema": schema}, {"json_schema": json.dumps(schema)}):
        text = _kobold(client, sampler_seed=1, **body).get_json()["results"][0]["text"]
        assert json.loads(text)["a"] in ("x", "y")
    assert _kobold(client, grammar="   ", max_length=3).status_code == 200  # blank: no grammar


@needs_llguidance
@pytest.mark.parametrize("body,field,needle", [
    ({"grammar": 'root ::= ("yes" | "no" "."'}, "grammar", "Expected ')'"),
    ({"grammar": "root ::= nowhere"}, "grammar", "nowhere"),
    ({"json_schema": {"type": "nonsense"}}, "json_schema", "nonsense"),
    ({"grammar": YES_NO, "json_schema": N_SCHEMA}, "grammar", "not both"),
])
def test_invalid_grammar_is_422_with_the_parsers_message(client: Any, body: Dict[str, Any], field: str,
                                                         needle: str) -> None:
    for route in ("/api/v1/generate", "/api/extra/generate/stream"):
        resp = client.post(route, json=dict({"prompt": "Is it so?", "max_length": 5}, **body))
        assert resp.status_code == 422, resp.get_data(as_text=True)
        detail = resp.get_json()["detail"]
        assert list(detail) == [field] and needle in detail[field][0]


def test_missing_llguidance_over_http(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kobold_backend.engine.grammar import MISSING_LIBRARY

    monkeypatch.setitem(sys.modules, "llguidance", None)
    resp = _kobold(client, grammar=YES_NO)
    assert resp.status_code == 422 and resp.get_json() == {"detail": {"grammar": [MISSING_LIBRARY]}}
    resp = _openai(client, "/v1/completions", prompt="x", response_format={"type": "json_object"})
    assert resp.status_code == 400 and resp.get_json()["error"]["message"] == MISSING_LIBRARY
    assert _kobold(client, max_length=2).status_code == 200  # requests without a grammar are unaffected


def test_json_schema_field_type_is_validated(client: Any) -> None:
    resp = _kobold(client, json_schema=5)
    assert resp.status_code == 422
    assert resp.get_json() == {"detail": {"json_schema": ["Not a valid JSON schema (an object or a JSON string of "
                                                          "one)."]}}


@needs_llguidance
def test_kobold_stream_with_grammar(client: Any) -> None:
    for seed in SEEDS[:3]:
        resp = client.post("/api/extra/generate/stream", json={"prompt": "Is it so?", "max_length": 30,
                                                               "temperature": 1, "top_k": 0, "top_p": 1,
                                                               "grammar": LIST_GBNF, "sampler_seed": seed})
        assert resp.status_code == 200
        events = sse_events(resp.data)
        text = "".join(e["token"] for e in events)
        assert LIST_RE.fullmatch(text), text
        assert events[-1]["finish_reason"] == "stop"


def _openai(client: Any, route: str, **body: Any) -> Any:
    return client.post(route, json=dict({"max_tokens": 60, "temperature": 1, "seed": 2}, **body))


@needs_llguidance
@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
        "additionalProperties": False}}},
    {"type": "json_object"},
])
def test_openai_response_format(client: Any, fmt: Dict[str, Any]) -> None:
    resp = _openai(client, "/v1/completions", prompt="Data:", response_format=fmt, n=2)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    choices = resp.get_json()["choices"]
    texts: List[Optional[str]] = [c["text"] for c in choices]
    chat = _openai(client, "/v1/chat/completions", messages=[{"role": "user", "content": "Give JSON"}],
                   response_format=fmt)
    assert chat.status_code == 200, chat.get_data(as_text=True)
    texts.append(chat.get_json()["choices"][0]["message"]["content"])
    streamed = _openai(client, "/v1/completions", prompt="Data:", response_format=fmt, stream=True)
    texts.append("".join(c["choices"][0]["text"] for c in sse_chunks(streamed.data) if c["choices"]))
    for text in texts:
        if fmt["type"] == "json_object" and not text.endswith("}"):
            assert text.startswith("{")  # an open-ended object may run out of tokens, never go wrong
            continue
        obj = json.loads(text)
        assert isinstance(obj, dict)
        if fmt["type"] == "json_schema":
            assert list(obj) == ["n"] and obj["n"] in range(10)


@needs_llguidance
def test_openai_grammar_field_and_errors(client: Any) -> None:
    resp = _openai(client, "/v1/completions", prompt="Is it so?", grammar=YES_NO, n=3)
    assert resp.status_code == 200
    for c in resp.get_json()["choices"]:
        assert YES_NO_RE.fullmatch(c["text"]) and c["finish_reason"] == "stop"
    bad = _openai(client, "/v1/completions", prompt="x", grammar="root ::= (")
    assert bad.status_code == 400 and bad.get_json()["error"]["param"] == "grammar"
    bad = _openai(client, "/v1/completions", prompt="x", response_format={"type": "json_schema",
                                                                           "json_schema": {"schema": {"type": "?"}}})
    assert bad.status_code == 400 and "?" in bad.get_json()["error"]["message"]


def test_openai_response_format_shapes(client: Any) -> None:
    for fmt in ({"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}}, 7):
        resp = _openai(client, "/v1/completions", prompt="x", response_format=fmt)
        assert resp.status_code == 400 and resp.get_json()["error"]["param"] == "response_format", fmt
    assert _openai(client, "/v1/completions", prompt="x", max_tokens=2,
                   response_format={"type": "text"}).status_code == 200
