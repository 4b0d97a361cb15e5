"""Beam search and classifier-free guidance fields of /api/v1/generate reach the engine."""

from __future__ import annotations

from typing import Any

import pytest

from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.sampling import SamplerSettings
from tests.server_helpers import make_app

PROMPT = "The old lighthouse keeper climbed the stairs"


@pytest.fixture(scope="module")
def setup(checkpoints: Any) -> Any:
    ckpt = checkpoints.get("dense_fp32")
    app = make_app(ckpt.path)
    yield app.test_client(), load_model(ckpt.path, device="cpu", max_seq_len=512)
    app.extensions["kobold_backend"].close()


def _engine_text(lm: Any, **kw: Any) -> str:
    ids = [lm.tokenizer.bos_id] + lm.tokenizer.encode(PROMPT)
    gen = Generator(lm.model, lm.tokenizer)
    return gen.generate(GenerationRequest(ids, 8, SamplerSettings(temperature=0), ban_eos=True, **kw)).text


def test_beams_over_http_equal_the_engine(setup: Any) -> None:
    client, lm = setup
    body = {"prompt": PROMPT, "max_length": 8, "temperature": 0, "use_default_badwordsids": True,
            "num_beams": 3, "beam_length": 4}
    resp = client.post("/api/v1/generate", json=body)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.get_json()["results"][0]["text"] == _engine_text(lm, num_beams=3, beam_length=4)


def test_guidance_over_http_equals_the_engine(setup: Any) -> None:
    client, lm = setup
    negative = "A cheerful song about summer"
    body = {"prompt": PROMPT, "max_length": 8, "temperature": 0, "use_default_badwordsids": True,
            "negative_prompt": negative, "guidance_scale": 2.5}
    resp = client.post("/api/v1/generate", json=body)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    neg_ids = [lm.tokenizer.bos_id] + lm.tokenizer.encode(negative)
    assert resp.get_json()["results"][0]["text"] == _engine_text(lm, negative_prompt_ids=neg_ids,
                                                                 guidance_scale=2.5)


@pytest.mark.parametrize("body,field", [
    ({"num_beams": 0}, "num_beams"), ({"num_beams": 17}, "num_beams"), ({"beam_length": 0}, "beam_length"),
    ({"guidance_scale": -1}, "guidance_scale"),
    ({"num_beams": 2, "negative_prompt": "x", "guidance_scale": 2.0}, "num_beams"),
])
def test_invalid_beam_and_guidance_fields(setup: Any, body: Any, field: str) -> None:
    client, _ = setup
    resp = client.post("/api/v1/generate", json={"prompt": PROMPT, **body})
    assert resp.status_code == 422
    assert field in resp.get_json()["detail"]
