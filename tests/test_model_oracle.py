"""Our engine against Hugging Face transformers (CPU, float32) on every fixture checkpoint.

transformers loads the dense copy of each checkpoint (for GPTQ: the packer's dequantized weights), so the two
models hold the same numbers and must agree to float32 rounding: full-sequence logits, greedy decoding through the
KV cache, prefix reuse, and cache independence.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, List

import pytest
import torch

from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.errors import OutOfContextError
from tests.fixtures.checkpoints import SPECS, CheckpointFactory
from tests.fixtures.hf_oracle import by_name, hf_load, hf_step, prompt_ids, row_rel_err

ALL = [s.name for s in SPECS]
LOGITS_RTOL = 1e-4
REUSE_RTOL = 1e-5
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def ours(checkpoints: CheckpointFactory) -> Callable[[str], LoadedModel]:
    return by_name(lambda name: load_model(checkpoints.get(name).path, device="cpu"))


@pytest.fixture(scope="module")
def hf(checkpoints: CheckpointFactory) -> Callable[[str], torch.nn.Module]:
    return by_name(lambda name: hf_load(checkpoints.get(name).oracle_path))


@pytest.mark.parametrize("name", ALL)
def test_logits_match_transformers(name: str, checkpoints: CheckpointFactory, ours, hf, record_property) -> None:
    built = checkpoints.get(name)
    ids = prompt_ids(built, 40, seed=1)
    lm = ours(name)
    logits = lm.model.forward(ids, lm.model.new_cache(max_seq_len=64), last_only=False)
    with torch.no_grad():
        ref = hf(name)(ids).logits
    assert logits.dtype == torch.float32
    assert logits.shape == (1, 40, built.vocab_size)
    err = row_rel_err(logits, ref)
    record_property("max_rel_err", err)
    assert err < LOGITS_RTOL, f"{name}: max relative logit error {err:.3e}"


@pytest.mark.parametrize("name", ALL)
def test_greedy_matches_transformers(name: str, checkpoints: CheckpointFactory, ours, hf, record_property) -> None:
    built = checkpoints.get(name)
    prompt = prompt_ids(built, 16, seed=2)
    lm, ref_model = ours(name), hf(name)

    cache = lm.model.new_cache(max_seq_len=64)
    logits = lm.model.forward(prompt, cache)
    our_tokens: List[int] = []
    our_steps = []
    for _ in range(GREEDY_TOKENS):
        our_steps.append(logits[0, -1])
        our_tokens.append(int(logits[0, -1].argmax()))
        logits = lm.model.forward(torch.tensor([[our_tokens[-1]]]), cache)
    assert cache.seq_len == 16 + GREEDY_TOKENS

    ref_logits, past = hf_step(ref_model, prompt, None)
    ref_tokens: List[int] = []
    gaps = []
    errs = []
    for step in range(GREEDY_TOKENS):
        last = ref_logits[0, -1]
        top2 = last.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        ref_tokens.append(int(last.argmax()))
        errs.append(row_rel_err(our_steps[step], last))
        ref_logits, past = hf_step(ref_model, torch.tensor([[ref_tokens[-1]]]), past)
    # A fixture whose greedy path passes near a tie would make this test flaky rather than meaningful.
    assert min(gaps) > 1e-3, f"fixture {name} has a near-tie on its greedy path (gap {min(gaps):.2e})"
    record_property("max_step_rel_err", max(errs))
    assert our_tokens == ref_tokens
    assert max(errs) < LOGITS_RTOL, f"{name}: decode-step logits differ by {max(errs):.3e}"


@pytest.mark.parametrize("name", ALL)
def test_prefix_reuse_matches_fresh_prefill(name: str, checkpoints: CheckpointFactory, ours) -> None:
    built = checkpoints.get(name)
    lm = ours(name)
    a = prompt_ids(built, 20, seed=3)
    b = prompt_ids(built, 12, seed=4)[:, 1:]
    c = prompt_ids(built, 9, seed=5)[:, 1:]
    fresh = lm.model.forward(torch.cat([a, b], 1), lm.model.new_cache(max_seq_len=64), last_only=False)[:, 20:]

    cache = lm.model.new_cache(max_seq_len=64)
    lm.model.forward(a, cache)
    continued = lm.model.forward(b, cache, last_only=False)
    assert cache.seq_len == 31
    assert row_rel_err(continued, fresh) < REUSE_RTOL

    # Reuse after a different continuation: prefill A+C, cut back to A, then feed B.
    cache = lm.model.new_cache(max_seq_len=64)
    lm.model.forward(torch.cat([a, c], 1), cache)
    cache.truncate(20)
    reused = lm.model.forward(b, cache, last_only=False)
    assert row_rel_err(reused, fresh) < REUSE_RTOL


@pytest.mark.parametrize("name", ["dense_fp16", "gqa", "gptq_act_order"])
def test_cache_is_never_reallocated(name: str, checkpoints: CheckpointFactory, ours) -> None:
    lm = ours(name)
    cache = lm.model.new_cache(max_seq_len=48)
    before = [t.data_ptr() for t in cache.k + cache.v]
    logits = lm.model.forward(prompt_ids(checkpoints.get(name), 16, seed=6), cache)
    for _ in range(GREEDY_TOKENS):
        logits = lm.model.forward(logits[:, -1].argmax(-1, keepdim=True), cache)
    assert cache.seq_len == 48
    assert [t.data_ptr() for t in cache.k + cache.v] == before
    with pytest.raises(OutOfContextError):
        lm.model.forward(torch.tensor([[5]]), cache)


@pytest.mark.parametrize("name", ["dense_fp16", "mistral", "gptq_v1_sym_g32"])
def test_two_caches_on_one_model_are_independent(name: str, checkpoints: CheckpointFactory, ours) -> None:
    built = checkpoints.get(name)
    lm = ours(name)
    a, b = prompt_ids(built, 14, seed=7), prompt_ids(built, 19, seed=8)
    x, y = torch.tensor([[11]]), torch.tensor([[12]])
    c1, c2 = lm.model.new_cache(max_seq_len=32), lm.model.new_cache(max_seq_len=32)
    lm.model.forward(a, c1)
    lm.model.forward(b, c2)
    out1 = lm.model.forward(x, c1)
    out2 = lm.model.forward(y, c2)
    ref1 = lm.model.forward(torch.cat([a, x], 1), lm.model.new_cache(max_seq_len=32))
    ref2 = lm.model.forward(torch.cat([b, y], 1), lm.model.new_cache(max_seq_len=32))
    assert (c1.seq_len, c2.seq_len) == (15, 20)
    assert row_rel_err(out1, ref1) < REUSE_RTOL
    assert row_rel_err(out2, ref2) < REUSE_RTOL


def _edited_copy(src: Path, dst: Path, **config_changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_rope_scaling_fixtures_are_sensitive(checkpoints: CheckpointFactory, hf, tmp_path: Path) -> None:
    """The scaled-RoPE fixtures only prove something if ignoring the scaling changes the oracle's logits."""
    for name in ("llama3_rope", "linear_rope"):
        built = checkpoints.get(name)
        ids = prompt_ids(built, 40, seed=1)
        unscaled = hf_load(_edited_copy(built.oracle_path, tmp_path / name, rope_scaling=None))
        with torch.no_grad():
            assert row_rel_err(unscaled(ids).logits, hf(name)(ids).logits) > 1e-2


