"""End to end on the shipped demo model: seeds, banned phrases, stop strings and grammars as a user sees them."""

from __future__ import annotations

import json
import re

import pytest

from kobold_backend.demo import shipped_demo_dir
from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.sampling import SamplerSettings

PROMPT = "This program is free software"

pytestmark = pytest.mark.skipif(shipped_demo_dir() is None, reason="the trained demo model is not shipped")


@pytest.fixture(scope="module")
def demo():
    lm = load_model(shipped_demo_dir(), device="cpu")
    return lm, Generator(lm.model, lm.tokenizer)


def _ids(lm):
    return lm.tokenizer.encode(PROMPT, add_bos=True)


def test_the_phrase_the_model_likes_is_likely(demo) -> None:
    """The banned-phrase test below is only meaningful if the model really wants to write the phrase."""
    lm, gen = demo
    hits = sum("the" in gen.generate(GenerationRequest(_ids(lm), 24, SamplerSettings(temperature=0.8),
                                                        seed=s, ban_eos=True)).text.lower() for s in range(20))
    assert hits >= 15


def test_banned_phrase_never_appears_in_100_sampled_continuations(demo) -> None:
    lm, gen = demo
    settings = SamplerSettings(temperature=0.8)
    for seed in range(100):
        out = gen.generate(GenerationRequest(_ids(lm), 24, settings, seed=seed, ban_eos=True,
                                             banned_strings=["The", "string"]))
        assert "the" not in out.text.lower() and "string" not in out.text.lower(), (seed, out.text)


def test_stop_strings_are_never_streamed(demo) -> None:
    lm, gen = demo
    for seed in range(20):
        events = list(gen.stream(GenerationRequest(_ids(lm), 40, SamplerSettings(temperature=0.8), seed=seed,
                                                   ban_eos=True, stop_strings=["\n", "string"])))
        text = "".join(e.text for e in events)
        assert "\n" not in text and "string" not in text
        assert events[-1].finish_reason in ("stop_string", "length")


def test_seeds_reproduce_and_differ(demo) -> None:
    lm, gen = demo
    settings = SamplerSettings(temperature=1.0, top_p=0.95)
    runs = [gen.generate(GenerationRequest(_ids(lm), 20, settings, seed=s, ban_eos=True)).text for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_grammar_output_always_parses(demo) -> None:
    grammar = pytest.importorskip("kobold_backend.engine.grammar")
    try:
        import llguidance  # noqa: F401
    except ImportError:
        pytest.skip("llguidance is not installed (Python 3.8)")
    lm, gen = demo
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["name", "count"], "additionalProperties": False}
    gbnf = 'root ::= ("yes" | "no") ", because " [a-z ]{1,20} "."'
    for seed in range(10):
        c = grammar.GrammarConstraint.build(lm.tokenizer, json_schema=schema)
        out = gen.generate(GenerationRequest(_ids(lm), 120, SamplerSettings(temperature=1.0), seed=seed, grammar=c))
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert isinstance(value["name"], str) and isinstance(value["count"], int)
        c = grammar.GrammarConstraint.build(lm.tokenizer, gbnf=gbnf)
        out = gen.generate(GenerationRequest(_ids(lm), 60, SamplerSettings(temperature=1.0), seed=seed, grammar=c))
        assert out.finish_reason == "stop", out.text
        assert re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", out.text), out.text
