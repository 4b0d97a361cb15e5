"""Passthrough through the United plugin: a dict spec in _raw_generate's keywords reaches the model.

United's own raw_generate does not forward extra keywords, so callers (scripts, patched API routes) call
_raw_generate directly, as these tests do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kobold_backend.errors import RequestError
from kobold_backend.host.backend import PASSTHROUGH_ENV
from tests.test_host_backend import load, sample_with, tokens
from tests.united_harness import GenerationSettings, UnitedHost


def _greedy(host: UnitedHost) -> None:
    sample_with(host, temp=0.01, top_k=1, top_p=1.0, rep_pen=1.0)


def _gen(backend: Any, prompt: Any, max_new: int, **kw: Any) -> Any:
    return backend._raw_generate(prompt, max_new, GenerationSettings(), seed=1, **kw)


def test_passthrough_is_refused_unless_enabled(united: UnitedHost, checkpoints: Any, monkeypatch: Any) -> None:
    monkeypatch.delenv(PASSTHROUGH_ENV, raising=False)
    backend = load(united, checkpoints.get("dense_fp32").path)
    prompt = backend.tokenizer.encode("You may convey")
    with pytest.raises(RequestError, match=PASSTHROUGH_ENV):
        _gen(backend, prompt, 4, passthrough={"capture": {"layers": [0]}})


def test_steer_and_capture_reach_the_model(united: UnitedHost, checkpoints: Any, tmp_path: Path,
                                           monkeypatch: Any) -> None:
    monkeypatch.setenv(PASSTHROUGH_ENV, str(tmp_path / "pt"))
    backend = load(united, checkpoints.get("dense_fp32").path)
    _greedy(united)
    prompt = backend.tokenizer.encode("You may convey verbatim copies")
    plain = tokens(_gen(backend, prompt, 8))
    hidden = backend.model_config.hidden_size
    steer = {"steer": {"vector": [8.0] * hidden, "layers": [0], "strength": 1.0}}
    steered = tokens(_gen(backend, prompt, 8, passthrough=steer))
    assert steered != plain
    assert tokens(_gen(backend, prompt, 8)) == plain  # nothing leaks into later runs
    _gen(backend, prompt, 3, passthrough={"capture": {"layers": [1], "positions": "last"}})
    results = backend.last_passthrough_results[0].results()
    assert "capture" in results
