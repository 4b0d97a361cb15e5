"""The shipped demo model (kobold_backend/demo/, recorded in docs/demo-model.md), the GPTQ quantizer that made it,
and the tools that build it (tools/build_demo_corpus.py, tools/train_demo.py), checked against independent oracles:
the GPTQ packer and unpacker written from the format spec (tests/fixtures/gptq_pack.py), transformers in float32,
direct matrix products, and a random-weight model of the same shape."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List

import pytest
import torch
from safetensors.torch import load_file, save_file

import kobold_backend.demo as demo
from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.quantize import output_error, quantize_checkpoint, quantize_gptq, quantize_rtn
from tests.fixtures.checkpoints import CheckpointFactory
from tests.fixtures.gptq_pack import quantize_pack, unpack_reference
from tests.fixtures.hf_oracle import hf_load, row_rel_err

REPO = Path(__file__).resolve().parent.parent
CARD = REPO / "docs" / "demo-model.md"
MAX_SHIPPED_BYTES = 10_000_000
SHIPPED = demo.shipped_demo_dir()
needs_shipped = pytest.mark.skipif(
    SHIPPED is None,
    reason="the trained demo checkpoint is not shipped yet: kobold_backend/demo/ lacks its files "
           "(tools/train_demo.py train + install produce them; see docs/demo-model.md)",
)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"tools_{name}", REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


def card_record(path: Path = CARD) -> Dict[str, Any]:
    """The JSON block under the card's "## Record" heading."""
    text = path.read_text(encoding="utf-8")
    match = re.search(r"^## Record\n.*?```json\n(.*?)\n```", text, re.S | re.M)
    assert match, f"{path} has no '## Record' JSON block: the shipped model's card was not written by the tool"
    return json.loads(match.group(1))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def perplexity(lm: LoadedModel, ids: List[int], start: int = 1) -> float:
    """exp(mean -log p(ids[i] | ids[:i])) over i >= start, with the engine in one forward pass."""
    cache = lm.model.new_cache(max_seq_len=len(ids))
    logits = lm.model.forward(torch.tensor([ids]), cache, last_only=False)[0]
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    return math.exp(float(nll[start - 1:].mean()))