@pytest.mark.parametrize(
    "option, config_change",
    [
        # compress_pos_emb c divides positions by c: transformers' linear scaling with factor c.
        ({"compress_pos_emb": 2.0}, {"rope_scaling": {"type": "linear", "factor": 2.0}}),
        # NTK alpha: base <- base * alpha^(d / (d - 2)) (engine-notes 2.7), with head_dim d = 16.
        ({"rope_alpha": 2.5}, {"rope_theta": 10000.0 * 2.5 ** (16 / 14)}),
        ({"embed_on_cpu": True}, {}),
    ],
)
def test_load_options_match_transformers(
    option: dict, config_change: dict, checkpoints: CheckpointFactory, tmp_path: Path
) -> None:
    built = checkpoints.get("dense_fp16")
    lm = load_model(built.path, device="cpu", **option)
    ref_model = hf_load(_edited_copy(built.oracle_path, tmp_path / "edited", **config_change))
    ids = prompt_ids(built, 40, seed=9)
    logits = lm.model.forward(ids, lm.model.new_cache(max_seq_len=64), last_only=False)
    with torch.no_grad():
        assert row_rel_err(logits, ref_model(ids).logits) < LOGITS_RTOL


GPU_RTOL = {"float16": 5e-3, "bfloat16": 3e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ALL)
def test_gpu_logits_match_transformers(name: str, dtype: str, checkpoints: CheckpointFactory, hf,
                                       record_property) -> None:
    """On the GPU in half precision: prefill logits, then decode-step logits along transformers' greedy path
    (teacher-forced, so one rounding-induced argmax flip cannot derail the comparison)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    built = checkpoints.get(name)
    lm = load_model(built.path, device="cuda", dtype=dtype)
    ref_model = hf(name)
    prompt = prompt_ids(built, 24, seed=10)
    cache = lm.model.new_cache(max_seq_len=64)
    before = [t.data_ptr() for t in cache.k + cache.v]
    ours = lm.model.forward(prompt.cuda(), cache, last_only=False)
    ref, past = hf_step(ref_model, prompt, None)
    errs = [row_rel_err(ours.cpu(), ref)]
    for _ in range(16):
        token = ref[:, -1:].argmax(-1)
        ours = lm.model.forward(token.cuda(), cache)
        ref, past = hf_step(ref_model, token, past)
        errs.append(row_rel_err(ours.cpu(), ref[:, -1:]))
    record_property("max_rel_err", max(errs))
    assert ours.device.type == "cuda" and [t.data_ptr() for t in cache.k + cache.v] == before
    assert max(errs) < GPU_RTOL[dtype], f"{name} {dtype}: max relative logit error {max(errs):.3e}"
