"""Speculative decoding on CUDA with decode graphs on: greedy tokens identical to plain (graph) decoding for the
trained demo model (GPTQ, float16) and an fp32 fixture, with n-gram drafts and the model drafting for itself,
and seeded sampling reproducible (-m gpu)."""

from __future__ import annotations

from typing import Any, List

import pytest
import torch

from kobold_backend import demo
from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.sampling import SamplerSettings
from kobold_backend.engine.speculative import SpeculationConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplerSettings(temperature=0)
TEXTS = [
    "Once upon a time there was a little dragon who",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "One, two, three, four, five, six,",
    "In the morning the village",
]


def _generators(lm: Any) -> List[Generator]:
    out = []
    for config in (None, SpeculationConfig("ngram", 5), SpeculationConfig("draft", 4, lm.model, "itself")):
        gen = Generator(lm.model, lm.tokenizer)
        assert gen.use_graphs, "the test is about CUDA graphs being on"
        gen.use_speculation(config)
        out.append(gen)
    return out


def _check_identical(lm: Any, prompts: List[List[int]]) -> None:
    plain, ngram, self_draft = _generators(lm)
    accepted = 0
    for prompt in prompts:
        for length in (1, 9, 80):
            req = dict(prompt_ids=prompt, max_new_tokens=length, settings=GREEDY, ban_eos=True)
            want = plain.generate(GenerationRequest(**req)).token_ids
            for gen in (ngram, self_draft):
                got = gen.generate(GenerationRequest(**req)).token_ids
                assert got == want, _divergence(lm, prompt, want, got)
                accepted += gen.stats.speculation.accepted
    assert accepted > 0


def _divergence(lm: Any, prompt: List[int], want: List[int], got: List[int]) -> str:
    """Where two greedy runs part, and the gap between the two best logits there (a near-tie shows as ~1e-3)."""
    at = next(i for i, (a, b) in enumerate(zip(want + [-1], got + [-2])) if a != b)
    ids = torch.tensor([prompt + want[:at]], device=lm.model.device)
    logits = lm.model.forward(ids, lm.model.new_cache())[0, -1]
    top = torch.topk(logits, 2).values
    gap = float(top[0] - top[1])
    return f"token {at} differs ({want[at:at + 1]} vs {got[at:at + 1]}); top-2 logit gap there {gap:.4g}"


def test_greedy_identical_on_the_demo_model_with_graphs() -> None:
    lm = load_model(demo.ensure_demo_model(), device="cuda", max_seq_len=512)
    _check_identical(lm, [lm.tokenizer.encode(t, add_bos=True) for t in TEXTS])


def test_greedy_identical_on_an_fp32_fixture_with_graphs(checkpoints: Any) -> None:
    lm = load_model(checkpoints.get("dense_fp32").path, device="cuda", dtype="float32", max_seq_len=256)
    prompts = []
    for seed in range(4):
        ids = torch.randint(3, lm.config.vocab_size, (16,), generator=torch.Generator().manual_seed(seed)).tolist()
        prompts.append(ids + ids[:8])
    _check_identical(lm, prompts)


def test_seeded_sampling_is_reproducible_and_stays_on_the_device() -> None:
    lm = load_model(demo.ensure_demo_model(), device="cuda", max_seq_len=512)
    gen = Generator(lm.model, lm.tokenizer)
    gen.use_speculation(SpeculationConfig("draft", 4, lm.model, "itself"))
    settings = SamplerSettings(temperature=0.8, top_p=0.9, rep_pen=1.1, rep_pen_range=64)
    prompt = lm.tokenizer.encode(TEXTS[1], add_bos=True)
    a = gen.generate(GenerationRequest(prompt, 60, settings, seed=5, ban_eos=True))
    b = gen.generate(GenerationRequest(prompt, 60, settings, seed=5, ban_eos=True))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 60
    assert gen.stats.speculation.acceptance_rate > 0.5  # drafting for itself: p and q agree up to rounding