def dequantized_oracle(folder: Path, out: Path) -> Path:
    """A dense float32 copy of a GPTQ folder, every linear unpacked by the spec's reference unpacker."""
    tensors = load_file(str(folder / "model.safetensors"))
    dense: Dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            p = name[: -len(".qweight")]
            dense[f"{p}.weight"] = unpack_reference(t, tensors[f"{p}.qzeros"], tensors[f"{p}.scales"],
                                                    tensors[f"{p}.g_idx"], "gptq")
        elif name.endswith(".weight"):
            dense[name] = t.float()
    out.mkdir(parents=True, exist_ok=True)
    save_file(dense, str(out / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# ------------------------------------------------------------------------------------------- the shipped model


@pytest.fixture(scope="module")
def shipped() -> LoadedModel:
    assert SHIPPED is not None
    return load_model(SHIPPED, device="cpu", dtype="float32")


@needs_shipped
def test_shipped_files_match_the_card() -> None:
    record = card_record()
    assert SHIPPED is not None
    assert sorted(record["files"]) == sorted(demo.SHIPPED_FILES)
    for name, digest in record["files"].items():
        assert sha256(SHIPPED / name) == digest, f"{name} differs from the sha256 in docs/demo-model.md"


@needs_shipped
def test_shipped_layout(shipped: LoadedModel) -> None:
    assert SHIPPED is not None
    assert sum((SHIPPED / n).stat().st_size for n in demo.SHIPPED_FILES) < MAX_SHIPPED_BYTES
    q = shipped.config.quant
    assert q is not None and q.bits == 4 and q.sym and not q.desc_act and q.checkpoint_format == "gptq"
    assert q.group_size in (64, 128)
    tensors = load_file(str(SHIPPED / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].dtype == torch.float16
    assert tensors["lm_head.weight"].dtype == torch.float16
    for i in range(shipped.config.num_layers):
        for lin in LINEARS:
            assert tensors[f"model.layers.{i}.{lin}.qweight"].dtype == torch.int32
            assert f"model.layers.{i}.{lin}.weight" not in tensors
    assert shipped.tokenizer.vocab_size == shipped.config.vocab_size
    assert shipped.tokenizer.bos_id == 1 and 2 in shipped.tokenizer.eos_ids


@needs_shipped
def test_engine_matches_transformers_on_the_unpacked_weights(shipped: LoadedModel, tmp_path: Path) -> None:
    assert SHIPPED is not None
    ids = shipped.tokenizer.encode(card_record()["sample"]["text"], add_bos=True)[: shipped.model.max_seq_len]
    ours = shipped.model.forward(torch.tensor([ids]), shipped.model.new_cache(max_seq_len=len(ids)),
                                 last_only=False)
    with torch.no_grad():
        ref = hf_load(dequantized_oracle(SHIPPED, tmp_path / "oracle"))(torch.tensor([ids])).logits
    assert row_rel_err(ours, ref) < 1e-4


def _random_like(folder: Path, out: Path) -> Path:
    """A dense model of the same shape and tokenizer with transformers' initialisation (N(0, 0.02), norms 1)."""
    g = torch.Generator().manual_seed(0)
    reference = load_file(str(dequantized_oracle(folder, out) / "model.safetensors"))
    weights = {k: torch.ones_like(v) if k.endswith("norm.weight") else 0.02 * torch.randn(v.shape, generator=g)
               for k, v in reference.items()}
    save_file(weights, str(out / "model.safetensors"))
    for name in ("tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(folder / name, out / name)
    return out


@needs_shipped
def test_trained_continuation_is_far_more_likely_than_random(shipped: LoadedModel, tmp_path: Path) -> None:
    """Perplexity of the held-out sample's continuation (its last two thirds) given its first third."""
    assert SHIPPED is not None
    ids = shipped.tokenizer.encode(card_record()["sample"]["text"], add_bos=True)[: shipped.model.max_seq_len]
    start = len(ids) // 3
    random_lm = load_model(_random_like(SHIPPED, tmp_path / "random"), device="cpu", dtype="float32")
    trained, rand = perplexity(shipped, ids, start), perplexity(random_lm, ids, start)
    assert rand > 0.5 * shipped.config.vocab_size  # the random model is about uniform
    assert trained * 20 < rand, f"trained {trained:.1f} vs random {rand:.1f}"


@needs_shipped
def test_card_perplexities(shipped: LoadedModel) -> None:
    record = card_record()
    ppl = record["heldout_perplexity"]
    assert abs(ppl["gptq4"] / ppl["dense"] - 1) <= 0.10, "4-bit held-out perplexity not within 10% of dense"
    sample = record["sample"]
    ids = shipped.tokenizer.encode(sample["text"], add_bos=True)[: shipped.model.max_seq_len]
    assert perplexity(shipped, ids) == pytest.approx(sample["perplexity_gptq4_engine"], rel=0.01)


@needs_shipped
def test_ensure_demo_model_returns_the_shipped_folder(tmp_path: Path) -> None:
    calls: List[Any] = []
    assert demo.ensure_demo_model(tmp_path, progress=lambda *a: calls.append(a)) == SHIPPED
    assert calls == [] and list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------- shipped or fallback


def test_falls_back_to_random_weights_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(demo, "SHIPPED_DIR", tmp_path / "not-installed")
    with caplog.at_level(logging.WARNING, logger="kobold_backend.demo"):
        path = demo.ensure_demo_model(tmp_path / "cache")
    assert path.parent == tmp_path / "cache" and (path / "config.json").is_file()
    assert "RANDOM-WEIGHT" in caplog.text and "GIBBERISH" in caplog.text


def test_an_incomplete_shipped_folder_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  quantized_gqa: Path) -> None:
    ship = tmp_path / "demo"
    shutil.copytree(quantized_gqa, ship)
    monkeypatch.setattr(demo, "SHIPPED_DIR", ship)
    assert demo.ensure_demo_model(tmp_path / "cache") == ship and not (tmp_path / "cache").exists()
    (ship / "tokenizer.model").unlink()
    assert demo.ensure_demo_model(tmp_path / "cache").parent == tmp_path / "cache"


# ------------------------------------------------------------------------------------------- the quantizer


def test_round_to_nearest_packs_like_the_spec_packer() -> None:
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1))
    ref = quantize_pack(w, group_size=64, sym=True, checkpoint_format="gptq")
    ql = quantize_rtn(w, 64)
    packed = ql.pack()
    for key in ("qweight", "qzeros", "scales", "g_idx"):
        assert torch.equal(packed[key], getattr(ref, key)), key
    assert torch.equal(ql.dequantize(), ref.dequantized)
    assert torch.equal(unpack_reference(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"],
                                        "gptq"), ref.dequantized)


def test_gptq_with_an_identity_hessian_is_round_to_nearest() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    g, r = quantize_gptq(w, torch.eye(128), 32), quantize_rtn(w, 32)
    assert torch.equal(g.q, r.q) and torch.equal(g.scales, r.scales)


def test_gptq_beats_round_to_nearest_on_correlated_inputs() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 24, generator=gen) @ torch.randn(24, 256, generator=gen)
    x += 0.05 * torch.randn(4096, 256, generator=gen)
    w = torch.randn(128, 256, generator=gen)
    h = x.t() @ x
    y = x @ w.t()
    errs = {}
    for name, ql in (("gptq", quantize_gptq(w, h, 64)), ("rtn", quantize_rtn(w, 64))):
        errs[name] = float((x @ ql.dequantize().t() - y).norm() / y.norm())
        assert output_error(w, ql.dequantize(), h) == pytest.approx(errs[name], rel=1e-3)
    assert errs["gptq"] < 0.5 * errs["rtn"], errs


