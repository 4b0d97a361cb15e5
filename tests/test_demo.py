"""The random-weight fallback demo checkpoint (used only when the shipped trained model is missing): built once,
atomically, loadable by the engine, the same model as transformers sees, and clearly labelled as random weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kobold_backend.demo as demo
from kobold_backend.engine.loader import load_model
from tests.fixtures.hf_oracle import hf_load, row_rel_err

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.build_random_demo_model(tmp_path_factory.mktemp("cache"))


def test_built_once_into_a_versioned_folder(demo_dir: Path) -> None:
    assert demo_dir.name == f"demo-{demo.DEMO_VERSION}"
    assert sorted(p.name for p in demo_dir.parent.iterdir()) == [demo_dir.name]  # no temporary folder left
    stamp = (demo_dir / "model.safetensors").stat().st_mtime_ns
    calls = []
    assert demo.build_random_demo_model(demo_dir.parent, progress=lambda *a: calls.append(a)) == demo_dir
    assert calls == [] and (demo_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_model_card_says_random_weights(demo_dir: Path) -> None:
    card = (demo_dir / "README.md").read_text()
    assert "DEMO" in card and "RANDOM" in card and "GIBBERISH" in card


def test_progress_is_reported_as_load_model_does(tmp_path: Path) -> None:
    calls = []
    demo.build_random_demo_model(tmp_path, progress=lambda done, total, message: calls.append((done, total, message)))
    assert calls[-1][0] == calls[-1][1] and all(isinstance(m, str) for _, _, m in calls)


def test_a_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(vocab: int) -> dict:
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo, "_random_weights", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        demo.build_random_demo_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_loads_and_generates_with_the_engine(demo_dir: Path) -> None:
    lm = load_model(demo_dir, device="cpu")
    cfg = json.loads((demo_dir / "config.json").read_text())
    assert lm.config.vocab_size == lm.tokenizer.vocab_size == cfg["vocab_size"]
    ids = lm.tokenizer.encode("Once upon a time", add_bos=True)
    cache = lm.model.new_cache(max_seq_len=64)
    logits = lm.model.forward(torch.tensor([ids]), cache)
    out = []
    for _ in range(16):
        out.append(int(logits[0, -1].argmax()))
        logits = lm.model.forward(torch.tensor([out[-1:]]), cache)
    assert len(set(out)) > 1
    assert isinstance(lm.tokenizer.decode(out), str)


def test_matches_transformers(demo_dir: Path) -> None:
    lm = load_model(demo_dir, device="cpu")
    ids = torch.randint(3, 2000, (1, 32), generator=torch.Generator().manual_seed(0))
    ours = lm.model.forward(ids, lm.model.new_cache(max_seq_len=64), last_only=False)
    with torch.no_grad():
        ref = hf_load(demo_dir)(ids).logits
    assert row_rel_err(ours, ref) < 1e-4


def test_does_not_import_transformers(tmp_path: Path) -> None:
    code = (
        "import sys, kobold_backend.demo as d\n"
        f"d.build_random_demo_model({str(tmp_path)!r})\n"
        "d.ensure_demo_model()\n"
        "assert 'transformers' not in sys.modules and 'tests' not in sys.modules\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(tmp_path), env=env)
