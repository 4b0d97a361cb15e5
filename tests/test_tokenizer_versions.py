"""The engine's tokenizer under this environment's `tokenizers` release against transformers and tokenizers of the
newest releases, on tokenizer folders those newest releases wrote (as a model repo's files are): the United job
runs it under tokenizers 0.15 with KOBOLD_BACKEND_REFERENCE_PYTHON naming the project's .venv, where
tests/united/reference_tokenizers.py writes the folders and AutoTokenizer's ids. The main suite compares the same
folders in-process (test_tokenizer_fidelity.py), so there it is skipped."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest

from kobold_backend.engine import tokenizer_compat
from kobold_backend.engine.tokenizer import load_tokenizer
from kobold_backend.errors import ModelFormatError
from tests.fixtures.tokenizer_families import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_PYTHON = os.environ.get("KOBOLD_BACKEND_REFERENCE_PYTHON")
pytestmark = pytest.mark.skipif(not REFERENCE_PYTHON, reason="only in the United job (KOBOLD_BACKEND_REFERENCE_PYTHON)")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Dict[str, Any]]:
    out = tmp_path_factory.mktemp("reference_tokenizers")
    proc = subprocess.run([str(REFERENCE_PYTHON), "tests/united/reference_tokenizers.py", str(out)], cwd=str(ROOT),
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "reference.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_ids_and_text_equal_the_newest_transformers(reference: Tuple[Path, Dict[str, Any]], name: str) -> None:
    out, record = reference
    if name == "qwen2-split-specials" and not tokenizer_compat.installed_features().encode_special_tokens:
        with pytest.raises(ModelFormatError, match="split_special_tokens"):
            load_tokenizer(out / name)
        return
    tok = load_tokenizer(out / name)
    assert tok.vocab_size == record[name]["vocab_size"]
    for row in record[name]["rows"]:
        assert tok.encode(row["text"], add_bos=True, add_eos=True) == row["full"], row["text"]
        assert tok.encode(row["text"]) == row["plain"], row["text"]
        assert tok.decode(row["full"]) == row["decoded"], row["text"]
