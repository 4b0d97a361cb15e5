"""GGUF files read by the engine under the United job's gguf (pyproject's lower bound), numpy and torch, against
transformers of the newest release: tests/united/reference_gguf.py, run in the project's .venv
(KOBOLD_BACKEND_REFERENCE_PYTHON), writes the files with the newest gguf and records transformers' logits and greedy
tokens on the dequantized weights and AutoTokenizer's ids. The main suite checks the same in-process
(test_gguf_model.py), so there it is skipped."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kobold_backend.engine.loader import load_model
from tests.fixtures.hf_oracle import row_rel_err

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_PYTHON = os.environ.get("KOBOLD_BACKEND_REFERENCE_PYTHON")
pytestmark = pytest.mark.skipif(not REFERENCE_PYTHON, reason="only in the United job (KOBOLD_BACKEND_REFERENCE_PYTHON)")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference_gguf")
    proc = subprocess.run([str(REFERENCE_PYTHON), "tests/united/reference_gguf.py", str(out)], cwd=str(ROOT),
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("name", ["spm", "bpe"])
def test_gguf_logits_greedy_tokens_and_ids_equal_transformers(reference: Path, name: str) -> None:
    record = json.loads((reference / name / "reference.json").read_text(encoding="utf-8"))
    lm = load_model(reference / name / "model.gguf", device="cpu")
    ids = torch.tensor([record["prompt"]])
    ours = lm.model.forward(ids, lm.model.new_cache(64), last_only=False)
    assert row_rel_err(ours, load_file(str(reference / name / "reference.safetensors"))["logits"]) < 1e-4
    cache = lm.model.new_cache(64)
    logits = lm.model.forward(ids, cache)
    tokens = []
    for _ in record["greedy"]:
        tokens.append(int(logits[0, -1].argmax()))
        logits = lm.model.forward(torch.tensor([[tokens[-1]]]), cache)
    assert tokens == record["greedy"]
    for text, expected in record.get("texts", {}).items():
        assert lm.tokenizer.encode(text) == expected, text