def test_gptq_zeroes_inputs_that_never_fire() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(512, 64, generator=gen)
    x[:, 5] = 0
    ql = quantize_gptq(torch.randn(32, 64, generator=gen), x.t() @ x, 32)
    assert not ql.dequantize()[:, 5].any()


QUANT_REPORTS: Dict[str, Any] = {}


@pytest.fixture(scope="module")
def quantized_gqa(checkpoints: CheckpointFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GQA fixture (dense fp16) quantized with GPTQ on random calibration ids."""
    src = checkpoints.get("gqa").path
    calib = torch.randint(3, 900, (8, 48), generator=torch.Generator().manual_seed(5))
    dst = tmp_path_factory.mktemp("gqa-gptq")
    QUANT_REPORTS["gqa"] = quantize_checkpoint(src, dst, calibration=calib, group_size=32, method="gptq")
    return dst


def test_quantized_checkpoint_loads_as_the_spec_says(quantized_gqa: Path, tmp_path: Path) -> None:
    lm = load_model(quantized_gqa, device="cpu", dtype="float32")
    ids = torch.randint(3, 900, (1, 40), generator=torch.Generator().manual_seed(6))
    ours = lm.model.forward(ids, lm.model.new_cache(max_seq_len=64), last_only=False)
    with torch.no_grad():
        ref = hf_load(dequantized_oracle(quantized_gqa, tmp_path / "oracle"))(ids).logits
    assert row_rel_err(ours, ref) < 1e-4
    settings = json.loads((quantized_gqa / "quantize_config.json").read_text())
    assert settings["bits"] == 4 and settings["group_size"] == 32 and settings["sym"] is True
    assert settings["checkpoint_format"] == "gptq" and settings["desc_act"] is False
    assert json.loads((quantized_gqa / "config.json").read_text())["quantization_config"] == settings


def test_quantized_checkpoint_stays_close_to_the_dense_one(quantized_gqa: Path,
                                                           checkpoints: CheckpointFactory) -> None:
    """Random weights are the worst case for 4 bits (no outlier structure, isotropic inputs): logits move ~16%."""
    ids = torch.randint(3, 900, (1, 40), generator=torch.Generator().manual_seed(7))
    logits = {}
    for name, folder in (("dense", checkpoints.get("gqa").path), ("gptq", quantized_gqa)):
        lm = load_model(folder, device="cpu", dtype="float32")
        logits[name] = lm.model.forward(ids, lm.model.new_cache(max_seq_len=64), last_only=False)
    assert float((logits["gptq"] - logits["dense"]).norm() / logits["dense"].norm()) < 0.25
    errors = QUANT_REPORTS["gqa"]["relative_output_error"]
    assert set(errors) == {f"model.layers.{i}.{lin}" for i in range(2) for lin in LINEARS}
    assert sum(e["gptq"] for e in errors.values()) < sum(e["rtn"] for e in errors.values())


# ------------------------------------------------------------------------------------------- the tools


def test_corpus_signatures_leak_no_machine_state() -> None:
    corpus = _tool("build_demo_corpus")

    def f(a, b=None, c="utf-8", d=(1, 2), e=object(), env=dict(HOME="/root"), exe=sys.executable):  # noqa: B006
        return None

    sig = corpus._signature(f)
    assert sig == "(a, b=None, c='utf-8', d=(1, 2), e=..., env=..., exe=...)"


def test_corpus_split_normalise_and_dedup(tmp_path: Path) -> None:
    corpus = _tool("build_demo_corpus")
    assert corpus.normalise("a\tb  \r\n\n\n\nc\x07") == "a   b\n\nc"
    docs = [("x:1", "", f"Paragraph number {i} of a licence text, long enough to keep.") for i in range(400)]
    docs += [("x:dup", "", "PARAGRAPH  number 0 of a licence text,\nlong enough to keep.")]
    manifest = corpus.build(tmp_path, heldout_permille=100, documents=iter(docs))
    files = manifest["files"]
    assert files["train.jsonl"]["documents"] + files["heldout.jsonl"]["documents"] == 400
    heldout = [json.loads(line)["text"] for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    expected = [t for _, _, t in docs[:400]
                if int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "big") % 1000 < 100]
    assert heldout == expected and 20 < len(heldout) < 70
    assert files["heldout.jsonl"]["sha256"] == sha256(tmp_path / "heldout.jsonl")


@pytest.mark.slow
def test_training_pipeline_end_to_end_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """build corpus -> train (tiny, 30 steps, CPU) -> GPTQ -> engine evaluation -> install -> card record."""
    monkeypatch.setenv("KOBOLD_BACKEND_EXT", "torch")  # what the tool sets for itself, undone after the test
    corpus = _tool("build_demo_corpus")
    train = _tool("train_demo")
    docs = list(corpus.license_documents()) + list(corpus.help_topic_documents())
    corpus.build(tmp_path / "corpus", documents=iter(docs))
    out = tmp_path / "out"
    rc = train.main(["train", "--corpus", str(tmp_path / "corpus"), "--out", str(out), "--work",
                     str(tmp_path / "work"), "--tiny", "--steps", "30", "--device", "cpu"])
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(demo.SHIPPED_FILES + ("report.json",))
    report = json.loads((out / "report.json").read_text())
    ppl = report["heldout_eval"]["perplexity"]
    assert ppl["dense_torch"] == pytest.approx(ppl["dense_engine"], rel=1e-3)  # transformers vs our engine
    assert ppl["dense_engine"] < report["tokenizer"]["vocab_size"]  # it learned something in 30 steps
    assert report["training"]["runs"][0]["steps"] == 30
    ship, card = tmp_path / "ship", tmp_path / "card.md"
    with pytest.raises(SystemExit):
        train.main(["install", str(out), "--ship-dir", str(ship), "--card", str(card)])  # tiny runs are refused
    assert train.main(["install", str(out), "--ship-dir", str(ship), "--card", str(card), "--allow-tiny"]) == 0
    record = card_record(card)
    assert {n: sha256(ship / n) for n in demo.SHIPPED_FILES} == record["files"]
    lm = load_model(ship, device="cpu", dtype="float32")
    ids = lm.tokenizer.encode(record["sample"]["text"], add_bos=True)[: lm.model.max_seq_len]
    assert perplexity(lm, ids) == pytest.approx(record["sample"]["perplexity_gptq4_engine"], rel=1e-3)
